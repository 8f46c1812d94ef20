"""Which variant of the attention kernel runs (pure Python: the dispatcher and CPU tests import it).

Two generations share one kernel body (`mla_attention.MlaAttention`), selected by a `Tuning`
that is part of the compile key:
- v1, the first kernel (issue 4): Q re-read from shared memory for every key tile, one
  accumulator chain for S, E2M1 decoded value by value in float32.
- v2 (issue 14): for the 16-row tile (h <= 16) Q stays in registers for the whole key
  loop and S = Q K^T runs as two independent accumulator chains; E2M1 latents with E4M3 block
  scales are decoded a byte at a time straight into bf16x2 (`e2m1_bits`), with 2^9 * s_l folded
  into the scores and the output; a ring of raw record stages keeps `prefetch` key tiles in
  flight; at h <= 16 a narrow tile (4 warps, 32 keys, 2 tiles in flight) replaces the 8-warp one
  where two CTAs fit an SM (`launch_choice`), so one CTA's decode overlaps the other's MMAs.
  What each change is worth was measured, not assumed (docs/kernels.md, 2026-12-03, issue 14).

Which generation a launch runs is decided in one place, `generation_for`: unset, the measured
per-format default (v3 for dense one-query-per-sequence decode launches of the formats in
`V3_DEFAULT_FORMATS`, v2 for everything else); `MLA_EVAL_ATTENTION_KERNEL=v1|v2|v3` forces a
generation (v3 only for the launches it covers: `v3_blocker` names the reason for the rest, which run v2).
"""

from __future__ import annotations

import dataclasses
import os

from mla_eval.formats.spec import LATENT_DIM, ROPE_DIM
from mla_eval_kernels.plan.device_limits import HOPPER_REGS_PER_SM, HOPPER_SMEM_PER_BLOCK, HOPPER_SMEM_PER_SM

