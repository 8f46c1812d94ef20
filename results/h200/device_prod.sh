#!/usr/bin/env bash
# The H200 run of the production-path work (issue 12) and the engine-exact formats (issue 15), one
# device call after the CuTe DSL wheel halves were copied (see tools/device/device_check.sh):
#   bash results/h200/device_prod.sh [tests] [prodbench] [presets] [formats]
#     tests      GPU tests (kernels incl. new formats, decode steps, backends, random preset models)
#     prodbench  python -m benchmarks.production_bench: cost per layer and format at every preset
#                geometry, kernel-vs-reference KLD, projection of full-depth runs
#     presets    mla-eval kld on every preset geometry (random:<preset>:layers=3), --backend kernel and
#                --backend reference, wikitext-2 test windows of 4096 (> index_topk 2048)
#     formats    mla-eval kld on the embedded model with every registered format (old and new), and the
#                engine residual scripts of the formats
# Needs .devdata/wiki.test.raw carried (never committed). Logs and JSON under $OUT (packed: a call
# returns at most 8 files). Every step is independent: a rerun may name just the steps that are missing.
. "$(dirname "$0")/device_setup.sh"  # log, step timer, CuTe DSL + jsonschema
TEXT=.devdata/wiki.test.raw
mkdir -p "$OUT/runs"
for what in "${@:-tests}"; do
case "$what" in
tests)
    step "GPU tests"
    bash tools/device/device_check.sh tests "${KEXPR:-}" > "$OUT/runs/gpu_tests.log" 2>&1; echo "GPU tests rc=$?"
    cp "$OUT/pytest.log" "$OUT/runs/pytest-gpu.log" 2>/dev/null; rm -f "$OUT/pytest.log"
    grep -E "passed|failed" "$OUT/runs/gpu_tests.log" | tail -3
    ;;
prodbench)
    step "production bench"
    timeout ${PRODBENCH_TIMEOUT:-300} python3 -m benchmarks.production_bench --out "$OUT/runs/production-bench.json" \
        ${PRODBENCH_ARGS:-} 2>&1 | tail -40
    echo "production bench exit $?"
    ;;
presets)
    for p in deepseek-v3 deepseek-v3.2 kimi-k2 glm-5 glm-5.2; do
        for b in kernel reference; do
            step "kld random:$p:layers=3 --backend $b"
            timeout 150 python3 -m mla_eval kld --model "random:$p:layers=3" --text "$TEXT" --max-tokens 16384 \
                --ctx 4096 --stride 2048 --min-context 2048 --formats fp8_ds_mla,nvfp4,nvfp4_fp8rope --backend "$b" \
                --out "$OUT/runs/kld-$p-$b.json" 2>&1 | grep -v -E "scoring|^[│┃┏┡└]" | tail -14
            echo "exit $?"
        done
    done
    ;;
formats)
    step "kld, embedded model, every format"
    fmts=$(python3 -c "from mla_eval.formats import format_names; print(','.join(n for n in format_names() if n != 'bf16'))")
    timeout 300 python3 -m mla_eval kld --text "$TEXT" --max-tokens 65536 --formats "$fmts" --no-layer-stats --prefill absorbed \
        --out "$OUT/runs/kld-default-all-formats.json" 2>&1 | grep -v -E "scoring" | tail -30
    echo "exit $?"
    for s in measure_rope_rcp_residual measure_sglang_fp4_residual; do
        step "$s"; timeout 120 python3 -m mla_eval_kernels.$s --out "$OUT/runs/$s.json" 2>&1 | tail -12
    done
    ;;
esac
done
# one archive per script run: two scripts in one device call must not overwrite each other's results
tar -C "$OUT" -czf "$OUT/runs-$(basename "$0" .sh)-$(date +%s).tgz" runs && rm -rf "${OUT:?}/runs"
step "done"
