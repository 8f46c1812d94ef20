"""One dense-decode attention launch per format at shape (b) of the benchmark, for a profiler.

    ncu --clock-control none -k regex:MlaAttention --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section MemoryWorkloadAnalysis \
        python -m benchmarks.profile_dense --formats nvfp4,bf16 [--context 65536]

h=16, batch 32, every query sees the whole context through a random block table (as in bench.py);
the kernel generation is the environment's (MLA_EVAL_ATTENTION_KERNEL). One attention launch per
format (so `--launch-count` = number of formats); `--time` adds a second launch and prints its time.
`--consumer-rev N` launches v3 itself with that consumer revision (`tuning.V3_CONSUMER_REVS`) instead of
what dispatch runs: the SASS of two revisions side by side in ncu. `--heads 128 --cta-pair 1` (or 0) launches v3's
two-producer 32-head tile itself, as CTA pairs or not (docs/kernels.md#the-cta-pair; shape (d) of the benchmark
with `--context 8192`): the pair's profile beside the unpaired kernel's.
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
    ap.add_argument("--consumer-rev", type=int, help="launch v3 with this consumer revision (default: what dispatch runs)")
    ap.add_argument("--heads", type=int, default=16, help="query heads (16: shape (b); 128 with --context 8192: (d))")
    ap.add_argument("--cta-pair", type=int, choices=(0, 1),
                    help="launch v3's two-producer 32-head tile as CTA pairs (1) or not (0); needs --heads % 64 == 0")
    args = ap.parse_args(argv)
    if args.cta_pair is not None and args.heads % 64:
        ap.error(f"--cta-pair needs pairs of 32-head tiles: --heads a multiple of 64, not {args.heads}")
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

        def run():
            if args.consumer_rev is not None or args.cta_pair is not None:
                from mla_eval_kernels.cute.launch import mla_attention_v3

                tile = {} if args.cta_pair is None else dict(head_tile=32, producer_wgs=2, cta_pair=bool(args.cta_pair))
                return mla_attention_v3(
                    plan_for(spec), q, cache, softmax_scale=0.0417, block_table=table, seq_lens=lens, sink=None,
                    outer_scale=s_l, max_seq_len=args.context, consumer_rev=args.consumer_rev, **tile,
                )
            return dispatch.mla_attention_dense(
                spec, q, cache, block_table=table, seq_lens=lens, softmax_scale=0.0417, outer_scale=s_l,
                max_seq_len=args.context, backend="kernel",
            )

        version = generation_for(plan_for(spec), sparse=False, heads=args.heads)[0]  # what dispatch runs for this launch
        if args.consumer_rev is not None:
            version = f"v3 consumer rev {args.consumer_rev}"
        if args.cta_pair is not None:
            version = f"v3 32-head tile, {'CTA pairs' if args.cta_pair else 'unpaired'}"
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
