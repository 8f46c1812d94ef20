"""Benchmark of the cache writer and MLA attention kernels, with ceilings measured in the same run.

    python -m benchmarks.kernel_bench [--formats nvfp4,bf16] [--out bench-out] [--quick] [--variants]
        [--shapes writer,a,b,c,d] [--heads 128]

Shapes (issue 4; d: issue 14):
  (a) sparse decode, DeepSeek-V3.2: h=128 (or --heads), top-k 2048, batch 64 and 128 (compute-bound)
  (b) dense decode, h=16, context 8K / 32K / 64K, batch 32 (memory-bound)
  (c) teacher-forced prefill-as-decode: 2048 queries, causal over 2048 slots, h=8 (the default model)
  (d) dense decode, h=128 (or --heads), context 8K / 32K, batch 32 (issue 14's dense h=128 target; not in the
      default --shapes); the shape is named d_dense_decode_h<heads>
  writer: 65536 tokens
Reported: median time over timed runs (CUDA events; rotating cache copies so the L2 holds none),
cache GB/s (record bytes read), TFLOP/s (2 * (576 + 512) per query, head, key), ratios to the
ceilings (device-to-device copy, bytes read + written; bf16 8192^3 matmul) and, for nvfp4 at
(a) and (b), the speed-up over the torch reference.

Every attention row names the kernel generation that ran (`kernel`: v1 = the first, v2 and v3 = issue 14's;
`tuning.generation_for` picks it per launch, MLA_EVAL_ATTENTION_KERNEL forces one). `--variants`
adds, at shape (b), the v1 and v2 kernels side by side plus probes that switch one v2 change on or off
(`probe_variants`), so a gain is attributed by measurement; `skip_decode` leaves the decode out (wrong
output) to show what the decode costs.
At (b), every format the v3 kernel covers (`tuning.v3_blocker`) gets both a `kernel=v2` and a
`kernel=v3` row (one of them is the default launch), whatever MLA_EVAL_ATTENTION_KERNEL says; with
`--variants`, at 64K also v3-p1 /
v3-p2 (producer warpgroups) and, for the decoded formats, the timing probes v3-nodec / v3-nomma (wrong
output: no decode / no wgmma), which tell which side bounds v3, and v3-r<S>x<K> for each raw ring that fits
other than the default (`tuning.v3_raw_rings`: the fp8 records' part-tile rings).
At h = 128 ((a) with `--variants`, and (d) always) v3 runs once per head tile: rows v3-t16 and v3-t32
(`tuning.V3_HEAD_TILES`); the default row beside them says what dispatch runs. With `--variants`, also the 32-head
tile with the other producer warpgroup count there: v3-t32-p1 (the default is two, with per-role registers,
`setmaxnreg`).
(The consumer / decode rev-1 rows and the CTA pair's row went with their code: docs/kernels.md keeps their history.)

Compiling every kernel takes seconds each, so one worker process per format compiles and warms
up in parallel; the timed part runs under an exclusive file lock, one worker at a time.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from mla_eval import provenance
from mla_eval.atomic_io import write_json_atomic
from mla_eval.formats import all_formats, get_format

SLOTS_A = 1 << 18
LOCK = Path(os.environ.get("TMPDIR", "/tmp")) / "mla_eval_bench.lock"


def probe_variants(plan) -> list[tuple[str, tuple | None, object]]:
    """(name, tile or None for tile_config's, Tuning) of the h=16 variants timed at shape (b): v1,
    v2 as dispatched (`launch_choice`), and v2 with one change undone or varied (what each change is
    worth, measured in one run). The 2026-12-03 JSON predates `launch_choice`: its "v2" is today's
    "v2-wide" and its "v2-narrow-pf2" today's "v2" where two narrow CTAs fit an SM."""
    import dataclasses

    from mla_eval_kernels.plan.tuning import V1, Tuning, default_tuning, fast_e2m1_eligible, is_bf16_plan, launch_choice

    wide_tile = (16, 1, 8, 64)
    tile, v2 = launch_choice(plan, wide_tile, "v2")
    wide = default_tuning(plan, wide_tile, "v2")
    out = [
        ("v1", None, V1),
        ("v2", tile, v2),
        ("v2-wide", wide_tile, wide),
        ("v2-wide-q_smem", wide_tile, dataclasses.replace(wide, q_regs=False)),
        ("v2-wide-chains4", wide_tile, dataclasses.replace(wide, s_chains=4)),
    ]
    if not is_bf16_plan(plan):
        out += [("v2-wide-prefetch1", wide_tile, dataclasses.replace(wide, prefetch=1))]
        out += [("v2+skip_decode", tile, dataclasses.replace(v2, skip_decode=True))]
    if fast_e2m1_eligible(plan):
        out += [("v2-slow_e2m1", tile, dataclasses.replace(v2, fast_e2m1=False))]
        out += [("v1+fast_e2m1", None, Tuning(fast_e2m1=True))]
    return out


def v3_tile_variants(plan, heads: int, sparse: bool, variants: bool) -> list[tuple[str, int, int | None]]:
    """(row name, head tile, producer warpgroups or None for the default) of the v3 rows of an h > 16 launch: one
    per head tile its CTA fits (v3-t16, v3-t32); with `variants`, the 32-head tile also with the other producer
    warpgroup count (v3-t32-p1: two are the default, with per-role registers, `tuning.v3_reg_budget`). None where v3
    refuses the format."""
    from mla_eval_kernels.plan.tuning import V3_HEAD_TILES, V3_WIDE_HEADS, v3_blocker, v3_head_tile, v3_producer_wgs

    if v3_blocker(plan, sparse=sparse) is not None:
        return []
    rows = []
    fits = v3_head_tile(plan, heads, sparse)[0]
    for tile in (t for t in V3_HEAD_TILES if t <= fits):
        rows.append((f"v3-t{tile}", tile, None))
        if variants and tile == V3_WIDE_HEADS:
            other = 3 - v3_producer_wgs(plan, tile)
            rows.append((f"v3-t{tile}-p{other}", tile, other))
    return rows


def _median_ms(fn, reps: int, warmup: int = 3) -> float:
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _graph_ms(fn, reps: int) -> tuple[float, str]:
    """Median time of fn replayed from a CUDA graph (no host launch overhead), else plain launches."""
    try:
        fn(0)
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(0)
        torch.cuda.current_stream().wait_stream(s)
        graphs = []
        for i in range(4):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn(i)
            graphs.append(g)
        return _median_ms(lambda i: graphs[i % 4].replay(), reps), "graph"
    except Exception as exc:  # noqa: BLE001 - report and fall back
        print(f"  (graph capture failed: {type(exc).__name__}: {exc}; timing plain launches)", file=sys.stderr)
        return _median_ms(fn, reps), "launch"


def ceilings() -> dict:
    n = 1 << 30  # 4 GiB fp32 per buffer
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = _median_ms(lambda i: dst.copy_(src), 10)
    src = dst = None  # free 8 GiB before the matmul
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = _median_ms(lambda i: a @ b, 10)
    return {
        "copy_tb_s": 2 * n / copy_ms / 1e9,
        "bf16_matmul_tflop_s": 2 * 8192**3 / mm_ms / 1e9,
        "copy_bytes": 2 * n,
        "matmul": "8192x8192x8192 bf16, random",
    }


def _random_caches(spec, num_slots: int, copies: int):
    from mla_eval.attention import dispatch

    caches = []
    for c in range(copies):
        cache = torch.empty(num_slots // 64, 64, spec.record_bytes, dtype=torch.uint8, device="cuda")
        for start in range(0, num_slots, 1 << 17):
            t = min(1 << 17, num_slots - start)
            lat = torch.randn(t, 512, device="cuda", dtype=torch.bfloat16)
            rope = torch.randn(t, 64, device="cuda", dtype=torch.bfloat16)
            slots = torch.arange(start, start + t, device="cuda")
            s_l = 0.05 if spec.outer_scale is not None else None
            dispatch.write_cache(spec, lat, rope, slots, cache, outer_scale=s_l, backend="kernel", check_finite=False)
        caches.append(cache)
    return caches


def _dense_problem(spec, batch: int, heads: int, ctx: int, gen):
    """(q, block_table, seq_lens, cache) of a dense decode shape: `batch` sequences of `ctx` keys each in random
    64-slot blocks of one random cache, one query of `heads` heads per sequence (shapes b and d)."""
    blocks = batch * ctx // 64
    cache = _random_caches(spec, blocks * 64, 1)[0]
    table = torch.randperm(blocks, device="cuda").view(batch, -1).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, table, lens, cache


def run_format(name: str, quick: bool, variants: bool = False, shapes: str = "writer,a,b,c", heads: int = 128) -> list[dict]:
    """All measurements of one format (called in a worker process); `shapes` picks writer / a / b / c / d; `heads`
    is the head count of shapes (a) and (d) (128: DeepSeek-V3's; 64 / 32: the same model on 2 / 4 GPUs of TP)."""
    from mla_eval.attention import dispatch
    from mla_eval_kernels.cute import launch as kernel
    from mla_eval_kernels.plan.launch import flops
    from mla_eval_kernels.plan.record_plan import plan_for
    from mla_eval_kernels.plan.tuning import (
        generation_for,
        is_bf16_plan,
        v3_blocker,
        v3_producer_wgs,
        v3_raw_rings,
    )

    def ran(sparse: bool, heads: int, queries_per_seq: int = 1) -> str:
        """The generation the default launch of a shape runs (the one policy dispatch follows)."""
        return generation_for(plan_for(spec), sparse=sparse, heads=heads, queries_per_seq=queries_per_seq)[0]

    spec = get_format(name)
    s_l = 0.05 if spec.outer_scale is not None else None
    reps = 5 if quick else 20
    rows, todo = [], []

    def v3_tile_rows(shape, params, heads, sparse, nbytes, nflop, lists):
        """v3 rows of an h > 16 launch, one per head tile its CTA fits (`lists(i)`: the launch's slot lists for
        timed run i)."""
        from benchmarks.probes import mla_attention_v3

        plan = plan_for(spec)
        for row, tile, wgs in v3_tile_variants(plan, heads, sparse, variants):

            def f3(i, tile=tile, wgs=wgs):
                return mla_attention_v3(
                    plan, lists(i)["q"], lists(i)["cache"], softmax_scale=0.0417, block_table=lists(i).get("block_table"),
                    seq_lens=lists(i).get("seq_lens"), indices=lists(i).get("indices"), sink=None, outer_scale=s_l,
                    max_seq_len=lists(i).get("max_seq_len"), head_tile=tile, producer_wgs=wgs,
                )

            todo.append((shape, dict(params, kernel=row), f3, nbytes, nflop, None))
    gen = torch.Generator(device="cuda").manual_seed(0)

    # writer
    t = 65536
    lat = torch.randn(t, 512, device="cuda", dtype=torch.bfloat16)
    rope = torch.randn(t, 64, device="cuda", dtype=torch.bfloat16)
    wcache = torch.empty(t // 64, 64, spec.record_bytes, dtype=torch.uint8, device="cuda")
    perm = torch.randperm(t, device="cuda")

    def writer(i):
        dispatch.write_cache(spec, lat, rope, perm, wcache, outer_scale=s_l, backend="kernel", check_finite=False)

    shapes = set(shapes.split(","))
    if "writer" in shapes:
        todo.append(("writer", dict(tokens=t), writer, t * (1152 + spec.record_bytes), 0.0, None))

    # (a) sparse decode
    caches = _random_caches(spec, SLOTS_A, 4) if shapes & {"a", "c"} else None
    for n in () if "a" not in shapes else (64,) if quick else (64, 128):
        q = torch.randn(n, heads, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
        idx = torch.argsort(torch.rand(n, SLOTS_A, device="cuda", generator=gen), dim=1)[:, :2048].to(torch.int32)

        def fa(i, q=q, idx=idx):
            return dispatch.mla_attention_sparse(
                spec, q, caches[i % 4], indices=idx, softmax_scale=0.0417, outer_scale=s_l, backend="kernel"
            )

        def ref_a(i, q=q, idx=idx):
            return dispatch.mla_attention_sparse(
                spec, q, caches[0], indices=idx, softmax_scale=0.0417, outer_scale=s_l, backend="reference"
            )

        ref = ref_a if name == "nvfp4" and n == 64 else None
        todo.append(
            (
                "a_sparse_decode", dict(batch=n, heads=heads, topk=2048, kernel=ran(True, heads)), fa,
                n * 2048 * spec.record_bytes, flops(n, heads, 2048), ref,
            )
        )
        if variants:  # v3 beside the default (v2): sparse lists, 16- and 32-head tiles
            v3_tile_rows(
                "a_sparse_decode", dict(batch=n, heads=heads, topk=2048), heads, True, n * 2048 * spec.record_bytes,
                flops(n, heads, 2048), lambda i, q=q, idx=idx: dict(q=q, cache=caches[i % 4], indices=idx),
            )

    # (b) dense decode, memory-bound
    batch = 32
    for ctx in () if "b" not in shapes else (8192,) if quick else (8192, 32768, 65536):
        q, table, lens, bcache = _dense_problem(spec, batch, 16, ctx, gen)

        def fb(i, q=q, table=table, lens=lens, bcache=bcache, ctx=ctx):
            return dispatch.mla_attention_dense(
                spec, q, bcache, block_table=table, seq_lens=lens, softmax_scale=0.0417, outer_scale=s_l,
                max_seq_len=ctx, backend="kernel",
            )

        def ref_b(i, q=q, table=table, lens=lens, bcache=bcache):
            return dispatch.mla_attention_dense(
                spec, q, bcache, block_table=table, seq_lens=lens, softmax_scale=0.0417, outer_scale=s_l, backend="reference"
            )

        ref = ref_b if name == "nvfp4" and ctx <= 32768 else None
        todo.append(
            (
                "b_dense_decode", dict(batch=batch, heads=16, context=ctx, kernel=ran(False, 16)), fb,
                batch * ctx * spec.record_bytes, flops(batch, 16, ctx), ref,
            )
        )
        if v3_blocker(plan_for(spec), sparse=False) is None:
            from benchmarks.probes import mla_attention_v3

            # the generation the default launch does not run, so that v2 and v3 stay side by side
            other = "v2" if ran(False, 16) == "v3" else "v3"

            def fb3(i, q=q, table=table, lens=lens, bcache=bcache, ctx=ctx, other=other):
                return kernel.mla_attention(
                    plan_for(spec), q, bcache, softmax_scale=0.0417, block_table=table, seq_lens=lens, indices=None,
                    sink=None, outer_scale=s_l, max_seq_len=ctx, generation=other,
                )

            todo.append(
                (
                    "b_dense_decode", dict(batch=batch, heads=16, context=ctx, kernel=other), fb3,
                    batch * ctx * spec.record_bytes, flops(batch, 16, ctx), None,
                )
            )
            # v3 rows by keywords of `mla_attention_v3`: with --variants at 64K the probes
            v3_rows = []
            if variants and (ctx == 65536 or quick):
                # what the second (or a second) producer warpgroup is worth
                pwg = v3_producer_wgs(plan_for(spec))
                probes = [(f"v3-p{3 - pwg}", dict(producer_wgs=3 - pwg))]
                if not is_bf16_plan(plan_for(spec)):
                    # timing probes (wrong output): the producer's decode left out; the consumer's wgmma left out
                    probes += [("v3-nodec", dict(timing_probe="nodec")), ("v3-nomma", dict(timing_probe="nomma"))]
                # the other raw rings that fit (fp8 records: fewer keys in flight, or larger stages), same output
                probes += [(f"v3-r{r[0]}x{r[1]}", dict(raw_ring=r)) for r in v3_raw_rings(plan_for(spec))[1:]]
                v3_rows += probes
            for vname, kw in v3_rows:

                def fb3v(i, q=q, table=table, lens=lens, bcache=bcache, ctx=ctx, kw=kw):
                    return mla_attention_v3(
                        plan_for(spec), q, bcache, softmax_scale=0.0417, block_table=table, seq_lens=lens, sink=None,
                        outer_scale=s_l, max_seq_len=ctx, **kw,
                    )

                todo.append(
                    (
                        "b_dense_decode", dict(batch=batch, heads=16, context=ctx, kernel=vname), fb3v,
                        batch * ctx * spec.record_bytes, flops(batch, 16, ctx), None,
                    )
                )
        if variants and (ctx == 65536 or quick):
            plan = plan_for(spec)
            for vname, vtile, tuning in probe_variants(plan):

                def fv(i, q=q, table=table, lens=lens, bcache=bcache, ctx=ctx, vtile=vtile, tuning=tuning):
                    return kernel.mla_attention(
                        plan, q, bcache, softmax_scale=0.0417, block_table=table, seq_lens=lens, indices=None, sink=None,
                        outer_scale=s_l, max_seq_len=ctx, tuning=tuning, tile=vtile,
                    )

                todo.append(
                    (
                        "b_dense_decode", dict(batch=batch, heads=16, context=ctx, kernel=vname), fv,
                        batch * ctx * spec.record_bytes, flops(batch, 16, ctx), None,
                    )
                )

    # (d) dense decode at h = `heads` (128 unless asked): the default launch and v3 per head tile
    d_shape = f"d_dense_decode_h{heads}"
    for ctx in () if "d" not in shapes else (8192,) if quick else (8192, 32768):
        q, table, lens, dcache = _dense_problem(spec, batch, heads, ctx, gen)

        def fd(i, q=q, table=table, lens=lens, dcache=dcache, ctx=ctx):
            return dispatch.mla_attention_dense(
                spec, q, dcache, block_table=table, seq_lens=lens, softmax_scale=0.0417, outer_scale=s_l,
                max_seq_len=ctx, backend="kernel",
            )

        dparams = dict(batch=batch, heads=heads, context=ctx)
        nbytes, nflop = batch * ctx * spec.record_bytes, flops(batch, heads, ctx)
        todo.append((d_shape, dict(dparams, kernel=ran(False, heads)), fd, nbytes, nflop, None))
        v3_tile_rows(
            d_shape, dparams, heads, False, nbytes, nflop,
            lambda i, q=q, table=table, lens=lens, dcache=dcache, ctx=ctx: dict(
                q=q, cache=dcache, block_table=table, seq_lens=lens, max_seq_len=ctx
            ),
        )

    # (c) prefill-as-decode: query i sees slots 0..i of one 2048-token sequence
    n = 2048
    ccache = caches[0] if caches else None
    table = torch.arange(n // 64, device="cuda", dtype=torch.int32).repeat(n, 1)
    lens = torch.arange(1, n + 1, device="cuda", dtype=torch.int32)
    qc = torch.randn(n, 8, 576, device="cuda", dtype=torch.bfloat16, generator=gen)

    def fc(i):
        return dispatch.mla_attention_dense(
            spec, qc, ccache, block_table=table, seq_lens=lens, softmax_scale=0.0417, outer_scale=s_l, max_seq_len=n,
            backend="kernel", queries_per_seq=n,
        )

    keys = n * (n + 1) / 2
    if "c" in shapes:
        cparams = dict(queries=n, heads=8, slots=n, kernel=ran(False, 8, n))
        todo.append(("c_prefill_as_decode", cparams, fc, keys * spec.record_bytes, flops(1, 8, keys), None))
    if variants and "c" in shapes:  # v1 and the 8-warp v2 tile at (c) too: launch_choice was measured at (b) only
        plan = plan_for(spec)
        for vname, vtile, tuning in probe_variants(plan)[:3]:

            def fcv(i, vtile=vtile, tuning=tuning):
                return kernel.mla_attention(
                    plan, qc, ccache, softmax_scale=0.0417, block_table=table, seq_lens=lens, indices=None, sink=None,
                    outer_scale=s_l, max_seq_len=n, tuning=tuning, tile=vtile,
                )

            todo.append(
                (
                    "c_prefill_as_decode", dict(queries=n, heads=8, slots=n, kernel=vname), fcv, keys * spec.record_bytes,
                    flops(1, 8, keys), None,
                )
            )

    for _, _, fn, _, _, _ in todo:  # compile + warm up outside the lock
        fn(0)
    torch.cuda.synchronize()
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for shape, params, fn, nbytes, nflop, ref in todo:
            ms, how = _graph_ms(fn, reps)
            row = dict(format=name, shape=shape, **params, ms=ms, timing=how,
                       cache_gb_s=nbytes / ms / 1e6, tflop_s=nflop / ms / 1e9 if nflop else None)
            if ref is not None:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                ref(0)
                torch.cuda.synchronize()
                row["reference_ms"] = (time.perf_counter() - t0) * 1e3
                row["speedup_vs_reference"] = row["reference_ms"] / ms
            rows.append(row)
            print(json.dumps(row), flush=True)
        fcntl.flock(lock, fcntl.LOCK_UN)
    return rows


def kernel_format_names() -> list[str]:
    """Every registered format the CuTe kernels serve (others run on the torch reference only)."""
    from mla_eval_kernels.plan.record_plan import UnsupportedFormat, plan_for

    names = []
    for spec in all_formats():
        try:
            plan_for(spec)
        except UnsupportedFormat:
            continue
        names.append(spec.name)
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default=None, help="comma-separated (default: every format the kernels serve)")
    ap.add_argument("--out", default="bench-out", help="folder for the JSON (default bench-out)")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    ap.add_argument("--variants", action="store_true", help="v1 / v2 / v3 and probe variants side by side at (a), (b)")
    ap.add_argument("--shapes", default="writer,a,b,c", help="comma-separated subset of writer,a,b,c,d")
    ap.add_argument("--heads", type=int, default=128,
                    help="query heads of shapes (a) and (d) (default 128, DeepSeek-V3; 64 / 32 for 2 / 4 GPUs of TP)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.formats is None:
        args.formats = ",".join(kernel_format_names())
    bad = set(args.shapes.split(",")) - {"writer", "a", "b", "c", "d"}
    if bad:
        print(f"error: --shapes: unknown {','.join(sorted(bad))} (expected writer,a,b,c,d)", file=sys.stderr)
        return 2
    if not 16 < args.heads <= 128 or args.heads % 16:
        print(f"error: --heads {args.heads}: shapes (a) and (d) time more than one 16-head tile; give a multiple of 16 "
              "in 32..128", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: the benchmark times CUDA kernels and sees no CUDA GPU; run it on one (e.g. the H200)", file=sys.stderr)
        return 2
    if args.worker:
        run_format(args.worker, args.quick, args.variants, args.shapes, args.heads)
        return 0

    gpu = torch.cuda.get_device_name()
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ceil = ceilings()
        fcntl.flock(lock, fcntl.LOCK_UN)
    print(f"GPU {gpu}: copy {ceil['copy_tb_s']:.2f} TB/s, bf16 matmul {ceil['bf16_matmul_tflop_s']:.0f} TFLOP/s", flush=True)
    procs = {}
    for name in args.formats.split(","):
        cmd = [sys.executable, "-m", "benchmarks.kernel_bench", "--worker", name] + (["--quick"] if args.quick else [])
        cmd += ["--variants"] if args.variants else []
        cmd += ["--shapes", args.shapes, "--heads", str(args.heads)]
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    rows, failed = [], []
    for name, p in procs.items():
        out, _ = p.communicate()
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if p.returncode:
            failed.append(name)
    for r in rows:
        r["copy_ratio"] = r["cache_gb_s"] / (ceil["copy_tb_s"] * 1e3)
        if r.get("tflop_s"):
            r["matmul_ratio"] = r["tflop_s"] / ceil["bf16_matmul_tflop_s"]
    # what computed these numbers: the command, the code (commit or source digest), CuTe DSL
    doc = {"gpu": gpu, "capability": list(torch.cuda.get_device_capability()), "ceilings": ceil, "rows": rows,
           "failed_formats": failed, "torch": torch.__version__, "cutlass_dsl": provenance.cutlass_dsl_version(),
           "command": ["python", "-m", "benchmarks.kernel_bench", *(sys.argv[1:] if argv is None else argv)],
           "code": provenance.code_identity()}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"bench-{gpu.replace(' ', '_')}.json"
    write_json_atomic(path, doc)
    print(f"\n{'format':18} {'shape':20} {'kernel':16} {'params':34} "
          f"{'ms':>9} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8} {'%mm':>5} {'x ref':>6}")
    for r in rows:
        params = ",".join(f"{k}={r[k]}" for k in ("batch", "heads", "topk", "context", "queries", "tokens") if k in r)
        tf = f"{r['tflop_s']:8.1f}" if r.get("tflop_s") else " " * 8
        mm = f"{100 * r['matmul_ratio']:5.1f}" if r.get("matmul_ratio") else " " * 5
        sp = f"{r['speedup_vs_reference']:6.1f}" if "speedup_vs_reference" in r else ""
        print(
            f"{r['format']:18} {r['shape']:20} {r.get('kernel', '?'):16} {params:34} {r['ms']:9.4f} {r['cache_gb_s']:7.0f} "
            f"{100 * r['copy_ratio']:6.1f} {tf} {mm} {sp}"
        )
    print(f"saved {path}; failed formats: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
