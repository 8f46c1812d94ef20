#!/usr/bin/env bash
# Issue 17, item 4: the task curriculum (recipes/train-default-model-tasks.toml) on top of the shipped
# default model, in two device calls made back to back (the second must find the machine warm):
#   call 1, model file stashed, carry [".train_data/a"] (training shards 00-05, never committed):
#       bash results/h200/device_train_tasks.sh tok
#     copies the shards to /tmp/mla_train/shards and tokenises them into /tmp/mla_train/tok
#   call 2, model carried, carry [".train_data/eval", ".devwheels/js"] (eval_docs.txt.xz, words.json,
#   wiki.test.raw; the jsonschema wheels for `check`):
#       TRAIN_S=480 bash results/h200/device_train_tasks.sh train check
#     train: `python -m tools.train train` from mla_eval/default_model (or, machine still warm, from the
#            full checkpoint of the previous call: phases longer than one call resume there; fresh AdamW, 30-step
#            re-warm-up, the recipe's phases from the first); the bf16 export comes back as
#            model.safetensors.partNN + meta.tar (config, trainer state), the log as train_log.jsonl
#     check: the new model's wikitext-2 perplexity (the recipe evaluator, stock SDPA) and a quick bf16
#            needle grid of the RULER-style tasks at 4K/16K/64K (`mla-eval needle --formats bf16`,
#            3 depths x 4 trials: a first read of whether the curriculum worked, not the committed grid)
# .train_data/a and .train_data/eval: see results/default_model/COMMANDS.md (hard links into
# .train_data/text made by `python -m tools.train prepare`).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/log") 2>&1
t0=$(date +%s); step() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
W=/tmp/mla_train; E=${EXPORT:-$W/export}; mkdir -p "$W"  # EXPORT: check a carried export (cold machine)
RECIPE=${RECIPE:-recipes/train-default-model-tasks.toml}  # tasks2.toml: the second attempt (continues the first)
# INIT / INIT_STATE: the weights folder and trainer_state.json to continue from (default: the shipped model).
# The second attempt: INIT=.train_data/init (the first attempt's export: model.safetensors, config.json and the
# tokenizer files; carried, never committed), INIT_STATE=results/default_model/tasks-curriculum/trainer_state.json
INIT=${INIT:-mla_eval/default_model}; INIT_STATE=${INIT_STATE:-results/default_model/trainer_state.json}
for w in "$@"; do
case "$w" in
tok)
    step "copy and tokenise the training shards"
    mkdir -p "$W/shards" && cp ${SHARDS:-.train_data/a}/train_*.txt.xz "$W/shards/" && ls "$W/shards"
    python3 -c "
from pathlib import Path
from tools.train.trainer import TokenStore
TokenStore(['$W/shards'], Path('mla_eval/default_model/tokenizer.json'), Path('$W/tok'))" 2>&1 | tail -8
    ;;
train)
    step "train: $RECIPE from $INIT, budget ${TRAIN_S:-480} s"
    [ -d "$W/tok" ] || { echo "no tokenised shards in $W/tok: run the 'tok' call first (machine went cold?)"; exit 3; }
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
    python3 -m tools.train train --recipe "$RECIPE" --data "$W/shards" .train_data/eval --words .train_data/eval/words.json \
        --work "$W" --init "$INIT" --init-state "$INIT_STATE" --restart-curriculum \
        --budget-s "${TRAIN_S:-480}" --export "$E" --log "$OUT/train_log.jsonl" 2>&1 | grep -v "Writing model shards"
    echo "train rc=$?"
    cp mla_eval/default_model/tokenizer.json mla_eval/default_model/tokenizer_config.json "$E/"
    [ -f mla_eval/default_model/generation_config.json ] && cp mla_eval/default_model/generation_config.json "$E/"
    split -b 15M -d "$E/model.safetensors" "$OUT/model.safetensors.part"
    tar -cf "$OUT/meta.tar" -C "$E" config.json trainer_state.json
    sha256sum "$E/model.safetensors"
    ;;
check)
    # mla-eval validates its result with jsonschema, which the image lacks: the wheels of .devwheels/js
    if ! python3 -c 'import jsonschema' 2>/dev/null && [ -d .devwheels/js ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devwheels/js/*.whl 2>&1 | tail -1
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    step "check: wikitext-2 perplexity + pass key 4K/64K (recipe evaluator)"
    timeout 120 python3 -m tools.train eval --model "$E" --wikitext .train_data/eval/wiki.test.raw \
        --haystack-docs .train_data/eval/eval_docs.txt.xz --words .train_data/eval/words.json --lengths 4096,65536 \
        --beyond "" --depths 3 --trials 2 --out "$OUT/quality_bf16_tasks.json" 2>&1 | grep -v "Loading weights" | tail -6
    step "check: bf16 needle tasks 4K/16K/64K (3 depths x 4 trials)"
    python3 - <<'PY'
import lzma, pathlib
docs = lzma.open(".train_data/eval/eval_docs.txt.xz", "rt", encoding="utf-8").read().split("\x00")
pathlib.Path("/tmp/heldout.txt").write_text("\n\n".join(docs), encoding="utf-8")
PY
    timeout 200 python3 -m mla_eval needle --model "$E" --formats bf16 --task single:number,single:word,multikey:number,multivalue:number,vt \
        --haystack /tmp/heldout.txt --lengths 4K,16K,64K --depths 0,50,100 --trials 4 \
        --out "$OUT/needle-tasks-check.json" 2>&1 | grep -v -E "scoring|prompts" | tail -45
    ;;
*) echo "unknown step $w (tok, train, check)"; exit 2 ;;
esac
done
step "done"
