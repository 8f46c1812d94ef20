#!/usr/bin/env bash
# GPU validation and timing of v3's E2M1 decode rev 2 (session 10, issue 14; attention_tuning.V3_DECODE_REV holds it at 1).
# After device_setup's wheel calls (results/h200/README.md; carry .devwheels/b .devwheels/js), one call each:
#   bash results/h200/device_dec.sh kern   then, the machine still warm:   bash results/h200/device_dec.sh bench
#   kern   tests/test_kernels_v3_gpu.py -k decode_rev: rev 2 against the reference (NaN-poisoned outputs, 1 and 3 splits)
#          and bit for bit against rev 1, nvfp4 / nvfp4_fp8rope / nvfp4_fp8_ds_mla x dense h=16 (2 and 1 producer
#          warpgroups), sparse h=16, dense h=32, dense h=128 (two producers, setmaxnreg), sparse h=128; then the rest of
#          the v3 file's fold-format cases (rev 1, the default, unchanged)
#   bench  (b) dense decode h=16 batch 32 at 8K / 32K / 64K (rows v3 and v3-d2, marked v3_held) and (d) dense h=128
#          (v3-t16 / v3-t32 and their -d2 rows), for the three fold formats
# If kern passes and v3-d2 is at least as fast as v3 at every (b) context: set V3_DECODE_REV = 2 (commit with the logs).
. "$(dirname "$0")/device_setup.sh"  # log, step timer, CuTe DSL + jsonschema
mkdir -p "$OUT/runs"
for w in "$@"; do
case "$w" in
kern)
    step "v3 decode rev 2: bitwise against rev 1 and against the reference"
    gpu_pytest 400 dec -n 8 tests/test_kernels_v3_gpu.py -k "decode_rev"
    step "v3 fold formats at the default revision"
    gpu_pytest 180 dec-default -n 8 tests/test_kernels_v3_gpu.py -k "matches_reference and (nvfp4 and not mxfp4)"
    ;;
bench)
    step "bench (b) and (d): v3 and v3-d2 for the fold formats"
    gpu_bench 550 bench-dec --shapes b,d --formats nvfp4,nvfp4_fp8rope,nvfp4_fp8_ds_mla
    ;;
*) echo "unknown step $w (kern, bench)"; exit 2 ;;
esac
done
step "done"
