#!/usr/bin/env bash
# One training call on the lent GPU machine (run from the repository root by the `run` tool).
#   bash tools/train/device_train.sh TRAIN_BUDGET_S EVAL(0|1) DATA_DIR...
# Resumes from /tmp/mla_train/ckpt.pt when the machine is still warm, else from the bf16 weights in
# .train_data/weights/ (fresh optimizer state) when carried, else starts from scratch.
# Writes to $OUT: the call's training log, the bf16 weights split into <= 15 MiB parts,
# meta.tar (config, generation config, trainer state), and with EVAL=1 the quality JSON and the
# per-layer latent statistics.
set -uo pipefail
BUDGET=${1:?train budget seconds}
EVAL=${2:-0}
shift 2
DATA=("$@")
W=/tmp/mla_train
mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, transformers, tokenizers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__)"
ls "$W" 2>/dev/null | head
INIT=()
if [ ! -f "$W/ckpt.pt" ] && [ -f .train_data/weights/model.safetensors ]; then INIT=(--init .train_data/weights); fi
WORDS=.train_data/eval/words.json
python3 -m tools.train train ${PROBE:+--probe} ${TINY:+--tiny} --data "${DATA[@]}" .train_data/eval --words "$WORDS" --work "$W" "${INIT[@]}" \
  --budget-s "$BUDGET" --export "$W/export" --log "$OUT/train_log.jsonl" 2>&1 | grep -v "Writing model shards"
rc=$?
E="$W/export"
cp mla_eval/default_model/tokenizer.json mla_eval/default_model/tokenizer_config.json "$E/" 2>/dev/null
split -b 15M -d "$E/model.safetensors" "$OUT/model.safetensors.part" && ls -la "$OUT"
tar -cf "$OUT/meta.tar" -C "$E" config.json generation_config.json trainer_state.json
if [ "$EVAL" = "1" ]; then
  python3 -m tools.train eval --model "$E" --wikitext .train_data/eval/wiki.test.raw \
    --haystack-docs .train_data/eval/eval_docs.txt.xz --austen .train_data/eval/austen_excerpt.txt \
    --words "$WORDS" --out "$OUT/quality_bf16.json" --budget-s "${EVAL_BUDGET:-110}" 2>&1 | grep -v "Loading weights"
  python3 -m tools.train.latent_stats --model "$E" --text .train_data/eval/wiki.test.raw \
    --json "$OUT/latent_stats.json" 2>&1 | grep -v "Loading weights"
fi
ls -la "$OUT"
exit $rc
