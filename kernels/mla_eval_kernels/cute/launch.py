"""The one host launcher of the attention kernels, every generation.

`mla_attention` (the default launch of a format, or a v1/v2 variant by `tile` / `tuning`) turns its arguments into a
`plan.launch.LaunchPlan` (cached per format, list kind, head count, queries per sequence and device) and calls `run`
(as the dispatcher does, and the benchmark's v3 probes, benchmarks/probes.py), which does what every launch shares:
the split-KV schedule, the split partials, the kernel's arguments (`AttentionArgs`), the compiled kernel, the launch,
and the combine of the partials.

One construction path: `kernel_for(spec)` is the only place a kernel object is made (from a `plan.launch.KernelSpec`,
whose configuration `v2_plan` / `v3_plan` resolved to concrete values), and `compiled_kernel(spec, args, device)` the
only place one is compiled (cached by `spec.compile_key`). Dispatch, tools/compile_check, the benchmark and the tests
all go through these two, so a kernel compiled without a GPU (CUTE_DSL_ARCH=sm_90a, `placeholder_args`) is built
exactly as a launch builds it.

Problem and argument conventions: `cute.mla_attention` (q bf16 [N, H, 576] contiguous, cache uint8 [blocks,
block_size, R], int32 slot lists, sink fp32 [H]; validated by `mla_eval.attention.dispatch`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32

from mla_eval_kernels.cute import mla_attention as v2
from mla_eval_kernels.cute import mla_attention_v3 as v3
from mla_eval_kernels.cute.compile_cache import arch_tag, compiled
from mla_eval_kernels.cute.mla_combine import MlaCombine
from mla_eval_kernels.plan.device_limits import DeviceFacts, device_facts
from mla_eval_kernels.plan.launch import (
    D_V,
    KernelSpec,
    LaunchPlan,
    SplitSchedule,
    V2Config,
    launch_plan,
    split_schedule,
    v2_plan,
)
from mla_eval_kernels.plan.record_plan import RecordPlan
from mla_eval_kernels.plan.tuning import Tuning


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


def _outputs(q: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    n, h = q.shape[0], q.shape[1]
    if out is None:
        out = torch.empty(n, h, D_V, dtype=torch.float32, device=q.device)
    if lse is None:
        lse = torch.empty(n, h, dtype=torch.float32, device=q.device)
    return out, lse


def _ptr(t: torch.Tensor, dtype, align: int):
    return _make_ptr(dtype, t.data_ptr(), align)


def _make_ptr(dtype, address: int, align: int):
    from cutlass.cute.runtime import make_ptr

    return make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)


class AttentionArgs(NamedTuple):
    """The arguments of every attention kernel's entry (`MlaAttention.__call__`, `MlaAttentionV3.__call__`: their
    parameters are these names in this order; tests/test_kernel_construction.py checks both): the one record of the
    kernel interface, built from a launch's tensors by `run` and with placeholder pointers by `placeholder_args`."""

    q_ptr: Any  # bf16 [N, H, 576]
    cache_ptr: Any  # uint8 [slots, record bytes]
    idx_ptr: Any  # int32: block_table rows (dense) or top-k index lists (sparse)
    seqlen_ptr: Any  # int32 [N] (dense); sparse: the index lists again, unused
    sink_ptr: Any  # fp32 [H], or any fp32 pointer without a sink
    out_ptr: Any  # fp32 [N, H, 512] (split: [splits, N, H, 512] partials)
    lse_ptr: Any  # fp32 [N, H] (split: [splits, N, H])
    num_queries: Any
    num_heads: Any
    idx_stride: Any  # entries per block_table row / index list
    num_slots: Any  # blocks x block size: slot ids at or past it are outside the cache
    block_size: Any
    softmax_scale: Any
    s_l: Any  # the outer scale (1.0 without one)
    tiles_per_split: Any
    num_splits: Any
    stream: Any


def placeholder_args(heads: int = 16, stream=None) -> AttentionArgs:
    """Arguments for compiling without a device (CUTE_DSL_ARCH=sm_90a; nothing is launched): placeholder pointers of
    the right dtype and alignment, then run-time scalars (the head count is run-time: it does not change the cubin)."""
    p = _make_ptr
    return AttentionArgs(
        p(BFloat16, 1 << 20, 16), p(cutlass.Uint8, 1 << 20, 16), p(Int32, 1 << 20, 4), p(Int32, 1 << 20, 4),
        p(Float32, 1 << 20, 4), p(Float32, 1 << 20, 16), p(Float32, 1 << 20, 4), Int32(4), Int32(heads), Int32(64),
        Int32(4096), Int32(64), Float32(0.1), Float32(1.0), Int32(4), Int32(2),
        stream if stream is not None else cuda.CUstream(0),
    )


