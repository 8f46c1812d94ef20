#!/usr/bin/env bash
# Issue 18 on a multi-GPU H200 machine (nvidia-h200-x2 / -x4 / -x8): torchrun data-parallel kld and
# --device-map auto, each compared with the single-GPU run of the same windows (every metric identical).
#   bash results/h200/device_multigpu.sh [ckpt] [dp] [devmap] [needle] [fail]
#     ckpt    save a production-geometry random checkpoint (random:glm-5, LAYERS layers, bf16) to $CKPT
#             (--device-map needs a checkpoint folder; random: specs are built on one device)
#     dp      kld on 1 GPU, then torchrun --nproc-per-node N for N = 2, 4, 8 (those that fit the GPUs):
#             JSON + wall time each; compare.py checks formats{} equal to the 1-GPU document
#     devmap  kld with --device-map auto on the first N GPUs (CUDA_VISIBLE_DEVICES) and a --max-memory cap
#             of ~1.3/N of the weights, so the layers must spread over all N; compared with the 1-GPU run;
#             the document records each layer's device (its cache lives there)
#     needle  one needle cell (16K, depth 50) 1 GPU vs --device-map auto on every GPU with the cap
#     fail    failure behaviour over NCCL: rank 1 killed after scoring (tests/dist_fault_worker.py exit):
#             rank 0 must print one error line, no document
# Needs .devdata/wiki.test.raw carried (never committed). Outputs under $OUT/runs (packed into runs.tgz):
# kld-*.json, needle-*.json, timing.tsv (step, N, seconds, exit), compare-*.txt, memory-*.txt.
# Every step is time-bounded (timeout); a missing checkpoint is made first, so steps can go in separate calls.
. "$(dirname "$0")/device_setup.sh"  # log, step timer, CuTe DSL + jsonschema
TEXT=${TEXT:-.devdata/wiki.test.raw}
CKPT=${CKPT:-/tmp/ckpt-glm5-random}
LAYERS=${LAYERS:-16}
FORMATS=${FORMATS:-fp8_ds_mla,nvfp4,nvfp4_fp8rope}
KLD_ARGS=(--text "$TEXT" --max-tokens "${MAX_TOKENS:-65536}" --ctx 4096 --stride 2048 --min-context 2048
          --formats "$FORMATS" --scales none --no-layer-stats --prefill absorbed)
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
mkdir -p "$OUT/runs"
echo "GPUs visible: $NGPU"; nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader

timed() {  # timed NAME N CMD...: run CMD with a timeout, append "NAME N seconds exit" to timing.tsv
    local name=$1 n=$2; shift 2
    local s; s=$(date +%s%N)
    timeout "${STEP_TIMEOUT:-540}" "$@"; local rc=$?
    local ms=$(( ($(date +%s%N) - s) / 1000000 ))
    printf '%s\t%s\t%d.%03d\t%s\n' "$name" "$n" $((ms / 1000)) $((ms % 1000)) "$rc" >> "$OUT/runs/timing.tsv"
    return $rc
}

compare() {  # compare ONE.json OTHER.json LABEL: every per-format metric identical
    python3 - "$1" "$2" > "$OUT/runs/compare-$3.txt" 2>&1 <<'EOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
same = a["formats"] == b["formats"]
diff = [(f, k) for f in a["formats"] for k in a["formats"][f] if a["formats"][f][k] != b["formats"].get(f, {}).get(k)]
keys = ("world_size", "device_map", "max_memory_per_gpu", "layer_devices")
print("identical" if same else f"DIFFERENT in {len(diff)} metrics, first: {diff[:5]}")
print({k: b["settings"].get(k) for k in keys})
print("seconds", a.get("seconds"), "->", b.get("seconds"))
sys.exit(0 if same else 1)
EOF
    local rc=$?; echo "compare $3: $(head -1 "$OUT/runs/compare-$3.txt")"; return $rc
}

memory_log() {  # memory_log LABEL: per-GPU memory every 2 s while the caller's command runs
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader -l 2 > "$OUT/runs/memory-$1.txt" 2>&1 &
    MEMPID=$!
}

steps="${*:-ckpt dp devmap needle fail}"
[ -f "$CKPT/weights_bytes" ] || case " $steps " in *" ckpt "*) ;; *) steps="ckpt $steps";; esac  # a fresh machine
for what in $steps; do
case "$what" in
ckpt)
    [ -f "$CKPT/weights_bytes" ] && { echo "checkpoint $CKPT already there"; continue; }
    step "random glm-5 checkpoint, $LAYERS layers -> $CKPT"
    timeout 300 python3 - "$CKPT" "$LAYERS" <<'EOF'
