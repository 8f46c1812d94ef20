#!/usr/bin/env bash
# GPU validation of branch wip-v3fp8 (session 8, CPU-only): v3 for fp8_ds_mla, fp8_ds_mla_pow2 and fp8_e4m3 through
# part-tile raw rings (attention_tuning.v3_raw_ring), held off by attention_tuning.V3_AWAITING_GPU_TESTS.
# After the wheel-halves call of device_setup.sh (as device_session8.sh; carry .devwheels/b .devwheels/js):
#   bash results/h200/device_v3fp8.sh kern   then, the machine still warm:   bash results/h200/device_v3fp8.sh bench
#   (one call each: kern can take 800 s at its limits, bench 500 s; a call runs at most 600 s)
#   kern   tests/test_kernels_v3_gpu.py in full (the held formats run v3 there: fixture kernels_under_test clears the
#          list), and the fp8 cases of tests/test_kernels_gpu.py (v2; its cubins are unchanged by the branch)
#   bench  (b) dense decode h=16 batch 32 with --variants: v2 and v3 rows for the three formats (v3 rows marked
#          v3_held while listed), the other rings (v3-r<S>x<K>), v3-nodec / v3-nomma; nvfp4 and bf16 beside them
# If kern passes: delete the three entries of V3_AWAITING_GPU_TESTS (commit with the logs). Add a format to
# V3_DEFAULT_FORMATS only where its v3 row beats v2 at 8K, 32K and 64K; keep the default ring unless a v3-r row wins.
. "$(dirname "$0")/device_setup.sh"  # log, step timer, CuTe DSL + jsonschema
mkdir -p "$OUT/runs"
for w in "$@"; do
case "$w" in
kern)
    step "v3 kernel GPU tests (fp8 records on part-tile raw rings included)"
    gpu_pytest 500 v3fp8 -n 8 tests/test_kernels_v3_gpu.py
    step "v2 fp8 kernel GPU tests"
    gpu_pytest 300 v3fp8-v2 -n 8 tests/test_kernels_gpu.py -k "fp8_ds_mla or fp8_e4m3"
    ;;
bench)
    step "bench (b) variants, fp8 records beside nvfp4 and bf16"
    gpu_bench 500 bench-v3fp8 --shapes b --variants --formats fp8_ds_mla,fp8_ds_mla_pow2,fp8_e4m3,nvfp4,bf16
    ;;
*) echo "unknown step $w (kern, bench)"; exit 2 ;;
esac
done
step "done"
