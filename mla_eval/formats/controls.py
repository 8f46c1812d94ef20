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

from mla_eval.formats.spec import LATENT_DIM, ROPE_DIM, Field, FormatSpec, ScaleRule, VectorCoding

CONTROL_PREFIX = "control:"
ALL_CONTROLS = "control:*"
_SOURCE = "mla-eval control (not a real format): a yardstick of known damage for measuring a test's power"


def _e2m1(dim: int, name: str, offset: int, scale_offset: int | None) -> VectorCoding:
    """E2M1 codes of `dim` values at `offset`; one OCP E8M0 scale at `scale_offset`, or none (unscaled)."""
    data = Field(name, offset, "e2m1", dim)
    if scale_offset is None:
        return VectorCoding(dim, "e2m1", data, ScaleRule.TENSOR, dim)
    return VectorCoding(dim, "e2m1", data, ScaleRule.OCP_E8M0, dim, Field(f"{name}_scale", scale_offset, "e8m0", 1))


def _bf16(offset: int) -> VectorCoding:
    return VectorCoding(ROPE_DIM, "bf16", Field("rope", offset, "bf16", ROPE_DIM), ScaleRule.NONE, ROPE_DIM)


CONTROL_FORMATS: tuple[FormatSpec, ...] = (
    # [0,256) codes | [256,257) scale | [257,272) pad | [272,400) bf16 rope
    FormatSpec(
        name="control:e2m1_g512",
        title="CONTROL e2m1, one scale per 512 (not a real format)",
        description="Control, not a real format: E2M1 latent under one E8M0 scale per token (OCP rule); bf16 rope.",
        source=_SOURCE,
        record_bytes=400,
        latent=_e2m1(LATENT_DIM, "latent", 0, 256),
        rope=_bf16(272),
        pads=(Field("pad", 257, "pad", 15),),
        control=True,
    ),
    # [0,256) codes | [256,257) scale | [257,289) rope codes | [289,290) rope scale | [290,304) pad
    FormatSpec(
        name="control:e2m1_g512_rope",
        title="CONTROL e2m1 latent and rope, one scale each (not a real format)",
        description="Control, not a real format: E2M1 latent and E2M1 rope, one E8M0 scale per vector each.",
        source=_SOURCE,
        record_bytes=304,
        latent=_e2m1(LATENT_DIM, "latent", 0, 256),
        rope=_e2m1(ROPE_DIM, "rope", 257, 289),
        pads=(Field("pad", 290, "pad", 14),),
        control=True,
    ),
    # [0,1024) bf16 latent | [1024,1056) rope codes | [1056,1072) pad
    FormatSpec(
        name="control:e2m1_unscaled_rope",
        title="CONTROL e2m1 rope without scales (not a real format)",
        description="Control, not a real format: bf16 latent; the rope as bare E2M1 codes (clip at 6, flush below 0.25).",
        source=_SOURCE,
        record_bytes=1072,
        latent=VectorCoding(LATENT_DIM, "bf16", Field("latent", 0, "bf16", LATENT_DIM), ScaleRule.NONE, LATENT_DIM),
        rope=_e2m1(ROPE_DIM, "rope", 1024, None),
        pads=(Field("pad", 1056, "pad", 16),),
        control=True,
    ),
    # [0,256) latent codes | [256,272) pad | [272,400) bf16 rope
    FormatSpec(
        name="control:e2m1_unscaled_latent",
        title="CONTROL e2m1 latent without scales (not a real format)",
        description="Control, not a real format: the latent as bare E2M1 codes (clip at 6, flush below 0.25); bf16 rope.",
        source=_SOURCE,
        record_bytes=400,
        latent=_e2m1(LATENT_DIM, "latent", 0, None),
        rope=_bf16(272),
        pads=(Field("pad", 256, "pad", 16),),
        control=True,
    ),

)
