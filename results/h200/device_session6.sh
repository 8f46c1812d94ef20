#!/usr/bin/env bash
# Session 6 on the H200: the validation of the v3 changes (issue 14), the TensorRT-LLM NVFP4 DSA formats in the
# kernels (issue 15) and the kld / needle figures under the v3 kernel. After the wheel-halves call of
# device_setup.sh (model stashed, carry .devwheels/a):
#   call 2 (model stashed; carry .devwheels/b .devwheels/js .devdata):  bash results/h200/device_session6.sh kern bench
#   call 3 (model in place; carry .devwheels/js .devdata; machine still warm, CuTe DSL in /tmp/site):
#                                                                        bash results/h200/device_session6.sh kld
#   kern   every kernel GPU test (v2 default and the v3 cases, all formats incl. the TensorRT-LLM records)
#   bench  shape (b) dense decode h=16, 8K/32K/64K, batch 32, with the v1/v2/v3 probe variants, ceilings in the same run
#   kld    mla-eval kld on the embedded model (wikitext-2 test, 16K tokens, ctx 2048 / stride 512) with the v2 and the
#          v3 kernel selected (MLA_EVAL_ATTENTION_KERNEL), then one needle grid (single:number, 4K/64K) under v3:
#          v3 must reproduce v2's figures within the kernel-vs-reference tolerance
# Logs and JSON under $OUT (runs/). A rerun may name only the steps that are missing.
. "$(dirname "$0")/device_setup.sh"  # log, step timer, CuTe DSL + jsonschema
TEXT=.devdata/wiki.test.raw
KFORMATS=${KFORMATS:-bf16,nvfp4,nvfp4_fp8_ds_mla,fp8_ds_mla,trtllm_nvfp4_dsa}
mkdir -p "$OUT/runs"
quiet() { grep -v -E "scoring|^[│┃┏┡└]" | tail -${1:-30}; }
for w in "$@"; do
case "$w" in
kern)
    step "kernel GPU tests: v2 default, the v3 cases, every format"
    gpu_pytest 330 kernels -n 8 tests/test_kernels_gpu.py tests/test_kernels_v3_gpu.py tests/test_dispatch_backends.py
    ;;
bench)
    step "bench (b) with variants: $KFORMATS"
    timeout 220 python3 -m benchmarks.kernel_bench --shapes b --formats "$KFORMATS" --variants --out "$OUT/runs/bench" \
        > "$OUT/runs/bench.log" 2>&1
    echo "bench rc=$?"; grep -E "^GPU|b_dense|saved|Error|error" "$OUT/runs/bench.log" | tail -60
    ;;
kld)
    for k in v2 v3; do
        step "kld, embedded model, kernel $k"
        MLA_EVAL_ATTENTION_KERNEL=$k timeout 150 python3 -m mla_eval kld --text "$TEXT" --max-tokens 16384 \
            --formats nvfp4,nvfp4_fp8rope,nvfp4_fp8_ds_mla,mxfp4,fp8_ds_mla --no-layer-stats --prefill absorbed \
            --out "$OUT/runs/kld-default-$k.json" 2>&1 | quiet 25
    done
    step "needle single:number 4K/64K under v3 (nvfp4, nvfp4_fp8_ds_mla, bf16)"
    MLA_EVAL_ATTENTION_KERNEL=v3 timeout 150 python3 -m mla_eval needle --formats nvfp4,nvfp4_fp8_ds_mla --task single:number \
        --lengths 4K,64K --depths 0,50,100 --trials 10 --out "$OUT/runs/needle-v3.json" 2>&1 | quiet 25
    ;;
*) echo "unknown step $w (kern, bench, kld)"; exit 2 ;;
esac
done
step "done"
