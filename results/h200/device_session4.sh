#!/usr/bin/env bash
# The fourth session's H200 run (2026-12-03), split into the steps that fit one device call each:
#   bash results/h200/device_session4.sh ktests    GPU tests without the embedded model (kernels v1/v2 incl. the
#                                                   131K-query launch, dispatch, random models, semantics kernel paths)
#   bash results/h200/device_session4.sh mtests    GPU tests that load the embedded model (decode steps, semantics
#                                                   whole-run agreement, 64K/128K long context)
#   bash results/h200/device_session4.sh newfmt    kld on wikitext-2 with the engine-exact formats beside the old ones
# The semantics and long-context runs are results/h200/device_semantics.sh and device_long.sh.
# Logs under $OUT (they come back with the call).
. "$(dirname "$0")/device_setup.sh"  # log, step timer, CuTe DSL + jsonschema
for w in "$@"; do
case "$w" in
ktests)
    step "GPU tests (no model)"
    timeout 330 python3 -m pytest tests/test_kernels_gpu.py tests/test_dispatch_backends.py tests/test_random_models_gpu.py \
        tests/test_kernel_launch_plan.py tests/test_semantics_gpu.py -q -n 8 -p no:cacheprovider -rfE \
        > "$OUT/pytest-ktests.log" 2>&1
    echo "pytest rc=$?"; grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest-ktests.log" | grep -v "^E " | tail -25
    ;;
mtests)
    step "GPU tests (embedded model)"
    timeout 300 python3 -m pytest tests/test_decode_steps_gpu.py tests/test_semantics_gpu.py tests/test_long_gpu.py \
        -q -n 4 -p no:cacheprovider -rfE > "$OUT/pytest-mtests.log" 2>&1
    echo "pytest rc=$?"; grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest-mtests.log" | grep -v "^E " | tail -25
    ;;
newfmt)
    step "kld: engine-exact formats beside the old ones (wikitext-2 test, 32K tokens)"
    timeout 200 python3 -m mla_eval kld --text .devdata/wiki.test.raw --max-tokens 32768 --no-layer-stats --prefill absorbed \
        --formats fp8_ds_mla,fp8_ds_mla_pow2,nvfp4,nvfp4_fp8rope,nvfp4_fp8_ds_mla,mxfp4 \
        --out "$OUT/kld-engine-formats.json" 2>&1 | grep -v -E "scoring" | tail -25
    echo "exit $?"
    ;;
*) echo "unknown step $w (ktests, mtests, newfmt)"; exit 2 ;;
esac
done
