#!/usr/bin/env bash
# Session 9's model-side device steps (the kernel steps are device_v3fp8.sh's and, once written, device_v3h.sh's).
# After the wheel calls of device_setup.sh (the tree is near the 64 MiB carry limit: the first half in two pieces,
# .devwheels/a1 and a2, part.ab alone in .devwheels/bp; see results/h200/README.md, "Ninth session"):
#   model stashed, carry .devwheels/b .devwheels/js:   bash results/h200/device_session9.sh kern bench
#   model in place, no carry:                           bash results/h200/device_session9.sh fwd
#   kern   tests/test_kernels_v3_gpu.py with the session's defaults (bf16 copied by two producer warpgroups, the fp8
#          records on the 2x32 part-tile ring): what ran as probes in the first call now runs as the default
#   bench  (b) dense decode h=16 batch 32 at 8K/32K/64K, v2 and v3 rows, for bf16 and the fp8 records (+ nvfp4):
#          decides whether bf16 joins V3_DEFAULT_FORMATS and confirms the 2x32 ring at 8K and 32K
#   fwd    the issue-14 kld window target at production geometry: forward_bench --parts kld on random:deepseek-v3
#          (128 heads, hidden 7168, 3 layers; random weights: cost, not quality), stock SDPA vs nvfp4 / fp8_ds_mla /
#          bf16 through both window paths in one run, with torch.profiler tables of one window (--profile-kld);
#          then the embedded model's profile for comparison
. "$(dirname "$0")/device_setup.sh"  # log, step timer, CuTe DSL + jsonschema
mkdir -p "$OUT/runs"
for w in "$@"; do
case "$w" in
kern)
    step "v3 kernel GPU tests under the session's defaults"
    gpu_pytest 400 v3-defaults -n 8 tests/test_kernels_v3_gpu.py
    ;;
bench)
    step "bench (b): v2 and v3 rows at 8K/32K/64K"
    gpu_bench 300 bench-b --shapes b --formats bf16,fp8_ds_mla,fp8_ds_mla_pow2,fp8_e4m3,nvfp4
    ;;
fwd)
    step "forward_bench --parts kld, random:deepseek-v3, 8 x 2048 tokens"
    timeout 300 python3 -m benchmarks.forward_bench --parts kld --model random:deepseek-v3 \
        --formats nvfp4,fp8_ds_mla,bf16 --out "$OUT/runs/forward-bench-kld-dsv3.json" \
        --profile-kld "$OUT/runs/profile-kld-dsv3.txt" 2>&1 | grep -v USDT | tail -12
    step "forward_bench --parts kld, embedded model, profile"
    timeout 150 python3 -m benchmarks.forward_bench --parts kld --formats nvfp4 \
        --out "$OUT/runs/forward-bench-kld-default.json" --profile-kld "$OUT/runs/profile-kld-default.txt" 2>&1 \
        | grep -v USDT | tail -6
    ;;
*) echo "unknown step $w (kern, bench, fwd)"; exit 2 ;;
esac
done
step "done"
