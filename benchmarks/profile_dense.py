"""One dense-decode attention launch per format at shape (b) of the benchmark, for a profiler.

    ncu --clock-control none -k regex:MlaAttention --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section MemoryWorkloadAnalysis \
        python -m benchmarks.profile_dense --formats nvfp4,bf16 [--context 65536]

h=16, batch 32, every query sees the whole context through a random block table (as in bench.py);
the kernel generation is the environment's (MLA_EVAL_ATTENTION_KERNEL). One attention launch per
format (so `--launch-count` = number of formats); `--time` adds a second launch and prints its time.
`--heads 128 --context 8192` profiles shape (d) of the benchmark; `--sparse` launches top-k lists of `--context`
keys instead of the block table (shape (a): `--heads 128 --context 2048 --batch 128 --sparse`).
"""

from __future__ import annotations

import argparse

import torch

from mla_eval.attention import dispatch
from mla_eval.formats import get_format


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="nvfp4,bf16")
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--heads", type=int, default=16, help="query heads (16: shape (b); 128 with --context 8192: (d))")
    ap.add_argument("--sparse", action="store_true", help="top-k index lists of --context keys per query (shape (a))")
    args = ap.parse_args(argv)
    from benchmarks.kernel_bench import _random_caches
    from mla_eval_kernels.plan.record_plan import plan_for
    from mla_eval_kernels.plan.tuning import generation_for

    for name in args.formats.split(","):
        spec = get_format(name)
        s_l = 0.05 if spec.outer_scale is not None else None
        blocks = args.batch * args.context // 64
        cache = _random_caches(spec, blocks * 64, 1)[0]
        table = torch.randperm(blocks, device="cuda").view(args.batch, -1).to(torch.int32)
        lens = torch.full((args.batch,), args.context, dtype=torch.int32, device="cuda")
        q = torch.randn(args.batch, args.heads, 576, device="cuda", dtype=torch.bfloat16)

        # sparse: each query's top-k list, distinct random slots of the whole cache
        idx = torch.stack([torch.randperm(blocks * 64, device="cuda")[: args.context] for _ in range(args.batch)])
        idx = idx.to(torch.int32)

        def run():
            if args.sparse:
                return dispatch.mla_attention_sparse(
                    spec, q, cache, idx, softmax_scale=0.0417, outer_scale=s_l, backend="kernel",
                )
            return dispatch.mla_attention_dense(
                spec, q, cache, block_table=table, seq_lens=lens, softmax_scale=0.0417, outer_scale=s_l,
                max_seq_len=args.context, backend="kernel",
            )

        version = generation_for(plan_for(spec), sparse=args.sparse, heads=args.heads)[0]  # what dispatch runs
        run()  # compiles; the profiled launch
        torch.cuda.synchronize()
        if not args.time:
            print(f"{name} {version} context={args.context}: launched")
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        print(f"{name} {version} context={args.context}: {a.elapsed_time(b):.3f} ms (unprofiled second launch)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
