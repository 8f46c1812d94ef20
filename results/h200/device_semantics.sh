#!/usr/bin/env bash
# The H200 run of issue 16 (attention semantics and math), one device call after the CuTe DSL wheel
# halves were copied (see tools/device/device_check.sh):
#   bash results/h200/device_semantics.sh [tests] [default] [prod] [qp]
#     tests    GPU tests of fp8-q math and the engine chunk attention, kernel vs reference
#              (tests/test_semantics_gpu.py) and the CPU semantics tests on this machine
#     default  mla-eval kld on the embedded model, wikitext-2 test (16K tokens, ctx 2048 / stride 512):
#              nvfp4, nvfp4+s_l, fp8_ds_mla under cache, engine:512 and vllm (engine:8192 >= ctx: one
#              chunk, KLD exactly 0) semantics, bf16 and fp8-q math, --explain nvfp4
#     prod     the same on a production-geometry random checkpoint (random:deepseek-v3:layers=2, ctx
#              4096, engine:2048 and vllm): plumbing and cost at real geometry, not quality
#     qp       fp8-qp (P to E4M3: torch reference only) on the embedded model, 8K tokens
# Needs .devdata/wiki.test.raw carried (never committed). Every step < 3 min (timeout 170 s); logs and
# JSON under $OUT/runs, packed into $OUT/runs.tgz. A rerun may name just the steps that are missing.
. "$(dirname "$0")/device_setup.sh"  # log, step timer, CuTe DSL + jsonschema
TEXT=.devdata/wiki.test.raw
FORMATS=nvfp4,nvfp4+s_l,fp8_ds_mla
mkdir -p "$OUT/runs"
quiet() { grep -v -E "scoring|^[│┃┏┡└]" | tail -${1:-30}; }
for what in "${@:-tests default prod qp}"; do
for w in $what; do
case "$w" in
tests)
    step "semantics tests (GPU + CPU)"
    timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_semantics_gpu.py tests/test_semantics.py \
        > "$OUT/runs/semantics_tests.log" 2>&1; echo "semantics tests rc=$?"
    tail -5 "$OUT/runs/semantics_tests.log"
    ;;
default)
    step "kld, embedded model: cache / engine:512 / vllm x bf16 / fp8-q, explain nvfp4"
    timeout 170 python3 -m mla_eval kld --text "$TEXT" --max-tokens 16384 --formats "$FORMATS" --no-layer-stats --prefill absorbed \
        --semantics cache,engine:512,vllm --math bf16,fp8-q --explain nvfp4 \
        --out "$OUT/runs/kld-default-semantics.json" 2>&1 | quiet 45
    echo "exit $?"
    ;;
prod)
    step "kld, random:deepseek-v3:layers=2 (production geometry, random weights): cache / engine:2048 / vllm x bf16 / fp8-q"
    timeout 170 python3 -m mla_eval kld --model random:deepseek-v3:layers=2 --text "$TEXT" --max-tokens 16384 \
        --ctx 4096 --stride 2048 --min-context 2048 --formats "$FORMATS" --no-layer-stats --prefill absorbed \
        --semantics cache,engine:2048,vllm --math bf16,fp8-q --explain nvfp4 \
        --out "$OUT/runs/kld-deepseek-v3-semantics.json" 2>&1 | quiet 45
    echo "exit $?"
    ;;
qp)
    step "kld, embedded model: fp8-qp (torch reference on the GPU)"
    timeout 170 python3 -m mla_eval kld --text "$TEXT" --max-tokens 8192 --formats nvfp4,fp8_ds_mla --scales none \
        --no-layer-stats --prefill absorbed --semantics cache,engine:512 --math bf16,fp8-q,fp8-qp --explain nvfp4 --backend reference \
        --out "$OUT/runs/kld-default-fp8qp.json" 2>&1 | quiet 35
    echo "exit $?"
    ;;
*) echo "unknown step $w (tests, default, prod, qp)"; exit 2 ;;
esac
done
done
# one archive per script run: two scripts in one device call must not overwrite each other's results
tar -C "$OUT" -czf "$OUT/runs-$(basename "$0" .sh)-$(date +%s).tgz" runs && rm -rf "${OUT:?}/runs"
step "done"
