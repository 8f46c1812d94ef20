"""An attention call's launch plan (pure Python): which kernel generation, with which configuration, serves a
(format, list kind, head count, queries per sequence) on a device -- decided once per combination and cached -- and
the split-KV schedule of one call.

`launch_plan` is what the dispatcher asks (the default per launch: `tuning.generation_for`); `v2_plan` and
`v3_plan` build a plan for an explicit variant (the benchmark's and the GPU tests' probes). The one host launcher,
`mla_eval_kernels.cute.launch`, runs any `LaunchPlan`: its generation picks the kernel class, its config the
compile-time specialisation (part of the compile key).

The cache key holds everything a plan depends on besides its arguments: the generation MLA_EVAL_ATTENTION_KERNEL
forces and the hold registries the GPU tests' fixture edits (`tuning.hold_state`), so a plan never outlives a setting
it was made under.
"""

from __future__ import annotations

import dataclasses
import functools

from mla_eval.formats.spec import LATENT_DIM
from mla_eval_kernels.plan import tuning as tn
from mla_eval_kernels.plan.device_limits import DeviceFacts
from mla_eval_kernels.plan.launch_grid import attention_grid
from mla_eval_kernels.plan.record_plan import RecordPlan

D_QK = tn.D_QK
D_V = LATENT_DIM