def kernel_for(spec: KernelSpec):
    """The kernel object of a spec: the only constructor of attention kernels (the generation picks the class)."""
    flags = dict(sparse=spec.sparse, has_sink=spec.has_sink, has_outer=spec.has_outer, split=spec.split)
    if isinstance(spec.config, V2Config):  # v1 and v2: one kernel body, the Tuning tells them apart
        return v2.MlaAttention(spec.plan, spec.config, **flags)
    return v3.MlaAttentionV3(spec.plan, spec.config, **flags)


def compiled_kernel(spec: KernelSpec, args: AttentionArgs, arch: str, options: str = ""):
    """The compiled kernel of `spec` (built by `kernel_for` and compiled once per `spec.compile_key(arch)`; `options`,
    e.g. "--keep-ptx --dump-dir=D", only for a first compile: tools/compile_check)."""
    key = spec.compile_key(arch)
    if options:
        return compiled(key, lambda: cute.compile(kernel_for(spec), *args, options=options))
    return compiled(key, lambda: cute.compile(kernel_for(spec), *args))


def launch_spec(
    launch: LaunchPlan, plan: RecordPlan, *, sparse: bool, has_sink: bool, has_outer: bool, split: bool
) -> KernelSpec:
    """The kernel spec of one launch: its plan's configuration plus the call's list kind, sink, s_l and split."""
    return KernelSpec(plan, launch.config, sparse=bool(sparse), has_sink=bool(has_sink), has_outer=bool(has_outer),
                      split=bool(split))


@dataclasses.dataclass
class PreparedCall:
    """One call's kernel spec and arguments, its split schedule and its partial buffers (`prepare`)."""

    spec: KernelSpec
    args: AttentionArgs
    sched: SplitSchedule
    part_out: torch.Tensor
    part_lse: torch.Tensor


def prepare(
    launch: LaunchPlan,
    plan: RecordPlan,
    q: torch.Tensor,
    cache: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    softmax_scale: float,
    block_table: torch.Tensor | None,
    seq_lens: torch.Tensor | None,
    indices: torch.Tensor | None,
    sink: torch.Tensor | None,
    outer_scale: float | None,
    facts: DeviceFacts,
    stream,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    workspace_fill: float | None = None,
) -> PreparedCall:
    """Everything of a launch but the launch: the split-KV schedule on `facts`, the split partials, the kernel spec
    and its `AttentionArgs`. `run` calls it with the device's facts and stream; the CPU construction test
    (tests/test_kernel_construction.py) with `HOPPER_FACTS` and CPU tensors, then compiles the spec as `run` does."""
    n, h = q.shape[0], q.shape[1]
    dev = q.device
    sparse = indices is not None
    if sparse:  # every query's list is `topk` wide (invalid entries masked); seq_lens unused
        idx, seqlen, stride = indices, indices, indices.shape[1]
        max_keys = stride
    else:
        idx, seqlen, stride = block_table, seq_lens, block_table.shape[1]
        max_keys = int(max_seq_len) if max_seq_len is not None else int(seq_lens.max())
    sched = split_schedule(launch, plan, num_queries=n, heads=h, max_keys=max_keys, facts=facts, num_splits=num_splits)
    has_sink, has_outer = sink is not None, outer_scale is not None
    if sched.split:
        part_out = torch.empty(sched.num_splits, n, h, D_V, dtype=torch.float32, device=dev)
        part_lse = torch.empty(sched.num_splits, n, h, dtype=torch.float32, device=dev)
        if workspace_fill is not None:
            part_out.fill_(workspace_fill)
            part_lse.fill_(workspace_fill)
    else:
        part_out, part_lse = out, lse
    args = AttentionArgs(
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
    spec = launch_spec(launch, plan, sparse=sparse, has_sink=has_sink, has_outer=has_outer, split=sched.split)
    return PreparedCall(spec, args, sched, part_out, part_lse)


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
    stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
    call = prepare(
        launch, plan, q, cache, out, lse, softmax_scale=softmax_scale, block_table=block_table, seq_lens=seq_lens,
        indices=indices, sink=sink, outer_scale=outer_scale, facts=device_facts(dev), stream=stream,
        max_seq_len=max_seq_len, num_splits=num_splits, workspace_fill=workspace_fill,
    )
    fn = compiled_kernel(call.spec, call.args, arch_tag(dev))
    fn(*call.args)
    if call.sched.split:
        has_sink = sink is not None
        cargs = (
            _ptr(call.part_out, Float32, 16),
            _ptr(call.part_lse, Float32, 4),
            _ptr(sink if has_sink else lse, Float32, 4),
            _ptr(out, Float32, 16),
            _ptr(lse, Float32, 4),
            Int32(n * h),
            Int32(h),
            Int32(call.sched.num_splits),
            stream,
        )
        ckey = ("mla_combine", 1, bool(has_sink), arch_tag(dev))
        cfn = compiled(ckey, lambda: cute.compile(MlaCombine(has_sink), *cargs))
        cfn(*cargs)
    return out, lse
