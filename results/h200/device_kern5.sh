#!/usr/bin/env bash
# Session 5, issue 14: the first device run of the v3 dense-decode kernel (kernels/mla_attention_v3.py).
#   bash results/h200/device_kern5.sh [tests] [bench] [profile]      (no argument: tests bench)
#   tests    v3 registers/stack from the device's own compile (compile_check --versions v3), the v3 GPU
#            tests (tests/test_kernels_v3_gpu.py), then the v3 cases of tests/test_kernels_gpu.py
#            (MLA_EVAL_ATTENTION_KERNEL=v3 on every format / head count / mode: v3 where it applies,
#            v2 for sparse lists and formats whose stages do not fit); a hang is cut by timeout
#   bench    shape (b) dense decode h=16, 8K/32K/64K, batch 32: the default kernel (v2) and v3 side by
#            side in one run, with the copy / matmul ceilings; JSON under $OUT/bench (VARIANTS=1: also the
#            v1/v2 probes, v3 without its L2 prefetch and with the other producer count at 64K; ~1 min more)
#   profile  ncu of one v3 launch at (b) 64K for nvfp4 and bf16 (if ncu is there; not in the 5 minutes)
# Needs the wheel-halves setup of device_setup.sh (CuTe DSL install). Logs under $OUT.
# Budget: install ~0.5 min, tests <= 4.3 min (timeouts; expected ~2), bench <= 2 min (expected ~1.5: 3 formats
# compile in parallel workers). `-k v3` keeps all of test_kernels_v3_gpu.py (its module name has v3).
. "$(dirname "$0")/device_setup.sh"  # log, step timer, CuTe DSL + jsonschema
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests bench)
for w in "${steps[@]}"; do
case "$w" in
tests)
    step "v3 compile on the device (registers, stack, PTX checks)"
    timeout 60 python3 -m tools.compile_check --versions v3 --formats bf16,nvfp4 --heads 16 2>&1 \
        | grep -E "v3|FAILED" > "$OUT/compile-v3.log"; grep -c " ok " "$OUT/compile-v3.log"; grep FAILED "$OUT/compile-v3.log" | head
    step "v3 GPU tests + the v3 cases of the existing kernel tests (MLA_EVAL_ATTENTION_KERNEL=v3)"
    timeout 200 python3 -m pytest tests/test_kernels_v3_gpu.py tests/test_kernels_gpu.py -k "v3" -q -n 8 \
        -p no:cacheprovider -rfE > "$OUT/pytest-v3.log" 2>&1
    echo "pytest rc=$? (124 = timeout: a hang?)"; grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest-v3.log" | grep -v "^E " | tail -30
    ;;
bench)
    step "bench (b): v2 (default) and v3 side by side"
    timeout 120 python3 -m benchmarks.kernel_bench --shapes b --formats bf16,nvfp4,fp8_ds_mla ${VARIANTS:+--variants} \
        --out "$OUT/bench" > "$OUT/bench-v3.log" 2>&1
    echo "bench rc=$?"; grep -E "^GPU|b_dense|saved|Error|error" "$OUT/bench-v3.log" | tail -30
    ;;
profile)
    if command -v ncu > /dev/null; then
        for f in nvfp4 bf16; do
            step "ncu v3 (b) 64K $f"
            MLA_EVAL_ATTENTION_KERNEL=v3 timeout 240 ncu --clock-control none -k regex:MlaAttentionV3 -c 1 \
                --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
                --section LaunchStats python3 -m benchmarks.profile_dense --formats "$f" > "$OUT/ncu-v3-$f.txt" 2>&1
            echo "ncu rc=$?"; grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Compute \(SM\)" "$OUT/ncu-v3-$f.txt" | head
        done
    else
        echo "no ncu on this machine"
    fi
    ;;
*) echo "unknown step $w (tests, bench, profile)"; exit 2 ;;
esac
done
