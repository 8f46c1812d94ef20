"""Which variant of the attention kernel runs (pure Python: the dispatcher and CPU tests import it).

Two generations share one kernel body (`mla_attention.MlaAttention`), selected by a `Tuning`
that is part of the compile key:
- v1, the first kernel (issue 4): Q re-read from shared memory for every key tile, one
  accumulator chain for S, E2M1 decoded value by value in float32.
- v2 (issue 14, the default): for the 16-row tile (h <= 16) Q stays in registers for the whole key
  loop and S = Q K^T runs as several independent accumulator chains (the 36 k-steps of one chain
  are a serial chain of dependent MMAs); E2M1 latents with E4M3 block scales are decoded a byte at a
  time straight into bf16x2 (`e2m1_bits`), with 2^9 * s_l folded into the scores and the output.

`MLA_EVAL_ATTENTION_KERNEL=v1` selects the first kernel (the fallback); unset or `v2`, the second.
"""

from __future__ import annotations

import dataclasses
import os

ENV = "MLA_EVAL_ATTENTION_KERNEL"
VERSIONS = ("v1", "v2")


@dataclasses.dataclass(frozen=True)
class Tuning:
    q_regs: bool = False  # Q fragments loaded once into registers (16-row tile only: 144 registers)
    s_chains: int = 1  # independent accumulators for S = Q K^T, summed after the k loop
    fast_e2m1: bool = False  # byte -> bf16x2 E2M1 decode with the scale folded into S and out
    skip_decode: bool = False  # timing probe for the benchmark only: K is left undecoded (wrong output)

    def __post_init__(self):
        if self.s_chains not in (1, 2, 3, 4):
            raise ValueError(f"s_chains must be 1..4, not {self.s_chains}")


V1 = Tuning()


def fast_e2m1_eligible(plan) -> bool:
    """Formats whose latent decodes exactly into bf16 up to a per-layer factor: E2M1 values with
    E4M3 block scales (E2M1 x E4M3 has at most 6 significant bits), no per-token scale (it would
    need a per-key factor) and an outer scale, if any, on the latent only."""
    lat = plan.latent
    return lat.elem == "e2m1" and lat.scale_dtype == "e4m3" and plan.token_scale_offset < 0 and not plan.outer_on_rope


def kernel_version() -> str:
    v = os.environ.get(ENV, "v2").strip().lower() or "v2"
    if v not in VERSIONS:
        raise ValueError(f"{ENV}={v!r}: expected one of {', '.join(VERSIONS)}")
    return v


def default_tuning(plan, tile: tuple, version: str | None = None) -> Tuning:
    """The tuning of `version` (default: the environment's) for a format and tile (M, wm, wn, BN)."""
    version = version or kernel_version()
    if version == "v1":
        return V1
    m = tile[0]
    small = m == 16  # one row of 16 heads: Q (144 registers) fits beside the 32-register O accumulator
    return Tuning(q_regs=small, s_chains=4 if small else 1, fast_e2m1=fast_e2m1_eligible(plan))
