#!/usr/bin/env bash
# Issue 17, session 7: confirm and re-measure the retrained default model (second task curriculum) on one H200.
#   bash results/h200/device_ship17.sh [calib] [confirm] [grid] [kld64] [yarn] [full]      (in the order given)
#     calib    s_l outer scales for MODEL (the CPU recipe of results/default_model/COMMANDS.md, on the GPU)
#     confirm  bf16 alone, the three tasks at 64K, 50 prompts per cell (5 depths x 10 trials), held-out prose haystack;
#              writes confirm-gate.json and STOPS the script (exit 4) unless every task is >= 0.9 (FORCE=1 goes on)
#     grid     the RULER-style grid: 3 tasks x 4K/16K/64K x 50 prompts, bf16 + GRID_FORMATS, paired tests vs bf16
#     kld64    mla-eval kld --ctx 64K on the long held-out documents, every format in KLD_FORMATS, depth buckets to 64K
#     yarn     96K and 128K cells under --rope-scaling yarn:2 for bf16 + YARN_FORMATS (yarn96 / yarn128: one length)
#     full     mla-eval run recipes/h200-full.toml (wikitext-2 KLD for nine formats + the pass-key grid)
# Needs (carried, never committed): .devdata/wiki-long.txt (+ .note; results/long/make_wiki_long.py),
# .devdata/wiki.test.raw, .devwheels/js; CuTe DSL installed by an earlier call of the same warm machine or by
# device_setup.sh from the wheel halves (see results/h200/README.md). Each piece writes its own JSON under
# $OUT/runs, so a timeout or a lost machine costs only the piece that was running. Needle heatmaps are drawn on the
# CPU from the JSON (`mla-eval plot R.json --out DIR`): folders nested under $OUT do not come back from the device.
. "$(dirname "$0")/device_setup.sh"
TEXT=.devdata/wiki-long.txt
NOTE=$(cat "$TEXT.note" 2>/dev/null || echo "held-out Wikipedia articles concatenated (results/long/make_wiki_long.py)")
TASKS=${TASKS:-single:number,single:word,multikey:number}
TRIALS=${TRIALS:-10}; DEPTHS=${DEPTHS:-0,25,50,75,100}
GRID_FORMATS=${GRID_FORMATS:-fp8_ds_mla,nvfp4,nvfp4+s_l,nvfp4_fp8rope,nvfp4_fp8_ds_mla,mxfp4,trtllm_nvfp4_dsa,trtllm_nvfp4_dsa_r64}
YARN_FORMATS=${YARN_FORMATS:-nvfp4,mxfp4}
KLD_FORMATS=${KLD_FORMATS:-fp8_ds_mla,nvfp4,nvfp4+s_l,nvfp4_fp8rope,nvfp4_fp8_ds_mla,mxfp4,trtllm_nvfp4_dsa,trtllm_nvfp4_dsa_r64}
SCALES=${SCALES:-results/default_model/outer_scales-wikipedia-heldout.json}
# MODEL: a checkpoint folder to measure instead of the embedded model (e.g. a training export still on the machine)
M=(); [ -n "${MODEL:-}" ] && M=(--model "$MODEL")
R=$OUT/runs; mkdir -p "$R/plots"
[ -f "$TEXT" ] || { echo "missing $TEXT: build it with results/long/make_wiki_long.py and carry .devdata"; exit 3; }
sha256sum "${MODEL:-mla_eval/default_model}/model.safetensors" | tee "$R/model-sha256.txt"
quiet() { grep -v -E "scoring|prompts|^[│┃┏┡└]" ; }
needle() {  # name, timeout, lengths, formats, extra...
    local name=$1 limit=$2 lengths=$3 formats=$4; shift 4
    step "needle $name: $TASKS, $lengths, bf16 + ${formats:-nothing}, $TRIALS trials x depths $DEPTHS $*"
    timeout "$limit" python3 -m mla_eval needle --task "$TASKS" --haystack "$TEXT" --lengths "$lengths" \
        --depths "$DEPTHS" --trials "$TRIALS" --formats "${formats:-bf16}" --scales "$SCALES" "${M[@]}" "$@" \
        --out "$R/needle-$name.json" 2>&1 | quiet | tail -30
    echo "exit $?"
}
for w in ${@:-confirm grid kld64 yarn full}; do
case "$w" in
calib)  # outer scales for the +s_l variants of a MODEL that is not the embedded one (carry .train_data/eval)
    step "calibrate s_l: first 400,000 characters of the held-out articles, 32768 tokens, ctx 2048"
    python3 -c "import lzma,sys; sys.stdout.write(lzma.open('.train_data/eval/eval_docs.txt.xz','rt').read()
        .replace(chr(0), chr(10))[:400000])" > /tmp/calib_wiki.txt
    SCALES=$R/outer_scales-wikipedia-heldout.json
    python3 -m mla_eval calibrate --text /tmp/calib_wiki.txt --max-tokens 32768 --ctx 2048 "${M[@]}" \
        --out "$SCALES" --force 2>&1 | tail -2
    ;;
