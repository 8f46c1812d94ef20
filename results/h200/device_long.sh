#!/usr/bin/env bash
# The H200 run of issue 17 (long-context quality that can fail), one device call:
#   bash results/h200/device_long.sh [tests] [kld] [needle]        (default: all three, in this order)
#     tests   tests/test_long_gpu.py: a 64K KLD window (the model's full window) and a 128K one under
#             --rope-scaling yarn:2, 64K and 128K needles (needs the kernel fix for > 65535 queries)
#     kld     mla-eval kld at --ctx 16K / 32K / 64K on long documents (.devdata/wiki-long.txt: held-out
#             Wikipedia articles concatenated, see results/long/make_wiki_long.py), depth buckets to the
#             window, KLD-vs-depth plots; 64K with every default format, 16K/32K with four
#     needle  the RULER-style grid: 3 tasks x 50 samples per cell (5 depths x 10 trials) in real prose
#             (the same held-out articles as haystack): 4K/16K/64K for bf16 + 3 formats, then 96K and
#             128K under --rope-scaling yarn:2 for bf16 + nvfp4 (fewer formats: device time)
# Needs .devdata/wiki-long.txt (+ .note) carried (never committed): in your checkout, once, on a CPU:
#   python results/long/make_wiki_long.py --wiki ../shared/data/wikipedia --out .devdata/wiki-long.txt
# Expected device time (estimates from the H200 figures in results/h200/README.md, not measured):
#   install ~40 s, tests ~90 s, kld ~150 s, needle ~300 s: about 10 minutes. Every step has its own
#   timeout; each needle/kld piece writes its own JSON, so a timeout loses only that piece.
# Knobs: TASKS, TRIALS (10), DEPTHS (0,25,50,75,100), FORMATS_A, FORMATS_B, KLD_FORMATS.
. "$(dirname "$0")/device_setup.sh"  # log, step timer, CuTe DSL + jsonschema
TEXT=.devdata/wiki-long.txt
NOTE=$(cat "$TEXT.note" 2>/dev/null || echo "held-out Wikipedia articles concatenated (results/long/make_wiki_long.py)")
# default tasks: the two the model retrieves in bf16 on CPU at 2K-4K (3/3) and multikey with 3 distractors
# (1/3, 0/3: it answers a distractor's value); multivalue and vt were 0/3 everywhere (README)
TASKS=${TASKS:-single:number,single:word,multikey:number}
TRIALS=${TRIALS:-10}; DEPTHS=${DEPTHS:-0,25,50,75,100}
FORMATS_A=${FORMATS_A:-fp8_ds_mla,nvfp4,mxfp4}; FORMATS_B=${FORMATS_B:-nvfp4}
KLD_FORMATS=${KLD_FORMATS:-fp8_ds_mla,nvfp4,nvfp4_fp8rope,mxfp4}
mkdir -p "$OUT/runs/plots"
[ -f "$TEXT" ] || { echo "missing $TEXT: build it with results/long/make_wiki_long.py and carry .devdata"; exit 3; }
quiet() { grep -v -E "scoring|prompts|^[│┃┏┡└]" ; }
for what in "${@:-tests kld needle}"; do for w in $what; do
case "$w" in
tests)
    step "GPU test, largest lengths"
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_long_gpu.py > "$OUT/runs/pytest-long-gpu.log" 2>&1
    echo "long GPU tests rc=$?"; tail -5 "$OUT/runs/pytest-long-gpu.log"
    ;;
kld)
    for ctx in 16384 32768 65536; do
        fm=(--formats "$KLD_FORMATS"); [ "$ctx" = 65536 ] && fm=()   # 64K: every default format
        step "kld --ctx $ctx (${fm[1]:-default formats})"
        timeout 200 python3 -m mla_eval kld --text "$TEXT" --text-note "$NOTE" --max-tokens $((ctx * 2 + 2048)) \
            --ctx $ctx --stride $((ctx - 512)) --min-context 512 --no-layer-stats --prefill absorbed "${fm[@]}" \
            --out "$OUT/runs/kld-ctx$ctx.json" --plot "$OUT/runs/plots/kld-ctx$ctx" 2>&1 | quiet | tail -16
        echo "exit $?"
    done
    step "KLD-vs-depth plot across windows"
    python3 results/long/plot_kld_depth.py "$OUT/runs/plots/kld_by_depth_to_64k.png" "$OUT"/runs/kld-ctx*.json 2>&1 | tail -2
    ;;
needle)
    run_needle() {  # name, timeout, lengths, formats, extra...
        local name=$1 limit=$2 lengths=$3 formats=$4; shift 4
        step "needle $name: $TASKS, lengths $lengths, bf16 + $formats, $TRIALS trials x depths $DEPTHS $*"
        timeout "$limit" python3 -m mla_eval needle --task "$TASKS" --haystack "$TEXT" --lengths "$lengths" \
            --depths "$DEPTHS" --trials "$TRIALS" --formats "$formats" --scales none "$@" \
            --out "$OUT/runs/needle-$name.json" --plot "$OUT/runs/plots/needle-$name" 2>&1 | quiet | tail -40
        echo "exit $?"
    }
    run_needle short 120 4K,16K "$FORMATS_A"
    run_needle 64k 150 64K "$FORMATS_A"
    run_needle 96k-yarn2 120 96K "$FORMATS_B" --rope-scaling yarn:2
    run_needle 128k-yarn2 150 128K "$FORMATS_B" --rope-scaling yarn:2
    ;;
esac
done; done
# one archive per script run: two scripts in one device call must not overwrite each other's results
tar -C "$OUT" -czf "$OUT/runs-$(basename "$0" .sh)-$(date +%s).tgz" runs && rm -rf "${OUT:?}/runs"
step "done"
