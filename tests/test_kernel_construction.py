"""No GPU needed: every attention kernel dispatch would launch is built and compiled for sm_90a exactly as a launch
builds it (issue 39).

A launch goes `plan.launch.launch_plan` -> `cute.launch.prepare` (split schedule, `KernelSpec`, `AttentionArgs`) ->
`cute.launch.compiled_kernel` -> `kernel_for`. These tests walk that same path on the CPU with CPU tensors and the
Hopper facts (`HOPPER_FACTS`) for every kernel format x dense / sparse x heads 16 / 64 / 128 x split / unsplit x
sink x s_l x one or many queries per sequence, under the default generation and each forced one
(MLA_EVAL_ATTENTION_KERNEL): every spec is constructed (cheap: a construction slip such as a None where the kernel
wants a number fails here), and every distinct kernel configuration is compiled (`cute.compile` down to the cubin).
Compiling every distinct spec is 656 compiles (~30 min on 2 cores); the representative set is one spec per distinct
(format, generation, configuration, list kind) of v2 and v3 -- every kernel body, tile and ring dispatch can pick --,
v1 (the forced fallback: v2's body under the V1 tuning) for bf16, nvfp4 and fp8_ds_mla only, and for nvfp4 every (sink,
s_l, split) combination of each of its v3 configurations (the flags only switch code inside a body whose other paths
the first set compiles).

CI installs nvidia-cutlass-dsl (the `gpu` extra) and sets MLA_EVAL_REQUIRE_CUTE=1, so these tests fail there rather
than skip when CuTe DSL is missing.
"""

from __future__ import annotations

import inspect
import itertools
import os
import time

import cuda.bindings.driver as cuda
import pytest
import torch

if os.environ.get("MLA_EVAL_REQUIRE_CUTE"):
    import cutlass  # noqa: F401 - must import: a missing CuTe DSL fails CI instead of skipping these tests
else:
    pytest.importorskip("cutlass")

from mla_eval.formats import all_formats  # noqa: E402
from mla_eval_kernels.cute import launch  # noqa: E402
from mla_eval_kernels.cute.mla_attention import MlaAttention  # noqa: E402
from mla_eval_kernels.cute.mla_attention_v3 import MlaAttentionV3  # noqa: E402
from mla_eval_kernels.plan import launch as lp  # noqa: E402
from mla_eval_kernels.plan import tuning  # noqa: E402
from mla_eval_kernels.plan.device_limits import HOPPER_FACTS  # noqa: E402
from mla_eval_kernels.plan.record_plan import UnsupportedFormat, plan_for  # noqa: E402

ARCH = "sm_90a/cpu-construction-test"  # a compile-cache tag of its own: nothing here is ever launched
HEADS = (16, 64, 128)
GENERATIONS = (None, "v1", "v2", "v3")  # the default per launch, and each MLA_EVAL_ATTENTION_KERNEL
V1_FORMATS = ("bf16", "nvfp4", "fp8_ds_mla")  # the forced v1 fallback is compiled for these only
FLAG_FORMAT = "nvfp4"  # every (sink, s_l, split) of each of its v3 configurations is compiled


def _kernel_plans():
    out = []
    for spec in all_formats():
        try:
            out.append(plan_for(spec))
        except UnsupportedFormat:  # served by the torch reference only
            continue
    return out


PLANS = _kernel_plans()