import shutil, sys, json, torch
from pathlib import Path
from mla_eval.model.random_models import build_random_model, parse_random_spec
from mla_eval.model_home import default_model_path
out, layers = Path(sys.argv[1]), int(sys.argv[2])
tok = default_model_path()
spec = parse_random_spec(f"random:glm-5:layers={layers}")
vocab = json.loads((tok / "config.json").read_text())["vocab_size"]
model = build_random_model(spec, vocab, torch.device("cpu"), torch.bfloat16)
model.save_pretrained(out)
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(tok / f, out / f)
n = sum(p.numel() * p.element_size() for p in model.parameters())
(out / "weights_bytes").write_text(str(n))
print(f"saved {out}: {n / 2**30:.2f} GiB of weights")
EOF
    echo "exit $?"
    ;;
dp)
    step "kld 1 GPU"
    memory_log dp-1
    timed kld-dp 1 python3 -m mla_eval kld --model "$CKPT" "${KLD_ARGS[@]}" --out "$OUT/runs/kld-dp-1.json" 2>&1 | tail -12
    kill $MEMPID
    for n in 2 4 8; do
        [ "$n" -le "$NGPU" ] || continue
        step "kld torchrun --nproc-per-node $n"
        memory_log "dp-$n"
        timed kld-dp "$n" torchrun --nproc-per-node "$n" --master-port $((29500 + n)) -m mla_eval kld --model "$CKPT" \
            "${KLD_ARGS[@]}" --out "$OUT/runs/kld-dp-$n.json" 2>&1 | tail -12
        kill $MEMPID
        compare "$OUT/runs/kld-dp-1.json" "$OUT/runs/kld-dp-$n.json" "dp-$n"
    done
    ;;
devmap)
    W=$(cat "$CKPT/weights_bytes")
    [ -f "$OUT/runs/kld-dp-1.json" ] || { step "kld 1 GPU (reference for devmap)";
        timed kld-dp 1 python3 -m mla_eval kld --model "$CKPT" "${KLD_ARGS[@]}" --out "$OUT/runs/kld-dp-1.json" 2>&1 | tail -5; }
    for n in 2 4 8; do
        [ "$n" -le "$NGPU" ] || continue
        cap=$(( W * 13 / 10 / n ))
        step "kld --device-map auto on $n GPUs, --max-memory $cap bytes per GPU"
        memory_log "devmap-$n"
        timed kld-devmap "$n" env CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((n - 1)))" python3 -m mla_eval kld --model "$CKPT" \
            "${KLD_ARGS[@]}" --device-map auto --max-memory "$cap" --out "$OUT/runs/kld-devmap-$n.json" 2>&1 | tail -12
        kill $MEMPID
        compare "$OUT/runs/kld-dp-1.json" "$OUT/runs/kld-devmap-$n.json" "devmap-$n"
    done
    ;;
needle)
    W=$(cat "$CKPT/weights_bytes")
    NEEDLE=(--formats nvfp4,fp8_ds_mla --scales none --lengths 16K --depths 50 --trials 2)
    step "needle 16K 1 GPU"
    timed needle 1 python3 -m mla_eval needle --model "$CKPT" "${NEEDLE[@]}" --out "$OUT/runs/needle-1.json" 2>&1 | tail -8
    step "needle 16K --device-map auto on $NGPU GPUs"
    memory_log "needle-$NGPU"
    timed needle-devmap "$NGPU" python3 -m mla_eval needle --model "$CKPT" "${NEEDLE[@]}" --device-map auto \
        --max-memory $(( W * 13 / 10 / NGPU )) --out "$OUT/runs/needle-devmap-$NGPU.json" 2>&1 | tail -8
    kill $MEMPID
    compare "$OUT/runs/needle-1.json" "$OUT/runs/needle-devmap-$NGPU.json" "needle-devmap-$NGPU"
    ;;
fail)
    step "failure: rank 1 dies after scoring (NCCL run, gloo gather), MLA_EVAL_DIST_TIMEOUT=60"
    # torchrun may stop rank 0 itself once rank 1 exits (then rank 0 says "interrupted by SIGTERM: no result
    # written"); otherwise rank 0's gather fails and it says "error: rank 0 of 2: gathering ... failed".
    timed fail 2 env MLA_EVAL_DIST_TIMEOUT=60 torchrun --nproc-per-node 2 --master-port 29599 \
        tests/dist_fault_worker.py exit kld --model "$CKPT" "${KLD_ARGS[@]}" --max-tokens 16384 \
        --out "$OUT/runs/kld-fail.json" > "$OUT/runs/fail.log" 2>&1
    echo "torchrun exit $? (expected non-zero); rank 0's line:"
    grep -E "^error:|^interrupted by" "$OUT/runs/fail.log" | head -4
    [ ! -e "$OUT/runs/kld-fail.json" ] && echo "no document written (as required)" || echo "FAIL: a document was written"
    ;;
esac
done
cat "$OUT/runs/timing.tsv" 2>/dev/null
# one archive per script run: two scripts in one device call must not overwrite each other's results
tar -C "$OUT" -czf "$OUT/runs-$(basename "$0" .sh)-$(date +%s).tgz" runs && rm -rf "${OUT:?}/runs"
step "done"
