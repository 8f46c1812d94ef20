#!/usr/bin/env bash
# GPU validation and timing of v3's consumer rev 2 (issue 14, session 10; branch wip-cons): the tile loop unrolled by the
# K ring's stages (uniform wgmma descriptors), the lazy O^T rescale and the warp-fastest max / sum exchange. Held by
# attention_tuning.V3_CONSUMER_REV = 1 until `kernc2` passes and `benchb` times rev 2 faster (kernels/NOTES.md, session
# 10, consumer rev 2). After device_setup's wheel calls (results/h200/README.md; carry .devwheels/b .devwheels/js), one
# call each (machine warm between them):
#   bash results/h200/device_cons.sh kernc2;  bash ... benchb;  bash ... benchd;  bash ... ncu
#   kernc2  tests/test_kernels_v3_gpu.py -k consumer: rev 2 bitwise equal to rev 1 and within the reference bound (nvfp4,
#           bf16, fp8_ds_mla, mxfp4; dense h=16 / 32, sparse h=16 / 128; 1, 3 and the heuristic's splits; NaN-poisoned
#           outputs), the CPU compile / SASS-reader cases beside them
#   benchb  (b) dense decode h=16 batch 32, 8K / 32K / 64K, --variants: the v3 row (rev 1) and, at 64K, v3-c2 (rev 2)
#   benchd  (d) dense decode h=128 batch 32, 8K / 32K, --variants: v3-t16 / v3-t32 beside v3-t16-c2 / v3-t32-c2
#   ncu     `ncu --set full` of one launch of rev 1 and one of rev 2 (nvfp4, (b) 64K): details and SASS source pages
# If kernc2 passes and v3-c2 beats v3 at (b) for the v3 formats: set V3_CONSUMER_REV = 2 (commit with the logs and bench
# JSON); rev 1's code then goes at the next cleanup.
. "$(dirname "$0")/device_setup.sh"  # log, step timer, CuTe DSL + jsonschema
mkdir -p "$OUT/runs"
for w in "$@"; do
case "$w" in
kernc2)
    step "v3 consumer rev 2: bitwise vs rev 1, vs the reference; compile / SASS-reader cases"
    gpu_pytest 500 cons -n 8 tests/test_kernels_v3_gpu.py -k "consumer"
    ;;
benchb)
    step "bench (b) variants: v3 (consumer rev 1) and v3-c2"
    gpu_bench 550 bench-c2b --shapes b --variants --formats nvfp4,bf16,fp8_ds_mla,mxfp4
    ;;
benchd)
    step "bench (d) variants: v3-t16 / v3-t32 and their -c2 rows at h=128"
    gpu_bench 550 bench-c2d --shapes d --variants --formats nvfp4,bf16,fp8_ds_mla
    ;;
ncu)
    command -v ncu > /dev/null || { echo "no ncu on this machine"; continue; }
    for rev in 1 2; do
        step "ncu --set full, v3 nvfp4 (b) 64K, consumer rev $rev"
        rep="$OUT/runs/ncu-v3c$rev-nvfp4-b64k"
        timeout 250 ncu --clock-control none -k regex:MlaAttentionV3 -c 1 --set full --import-source no -o "$rep" \
            python3 -m mla_eval_kernels.profile_dense --formats nvfp4 --consumer-rev "$rev" > "$rep-run.log" 2>&1
        echo "ncu rc=$?"; tail -2 "$rep-run.log"
        ncu -i "$rep.ncu-rep" --page details > "$rep-details.txt" 2>&1
        ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep-sass.csv" 2>&1
        grep -E "Duration|Issue Slots Busy|Eligible Warps|Executed Ipc A" "$rep-details.txt" | head -8
    done
    ;;
*) echo "unknown step $w (kernc2, benchb, benchd, ncu)"; exit 2 ;;
esac
done
step "done"
