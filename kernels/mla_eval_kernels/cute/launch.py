"""The one host launcher of the attention kernels, every generation.

`mla_attention` (the default launch of a format, or a v1/v2 variant by `tile` / `tuning`) and `mla_attention_v3` (a
v3 variant by its probes) turn their arguments into a `plan.launch.LaunchPlan` (cached per format, list kind, head
count, queries per sequence and device) and call `run`, which does what every launch shares: the split-KV schedule,
the split partials, the kernel's 17 arguments, the compiled kernel (built once per compile key: the kernel object
is made only when its key is new), the launch, and the combine of the partials.

Problem and argument conventions: `cute.mla_attention` (q bf16 [N, H, 576] contiguous, cache uint8 [blocks,
block_size, R], int32 slot lists, sink fp32 [H]; validated by `mla_eval.attention.dispatch`).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32

from mla_eval_kernels.cute import mla_attention as v2
from mla_eval_kernels.cute import mla_attention_v3 as v3
from mla_eval_kernels.cute.compile_cache import arch_tag, compiled
from mla_eval_kernels.cute.mla_combine import MlaCombine
from mla_eval_kernels.plan.device_limits import device_facts
from mla_eval_kernels.plan.launch import D_V, LaunchPlan, V2Config, launch_plan, split_schedule, v2_plan, v3_plan
from mla_eval_kernels.plan.record_plan import RecordPlan
from mla_eval_kernels.plan.tuning import V3_L2_PREFETCH, Tuning


def mla_attention(
    plan: RecordPlan,
    q: torch.Tensor,
    cache: torch.Tensor,
    *,
    softmax_scale: float,
    block_table: torch.Tensor | None,
    seq_lens: torch.Tensor | None,
    indices: torch.Tensor | None,
    sink: torch.Tensor | None,
    outer_scale: float | None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace_fill: float | None = None,
    tuning: Tuning | None = None,
    tile: tuple[int, int, int, int] | None = None,
    queries_per_seq: int = 1,
    generation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [N, H, 512] fp32 and lse [N, H] fp32 of one attention launch.

    The kernel is `generation` if given (the dispatcher passes the one it recorded), else `tuning.generation_for`'s
    per-launch default (`queries_per_seq`: how many queries read each sequence's keys). `tuning` and/or `tile` ask
    for a v1/v2 variant instead (the benchmark and tests compare variants with them). `out` / `lse` may be given
    (contiguous fp32); `workspace_fill` fills the split partials first (tests poison them with NaN to prove every
    element is written).
    """
    if q.shape[0] == 0:
        return _outputs(q, out, lse)
    facts = device_facts(q.device)
    if tile is not None or tuning is not None:
        launch = v2_plan(plan, q.shape[1], facts, tile, tuning)
    else:
        launch = launch_plan(
            plan, sparse=indices is not None, heads=q.shape[1], facts=facts, queries_per_seq=queries_per_seq,
            generation=generation,
        )
    return run(
        launch, plan, q, cache, softmax_scale=softmax_scale, block_table=block_table, seq_lens=seq_lens, indices=indices,
        sink=sink, outer_scale=outer_scale, max_seq_len=max_seq_len, num_splits=num_splits, out=out, lse=lse,
        workspace_fill=workspace_fill,
    )


