#!/usr/bin/env bash
# GPU validation of branch wip-v3h (session 9, CPU-only): v3 for sparse top-k lists and a 32-head tile (h > 16),
# held off by attention_tuning.V3_LAUNCHES_AWAITING_GPU_TESTS (and the fp8 records by V3_AWAITING_GPU_TESTS).
# After the wheel-halves call of device_setup.sh (as device_session8.sh; carry .devwheels/b .devwheels/js):
#   bash results/h200/device_v3h.sh kern   then, the machine still warm:   bash results/h200/device_v3h.sh bench
#   (one call each; a call runs at most 600 s; `kernfull` adds the whole v3 file if time is left)
#   kern   the session-9 cases of tests/test_kernels_v3_gpu.py (sparse h=16/64/128, the 32-head tile at h=32/64/128,
#          the 16-head tile at h=128, held launches, routing) and every v3 case of tests/test_kernels_gpu.py (dense and
#          sparse, h=8..128: the fixture kernels_under_test clears both holds, so these run v3), all-invalid rows
#   bench  (a) sparse decode h=128 topk 2048 batch 64/128 with --variants (default v2 row, v3-t16, v3-t32) and the new
#          (d) dense decode h=128 batch 32, 8K / 32K (default v2 row, v3-t16, v3-t32), for bf16, nvfp4, fp8_ds_mla,
#          nvfp4_fp8_ds_mla (v3 rows marked v3_held while the holds stand)
# If kern passes: delete V3_LAUNCHES_AWAITING_GPU_TESTS' entries (commit with the logs; with the fp8 records still
# listed in V3_AWAITING_GPU_TESTS those stay on v2 unless device_v3fp8.sh kern passed too). The default policy
# (generation_for: v3 only for dense h <= 16) changes only where the bench's v3 rows beat the default row.
. "$(dirname "$0")/device_setup.sh"  # log, step timer, CuTe DSL + jsonschema
mkdir -p "$OUT/runs"
for w in "$@"; do
case "$w" in
kern)
    step "v3 session-9 GPU tests: sparse lists, 32-head tile"
    gpu_pytest 280 v3h -n 8 tests/test_kernels_v3_gpu.py -k "sparse or head_tile or held or environment_routes"
    step "every v3 case of the kernel GPU tests (dense and sparse, h=8..128), all-invalid rows"
    gpu_pytest 280 v3h-all -n 8 tests/test_kernels_gpu.py -k "(matches_reference and v3) or all_invalid"
    ;;
kernfull)
    step "the whole v3 GPU test file"
    gpu_pytest 550 v3h-full -n 8 tests/test_kernels_v3_gpu.py
    ;;
bench)
    step "bench (a) variants and (d): v2 vs v3 per head tile at h=128"
    gpu_bench 550 bench-v3h --shapes a,d --variants --formats bf16,nvfp4,fp8_ds_mla,nvfp4_fp8_ds_mla
    ;;
*) echo "unknown step $w (kern, kernfull, bench)"; exit 2 ;;
esac
done
step "done"