confirm)
    needle confirm 120 64K ""
    python3 - "$R/needle-confirm.json" "$R/confirm-gate.json" <<'EOF' || [ "${FORCE:-0}" = 1 ] || { step "gate failed: stop"; exit 4; }
import json, sys
d = json.load(open(sys.argv[1]))
acc = {t: c["bf16"]["cells"][-1] for t, c in d["tasks"].items()}
ok = all(c["accuracy"] >= 0.9 for c in acc.values())
json.dump({"pass": ok, "bar": 0.9, "cells": acc}, open(sys.argv[2], "w"), indent=1)
for t, c in acc.items():
    print(f"gate {t}: {c['correct']}/{c['n']} = {c['accuracy']:.2f} [{c['wilson_lo']:.2f}, {c['wilson_hi']:.2f}]")
print("gate", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
EOF
    ;;
grid)
    needle grid-short 200 4K,16K "$GRID_FORMATS"
    needle grid-64k 330 64K "$GRID_FORMATS"
    ;;
kld64)
    step "kld --ctx 65536: $KLD_FORMATS"
    timeout 300 python3 -m mla_eval kld --text "$TEXT" --text-note "$NOTE" --max-tokens $((65536 * 3 + 2048)) \
        --ctx 65536 --stride 65024 --min-context 512 --no-layer-stats --prefill absorbed --formats "$KLD_FORMATS" --scales "$SCALES" "${M[@]}" \
        --out "$R/kld-ctx65536.json" --plot "$R/plots" 2>&1 | quiet | tail -20
    echo "exit $?"
    python3 results/long/plot_kld_depth.py "$R/plots/kld_by_depth_to_64k.png" "$R/kld-ctx65536.json" 2>&1 | tail -2
    ;;
yarn)
    needle 96k-yarn2 200 96K "$YARN_FORMATS" --rope-scaling yarn:2
    needle 128k-yarn2 300 128K "$YARN_FORMATS" --rope-scaling yarn:2
    ;;
yarn96)  # one length per step, for calls that cannot hold both (about 47 s per format at 96K, 75 s at 128K)
    needle 96k-yarn2 $((60 + 50 * $(echo "bf16,$YARN_FORMATS" | tr ',' '\n' | wc -l))) 96K "$YARN_FORMATS" --rope-scaling yarn:2
    ;;
yarn128)
    needle 128k-yarn2 $((60 + 80 * $(echo "bf16,$YARN_FORMATS" | tr ',' '\n' | wc -l))) 128K "$YARN_FORMATS" --rope-scaling yarn:2
    ;;
full)
    step "mla-eval run recipes/h200-full.toml"
    timeout 420 python3 -m mla_eval run recipes/h200-full.toml --out "$R/h200-full" 2>&1 | quiet | tail -40
    echo "exit $?"
    ;;
*) echo "unknown step $w"; exit 2 ;;
esac
done
step "done"
