#!/usr/bin/env bash
# GPU validation and timing of session 10's two held instruction cuts in v3 (issue 14; docs/kernels.md, session 10):
# consumer rev 2 (`attention_tuning.V3_CONSUMER_REV` = 1 holds it: the tile loop unrolled by the K ring's stages, the
# lazy O^T rescale, the 16-byte max / sum exchange) and the E2M1 decode rev 2 (`V3_DECODE_REV` = 1 holds it: fewer
# producer instructions per bf16x2 pair; nvfp4, nvfp4_fp8rope, nvfp4_fp8_ds_mla). Both write the same output bits.
# After device_setup's wheel calls (results/h200/README.md; model stashed, carry .devwheels/b .devwheels/js):
#   bash results/h200/device_revs.sh kern   then, the machine still warm:   bash results/h200/device_revs.sh bench [bench32] [ncu]
#   kern   tests/test_kernels_v3_gpu.py -k "consumer or decode_rev": each revision bitwise against rev 1 and against the
#          reference (NaN-poisoned outputs, 1 / 3 / heuristic splits, dense and sparse, 16- and 32-head tiles, one and
#          two producer warpgroups), both together against the default kernel, and the CPU compile / SASS-reader cases
#   bench  (b) dense decode h=16 batch 32, 8K / 32K / 64K, --variants (rows v3, v3-d2 at every context; v3-c2, v3-c2-d2
#          at 64K) and (d) dense h=128 (v3-t16 / v3-t32 and their -c2 / -d2 rows)
#   ncu    `ncu --set full` of one nvfp4 launch at (b) 64K per consumer revision: details and SASS source pages
#   bench32  (a) sparse top-2048 h=128 batch 64 / 128 and (d) dense h=128 8K / 32K, --variants, nvfp4 / bf16 / fp8_ds_mla:
#          rows v3-t32 (two producer warpgroups, `setmaxnreg`, rev 1) beside v3-t32-c2 (rev 2's unrolled loop there since
#          session 11, docs/kernels.md) and v3-t32-p1; kern covers it (test_v3_consumer_rev2_unrolled_at_the_two_...)
# Flip a default (V3_CONSUMER_REV / V3_DECODE_REV = 2) only where its tests pass and its rows are faster at every (b)
# context; commit with the logs and the bench JSON.
. "$(dirname "$0")/device_setup.sh"  # log, step timer, CuTe DSL + jsonschema
mkdir -p "$OUT/runs"
for w in "$@"; do
case "$w" in
kern)
    step "v3 consumer rev 2 and decode rev 2: bitwise vs rev 1 and the default kernel, vs the reference"
    gpu_pytest 550 revs -n 8 tests/test_kernels_v3_gpu.py -k "(consumer or decode_rev) and not pair"
    ;;
bench)
    step "bench (b) and (d) with variants: v3 and its -c2 / -d2 / -c2-d2 rows"
    gpu_bench 550 bench-revs --shapes b,d --variants --formats nvfp4,nvfp4_fp8rope,nvfp4_fp8_ds_mla,bf16,fp8_ds_mla,mxfp4
    ;;
bench32)
    step "bench (a) and (d) h=128 with variants: v3-t32 (rev 1) vs v3-t32-c2 (rev 2 unrolled, two producers)"
    gpu_bench 550 bench-revs-t32 --shapes a,d --variants --formats nvfp4,bf16,fp8_ds_mla
    ;;
ncu)
    for rev in 1 2; do
        step "ncu --set full, v3 nvfp4 (b) 64K, consumer rev $rev"
        gpu_ncu 250 "ncu-v3c$rev-nvfp4-b64k" --formats nvfp4 --consumer-rev "$rev"
    done
    ;;
*) echo "unknown step $w (kern, bench, bench32, ncu)"; exit 2 ;;
esac
done
step "done"
