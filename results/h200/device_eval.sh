#!/usr/bin/env bash
# One device call on the H200: install CuTe DSL (parts copied by earlier calls, see
# kernels/device_check.sh), re-run the kernel tests, then the product path end to end:
# kld on wikitext-2 (a prefix, device-time bound), kernel-vs-reference KLD, a needle grid.
# Needs .devdata/wiki.test.raw carried (never committed). Logs and JSON under $OUT.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/log") 2>&1
t0=$(date +%s); step() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; }
bash kernels/device_check.sh tests > "$OUT/kernel_tests.log" 2>&1; echo "kernel tests rc=$?"; tail -4 "$OUT/kernel_tests.log"
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
TOK=${KLD_TOKENS:-60000}
step "kld wikitext-2 first $TOK tokens, all formats, kernels"
timeout ${KLD_TIMEOUT:-150} python3 -m mla_eval kld --text .devdata/wiki.test.raw --max-tokens $TOK --ctx 2048 --stride 512 --batch 8 \
  --out "$OUT/kld-wikitext2-h200.json" --plot "$OUT/plots" 2>&1 | grep -v "scoring" | tail -25
step "kld kernel vs reference, 6000 tokens"
for b in auto reference; do
  MLA_EVAL_BACKEND=$b timeout 90 python3 -m mla_eval kld --text .devdata/wiki.test.raw --max-tokens 6000 --formats fp8_ds_mla,nvfp4,nvfp4+s_l,mxfp4 \
    --batch 8 --no-layer-stats --out "$OUT/kld-backend-$b.json" 2>&1 | grep -v scoring | tail -9
done
step "needle 4K,16K,64K x 3 depths"
timeout ${NEEDLE_TIMEOUT:-100} python3 -m mla_eval needle --lengths 4K,16K,64K --depths 0,50,100 --formats fp8_ds_mla,nvfp4,nvfp4+s_l,mxfp4 \
  --out "$OUT/needle-h200.json" 2>&1 | tail -12
step "done"
