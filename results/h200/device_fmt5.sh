#!/usr/bin/env bash
# Session 5, TensorRT-LLM's NVFP4 DSA cache (`trtllm_nvfp4_dsa`, issue 15), one device call:
#   bash results/h200/device_fmt5.sh [residual] [tests] [kld] [needle]
#     residual  kernels/measure_trtllm_nvfp4_residual.py: records of the engine's arithmetic with the GPU's
#               rcp.approx.ftz vs the codec's rcp.rn stand-ins (byte, scale-byte and record mismatch rates), and
#               the instruction's results for the default global scale's 127 inputs
#     tests     GPU tests that cover the format: reference fallback on CUDA (bytes = CPU codec), dispatch, codec
#     kld       mla-eval kld on the embedded model, wikitext-2 test, 32K tokens: the 324 B records side by side
#               (trtllm_nvfp4_dsa, sglang_fp4_e2m1), the 360 B residual record, beside nvfp4 / nvfp4_fp8_ds_mla / fp8_ds_mla
#     needle    mla-eval needle at 4K/16K, the same formats
# The format runs on the torch reference path (the kernels refuse it by name). Needs .devdata/wiki.test.raw
# carried (never committed). Logs and JSON under $OUT, packed into one archive per run.
. "$(dirname "$0")/device_setup.sh"  # log, step timer, CuTe DSL + jsonschema
FMTS=trtllm_nvfp4_dsa,trtllm_nvfp4_dsa_r64,sglang_fp4_e2m1,nvfp4,nvfp4_fp8_ds_mla,fp8_ds_mla
mkdir -p "$OUT/runs"
for w in "${@:-residual tests kld}"; do
for what in $w; do
case "$what" in
residual)
    step "measure_trtllm_nvfp4_residual"
    timeout 150 python3 -m tools.measure.trtllm_nvfp4_residual --out "$OUT/runs/trtllm_nvfp4_residual.json" 2>&1 | tail -30
    echo "exit $?"
    ;;
tests)
    step "GPU tests (-k trtllm or reference fallback)"
    timeout 300 python3 -m pytest tests/test_kernels_gpu.py tests/test_dispatch_backends.py tests/test_engine_ports.py \
        tests/test_codec.py -q -n 8 -p no:cacheprovider -rfE -k "trtllm or fall_back or reference" \
        > "$OUT/runs/pytest-fmt5.log" 2>&1
    echo "pytest rc=$?"; grep -E "FAILED|ERROR|passed|failed" "$OUT/runs/pytest-fmt5.log" | grep -v "^E " | tail -15
    ;;
kld)
    step "kld: the 324 B records beside the others (wikitext-2 test, 32K tokens)"
    timeout 240 python3 -m mla_eval kld --text .devdata/wiki.test.raw --max-tokens 32768 --no-layer-stats --prefill absorbed \
        --formats "$FMTS" --out "$OUT/runs/kld-trtllm-nvfp4.json" 2>&1 | grep -v -E "scoring" | tail -25
    echo "exit $?"
    ;;
needle)
    step "needle 4K/16K"
    timeout 240 python3 -m mla_eval needle --formats "$FMTS" --lengths 4096,16384 --depth-steps 5 \
        --out "$OUT/runs/needle-trtllm-nvfp4.json" 2>&1 | tail -25
    echo "exit $?"
    ;;
*) echo "unknown step $what (residual, tests, kld, needle)"; exit 2 ;;
esac
done
done
tar -C "$OUT" -czf "$OUT/runs-$(basename "$0" .sh)-$(date +%s).tgz" runs && rm -rf "${OUT:?}/runs"
step "done"
