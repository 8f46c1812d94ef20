"""Control formats: deliberately damaging caches that no engine ships, for measuring a test's power.

A test that no real format fails means something only if it is shown to fail on a cache known to be
worse. These records are that yardstick: a ladder of E2M1 codings of increasing damage, each a plain
`FormatSpec` (so the codec, the reference attention, capacity and every result read the one spec), named
`control:<what>` and marked `control=True`, which every table and result shows as "control, not a real
format". They are never in a default format list and `mla-eval formats` lists them apart; `control:*`
in --formats selects the whole ladder in damage order.

The rungs, mildest first (KLD of each on the embedded model: docs/findings/2026-12-05-needle-power.md):
  control:e2m1_g512      the latent as E2M1 under ONE power-of-two scale per 512 values (mxfp4 has one per
                         32): small values of a token flush to zero next to its largest; bf16 rope.
  control:e2m1_g512_rope the same, and the rope as E2M1 under one scale per 64 values: positions blur.
  control:e2m1_unscaled_rope  bf16 latent; the rope as bare E2M1 codes (no scale: values clip at +-6,
                         |x| < 0.25 become 0).
  control:e2m1_unscaled_latent  the latent as bare E2M1 codes; bf16 rope. A layer whose latents are small
                         (GLM-5.2's first eight layers, max |c_kv| 0.02-0.10) stores zeros: its keys carry
                         nothing -- the failure mode of a block scale in the subnormals, taken to its end. On
                         latents of the embedded model as shipped (max 3-5) it is a mild rung; under
                         --latent-profile glm-5.2 it is the strongest.
"""

from __future__ import annotations

from mla_eval.formats.builtin import _bf16_latent, _bf16_rope
from mla_eval.formats.spec import CONTROL_PREFIX, LATENT_DIM, ROPE_DIM, Field, FormatSpec, ScaleRule, VectorCoding

ALL_CONTROLS = CONTROL_PREFIX + "*"  # in a format list: the whole ladder, mildest first
_SOURCE = "mla-eval control (not a real format): a yardstick of known damage for measuring a test's power"


def _e2m1(dim: int, name: str, offset: int, scale_offset: int | None) -> VectorCoding:
    """E2M1 codes of `dim` values at `offset`; one OCP E8M0 scale at `scale_offset`, or none (unscaled)."""
    data = Field(name, offset, "e2m1", dim)
    if scale_offset is None:
        return VectorCoding(dim, "e2m1", data, ScaleRule.TENSOR, dim)
    return VectorCoding(dim, "e2m1", data, ScaleRule.OCP_E8M0, dim, Field(f"{name}_scale", scale_offset, "e8m0", 1))


def _control(what: str, title: str, description: str, record_bytes: int, latent: VectorCoding, rope: VectorCoding,
             pad: tuple[int, int]) -> FormatSpec:
    """One rung: named `control:<what>` and labelled as no real format; `pad` = (offset, bytes) of its padding."""
    return FormatSpec(name=CONTROL_PREFIX + what, title=f"CONTROL {title} (not a real format)",
                      description=f"Control, not a real format: {description}", source=_SOURCE, record_bytes=record_bytes,
                      latent=latent, rope=rope, pads=(Field("pad", pad[0], "pad", pad[1]),), control=True)


CONTROL_FORMATS: tuple[FormatSpec, ...] = (
    # [0,256) codes | [256,257) scale | [257,272) pad | [272,400) bf16 rope
    _control("e2m1_g512", "e2m1, one scale per 512",
             "E2M1 latent under one E8M0 scale per token (OCP rule); bf16 rope.",
             400, _e2m1(LATENT_DIM, "latent", 0, 256), _bf16_rope(272), (257, 15)),
    # [0,256) codes | [256,257) scale | [257,289) rope codes | [289,290) rope scale | [290,304) pad
    _control("e2m1_g512_rope", "e2m1 latent and rope, one scale each",
             "E2M1 latent and E2M1 rope, one E8M0 scale per vector each.",
             304, _e2m1(LATENT_DIM, "latent", 0, 256), _e2m1(ROPE_DIM, "rope", 257, 289), (290, 14)),
    # [0,1024) bf16 latent | [1024,1056) rope codes | [1056,1072) pad
    _control("e2m1_unscaled_rope", "e2m1 rope without scales",
             "bf16 latent; the rope as bare E2M1 codes (clip at 6, flush below 0.25).",
             1072, _bf16_latent(), _e2m1(ROPE_DIM, "rope", 1024, None), (1056, 16)),
    # [0,256) latent codes | [256,272) pad | [272,400) bf16 rope
    _control("e2m1_unscaled_latent", "e2m1 latent without scales",
             "the latent as bare E2M1 codes (clip at 6, flush below 0.25); bf16 rope.",
             400, _e2m1(LATENT_DIM, "latent", 0, None), _bf16_rope(272), (256, 16)),
)
