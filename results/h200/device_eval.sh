#!/usr/bin/env bash
# The H200 evaluation of the kld and needle issues, in two device calls while the machine is warm.
#   bash results/h200/device_eval.sh check    install CuTe DSL (parts copied by earlier calls, see
#                                             kernels/device_check.sh) + jsonschema wheels carried in
#                                             .devwheels/js, kernel GPU tests, forward benchmark
#   bash results/h200/device_eval.sh recipe   mla-eval run recipes/h200-full.toml + report
# Needs .devdata/wiki.test.raw carried (never committed). Logs and JSON under $OUT.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/log") 2>&1
t0=$(date +%s); step() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; }
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
case "${1:-check}" in
check)
    if [ -d .devwheels/js ] && ! python3 -c 'import jsonschema' 2>/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devwheels/js/jsonschema*.whl \
            .devwheels/js/referencing*.whl .devwheels/js/rpds_py*.whl 2>&1 | tail -2
    fi
    step "kernel GPU tests"
    bash kernels/device_check.sh tests > "$OUT/kernel_tests.log" 2>&1; echo "kernel tests rc=$?"; tail -4 "$OUT/kernel_tests.log"
    python3 -c 'import jsonschema, cutlass; print("jsonschema", jsonschema.__version__)'
    step "forward benchmark (kld window and 64K needle cell vs stock SDPA)"
    timeout ${BENCH_TIMEOUT:-200} python3 -m mla_eval.evals.forward_bench --out "$OUT/forward-bench-h200.json"
    ;;
recipe)
    step "mla-eval run recipes/h200-full.toml"
    timeout ${RECIPE_TIMEOUT:-540} python3 -m mla_eval run recipes/h200-full.toml --out "$OUT/h200-full" 2>&1 | grep -v -E "scoring|prompts +[0-9━╸ ]" | tail -90
    echo "run exit $?"
    step "report"
    python3 -m mla_eval report "$OUT/h200-full" 2>&1 | tail -3
    ;;
esac
step "done"
