"""An attention call's launch plan (pure Python): which kernel generation, with which configuration, serves a
(format, list kind, head count, queries per sequence) on a device -- decided once per combination and cached -- and
the split-KV schedule of one call.

`launch_plan` is what the dispatcher asks (the default per launch: `tuning.generation_for`); `v2_plan` builds a v1/v2
plan of an explicit tile and tuning, `v3_plan` v3's default plan of a head tile (benchmarks/probes.py builds the
benchmark's v3 probes). The one host launcher,
`mla_eval_kernels.cute.launch`, runs any `LaunchPlan`: its generation picks the kernel class, its config the
compile-time specialisation (part of the compile key).

The cache key holds everything a plan depends on besides its arguments: the generation MLA_EVAL_ATTENTION_KERNEL
forces, so a plan never outlives the setting it was made under.
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


V3_TIMING_PROBES = ("", "nodec", "nomma")  # bench v3-nodec / v3-nomma: what the decode / the consumer's MMAs cost


@dataclasses.dataclass(frozen=True)
class V3Config:
    """A v3 launch (`cute.mla_attention_v3.MlaAttentionV3`), every value concrete: `v3_plan` resolves each default once
    (the kernel and its compile key read these values and resolve nothing; a None here is a TypeError at once, not a
    traceback at the first launch on a GPU). `timing_probe` ("nodec", "nomma") gives wrong output and serves the
    benchmark only; another `producer_wgs` or `raw_ring` than the default are probes too."""

    head_tile: int
    producer_wgs: int
    raw_ring: tuple[int, int]
    timing_probe: str = ""

    def __post_init__(self):
        ints = {"head_tile": self.head_tile, "producer_wgs": self.producer_wgs}
        for name, value in ints.items():
            if type(value) is not int:  # noqa: E721 - bool and None are not head counts
                raise TypeError(f"V3Config.{name} must be an int, not {value!r}")
        ring = self.raw_ring
        if not (isinstance(ring, tuple) and len(ring) == 2 and all(type(v) is int for v in ring)):  # noqa: E721
            raise TypeError(f"V3Config.raw_ring must be (stages, keys per stage) ints, not {ring!r}")
        if self.head_tile not in tn.V3_HEAD_TILES:
            raise ValueError(f"head tile must be one of {tn.V3_HEAD_TILES}, not {self.head_tile}")
        if self.producer_wgs not in tn.V3_PRODUCER_WGS_CHOICES:
            raise ValueError(f"producer_wgs must be one of {tn.V3_PRODUCER_WGS_CHOICES}, not {self.producer_wgs}")
        if self.timing_probe not in V3_TIMING_PROBES:
            raise ValueError(f"timing_probe must be one of {V3_TIMING_PROBES}, not {self.timing_probe!r}")

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
    return _launch_plan(plan, sparse, heads, facts, queries_per_seq, generation, tn.forced_generation())


@functools.lru_cache(maxsize=4096)
def _launch_plan(plan, sparse, heads, facts, queries_per_seq, generation, forced) -> LaunchPlan:
    del forced  # in the key only: generation_for reads it
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
) -> LaunchPlan:
    """A v3 launch with every default resolved here, once: the head tile (`tuning.v3_head_tile`, unless given), the
    producer warpgroups (`tuning.v3_producer_wgs` of that tile), the raw ring (`tuning.v3_raw_ring` of that tile and
    list kind). The only v3 plan builder kernels/ ships; the benchmark's probes (another producer count or raw ring, a
    timing probe) are built by benchmarks/probes.py."""
    if head_tile is None:
        head_tile = tn.v3_head_tile(plan, heads, sparse, facts.smem_per_block)[0]
    if head_tile not in tn.V3_HEAD_TILES:
        raise ValueError(f"head tile must be one of {tn.V3_HEAD_TILES}, not {head_tile}")
    config = V3Config(head_tile=int(head_tile), producer_wgs=tn.v3_producer_wgs(plan, head_tile),
                      raw_ring=tn.v3_raw_ring(plan, head_tile, sparse))
    return LaunchPlan("v3", why, config)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Everything a compiled attention kernel is specialised on: the record plan, the launch's configuration (its
    generation's config: `V2Config` or `V3Config`), the list kind, sink, outer scale and split. The one input of
    `cute.launch.kernel_for` (the only constructor of a kernel object) and of the compile key (`compile_key`), so a
    kernel is built and cached the same way by dispatch, compile_check, the benchmark and the tests."""

    plan: RecordPlan
    config: V2Config | V3Config
    sparse: bool
    has_sink: bool
    has_outer: bool
    split: bool

    def __post_init__(self):
        for name in ("sparse", "has_sink", "has_outer", "split"):
            if type(getattr(self, name)) is not bool:  # noqa: E721 - a None or 0 here was a construction slip
                raise TypeError(f"KernelSpec.{name} must be a bool, not {getattr(self, name)!r}")
        if not isinstance(self.config, (V2Config, V3Config)):
            raise TypeError(f"KernelSpec.config must be a V2Config or V3Config, not {type(self.config).__name__}")
        if self.has_outer and not self.plan.outer_allowed:
            raise ValueError(f"{self.plan.name} has no outer scale (s_l)")

    @property
    def generation(self) -> str:
        if isinstance(self.config, V3Config):
            return "v3"
        return "v1" if self.config.tuning == tn.V1 else "v2"

    def compile_key(self, arch: str) -> tuple:
        """The compile cache's key: the kernel's module and source revision, every specialisation (this spec,
        hashable and concrete) and the architecture with the DSL version (`compile_cache.arch_tag`)."""
        name, rev = KERNEL_SOURCE[self.generation]
        return (name, rev, self, arch)


# The kernel module of each generation and its source revision, bumped when a kernel's source changes what a given
# spec compiles to (the cache lives per process: this guards long-lived processes and tests that compare keys)
KERNEL_SOURCE = {"v1": ("mla_attention", 2), "v2": ("mla_attention", 2), "v3": ("mla_attention_v3", 3)}


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
