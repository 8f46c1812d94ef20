#!/usr/bin/env bash
# Session 10 on the H200 (issue 14): a source-level profile of v3 at shape (b), and the must-show "kld unchanged" for
# every format v3 now serves by default. The kernel steps of this session are device_v3h.sh's (kernp2, bench).
# After device_setup's wheel calls (results/h200/README.md; the tree is over the carry limit with the model in it):
#   model stashed, carry .devwheels/b .devwheels/js:   bash results/h200/device_v3h.sh kernp2 bench; bash ...session10.sh ncu
#   model in place, carry .devdata/wiki.test.raw:      bash results/h200/device_session10.sh kld
#   ncu  one v3 launch of nvfp4 at (b) 64K (h=16, batch 32) under `ncu --set full`: the details page, and the SASS
#        source page as CSV (per-instruction warp-stall samples: which role, producer or consumer, waits where)
#   kld  mla-eval kld on the embedded model (wikitext-2 test, 16K tokens) with v2 and with v3 forced
#        (MLA_EVAL_ATTENTION_KERNEL: the kld windows are T queries per sequence, which the default sends to v2), for
#        every format of V3_DEFAULT_FORMATS: v3 must reproduce v2's figures within the kernel-vs-reference tolerance
. "$(dirname "$0")/device_setup.sh"  # log, step timer, CuTe DSL + jsonschema
mkdir -p "$OUT/runs"
KLD_V3_FORMATS=${KLD_V3_FORMATS:-bf16,fp8_ds_mla,fp8_ds_mla_pow2,fp8_e4m3,nvfp4,nvfp4_fp8rope,nvfp4_fp8rope_st,nvfp4_fp8_ds_mla,mxfp4}
quiet() { grep -v -E "scoring|^[│┃┏┡└]" | tail -${1:-30}; }
for w in "$@"; do
case "$w" in
ncu)
    command -v ncu > /dev/null || { echo "no ncu on this machine"; continue; }
    step "ncu --set full, v3 nvfp4 (b) 64K"
    rep="$OUT/runs/ncu-v3-nvfp4-b64k"
    timeout 300 ncu --clock-control none -k regex:MlaAttentionV3 -c 1 --set full --import-source no -o "$rep" \
        python3 -m benchmarks.profile_dense --formats nvfp4 > "$OUT/runs/ncu-run.log" 2>&1
    echo "ncu rc=$?"; tail -3 "$OUT/runs/ncu-run.log"
    ncu -i "$rep.ncu-rep" --page details > "$rep-details.txt" 2>&1
    grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Compute \(SM\)|Issue Slots|Stall" "$rep-details.txt" | head -20
    ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep-sass.csv" 2>&1
    echo "sass rows: $(wc -l < "$rep-sass.csv")"; head -c 600 "$rep-sass.csv"; echo
    ;;
kld)
    for k in v2 v3; do
        step "kld, embedded model, kernel $k: $KLD_V3_FORMATS"
        MLA_EVAL_ATTENTION_KERNEL=$k timeout 200 python3 -m mla_eval kld --text .devdata/wiki.test.raw --max-tokens 16384 \
            --formats "$KLD_V3_FORMATS" --no-layer-stats --prefill absorbed --out "$OUT/runs/kld-default-$k.json" 2>&1 | quiet 25
    done
    ;;
*) echo "unknown step $w (ncu, kld)"; exit 2 ;;
esac
done
step "done"
