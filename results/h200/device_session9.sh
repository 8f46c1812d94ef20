#!/usr/bin/env bash
# Session 9's model-side device steps (the kernel steps are device_v3fp8.sh's and, once written, device_v3h.sh's).
# After the wheel-halves call of device_setup.sh; model in place; carry .devwheels/js .devdata:
#   bash results/h200/device_session9.sh fwd
#   fwd    the issue-14 kld window target at production geometry: forward_bench --parts kld on random:deepseek-v3
#          (128 heads, hidden 7168, 3 layers; random weights: cost, not quality), stock SDPA vs nvfp4 / fp8_ds_mla /
#          bf16 through both window paths in one run, with torch.profiler tables of one window (--profile-kld);
#          then the embedded model's profile for comparison
. "$(dirname "$0")/device_setup.sh"  # log, step timer, CuTe DSL + jsonschema
mkdir -p "$OUT/runs"
for w in "$@"; do
case "$w" in
fwd)
    step "forward_bench --parts kld, random:deepseek-v3, 8 x 2048 tokens"
    timeout 300 python3 -m mla_eval.evals.forward_bench --parts kld --model random:deepseek-v3 \
        --formats nvfp4,fp8_ds_mla,bf16 --out "$OUT/runs/forward-bench-kld-dsv3.json" \
        --profile-kld "$OUT/runs/profile-kld-dsv3.txt" 2>&1 | grep -v USDT | tail -12
    step "forward_bench --parts kld, embedded model, profile"
    timeout 150 python3 -m mla_eval.evals.forward_bench --parts kld --formats nvfp4 \
        --out "$OUT/runs/forward-bench-kld-default.json" --profile-kld "$OUT/runs/profile-kld-default.txt" 2>&1 \
        | grep -v USDT | tail -6
    ;;
*) echo "unknown step $w (fwd)"; exit 2 ;;
esac
done
step "done"