ENV = "MLA_EVAL_ATTENTION_KERNEL"
VERSIONS = ("v1", "v2", "v3")
# Generations that compile and pass their CPU checks but have not yet passed their GPU tests: selecting one
# prints a warning and results record it (mla_eval.attention.dispatch). Remove an entry once its GPU tests pass.
# v3 left it on 2026-12-04: 278 kernel GPU tests passed on the H200 (results/kernels/logs/pytest-kernels-session6.log).
UNVALIDATED: dict[str, str] = {}
D_QK = LATENT_DIM + ROPE_DIM
MAX_PREFETCH = 3
# v2 at h <= 16: 4 warps, 32-key tiles, 2 tiles of records in flight, so that two CTAs share an SM
# (the H200 run of 2026-12-03 measured it fastest for every format whose two CTAs fit; see NOTES.md)
NARROW_TILE = (16, 1, 4, 32)
NARROW_PREFETCH = 2
DRIVER_SMEM_PER_CTA = 1024  # shared memory the driver reserves for each resident CTA (sm_90)
# v3 (mla_attention_v3): key tiles of 64 slots (wgmma's M, keys in M), 16 heads per CTA (wgmma's N),
# a ring of 2 bf16 K tiles between the producer and consumer warpgroups, and a ring of raw record stages
# (`v3_raw_ring`: stages x keys per stage; all but one stage load while one decodes): 2 whole tiles where
# they fit beside the K ring (the ring every format ran until session 8), else part-tile stages (fp8 records)
V3_BN = 64
V3_HEADS = 16  # the head tile of h <= 16 launches, and of every v3 launch the 32-head tile does not serve
# The 32-head tile (wgmma N = 32) for h > 16 (session 9): with the K / V^T tile (A, 2 KB per k-step) read from shared
# memory at 128 B/clock, one m64nNk16 step costs 16 clocks of reads, while its math takes N / 2 clocks: N = 16 computes
# in 8 (shared-memory bound 2x), N = 32 in 16 (balanced); and a 32-head tile decodes each record once per 32 heads, so
# an h = 128 launch decodes every record 4 times instead of 8. `v3_head_tile` picks it per launch.
V3_WIDE_HEADS = 32
V3_HEAD_TILES = (V3_HEADS, V3_WIDE_HEADS)
V3_K_STAGES = 2
V3_RAW_WHOLE = (2, V3_BN)
V3_RAW_PART_KEYS = (V3_BN // 2, V3_BN // 4)  # keys per stage of a part-tile ring, largest first
# The part-tile ring the fp8 records run: 2 stages of 32 keys. Session 8 ordered the rings by keys in flight (5 x 16
# and 3 x 32 first, 64 keys in flight), but the H200 run of session 9 timed every ring that fits at 64K (dense decode
# h=16, batch 32; results/kernels/bench-NVIDIA_H200-2026-12-04-session9-v3fp8.json), ms: fp8_ds_mla 5x16 0.645,
# 4x16 0.626, 3x16 0.641, 2x32 0.587, 2x16 0.775; fp8_e4m3 3x32 0.609, 5x16 0.639, 4x16 0.634, 2x32 0.596, 3x16 0.656,
# 2x16 0.770. Fewer, larger part copies (one barrier per 32 keys) beat more keys in flight. Every ring passed the
# same GPU tests, bit-identical to each other (tests/test_kernels_v3_gpu.py::test_v3_part_tile_raw_rings).
V3_RAW_PREFERRED = (2, V3_BN // 2)
# key tiles of records prefetched into L2 beyond the one being copied: off. The H200 run of 2026-12-04
# (results/kernels/bench-NVIDIA_H200-2026-12-04-session6-rev2.json, dense decode h=16, batch 32, 64K) timed
# prefetch 2 against none: nvfp4 0.675 vs 0.577 ms, nvfp4_fp8_ds_mla 0.714 vs 0.555, bf16 0.783 vs 0.786.
# V3_L2_PREFETCH_PROBE keeps the prefetch measurable (bench row v3-pf).
V3_L2_PREFETCH = 0
V3_L2_PREFETCH_PROBE = 2
# The consumer warpgroup's per-tile code (issue 14, session 10): rev 1 is the GPU-tested consumer; rev 2 runs the tile
# loop unrolled by the K ring's stages, so the K / V^T wgmma descriptors come from a compile-time stage in uniform
# registers (uniform adds instead of ~4 vector instructions and two R2UR per wgmma; the second copy of a trip reads Q's
# descriptors from an opaque base, which also keeps the 32-head tile under `setmaxnreg` free of spills: session 11),
# skips the O^T rescale when no head's running max moved (alpha is exactly 1.0: bit-identical), and reads the 4-warp
# max / sum exchange with one 16-byte load per head (docs/kernels.md, sessions 10 and 11: nvfp4 707 -> 454 / 416 SASS
# per tile at h = 16, 957 -> 641 / 658 at the two-producer 32-head tile). Rev 2 is compiled and
# held off until tests/test_kernels_v3_gpu.py::test_v3_consumer_rev2_bitwise_equals_rev1 passes on an H200 and a
# bench (rows v3-c2) times it; the default then becomes 2. Part of the compile key (`mla_attention_v3.compile_key`).
V3_CONSUMER_REV = 1
V3_CONSUMER_REVS = (1, 2)
V3_DECODE_PRODUCER_WGS = 2  # producer warpgroups of a v3 CTA, every format (`v3_producer_wgs`; bench: v3-p1 has one)
V3_PRODUCER_WGS_CHOICES = (1, 2)  # what a launch may ask for (bench probes, tests); more would not fit the registers
# The 32-head tile's default: two producer warpgroups with per-role registers (`v3_reg_budget`). Session 10's H200
# run (results/kernels/bench-NVIDIA_H200-2026-12-04-session10-v3h.json; h = 128; ms, one producer -> two) timed two
# faster for bf16 and fp8_ds_mla everywhere (fp8_ds_mla sparse batch 64 0.224 -> 0.199, dense 32K 1.694 -> 1.393;
# bf16 0.251 -> 0.232, 1.736 -> 1.488) and for the nvfp4 records' dense lists (nvfp4 32K 1.495 -> 1.344), but 2-5 %
# slower for their sparse lists (nvfp4 batch 64 0.199 -> 0.203), which the default sends to v2 anyway (`generation_for`).
# Its GPU tests passed in the same session (`device_v3h.sh kernp2`: 31 passed). Bench probe: v3-t32-p1.
V3_WIDE_PRODUCER_WGS = 2
# Per-role register budgets of a 384-thread v3 CTA (one consumer, two producer warpgroups) at the 32-head tile, set by
# `setmaxnreg` after the role split: the launch gives each thread 65536 / 384 -> 168 registers (a multiple of 8), the
# consumer holds O^T [512, 32] = 128 fp32 registers per thread besides S^T (16, +16 with the fold), which spilled at
# 168 (session 9: nvfp4 368 B of stack dense, 192 B sparse); the one-producer kernel compiles to 221-230. The
# producers .dec to 136 first, the consumer .inc to 232: 232 x 128 + 136 x 256 = 64,512 = 168 x 384, the CTA's own
# registers moved between roles (`setmaxnreg.inc` waits until the .dec has returned them).
V3_REG_SPLIT = (232, 136)  # (consumer, producer) registers per thread
# The producer's E2M1 latent decode (`MlaAttentionV3.decode_latent`, the fold formats): rev 1 is the GPU-tested one; rev 2
# writes the same bf16 K bytes in fewer instructions (`e2m1_bits`: one prmt, multiply and and per bf16x2 pair instead
# of a prmt, two shifts and two ands; store addresses and the hi-first word order per thread, not per item). Rev 2
# was written without a device (session 10): it stays off until tests/test_kernels_v3_gpu.py compares it bitwise with
# rev 1 on an H200 and bench (b) times it (`v3-d2`); then set 2 here. The revision is in the compile key.
V3_DECODE_REV = 1
V3_DECODE_REVS = (1, 2)
# Formats whose dense decode launches run v3 by default: those where an H200 run measured v3 faster than v2 at
# every context timed (results/kernels/bench-NVIDIA_H200-2026-12-04-session8.json, dense decode h=16, batch 32,
# v3 without L2 prefetch; ms at 8K / 32K / 64K, v2 -> v3):
#   nvfp4             0.132 -> 0.088, 0.471 -> 0.304, 0.913 -> 0.589
#   nvfp4_fp8rope     0.130 -> 0.085, 0.464 -> 0.287, 0.899 -> 0.563
#   nvfp4_fp8rope_st  0.143 -> 0.105, 0.521 -> 0.372, 1.029 -> 0.727
#   nvfp4_fp8_ds_mla  0.121 -> 0.082, 0.446 -> 0.291, 0.870 -> 0.555
#   mxfp4             0.137 -> 0.104, 0.506 -> 0.367, 0.999 -> 0.726
# v3 refuses the TensorRT-LLM and SGLang records (`v3_blocker`).
V3_DEFAULT_FORMATS = (
    "nvfp4", "nvfp4_fp8rope", "nvfp4_fp8rope_st", "nvfp4_fp8_ds_mla", "mxfp4", "fp8_ds_mla", "fp8_ds_mla_pow2", "fp8_e4m3",
    "bf16",
)
# The fp8 records joined after their GPU tests passed on the H200 in session 9 (tests/test_kernels_v3_gpu.py, 105
# passed; results/h200/session9/), timed in the same session (results/kernels/bench-NVIDIA_H200-2026-12-04-session9-v3fp8
# .json, same shape, their first part-tile rings 5x16 / 3x32): fp8_ds_mla 0.133 -> 0.093, 0.499 -> 0.330, 0.976 -> 0.645;
# fp8_ds_mla_pow2 0.133 -> 0.093, 0.500 -> 0.331, 0.974 -> 0.646; fp8_e4m3 0.131 -> 0.088, 0.477 -> 0.312, 0.926 -> 0.609.
# bf16 joined in session 9 too, once its copy ran on two producer warpgroups (`v3_producer_wgs`): with one it had stayed
# on v2 (session 8: 0.747 vs 0.782 ms at 64K); with two, the session-9 run of `device_session9.sh kern bench` (the GPU
# tests under these defaults passed; results/kernels/bench-NVIDIA_H200-2026-12-04-session9-defaults.json) timed v2 -> v3
# 0.110 -> 0.094, 0.387 -> 0.322, 0.741 -> 0.636 (90 % of copy); the fp8 records on their 2x32 ring in the same run:
# fp8_ds_mla 0.137 -> 0.089, 0.507 -> 0.310, 0.991 -> 0.605; fp8_e4m3 0.129 -> 0.086, 0.473 -> 0.302, 0.913 -> 0.591.
# Formats whose v3 launches compile for sm_90a but have not passed tests/test_kernels_v3_gpu.py on an H200: while
# listed, `v3_blocker` refuses them (forced v3 then runs v2 and says why). The GPU tests clear this (fixture
# `kernels_under_test`); delete an entry after its GPU tests pass. Not in V3_DEFAULT_FORMATS either way until timed.
# Empty since session 9 (the fp8 records' part-tile rings passed).
V3_AWAITING_GPU_TESTS: dict[str, str] = {}
# Launch kinds whose v3 kernel compiles for sm_90a but has not passed tests/test_kernels_v3_gpu.py on an H200: while
# listed, v3 does not run them (sparse: `v3_blocker` refuses, forced v3 runs v2 and says why; the 32-head tile:
# `v3_head_tile` keeps the GPU-tested 16-head tile and says why; two producer warpgroups at the 32-head tile:
# `v3_producer_choice` keeps one and says why, and the bench marks the v3-t32-p2 row). The GPU tests clear this
# (fixture `kernels_under_test`); delete an entry after its GPU tests pass. `generation_for`'s default runs none of
# them either way (dense decode, h <= 16 only) until they are timed.
V3_SPARSE = "sparse"
V3_TILE_32 = "head_tile_32"
V3_TILE_32_TWO_PRODUCERS = "head_tile_32_two_producers"
# Sparse lists and the 32-head tile passed on the H200 in session 9 (tests/test_kernels_v3_gpu.py's sparse / head-tile
# cases, 31, and the v3 cases of tests/test_kernels_gpu.py, 43; results/h200/session9/). Not in the default: bench (a)
# and (d) timed the 32-head tile level with v2 (nvfp4 sparse h=128 batch 64: v2 0.206 ms, v3-t32 0.203, v3-t16 0.333).
# The 32-head tile with two producer warpgroups passed in session 10 (tests/test_kernels_v3_gpu.py -k "two_producer or
# head_tile or sass_role or compile_key": 31 passed; results/h200/session10/).
V3_LAUNCHES_AWAITING_GPU_TESTS: dict[str, str] = {}
# The CTA pair (session 11, kernels/cta_pair.py): two 32-head CTAs of a cluster of 2 along grid y decode half of each raw
# unit's keys each and store every decoded K row into both CTAs' stage. Compiled for sm_90a, not run on a device yet:
# held until tests/test_kernels_v3_gpu.py's pair cases pass on an H200 (they ask for the pair explicitly, under a
# deadline; the fixture `kernels_under_test` keeps this hold for every other GPU test, which has none) and bench (a) /
# (d) time its v3-t32-pair row (`bench --pair`; results/h200/device_v3h.sh pair); while held, `v3_cta_pair` keeps
# every launch unpaired and an explicit `cta_pair=True` is a probe.
V3_TILE_32_PAIR = "head_tile_32_cta_pair"
V3_LAUNCHES_AWAITING_GPU_TESTS[V3_TILE_32_PAIR] = (
    "the 32-head tile's CTA pair (a cluster of 2 sharing each tile's decode) has not passed its GPU tests "
    "(tests/test_kernels_v3_gpu.py -k pair, results/h200/device_v3h.sh pair)"
)
V3_PAIR_CTAS = 2  # CTAs of a pair's cluster, along grid y (head tiles 2c, 2c + 1)
# Launches with more than one head tile (h > 16) that run v3 by default, by format and list kind: where session 10's
# H200 bench (h = 128, batch 32-128; results/kernels/bench-NVIDIA_H200-2026-12-04-session10-v3h.json; ms, v2 -> v3's
# 32-head tile, two producer warpgroups) timed v3 faster at every size:
#   fp8_ds_mla        sparse top-2048 batch 64 0.259 -> 0.199, batch 128 0.505 -> 0.386; dense 8K 0.504 -> 0.359,
#                     32K 1.877 -> 1.393
#   nvfp4             dense 8K 0.389 -> 0.349, 32K 1.482 -> 1.344   (sparse: v2 0.203 / 0.394, v3 0.199-0.203 / 0.389-0.399)
#   nvfp4_fp8_ds_mla  dense 8K 0.376 -> 0.351, 32K 1.409 -> 1.311   (sparse: v2 0.196 / 0.384, v3 0.195-0.202 / 0.375-0.394)
# Everything else stays on v2: within a few per cent either way (bf16: sparse 0.213 vs 0.232, dense 0.398 vs 0.397 /
# 1.510 vs 1.488; the nvfp4 records' sparse lists) or not timed (fp8_ds_mla_pow2, fp8_e4m3, the other E2M1 records).
# Measured at h = 128 only; h = 32..64 follow the same rule (each 32-head tile's CTA does the same work whatever h).
V3_WIDE_DEFAULT: dict[str, tuple[str, ...]] = {
    "fp8_ds_mla": ("dense", "sparse"),
    "nvfp4": ("dense",),
    "nvfp4_fp8_ds_mla": ("dense",),
}
# A reason the default above must not run yet (a policy written without its GPU tests): while set, the unset
# default stays v2 everywhere and says why. None since tests/test_kernels_v3_gpu.py passed on the H200
# (session 8, results/h200/session8/).
V3_DEFAULT_PENDING: str | None = None


@dataclasses.dataclass(frozen=True)
class Tuning:
    q_regs: bool = False  # Q fragments loaded once into registers (16-row tile only: 144 registers)
    s_chains: int = 1  # independent accumulators for S = Q K^T, summed after the k loop
    fast_e2m1: bool = False  # byte -> bf16x2 E2M1 decode with the scale folded into S and out
    skip_decode: bool = False  # timing probe for the benchmark only: K is left undecoded (wrong output)
    prefetch: int = 1  # key tiles of records in flight ahead of the one decoded (raw ring of prefetch + 1)

    def __post_init__(self):
        if self.s_chains not in (1, 2, 3, 4):
            raise ValueError(f"s_chains must be 1..4, not {self.s_chains}")
        if not 1 <= self.prefetch <= MAX_PREFETCH:
            raise ValueError(f"prefetch must be 1..{MAX_PREFETCH}, not {self.prefetch}")


V1 = Tuning()


def is_bf16_plan(plan) -> bool:
    """Records that are exactly the bf16 K row (latent then rope, unscaled): copied, not decoded."""
    return (
        plan.latent.elem == "bf16"
        and plan.rope.elem == "bf16"
        and plan.latent.data_offset == 0
        and plan.rope.data_offset == 2 * LATENT_DIM
        and plan.record_bytes == 2 * D_QK
        and not plan.outer_allowed
    )


def v3_decode_rev(plan, requested: int | None = None) -> int:
    """The E2M1 decode revision a v3 kernel of `plan` compiles: `requested` (a probe: bench v3-d2, the GPU tests) or
    `V3_DECODE_REV` where the fold decode runs (`fast_e2m1_eligible`); 1 elsewhere, whose kernels rev 2 does not
    touch (one definition for the kernel and its compile key)."""
    if requested is not None and requested not in V3_DECODE_REVS:
        raise ValueError(f"decode_rev must be one of {V3_DECODE_REVS}, not {requested}")
    if not fast_e2m1_eligible(plan):
        return 1
    return requested or V3_DECODE_REV


def smem_bytes(plan, m: int, bn: int, wn: int, prefetch: int = 1) -> int:
    """Shared memory of one CTA: Q, K (two stages for the bf16 copy), P, the raw record ring
    (prefetch + 1 tiles; none for bf16), slot ids (prefetch + 2 tiles), row reductions, 4 KB slack."""
    bf16 = is_bf16_plan(plan)
    k_stages = 2 if bf16 else 1
    raw = 0 if bf16 else (prefetch + 1) * bn * plan.record_bytes
    slots = 4 * ((1 if bf16 else prefetch) + 2) * bn
    return 2 * m * D_QK + 2 * k_stages * bn * D_QK + 2 * m * bn + raw + slots + 4 * wn * m + 4 * 1024


def fast_e2m1_eligible(plan) -> bool:
    """Formats whose latent decodes exactly into bf16 up to a per-layer factor: E2M1 values with
    E4M3 block scales (E2M1 x E4M3 has at most 6 significant bits), no per-token scale (it would
    need a per-key factor) and an outer scale, if any, on the latent only."""
    lat = plan.latent
    return (lat.elem == "e2m1" and lat.scale_dtype == "e4m3" and plan.token_scale_offset < 0 and not plan.outer_on_rope
            and not plan.reader_e4m3)  # TensorRT-LLM's E4M3 read-back rounds each decoded value: decoded per value


def _smem_bytes_v3(plan, ring: tuple[int, int], heads: int = V3_HEADS, sparse: bool = False) -> int:
    raw = 0 if is_bf16_plan(plan) else ring[0] * ring[1] * plan.record_bytes
    k = V3_K_STAGES * V3_BN * D_QK * 2
    # sparse: the slot id of each key of each K stage, which the consumer masks by (an invalid index gets p = 0)
    valid = 4 * V3_K_STAGES * V3_BN if sparse else 0
    return k + raw + 2 * heads * D_QK + 2 * heads * V3_BN + 4 * 2 * V3_BN + valid + 4 * 8 * heads + 4 * 1024


def v3_raw_rings(plan, heads: int = V3_HEADS, sparse: bool = False) -> list[tuple[int, int]]:
    """Every raw ring (stages, keys per stage) a v3 CTA of this format and head tile can run on sm_90 (v3 is built
    for it, so the Hopper per-block limit decides), preferred first. Two whole tiles where they fit: the measured
    ring (bf16, which has none, gets it nominally). Else part-tile rings of 32 or 16 keys per stage, from 2 stages up
    to one tile ahead (stages - 1 <= stages per tile: the producer's slot ids are double-buffered by tile),
    the most keys in flight (stages - 1 stages load while one decodes) first, then the larger stage (fewer
    barriers), except that the measured fastest at the 16-head tile, `V3_RAW_PREFERRED`, goes first where it fits."""
    if is_bf16_plan(plan) or _smem_bytes_v3(plan, V3_RAW_WHOLE, heads, sparse) <= HOPPER_SMEM_PER_BLOCK:
        return [V3_RAW_WHOLE]
    rings = [
        (stages, keys)
        for keys in V3_RAW_PART_KEYS
        for stages in range(2, V3_BN // keys + 2)
        if _smem_bytes_v3(plan, (stages, keys), heads, sparse) <= HOPPER_SMEM_PER_BLOCK
    ]
    # the preference was timed at the 16-head tile only (the 32-head tile's rings are untimed)
    return sorted(rings, key=lambda r: (heads == V3_HEADS and r != V3_RAW_PREFERRED, -(r[0] - 1) * r[1], -r[1]))


def v3_raw_ring(plan, heads: int = V3_HEADS, sparse: bool = False) -> tuple[int, int]:
    """The raw ring (stages, keys per stage) a v3 CTA of this format and head tile runs: a compile-time
    specialisation derived from the plan alone (`v3_raw_rings`' first; a format none fits reports the smallest,
    which `v3_blocker` / `v3_head_tile` then refuse by its size)."""
    return (v3_raw_rings(plan, heads, sparse) or [(2, V3_RAW_PART_KEYS[-1])])[0]


def v3_raw_unit(ring: tuple[int, int], it, j: int):
    """(tile, part, stage) of the raw unit the v3 producer handles at step j of key tile `it`: a tile is
    U = V3_BN / keys units ("parts"); unit U it + j sits in stage (U it + j) % S (a constant when S divides U).
    j = h decodes part h of tile it; j = h + S - 1 is the unit loaded while it decodes (at most one tile
    ahead: S - 1 <= U); j = 0 .. S - 2 before the loop (it = 0) are the prologue's loads. `it` may be a kernel
    value (Int32): the one definition of the schedule for the kernel and its CPU model (tests)."""
    stages, keys = ring
    units = V3_BN // keys
    stage = j % stages if units % stages == 0 else (units * it + j) % stages
    return it + j // units, j % units, stage


def smem_bytes_v3(plan, ring: tuple[int, int] | None = None, heads: int = V3_HEADS, sparse: bool = False) -> int:
    """Shared memory of one v3 CTA: K ring, raw ring (`ring`, default `v3_raw_ring`; none for bf16), Q and P^T
    (`heads` rows: the head tile), slot ids (and, sparse, each K stage's), the 4-warp reductions, the mbarriers,
    and the 1 KB alignment of the wgmma tiles (4 KB of slack)."""
    return _smem_bytes_v3(plan, ring or v3_raw_ring(plan, heads, sparse), heads, sparse)


def v3_producer_wgs(plan, heads: int = V3_HEADS) -> int:
    """Producer warpgroups of a v3 CTA: V3_DECODE_PRODUCER_WGS for every format at the 16-head tile. Decoded formats
    split each tile's decode over them, because the decode, not the consumer's 68 wgmma per tile, is the longer
    stage (see NOTES.md). bf16 records are only copied, yet two warpgroups issuing the cp.async also win: session 9's
    H200 bench (b) 64K timed bf16 v3 with one producer warpgroup at 0.770 ms and with two at 0.624 (92 % of copy;
    v2 0.738), the two bit-identical in the GPU tests (test_v3_probes_write_the_same_k_tiles). The 32-head tile runs
    one by default (`V3_WIDE_PRODUCER_WGS`): its consumer holds O^T [512, 32] (128 fp32 registers per thread), which
    384 threads at an even 168 registers each cannot hold without spilling, 256 threads (255 each) can; and per head
    it decodes half as many records. So two producer warpgroups at the 32-head tile run with per-role registers
    (`v3_reg_budget`, `setmaxnreg`): `V3_WIDE_PRODUCER_WGS`, timed faster than one in session 10 (bench v3-t32-p1)."""
    return v3_producer_choice(plan, heads)[0]


def v3_producer_choice(plan, heads: int = V3_HEADS, *, gated: bool = True) -> tuple[int, str]:
    """(producer warpgroups, why) of a v3 CTA of head tile `heads` by default: the one definition behind
    `v3_producer_wgs`. The 32-head tile runs `V3_WIDE_PRODUCER_WGS`; two of them need per-role registers
    (`v3_reg_budget`) and, with `gated`, wait for `V3_TILE_32_TWO_PRODUCERS`' GPU tests (one runs meanwhile)."""
    if heads <= V3_HEADS:
        return V3_DECODE_PRODUCER_WGS, f"{V3_HEADS}-head tile: {V3_DECODE_PRODUCER_WGS} producer warpgroups"
    held = v3_producers_held(heads, V3_WIDE_PRODUCER_WGS) if gated else None
    if held:
        return 1, f"one producer warpgroup: {held}"
    n = V3_WIDE_PRODUCER_WGS
    return n, f"{heads}-head tile: {n} producer warpgroup{'s' if n > 1 else ''}"


def v3_producers_held(heads: int, producer_wgs: int) -> str | None:
    """Why `producer_wgs` producer warpgroups at head tile `heads` wait for their GPU tests (the default keeps one,
    `v3_producer_choice`; the bench marks its row), or None. An explicit `producer_wgs` given to the kernel entry is
    a probe (bench, tests), as an explicit head tile or raw ring is: it runs either way."""
    if heads > V3_HEADS and producer_wgs > 1 and V3_TILE_32_TWO_PRODUCERS in V3_LAUNCHES_AWAITING_GPU_TESTS:
        return V3_LAUNCHES_AWAITING_GPU_TESTS[V3_TILE_32_TWO_PRODUCERS]
    return None


def v3_pair_blocker(plan, heads: int, head_tile: int, producer_wgs: int) -> str | None:
    """Why a v3 launch of `heads` heads at head tile `head_tile` with `producer_wgs` producer warpgroups cannot run as
    CTA pairs (kernels/cta_pair.py), or None where it can: the one definition of where the pair applies (ungated;
    `v3_cta_pair` adds the hold). A pair is the two head tiles 2c, 2c + 1 of one query (cluster [1, 2, 1]), so grid y
    (h / 32) must be even: h % 64 == 0; the 32-head tile with two producer warpgroups (its registers and shared memory
    per CTA are that kernel's). Every format v3 runs qualifies: the decoded ones split each raw unit's keys
    (`v3_pair_keys`; the 16- / 32- / 64-key units halve to multiples of 8 rows, so a half is a whole number of the K
    tile's 8-row swizzle atoms), bf16 splits each tile's copy and forwards its half from its own stage."""
    if head_tile != V3_WIDE_HEADS:
        return f"the CTA pair runs the {V3_WIDE_HEADS}-head tile only, not {head_tile}"
    if producer_wgs != 2:
        return f"the CTA pair runs two producer warpgroups per CTA, not {producer_wgs}"
    if heads % (V3_PAIR_CTAS * V3_WIDE_HEADS):
        pair_heads = V3_PAIR_CTAS * V3_WIDE_HEADS
        return f"the CTA pair needs h % {pair_heads} == 0 (pairs of {V3_WIDE_HEADS}-head tiles), not h = {heads}"
    for _, keys in v3_raw_rings(plan, head_tile):
        if (keys // V3_PAIR_CTAS) % 8:  # (bf16's nominal ring: 64)
            return f"{plan.name}: a raw unit of {keys} keys does not halve into whole 8-row K atoms"
    return None


def v3_cta_pair(plan, heads: int, head_tile: int, producer_wgs: int, requested: bool | None = None) -> tuple[bool, str]:
    """(pair or not, why) of a v3 launch: `requested` True / False (a probe: bench v3-t32-pair, the tests) or, None, the
    default: a pair wherever `v3_pair_blocker` allows and `V3_TILE_32_PAIR` is not held. A request the launch cannot
    run raises ValueError naming why."""
    why = v3_pair_blocker(plan, heads, head_tile, producer_wgs)
    if requested:
        if why:
            raise ValueError(f"cta_pair=True: {why}")
        return True, "CTA pair (requested)"
    if requested is not None:
        return False, "no CTA pair (requested)"
    if why:
        return False, f"no CTA pair: {why}"
    if V3_TILE_32_PAIR in V3_LAUNCHES_AWAITING_GPU_TESTS:
        return False, f"no CTA pair: {V3_LAUNCHES_AWAITING_GPU_TESTS[V3_TILE_32_PAIR]}"
    return True, f"CTA pairs of {V3_WIDE_HEADS}-head tiles (each record decoded once per {V3_PAIR_CTAS * V3_WIDE_HEADS} heads)"


def v3_pair_keys(unit_keys: int, rank):
    """(first key, keys) of a raw unit of `unit_keys` keys that CTA `rank` (0 or 1; a kernel value or an int) of a pair
    copies and decodes: the contiguous half [rank * n / 2, (rank + 1) * n / 2). Contiguous halves keep the kernel's
    row arithmetic: a half of 8 m rows is m whole 8-row atoms of the swizzled K tile, the same bytes shifted by
    1024 m (`mla_attention.swizzled_offset`). The one definition for the kernel and its CPU model (tests)."""
    half = unit_keys // V3_PAIR_CTAS
    return rank * half, half


def v3_reg_budget(heads: int, producer_wgs: int) -> tuple[int, int] | None:
    """(consumer, producer) registers per thread that `setmaxnreg` sets after the role split, or None where every
    thread's share of the SM already holds its role (the 16-head tile: 65536 / 384 -> 168 >= the 124-150 it compiles
    to; the one-producer 32-head tile: 256 threads, 255 each). The 32-head tile with two producer warpgroups gets
    `V3_REG_SPLIT` (one definition; the kernel, the compile key and compile_check read it here)."""
    if producer_wgs not in V3_PRODUCER_WGS_CHOICES:
        raise ValueError(f"producer_wgs must be one of {V3_PRODUCER_WGS_CHOICES}, not {producer_wgs}")
    if heads <= V3_HEADS or producer_wgs == 1:
        return None
    consumer, producer = V3_REG_SPLIT
    threads = 128 * (1 + producer_wgs)
    launch = HOPPER_REGS_PER_SM // threads // 8 * 8  # what each thread holds at launch (allocation unit: 8 per thread)
    for r in (consumer, producer):
        if r % 8 or not 24 <= r <= 256:  # PTX ISA, setmaxnreg: a multiple of 8 in [24, 256]
            raise ValueError(f"setmaxnreg budget {r}: must be a multiple of 8 in [24, 256]")
    if producer > launch or consumer < launch or consumer * 128 + producer * 128 * producer_wgs > launch * threads:
        raise ValueError(f"setmaxnreg budgets {V3_REG_SPLIT} do not redistribute {launch} registers x {threads} threads")
    return consumer, producer


def v3_blocker(plan, sparse: bool, smem_limit: int = HOPPER_SMEM_PER_BLOCK, *, gated: bool = True) -> str | None:
    """Why a launch cannot run the v3 kernel (it then runs v2), or None when it can (with the 16-head tile at
    least; `v3_head_tile` says whether the 32-head one serves). `gated=False` leaves out `V3_AWAITING_GPU_TESTS`
    and `V3_LAUNCHES_AWAITING_GPU_TESTS` (what v3 can run at all: the compile check, the GPU tests'
    parametrisation)."""
    if plan.reader_e4m3:
        return f"{plan.name}: v3 has no E4M3 read-back decode (TensorRT-LLM formats run v2)"
    if plan.record_bytes % 16:  # the producer's cp.async and record addressing assume 16-byte chunks
        return f"{plan.name}: v3 copies records in 16-byte chunks only, this record is {plan.record_bytes} B (runs v2)"
    need = smem_bytes_v3(plan, sparse=sparse)
    if need > smem_limit:
        stages, keys = v3_raw_ring(plan, sparse=sparse)
        return (f"{plan.name}: v3 needs {need} B of shared memory per CTA (2 K tiles + {stages} record stages of "
                f"{keys} keys), the device allows {smem_limit}")
    if gated and plan.name in V3_AWAITING_GPU_TESTS:
        return f"{plan.name}: v3 held off: {V3_AWAITING_GPU_TESTS[plan.name]} (runs v2)"
    if gated and sparse and V3_SPARSE in V3_LAUNCHES_AWAITING_GPU_TESTS:
        return f"v3 held off for sparse top-k lists: {V3_LAUNCHES_AWAITING_GPU_TESTS[V3_SPARSE]} (runs v2)"
    return None


def v3_head_tile(
    plan, heads: int, sparse: bool = False, smem_limit: int = HOPPER_SMEM_PER_BLOCK, *, gated: bool = True
) -> tuple[int, str]:
    """(head tile, why) of a v3 launch of `heads` heads that `v3_blocker` lets run: the one definition of the tile
    (16 or 32 heads, wgmma's N; in the compile key). h <= 16: 16 (one tile, nothing padded). h > 16: 32 where its
    CTA fits `smem_limit` (Q and P^T grow to 32 rows) and, with `gated`, `V3_LAUNCHES_AWAITING_GPU_TESTS` does not
    hold it; else 16, the tile every v3 launch ran before session 9."""
    if heads <= V3_HEADS:
        return V3_HEADS, f"h = {heads}: one {V3_HEADS}-head tile"
    if gated and V3_TILE_32 in V3_LAUNCHES_AWAITING_GPU_TESTS:
        return V3_HEADS, f"{V3_HEADS}-head tiles: {V3_LAUNCHES_AWAITING_GPU_TESTS[V3_TILE_32]}"
    need = smem_bytes_v3(plan, heads=V3_WIDE_HEADS, sparse=sparse)
    if need > smem_limit:
        return V3_HEADS, (f"{V3_HEADS}-head tiles: the {V3_WIDE_HEADS}-head tile needs {need} B of shared memory "
                          f"per CTA, the device allows {smem_limit}")
    return V3_WIDE_HEADS, f"h = {heads}: {V3_WIDE_HEADS}-head tiles (each record decoded once per {V3_WIDE_HEADS} heads)"


def forced_generation() -> str | None:
    """The generation MLA_EVAL_ATTENTION_KERNEL forces, or None when it is unset (the per-launch default)."""
    v = os.environ.get(ENV, "").strip().lower()
    if v and v not in VERSIONS:
        raise ValueError(f"{ENV}={v!r}: expected one of {', '.join(VERSIONS)}")
    return v or None


def generation_for(
    plan, *, sparse: bool, heads: int, queries_per_seq: int = 1, smem_limit: int = HOPPER_SMEM_PER_BLOCK,
) -> tuple[str, str]:
    """(generation, why) of one attention launch: the one definition of which kernel runs.

    `queries_per_seq`: how many of the launch's queries read the same sequence's keys (1 for decode steps;
    T for the prefill-as-decode path, whose T queries per sequence each read a prefix of one list).
    MLA_EVAL_ATTENTION_KERNEL forces v1, v2 or v3 (v3 only where `v3_blocker` has no objection: else v2,
    and `why` is the blocker; h > 16 also names the head tile, `v3_head_tile`). Unset, v3 runs where it was
    measured faster: dense launches of one head tile (h <= 16) of `V3_DEFAULT_FORMATS` with one query per
    sequence, and launches of more heads (32-head tiles) of the formats and list kinds `V3_WIDE_DEFAULT` names;
    everything else v2 (more heads re-read each record once per head tile, where v2's 64-row tile reads it once:
    v3 won there only where its decode or copy gained more than that costs)."""
    forced = forced_generation()
    if forced in ("v1", "v2"):
        return forced, f"{ENV}={forced}"
    blocker = v3_blocker(plan, sparse, smem_limit)
    if forced == "v3":
        if blocker:
            return "v2", blocker
        if heads > V3_HEADS:
            return "v3", f"{ENV}=v3 ({v3_head_tile(plan, heads, sparse, smem_limit)[1]})"
        return "v3", f"{ENV}=v3"
    if plan.name not in V3_DEFAULT_FORMATS:
        return "v2", f"default: v3 not measured faster for {plan.name}"
    if blocker:
        return "v2", blocker
    kind = "sparse" if sparse else "dense"
    if heads > V3_HEADS and kind in V3_WIDE_DEFAULT.get(plan.name, ()) and queries_per_seq == 1:
        tile = v3_head_tile(plan, heads, sparse, smem_limit)[1]
        return "v3", f"default: v3 measured faster for {plan.name}'s {kind} lists at h = 128 ({tile})"
    if sparse:
        return "v2", f"default: v3 not measured faster for {plan.name}'s sparse top-k lists (h = 128)"
    if heads > V3_HEADS:
        return "v2", f"default: v3 not measured faster for {plan.name} at h > {V3_HEADS} (dense, h = 128)"
    if queries_per_seq > 1:
        return "v2", f"default: v3 measured at one query per sequence, not {queries_per_seq}"
    if V3_DEFAULT_PENDING:
        return "v2", f"default: v2; v3 was measured faster for {plan.name}, but {V3_DEFAULT_PENDING}"
    return "v3", f"default: v3 measured faster for {plan.name} (dense decode, h <= {V3_HEADS})"


def tile_config(plan, num_heads: int, smem_limit: int) -> tuple[int, int, int, int]:
    """(M rows per CTA, warps along M, warps along N, key tile BN) of the v1/v2 kernel for a format and head count, the
    largest key tile whose shared memory fits `smem_limit` bytes per CTA (the device's opt-in limit)."""
    if num_heads <= 16:
        m, wm, wn = 16, 1, 8
    elif num_heads <= 32:
        m, wm, wn = 32, 2, 4
    else:
        m, wm, wn = 64, 4, 2
    for bn in (64, 32):
        if smem_bytes(plan, m, bn, wn) <= smem_limit:
            return m, wm, wn, bn
    raise ValueError(f"no tile fits {smem_limit} bytes of shared memory per CTA for {plan.name}")


def hold_state() -> tuple:
    """A hashable snapshot of the hold registries (`V3_AWAITING_GPU_TESTS`, `V3_LAUNCHES_AWAITING_GPU_TESTS`,
    `V3_DEFAULT_PENDING`), which the GPU tests' fixture edits: part of every cached launch plan's key."""
    return (tuple(sorted(V3_AWAITING_GPU_TESTS)), tuple(sorted(V3_LAUNCHES_AWAITING_GPU_TESTS)), V3_DEFAULT_PENDING)


def default_tuning(plan, tile: tuple, version: str | None = None, smem_limit: int = HOPPER_SMEM_PER_BLOCK) -> Tuning:
    """The tuning of `version` (default: the forced one, else v2) for a format and tile (M, wm, wn, BN):
    v2 keeps as many tiles of records in flight as fit `smem_limit` bytes per CTA (at most 3)."""
    version = version or forced_generation() or "v2"
    if version == "v1":
        return V1
    # v3's fallback launches use v2's tuning wherever the v2 kernel runs
    m, _, wn, bn = tile
    small = m == 16  # one row of 16 heads: Q (144 registers) fits beside the 32-register O accumulator
    fits = [p for p in range(1, MAX_PREFETCH + 1) if smem_bytes(plan, m, bn, wn, p) <= smem_limit]
    prefetch = 1 if is_bf16_plan(plan) else max(fits, default=1)  # bf16 records go straight into K's 2 stages
    return Tuning(q_regs=small, s_chains=2 if small else 1, fast_e2m1=fast_e2m1_eligible(plan), prefetch=prefetch)


def narrow_fits_twice(plan, smem_per_sm: int = HOPPER_SMEM_PER_SM) -> bool:
    """Two narrow v2 CTAs (and the driver's reserve for each) fit one SM's shared memory."""
    m, _, wn, bn = NARROW_TILE
    return 2 * (smem_bytes(plan, m, bn, wn, NARROW_PREFETCH) + DRIVER_SMEM_PER_CTA) <= smem_per_sm


def launch_choice(
    plan, wide_tile: tuple, version: str | None = None, smem_per_block: int = HOPPER_SMEM_PER_BLOCK,
    smem_per_sm: int = HOPPER_SMEM_PER_SM,
) -> tuple[tuple, Tuning]:
    """(tile, tuning) the kernel runs with by default, given `tile_config`'s tile for the head count.

    v2 replaces the 16-row, 8-warp tile by the narrow one when two of its CTAs fit an SM (the
    decode of one CTA then overlaps the MMAs of the other); elsewhere the tile stays as it is."""
    version = version or forced_generation() or "v2"
    if version in ("v2", "v3") and wide_tile[0] == 16 and narrow_fits_twice(plan, smem_per_sm):
        tuning = dataclasses.replace(default_tuning(plan, NARROW_TILE, "v2", smem_per_block), prefetch=NARROW_PREFETCH)
        return NARROW_TILE, tuning
    return tuple(wide_tile), default_tuning(plan, wide_tile, version, smem_per_block)