def mla_attention_v3(
    plan: RecordPlan,
    q: torch.Tensor,
    cache: torch.Tensor,
    *,
    softmax_scale: float,
    block_table: torch.Tensor | None,
    seq_lens: torch.Tensor | None,
    sink: torch.Tensor | None,
    outer_scale: float | None,
    indices: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace_fill: float | None = None,
    l2_prefetch: int = V3_L2_PREFETCH,
    producer_wgs: int | None = None,
    timing_probe: str = "",
    raw_ring: tuple[int, int] | None = None,
    head_tile: int | None = None,
    consumer_rev: int | None = None,
    decode_rev: int | None = None,
    cta_pair: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A v3 launch, dense (`block_table`, `seq_lens`) or sparse (`indices [N, topk]`), with its probes: `head_tile`
    (16 or 32; default `tuning.v3_head_tile`), `l2_prefetch` (key tiles, 0 = none), `producer_wgs` (1 or 2),
    `timing_probe` ("nodec", "nomma": wrong output), `raw_ring` ((stages, keys per stage), one of
    `tuning.v3_raw_rings`), `consumer_rev`, `decode_rev`, `cta_pair` (None: `tuning.v3_cta_pair`'s default; True:
    the pair, a ValueError where the launch cannot pair). Other arguments as `mla_attention`."""
    if q.shape[0] == 0:
        return _outputs(q, out, lse)
    launch = v3_plan(
        plan, q.shape[1], indices is not None, device_facts(q.device), head_tile=head_tile, producer_wgs=producer_wgs,
        raw_ring=raw_ring, cta_pair=cta_pair, l2_prefetch=l2_prefetch, consumer_rev=consumer_rev, decode_rev=decode_rev,
        timing_probe=timing_probe,
    )
    return run(
        launch, plan, q, cache, softmax_scale=softmax_scale, block_table=block_table, seq_lens=seq_lens, indices=indices,
        sink=sink, outer_scale=outer_scale, max_seq_len=max_seq_len, num_splits=num_splits, out=out, lse=lse,
        workspace_fill=workspace_fill,
    )


def _outputs(q: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    n, h = q.shape[0], q.shape[1]
    if out is None:
        out = torch.empty(n, h, D_V, dtype=torch.float32, device=q.device)
    if lse is None:
        lse = torch.empty(n, h, dtype=torch.float32, device=q.device)
    return out, lse


def _ptr(t: torch.Tensor, dtype, align: int):
    from cutlass.cute.runtime import make_ptr

    return make_ptr(dtype, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def _kernel(launch: LaunchPlan, plan: RecordPlan, sparse: bool, has_sink: bool, has_outer: bool, split: bool, device):
    """(compile key, builder of the kernel object) of a launch plan: the generation picks the kernel class."""
    cfg = launch.config
    if isinstance(cfg, V2Config):  # v1 and v2: one kernel body, the Tuning tells them apart
        key = v2.compile_key(plan, cfg.tile, sparse, has_sink, has_outer, split, device, cfg.tuning)
        return key, lambda: v2.MlaAttention(plan, cfg.tile, sparse, has_sink, has_outer, split, cfg.tuning)
    key = v3.compile_key(
        plan, has_sink, has_outer, split, device, cfg.l2_prefetch, cfg.producer_wgs, cfg.timing_probe, cfg.raw_ring,
        cfg.head_tile, sparse, cfg.consumer_rev, cfg.decode_rev, cfg.cta_pair,
    )
    return key, lambda: v3.MlaAttentionV3(
        plan, has_sink, has_outer, split, cfg.l2_prefetch, cfg.producer_wgs, cfg.timing_probe, cfg.raw_ring, cfg.head_tile,
        sparse, cfg.consumer_rev, cfg.decode_rev, cfg.cta_pair,
    )


def run(
    launch: LaunchPlan,
    plan: RecordPlan,
    q: torch.Tensor,
    cache: torch.Tensor,
    *,
    softmax_scale: float,
    block_table: torch.Tensor | None,
    seq_lens: torch.Tensor | None,
    indices: torch.Tensor | None,
    sink: torch.Tensor | None,
    outer_scale: float | None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace_fill: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch `launch`'s kernel (and, split, the combine) on one call's tensors."""
    out, lse = _outputs(q, out, lse)
    n, h = q.shape[0], q.shape[1]
    if n == 0:
        return out, lse
    dev = q.device
    sparse = indices is not None
    if sparse:  # every query's list is `topk` wide (invalid entries masked); seq_lens unused
        idx, seqlen, stride = indices, indices, indices.shape[1]
        max_keys = stride
    else:
        idx, seqlen, stride = block_table, seq_lens, block_table.shape[1]
        max_keys = int(max_seq_len) if max_seq_len is not None else int(seq_lens.max())
    sched = split_schedule(
        launch, plan, num_queries=n, heads=h, max_keys=max_keys, facts=device_facts(dev), num_splits=num_splits
    )
    has_sink, has_outer = sink is not None, outer_scale is not None
    if sched.split:
        part_out = torch.empty(sched.num_splits, n, h, D_V, dtype=torch.float32, device=dev)
        part_lse = torch.empty(sched.num_splits, n, h, dtype=torch.float32, device=dev)
        if workspace_fill is not None:
            part_out.fill_(workspace_fill)
            part_lse.fill_(workspace_fill)
    else:
        part_out, part_lse = out, lse
    stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
    # the order of every attention kernel's __call__ (`MlaAttention.__call__`)
    args = (
        _ptr(q, BFloat16, 16),
        _ptr(cache, cutlass.Uint8, 16),
        _ptr(idx, Int32, 4),
        _ptr(seqlen, Int32, 4),
        _ptr(sink if has_sink else lse, Float32, 4),
        _ptr(part_out, Float32, 16),
        _ptr(part_lse, Float32, 4),
        Int32(n),
        Int32(h),
        Int32(stride),
        Int32(cache.shape[0] * cache.shape[1]),
        Int32(cache.shape[1]),
        Float32(softmax_scale),
        Float32(outer_scale if has_outer else 1.0),
        Int32(sched.tiles_per_split),
        Int32(sched.num_splits),
        stream,
    )
    key, build = _kernel(launch, plan, sparse, has_sink, has_outer, sched.split, dev)
    fn = compiled(key, lambda: cute.compile(build(), *args))
    fn(*args)
    if sched.split:
        cargs = (
            _ptr(part_out, Float32, 16),
            _ptr(part_lse, Float32, 4),
            _ptr(sink if has_sink else lse, Float32, 4),
            _ptr(out, Float32, 16),
            _ptr(lse, Float32, 4),
            Int32(n * h),
            Int32(h),
            Int32(sched.num_splits),
            stream,
        )
        ckey = ("mla_combine", 1, bool(has_sink), arch_tag(dev))
        cfn = compiled(ckey, lambda: cute.compile(MlaCombine(has_sink), *cargs))
        cfn(*cargs)
    return out, lse
