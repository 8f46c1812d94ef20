#!/usr/bin/env bash
# The H200 evaluation of the kld and needle issues in one device call (after the five calls that
# copy the CuTe DSL wheel parts, see tools/device/device_check.sh):
#   bash results/h200/device_eval.sh [tests] [bench] [recipe]
#     (always) install CuTe DSL + the jsonschema wheels carried in .devwheels/js
#     tests    the GPU tests (tests/test_kernels_gpu.py, tests/test_decode_steps_gpu.py; KEXPR=expr selects)
#     bench    python -m benchmarks.forward_bench: kld window and 64K needle cell vs stock SDPA
#              (BENCH_ARGS are added to its command line)
#     recipe   mla-eval run recipes/h200-full.toml + mla-eval report, packed as one .tgz
#              (a call returns at most 8 files)
#     needle   only the [needle] grid of recipes/h200-full.toml, twice: decode steps replayed as
#              CUDA graphs (the default) and eager (cuda_graphs = false), one .tgz each
# Needs .devdata/wiki.test.raw carried (never committed). Logs and JSON under $OUT.
. "$(dirname "$0")/device_setup.sh"  # log, step timer, CuTe DSL + jsonschema
for what in "${@:-bench}"; do
case "$what" in
tests)
    step "kernel GPU tests"
    bash tools/device/device_check.sh tests "${KEXPR:-}" > "$OUT/kernel_tests.log" 2>&1; echo "kernel tests rc=$?"; tail -4 "$OUT/kernel_tests.log"
    ;;
bench)
    step "forward benchmark (kld window and 64K needle cell vs stock SDPA)"
    timeout ${BENCH_TIMEOUT:-200} python3 -m benchmarks.forward_bench --out "$OUT/forward-bench-h200.json" --profile "$OUT/profile-needle-64k.txt" ${BENCH_ARGS:-}
    ;;
recipe)
    step "mla-eval run recipes/h200-full.toml"
    timeout ${RECIPE_TIMEOUT:-400} python3 -m mla_eval run recipes/h200-full.toml --out "$OUT/h200-full" 2>&1 \
        | grep -v -E "scoring|prompts +[0-9━╸ ]|^[│┃┏┡└]" | tail -40
    echo "run exit $?"
    step "report"
    python3 -m mla_eval report "$OUT/h200-full" 2>&1 | tail -3
    tar -C "$OUT" -czf "$OUT/h200-full.tgz" h200-full && rm -rf "$OUT/h200-full"
    ;;
needle)
    for graphs in true false; do
        name=h200-needle$([ $graphs = true ] || echo -eager)
        step "needle grid of recipes/h200-full.toml, cuda_graphs = $graphs"
        python3 - "$graphs" > "/tmp/$name.toml" <<'PY'
import json, sys, tomllib
doc = tomllib.load(open("recipes/h200-full.toml", "rb"))
print(f'device = {json.dumps(doc["device"])}\n[needle]')
for key, value in {**doc["needle"], "cuda_graphs": sys.argv[1] == "true"}.items():
    print(f"{key} = {json.dumps(value)}")  # strings, numbers and booleans: JSON spells them as TOML does
PY
        timeout ${RECIPE_TIMEOUT:-400} python3 -m mla_eval run "/tmp/$name.toml" --out "$OUT/$name" 2>&1 \
            | grep -v -E "prompts +[0-9━╸ ]|^[│┃┏┡└]" | tail -8
        tar -C "$OUT" -czf "$OUT/$name.tgz" "$name" && rm -rf "${OUT:?}/$name"
    done
    ;;
esac
done
step "done"
