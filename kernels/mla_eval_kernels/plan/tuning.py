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
D_QK = LATENT_DIM + ROPE_DIM
MAX_PREFETCH = 3
# v2 at h <= 16: 4 warps, 32-key tiles, 2 tiles of records in flight, so that two CTAs share an SM: measured fastest
# for every format whose two CTAs fit (docs/kernels.md#the-narrow-tile)
NARROW_TILE = (16, 1, 4, 32)
NARROW_PREFETCH = 2
DRIVER_SMEM_PER_CTA = 1024  # shared memory the driver reserves for each resident CTA (sm_90)
# v3 (mla_attention_v3): key tiles of 64 slots (wgmma's M, keys in M), 16 heads per CTA (wgmma's N), a ring of 2 bf16
# K tiles between the producer and consumer warpgroups, and a ring of raw record stages (`v3_raw_ring`: stages x keys
# per stage; all but one stage load while one decodes): 2 whole tiles where they fit beside the K ring, else part-tile
# stages (the fp8 records)
V3_BN = 64
V3_HEADS = 16  # the head tile of h <= 16 launches, and of every v3 launch the 32-head tile does not serve
# The 32-head tile (wgmma N = 32) for h > 16: an m64nNk16 step reads its 2 KB A tile (K or V^T) from shared memory in
# 16 clocks and computes in N / 2, so N = 32 balances what N = 16 leaves shared-memory bound, and each record is
# decoded once per 32 heads instead of 16. `v3_head_tile` picks it per launch (docs/kernels.md#the-32-head-tile).
V3_WIDE_HEADS = 32
V3_HEAD_TILES = (V3_HEADS, V3_WIDE_HEADS)
V3_K_STAGES = 2
V3_RAW_WHOLE = (2, V3_BN)
V3_RAW_PART_KEYS = (V3_BN // 2, V3_BN // 4)  # keys per stage of a part-tile ring, largest first
# The part-tile ring of the fp8 records: 2 stages of 32 keys. Fewer, larger part copies (one barrier per 32 keys)
# timed faster than more keys in flight; every ring gives the same bits (docs/kernels.md#raw-ring-of-the-fp8-records).
V3_RAW_PREFERRED = (2, V3_BN // 2)
V3_DECODE_PRODUCER_WGS = 2  # producer warpgroups of a v3 CTA, every format (docs/kernels.md#producer-warpgroups; bench v3-p1)
V3_PRODUCER_WGS_CHOICES = (1, 2)  # what a launch may ask for (bench probes, tests); more would not fit the registers
# The 32-head tile's default: two producer warpgroups with per-role registers (`v3_reg_budget`), measured faster for
# bf16, fp8_ds_mla and the nvfp4 records' dense lists (docs/kernels.md#default-at-more-than-16-heads). Bench probe: v3-t32-p1.
V3_WIDE_PRODUCER_WGS = 2
# Per-role register budgets of a 384-thread v3 CTA at the 32-head tile, set by `setmaxnreg` after the role split: the
# launch gives each thread 65536 / 384 -> 168 registers, where the consumer (O^T [512, 32] = 128 fp32 registers per
# thread besides S^T) spills; the producers .dec to 136, the consumer .inc to 232: 232 x 128 + 136 x 256 = 64,512 =
# 168 x 384, the CTA's own registers moved between roles (docs/kernels.md#register-budget-of-the-32-head-tile).
V3_REG_SPLIT = (232, 136)  # (consumer, producer) registers per thread
# Formats whose dense decode launches (h <= 16) run v3 by default: an H200 bench timed v3 faster than v2 at every
# context (8K / 32K / 64K) for each (docs/kernels.md#default-formats-at-16-heads). v3 refuses the TensorRT-LLM and SGLang
# records (`v3_blocker`).
V3_DEFAULT_FORMATS = (
    "nvfp4", "nvfp4_fp8rope", "nvfp4_fp8rope_st", "nvfp4_fp8_ds_mla", "mxfp4", "fp8_ds_mla", "fp8_ds_mla_pow2", "fp8_e4m3",
    "bf16",
)
# (No launch is held for its GPU tests: the hold registries went on 2026-12-05 with the last hold, issue 42; a new
# kernel variant stays out of the defaults above until its GPU tests pass. The consumer and decode code is rev 2
# only, and the CTA pair, which never ran, was deleted: docs/kernels.md keeps their histories.)
# Launches with more than one head tile (h > 16) that run v3 by default, by format and list kind: where an H200 bench
# at h = 128 timed v3's 32-head tile (two producer warpgroups) faster than v2 at every size; everything else stays on
# v2, within a few per cent either way or not timed (docs/kernels.md#default-at-more-than-16-heads). h = 32..64 follow the same
# rule (each 32-head tile's CTA does the same work whatever h).
V3_WIDE_DEFAULT: dict[str, tuple[str, ...]] = {
    "fp8_ds_mla": ("dense", "sparse"),
    "nvfp4": ("dense",),
    "nvfp4_fp8_ds_mla": ("dense",),
}

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
    stage (docs/kernels.md#producer-warpgroups). bf16 records are only copied, yet two warpgroups issuing the cp.async
    also win: the H200 bench (b) 64K timed bf16 v3 with one producer warpgroup at 0.770 ms and with two at 0.624 (92 % of copy;
    v2 0.738), the two bit-identical in the GPU tests (test_v3_probes_write_the_same_k_tiles). The 32-head tile runs
    one by default (`V3_WIDE_PRODUCER_WGS`): its consumer holds O^T [512, 32] (128 fp32 registers per thread), which
    384 threads at an even 168 registers each cannot hold without spilling, 256 threads (255 each) can; and per head
    it decodes half as many records. So two producer warpgroups at the 32-head tile run with per-role registers
    (`v3_reg_budget`, `setmaxnreg`): `V3_WIDE_PRODUCER_WGS`, timed faster than one (bench v3-t32-p1)."""
    return v3_producer_choice(plan, heads)[0]


def v3_producer_choice(plan, heads: int = V3_HEADS) -> tuple[int, str]:
    """(producer warpgroups, why) of a v3 CTA of head tile `heads` by default: the one definition behind
    `v3_producer_wgs`. The 32-head tile runs `V3_WIDE_PRODUCER_WGS` (two: per-role registers, `v3_reg_budget`)."""
    if heads <= V3_HEADS:
        return V3_DECODE_PRODUCER_WGS, f"{V3_HEADS}-head tile: {V3_DECODE_PRODUCER_WGS} producer warpgroups"
    n = V3_WIDE_PRODUCER_WGS
    return n, f"{heads}-head tile: {n} producer warpgroup{'s' if n > 1 else ''}"


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


def v3_blocker(plan, sparse: bool, smem_limit: int = HOPPER_SMEM_PER_BLOCK) -> str | None:
    """Why a launch cannot run the v3 kernel (it then runs v2), or None when it can (with the 16-head tile at
    least; `v3_head_tile` says whether the 32-head one serves)."""
    if plan.reader_e4m3:
        return f"{plan.name}: v3 has no E4M3 read-back decode (TensorRT-LLM formats run v2)"
    if plan.record_bytes % 16:  # the producer's cp.async and record addressing assume 16-byte chunks
        return f"{plan.name}: v3 copies records in 16-byte chunks only, this record is {plan.record_bytes} B (runs v2)"
    need = smem_bytes_v3(plan, sparse=sparse)
    if need > smem_limit:
        stages, keys = v3_raw_ring(plan, sparse=sparse)
        return (f"{plan.name}: v3 needs {need} B of shared memory per CTA (2 K tiles + {stages} record stages of "
                f"{keys} keys), the device allows {smem_limit}")
    return None


def v3_head_tile(plan, heads: int, sparse: bool = False, smem_limit: int = HOPPER_SMEM_PER_BLOCK) -> tuple[int, str]:
    """(head tile, why) of a v3 launch of `heads` heads that `v3_blocker` lets run: the one definition of the tile
    (16 or 32 heads, wgmma's N; in the compile key). h <= 16: 16 (one tile, nothing padded). h > 16: 32 where its
    CTA fits `smem_limit` (Q and P^T grow to 32 rows); else 16."""
    if heads <= V3_HEADS:
        return V3_HEADS, f"h = {heads}: one {V3_HEADS}-head tile"
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