def _call_tensors(plan, heads: int, sparse: bool, split: bool):
    """CPU tensors of one call: one query over 4,096 keys (the schedule splits it over the SMs) or 264 queries of 64
    keys each (two waves of the SMs: no split)."""
    n, keys = (1, 4096) if split else (264, 64)
    q = torch.zeros(n, heads, tuning.D_QK, dtype=torch.bfloat16)
    blocks = max(1, n * keys // 64)
    cache = torch.zeros(blocks, 64, plan.record_bytes, dtype=torch.uint8)
    if sparse:
        return q, cache, dict(block_table=None, seq_lens=None, indices=torch.zeros(n, keys, dtype=torch.int32))
    table = torch.arange(blocks, dtype=torch.int32).view(n, -1)
    return q, cache, dict(block_table=table, seq_lens=torch.full((n,), keys, dtype=torch.int32), indices=None)


def _prepared_calls(monkeypatch):
    """(generation forced or None, PreparedCall) of every combination, through the launch's own functions."""
    calls = []
    for forced in GENERATIONS:
        if forced:
            monkeypatch.setenv(tuning.ENV, forced)
        else:
            monkeypatch.delenv(tuning.ENV, raising=False)
        for plan, heads, sparse, split, qps in itertools.product(PLANS, HEADS, (False, True), (False, True), (1, 64)):
            chosen = lp.launch_plan(plan, sparse=sparse, heads=heads, facts=HOPPER_FACTS, queries_per_seq=qps)
            q, cache, lists = _call_tensors(plan, heads, sparse, split)
            out, lse = launch._outputs(q, None, None)
            for sink, outer in itertools.product((False, True), (False, True) if plan.outer_allowed else (False,)):
                call = launch.prepare(
                    chosen, plan, q, cache, out, lse, softmax_scale=0.1, sink=torch.zeros(heads) if sink else None,
                    outer_scale=0.5 if outer else None, facts=HOPPER_FACTS, stream=cuda.CUstream(0), **lists,
                )
                assert call.sched.split == split, (plan.name, heads, sparse, split)
                calls.append((forced, call))
    monkeypatch.delenv(tuning.ENV, raising=False)
    return calls


@pytest.fixture(scope="module")
def prepared():
    with pytest.MonkeyPatch.context() as mp:
        return _prepared_calls(mp)


def test_kernel_entries_take_the_one_argument_record():
    """Both kernels' entries and kernel bodies take `AttentionArgs`' values, in its order (the kernels' parameter lists
    are the one place the record is spelled out again, for the DSL's tracer)."""
    fields = list(launch.AttentionArgs._fields)
    for cls in (MlaAttention, MlaAttentionV3):
        assert list(inspect.signature(cls.__call__).parameters)[1:] == fields, cls.__name__
        assert list(inspect.signature(cls.kernel).parameters)[1 : len(fields)] == fields[:-1], cls.__name__
    assert len(launch.placeholder_args()) == len(fields)


def test_launch_configs_are_concrete_and_reject_unresolved_values():
    """`v3_plan` resolves every default; a config with a None (the slip that made every v3 launch raise on the GPU,
    7b800e8) is refused when it is made, on the CPU, not at the first launch."""
    plan = plan_for(next(s for s in all_formats() if s.name == "nvfp4"))
    cfg = lp.v3_plan(plan, 128, True, HOPPER_FACTS).config
    assert all(v is not None for v in vars(cfg).values())
    with pytest.raises(TypeError, match="producer_wgs"):
        lp.V3Config(head_tile=16, producer_wgs=None, raw_ring=(2, 64))
    with pytest.raises(TypeError, match="raw_ring"):
        lp.V3Config(head_tile=16, producer_wgs=2, raw_ring=None)
    with pytest.raises(TypeError, match="sparse"):
        lp.KernelSpec(plan, cfg, sparse=None, has_sink=False, has_outer=False, split=False)
    with pytest.raises(TypeError, match="V3Config"):
        MlaAttentionV3(plan, lp.v2_plan(plan, 16, HOPPER_FACTS).config, sparse=False, has_sink=False, has_outer=False,
                       split=False)


def test_every_launch_dispatch_chooses_is_constructed(prepared):
    """Every spec of every combination (~1,500 calls) builds its kernel object through `kernel_for`; the generations
    dispatch picks are all represented (v1 and v2 forced, v2 and v3 by default)."""
    gens = set()
    for forced, call in prepared:
        kern = launch.kernel_for(call.spec)
        assert kern.plan is call.spec.plan
        gens.add((forced, call.spec.generation))
    assert {(None, "v2"), (None, "v3"), ("v1", "v1"), ("v2", "v2"), ("v3", "v3")} <= gens


def _representative(prepared):
    specs, seen_config = {}, set()
    for _, call in prepared:
        spec = call.spec
        if spec.generation == "v1" and spec.plan.name not in V1_FORMATS:
            continue
        key = (spec.plan.name, spec.generation, spec.config, spec.sparse)
        flags = spec.plan.name == FLAG_FORMAT and spec.generation == "v3"
        if key not in seen_config or flags:
            seen_config.add(key)
            specs.setdefault(spec, call.args)
    return specs


@pytest.mark.slow
def test_every_distinct_kernel_compiles_as_a_launch_compiles_it(prepared):
    """The representative set (module docstring) compiles through `compiled_kernel`, the function a launch calls,
    with the arguments `prepare` built from the call's tensors."""
    specs = _representative(prepared)
    t0, failures = time.time(), []
    for spec, args in specs.items():
        try:
            launch.compiled_kernel(spec, args, ARCH)
        except Exception as exc:  # noqa: BLE001 - report every failing kernel, not only the first
            failures.append(f"{spec.plan.name} {spec.generation} {spec.config} sparse={spec.sparse} sink={spec.has_sink} "
                            f"outer={spec.has_outer} split={spec.split}: {type(exc).__name__}: {str(exc)[:200]}")
    print(f"{len(specs)} kernels compiled in {time.time() - t0:.0f} s")
    assert not failures, "\n".join(failures)


def test_ptx_digest_ignores_comments_debug_lines_and_kernel_names_only():
    """tools/ptx_digest: two PTX texts that differ only in comments, `.loc` / `.file` lines and the kernel symbol's
    class-derived name digest equal; any instruction change does not."""
    from tools.ptx_digest import ptx_digest

    a = "// generated\n.file 1 \"x.py\"\n.entry kernel_MlaAttentionV3_abc(\n\tadd.s32 %r1, %r2, 1;\n\t.loc 1 10 2\n"
    b = "// other\n.file 1 \"y.py\"\n.entry kernel_MlaAttention_xyz(\n\tadd.s32 %r1, %r2, 1;\n\t.loc 1 99 0\n"
    assert ptx_digest(a) == ptx_digest(b)
    assert ptx_digest(a) != ptx_digest(a.replace("add.s32 %r1, %r2, 1", "add.s32 %r1, %r2, 2"))
