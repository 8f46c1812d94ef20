#!/usr/bin/env bash
# GPU validation of branch wip-t32p2 (session 9, CPU-only): v3's 32-head tile with two producer warpgroups and per-role
# registers (setmaxnreg: consumer 232, producers 136), a probe held by attention_tuning.V3_LAUNCHES_AWAITING_GPU_TESTS
# ("head_tile_32_two_producers"); the 32-head tile's default stays one producer warpgroup (its cubins are unchanged).
# After the wheel-halves call of device_setup.sh (as device_session8.sh; carry .devwheels/b .devwheels/js):
#   bash results/h200/device_t32p2.sh kern   then, the machine still warm:   bash results/h200/device_t32p2.sh bench
#   (one call each; a call runs at most 600 s)
#   kern   tests/test_kernels_v3_gpu.py's two-producer cases (nvfp4, mxfp4, bf16, fp8_ds_mla; dense h=32/128, sparse
#          h=128; 1 and 3 splits; against the reference with NaN-poisoned outputs and bit-identical to one producer),
#          the compile checks of the variant, and the session-9 32-head-tile cases beside them (the default kernel)
#   bench  (a) sparse decode h=128 topk 2048 batch 64/128 and (d) dense decode h=128 batch 32, 8K / 32K, --variants:
#          default row (v2), v3-t16, v3-t32, v3-t32-p2 (marked v3_held while the hold stands), for bf16, nvfp4,
#          fp8_ds_mla, nvfp4_fp8_ds_mla
# If kern passes: delete V3_LAUNCHES_AWAITING_GPU_TESTS["head_tile_32_two_producers"] (commit with the logs). Make two
# producer warpgroups the 32-head tile's default (attention_tuning.V3_WIDE_PRODUCER_WGS = 2) only where v3-t32-p2 beats
# v3-t32 in the bench; the default policy (generation_for: v2 for sparse lists and h > 16) changes only where a v3 row
# beats the default row.
. "$(dirname "$0")/device_setup.sh"  # log, step timer, CuTe DSL + jsonschema
mkdir -p "$OUT/runs"
for w in "$@"; do
case "$w" in
kern)
    step "v3 32-head tile, two producer warpgroups (setmaxnreg): GPU tests, compile checks; the 32-head tile's cases"
    gpu_pytest 300 t32p2 -n 8 tests/test_kernels_v3_gpu.py -k "two_producer or head_tile or sass_role or compile_key"
    ;;
bench)
    step "bench (a) variants and (d): v2, v3-t16, v3-t32, v3-t32-p2 at h=128"
    gpu_bench 550 bench-t32p2 --shapes a,d --variants --formats bf16,nvfp4,fp8_ds_mla,nvfp4_fp8_ds_mla
    ;;
*) echo "unknown step $w (kern, bench)"; exit 2 ;;
esac
done
step "done"