@dataclasses.dataclass(frozen=True)
class V2Config:
    """A v1/v2 launch (`cute.mla_attention.MlaAttention`): tile (M heads, warps along M, warps along N, BN keys) and
    the generation's `Tuning`."""

    tile: tuple[int, int, int, int]
    tuning: tn.Tuning

    @property
    def heads_per_cta(self) -> int:
        return self.tile[0]

    @property
    def keys_per_tile(self) -> int:
        return self.tile[3]

    def ctas_per_sm(self, plan: RecordPlan, facts: DeviceFacts) -> int:
        """CTAs resident per SM, as shared memory allows."""
        m, _, wn, bn = self.tile
        return max(1, facts.smem_per_sm // tn.smem_bytes(plan, m, bn, wn, self.tuning.prefetch))


@dataclasses.dataclass(frozen=True)
class V3Config:
    """A v3 launch (`cute.mla_attention_v3.MlaAttentionV3`). Every field but the head tile is a default or a probe:
    `producer_wgs` None is `tuning.v3_producer_wgs`'s, `raw_ring` None `tuning.v3_raw_ring`'s, `decode_rev` None
    `tuning.v3_decode_rev`'s; `timing_probe` ("nodec", "nomma") gives wrong output and serves the benchmark only."""

    head_tile: int
    producer_wgs: int | None = None
    raw_ring: tuple[int, int] | None = None
    cta_pair: bool = False
    l2_prefetch: int = tn.V3_L2_PREFETCH
    consumer_rev: int | None = None  # None: `tuning.v3_consumer_rev`'s (the pair's own, else V3_CONSUMER_REV)
    decode_rev: int | None = None
    timing_probe: str = ""

    @property
    def heads_per_cta(self) -> int:
        return self.head_tile

    @property
    def keys_per_tile(self) -> int:
        return tn.V3_BN

    def ctas_per_sm(self, plan: RecordPlan, facts: DeviceFacts) -> int:
        return 1  # a v3 CTA takes the SM's shared memory


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Which kernel runs (`generation`: v1, v2 or v3), why (recorded in results), and its configuration."""

    generation: str
    why: str
    config: V2Config | V3Config


def launch_plan(
    plan: RecordPlan, *, sparse: bool, heads: int, facts: DeviceFacts, queries_per_seq: int = 1, generation: str | None = None
) -> LaunchPlan:
    """The default launch of `heads` heads over dense (`sparse` False) or top-k lists on a device (cached).
    `generation` forces a generation (the dispatcher passes the one it recorded; the benchmark the other one)."""
    return _launch_plan(plan, sparse, heads, facts, queries_per_seq, generation, tn.forced_generation(), tn.hold_state())


@functools.lru_cache(maxsize=4096)
def _launch_plan(plan, sparse, heads, facts, queries_per_seq, generation, forced, holds) -> LaunchPlan:
    del forced, holds  # in the key only: generation_for and the v3 choices read them
    if generation is None:
        generation, why = tn.generation_for(
            plan, sparse=sparse, heads=heads, queries_per_seq=queries_per_seq, smem_limit=facts.smem_per_block
        )
    else:
        why = f"asked for {generation}"
    if generation == "v3":
        return v3_plan(plan, heads, sparse, facts, why=why)
    wide = tn.tile_config(plan, heads, facts.smem_per_block)
    tile, tuning = tn.launch_choice(plan, wide, generation, smem_per_block=facts.smem_per_block, smem_per_sm=facts.smem_per_sm)
    return LaunchPlan(generation, why, V2Config(tuple(tile), tuning))


def v2_plan(
    plan: RecordPlan, heads: int, facts: DeviceFacts, tile: tuple | None = None, tuning: tn.Tuning | None = None
) -> LaunchPlan:
    """An explicit v1/v2 variant: `tile` (default `tuning.tile_config`'s for the head count) and `tuning` (default
    `tuning.default_tuning` of the forced generation, else v2)."""
    if tile is None:
        tile = tn.tile_config(plan, heads, facts.smem_per_block)
    if tuning is None:
        tuning = tn.default_tuning(plan, tile, smem_limit=facts.smem_per_block)
    generation = "v1" if tuning == tn.V1 else "v2"
    return LaunchPlan(generation, "asked for a tile and tuning", V2Config(tuple(tile), tuning))


def v3_plan(
    plan: RecordPlan, heads: int, sparse: bool, facts: DeviceFacts, *, why: str = "asked for v3", head_tile: int | None = None,
    producer_wgs: int | None = None, raw_ring: tuple[int, int] | None = None, cta_pair: bool | None = None,
    l2_prefetch: int = tn.V3_L2_PREFETCH, consumer_rev: int | None = None, decode_rev: int | None = None,
    timing_probe: str = "",
) -> LaunchPlan:
    """A v3 launch: the head tile `tuning.v3_head_tile` picks unless given, the CTA pair where `tuning.v3_cta_pair`
    pairs it (`cta_pair` None: its default; True: asked, a ValueError where the launch cannot pair), the rest as given."""
    if head_tile is None:
        head_tile = tn.v3_head_tile(plan, heads, sparse, facts.smem_per_block)[0]
    wgs = int(producer_wgs or tn.v3_producer_wgs(plan, head_tile))
    pair = tn.v3_cta_pair(plan, heads, head_tile, wgs, cta_pair)[0]
    config = V3Config(
        head_tile=head_tile, producer_wgs=producer_wgs, raw_ring=None if raw_ring is None else tuple(raw_ring), cta_pair=pair,
        l2_prefetch=l2_prefetch, consumer_rev=consumer_rev, decode_rev=decode_rev, timing_probe=timing_probe,
    )
    return LaunchPlan("v3", why, config)


@dataclasses.dataclass(frozen=True)
class SplitSchedule:
    """How one call's keys are split over CTAs: `num_splits` splits of `tiles_per_split` key tiles per (query, head
    tile); `grid` the launch grid (`launch_grid.attention_grid`)."""

    num_splits: int
    tiles_per_split: int
    head_tiles: int
    grid: tuple[int, int, int]

    @property
    def split(self) -> bool:
        return self.num_splits > 1


def split_schedule(
    launch: LaunchPlan, plan: RecordPlan, *, num_queries: int, heads: int, max_keys: int, facts: DeviceFacts,
    num_splits: int | None = None,
) -> SplitSchedule:
    """The split-KV schedule of a call: `num_splits` if given (rounded so no split is empty), else `choose_splits`
    over the CTAs the device holds at once. Refuses a grid past CUDA's limits (ValueError) before any launch."""
    cfg = launch.config
    max_tiles = -(-max_keys // cfg.keys_per_tile)
    head_tiles = -(-heads // cfg.heads_per_cta)
    if num_splits is None:
        num_splits, per = choose_splits(num_queries * head_tiles, max_tiles, facts.sms * cfg.ctas_per_sm(plan, facts))
    else:
        per = max(1, -(-max_tiles // max(1, num_splits)))
        num_splits = max(1, -(-max_tiles // per)) if max_tiles else 1
    return SplitSchedule(num_splits, per, head_tiles, attention_grid(num_queries, head_tiles, num_splits))


def choose_splits(num_ctas: int, max_tiles: int, cta_slots: int) -> tuple[int, int]:
    """(num_splits, tiles_per_split) minimising the estimated time waves(s) x (tiles / s + 2).

    `cta_slots` = SMs x CTAs resident per SM; the 2 tiles stand for the fixed cost of a CTA
    (Q load, prologue, epilogue, its share of the combine). A split keeps at least 2 key tiles.
    """
    if max_tiles == 0:
        return 1, 1
    best, best_cost = 1, None
    for s in range(1, max(1, max_tiles // 2) + 1):
        cost = -(-s * num_ctas // cta_slots) * (max_tiles / s + 2)
        if best_cost is None or cost < 0.97 * best_cost:
            best, best_cost = s, cost
    per = -(-max_tiles // best)
    return -(-max_tiles // per), per


def flops(num_queries: int, num_heads: int, keys_per_query: float) -> float:
    """FLOPs of absorbed MLA attention: 2 * (576 + 512) per (query, head, key)."""
    return 2.0 * (D_QK + D_V) * num_queries * num_heads * keys_per_query
