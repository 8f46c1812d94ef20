"""The benchmark's v3 probes (bench-only: kernels/ ships only the default launches, `plan.launch.v3_plan`): a v3
launch with another head tile, producer warpgroup count or raw ring than its default, or a timing probe ("nodec":
the decode left out, "nomma": the consumer's wgmma left out; wrong output, timing only). The GPU tests use them to
check that every probe that claims the same output computes it.

`v3_probe_plan` builds the launch plan (each knob validated against what the kernel can run: `tuning.v3_raw_rings`,
`V3_PRODUCER_WGS_CHOICES`, `V3_HEAD_TILES`); `mla_attention_v3` runs one through the one host launcher
(`cute.launch.run`), as the dispatcher runs the defaults.
"""

from __future__ import annotations

import dataclasses

from mla_eval_kernels.plan import tuning as tn
from mla_eval_kernels.plan.device_limits import DeviceFacts
from mla_eval_kernels.plan.launch import LaunchPlan, v3_plan
from mla_eval_kernels.plan.record_plan import RecordPlan


def v3_probe_plan(
    plan: RecordPlan, heads: int, sparse: bool, facts: DeviceFacts, *, head_tile: int | None = None,
    producer_wgs: int | None = None, raw_ring: tuple[int, int] | None = None, timing_probe: str = "",
) -> LaunchPlan:
    """v3's default plan (`v3_plan`) with the given knobs replaced; a knob the kernel cannot run is a ValueError."""
    base = v3_plan(plan, heads, sparse, facts, why="a benchmark probe", head_tile=head_tile)
    cfg = base.config
    changes = {}
    if producer_wgs is not None:
        changes["producer_wgs"] = int(producer_wgs)
    if raw_ring is not None:
        ring = tuple(int(v) for v in raw_ring)
        rings = tn.v3_raw_rings(plan, cfg.head_tile, sparse)
        if ring not in rings:
            raise ValueError(f"raw_ring {ring} is not one v3 runs for {plan.name}, {cfg.head_tile} heads (any of {rings})")
        changes["raw_ring"] = ring
    if timing_probe:
        changes["timing_probe"] = timing_probe
    return dataclasses.replace(base, config=dataclasses.replace(cfg, **changes))  # V3Config validates each value


def mla_attention_v3(plan: RecordPlan, q, cache, *, softmax_scale: float, block_table=None, seq_lens=None, sink=None,
                     outer_scale=None, indices=None, max_seq_len=None, num_splits=None, out=None, lse=None,
                     workspace_fill=None, head_tile=None, producer_wgs=None, raw_ring=None, timing_probe=""):
    """One v3 probe launch (arguments as `cute.launch.mla_attention`, plus the knobs of `v3_probe_plan`)."""
    from mla_eval_kernels.cute import launch
    from mla_eval_kernels.plan.device_limits import device_facts

    if q.shape[0] == 0:
        return launch._outputs(q, out, lse)
    probe = v3_probe_plan(plan, q.shape[1], indices is not None, device_facts(q.device), head_tile=head_tile,
                          producer_wgs=producer_wgs, raw_ring=raw_ring, timing_probe=timing_probe)
    return launch.run(probe, plan, q, cache, softmax_scale=softmax_scale, block_table=block_table, seq_lens=seq_lens,
                      indices=indices, sink=sink, outer_scale=outer_scale, max_seq_len=max_seq_len, num_splits=num_splits,
                      out=out, lse=lse, workspace_fill=workspace_fill)
