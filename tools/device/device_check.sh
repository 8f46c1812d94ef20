#!/usr/bin/env bash
# One device call: install CuTe DSL + this checkout, run the GPU tests, run the benchmark.
# Logs and results land under $OUT (they come back); the last lines printed are a summary.
#
# Prerequisite (see ../shared/device/README.md): `bash ../shared/device/prepare-cutedsl.sh` here,
# then device call 1 with carry [".devwheels/a"]:
#     mkdir -p /tmp/cutedsl-half && cp .devwheels/a/part.aa /tmp/cutedsl-half/
# and at once device call 2 with carry [".devwheels/b"]:
#     bash tools/device/device_check.sh [tests|bench|all|kern] [pytest -k expression]
# (kern: register use of the h=16 attention kernels, the benchmark with --variants, then the tests)
# When the working tree is too large to carry a 47 MB half, the wheel travels in six 16 MB parts
# (.devwheels/c1..c6), made here after prepare-cutedsl.sh with
#     for i in 1 2 3 4 5 6; do mkdir -p .devwheels/c$i; done
#     split -b 16M -d -a 1 .devwheels/dl/nvidia_cutlass_dsl_libs_cu13-*.whl /tmp/cu13part.
#     i=1; for f in /tmp/cu13part.*; do mv $f .devwheels/c$i/; i=$((i+1)); done
#     cp .devwheels/b/*.whl .devwheels/b/BIG_WHEEL_NAME .devwheels/c6/
# then calls 1-5 (carry .devwheels/cN): `mkdir -p /tmp/cutedsl-half && cp .devwheels/cN/* /tmp/cutedsl-half/`
# and call 6 (carry .devwheels/c6) runs this script.
set -o pipefail
what=${1:-all}
kexpr=${2:-}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
log=$OUT/log
exec > >(tee -a "$log") 2>&1
t0=$(date +%s)
step() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; }

step "install"
if ! python3 -c 'import cutlass' 2>/dev/null; then
    if [ -f .devwheels/b/install.sh ]; then  # the shared two-call layout
        bash .devwheels/b/install.sh || { echo "CuTe DSL install failed (half 1 missing? repeat call 1)"; exit 3; }
    elif [ -d .devwheels/c6 ]; then  # the wheel in 16 MB parts, earlier calls copied parts 0-4 to /tmp/cutedsl-half
        cp .devwheels/c6/cu13part.* /tmp/cutedsl-half/ && mkdir -p /tmp/cutedsl-wheels \
            && [ "$(ls /tmp/cutedsl-half/cu13part.* | wc -l)" = 6 ] \
            && cat /tmp/cutedsl-half/cu13part.* > "/tmp/cutedsl-wheels/$(cat .devwheels/c6/BIG_WHEEL_NAME)" \
            && cp .devwheels/c6/*.whl /tmp/cutedsl-wheels/ \
            && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/cutedsl-wheels/*.whl \
            || { echo "CuTe DSL install failed (parts missing: $(ls /tmp/cutedsl-half 2>/dev/null))"; exit 3; }
    fi
    export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q -e . --no-deps --no-build-isolation 2>&1 | grep -v "WARNING: Running pip as" | tail -3
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 - <<'EOF' || exit 4
import torch, cutlass, mla_eval_kernels
print("torch", torch.__version__, "cutlass-dsl", getattr(cutlass, "__version__", "?"), torch.cuda.get_device_name(), torch.cuda.get_device_capability())
EOF

rc=0
if [ "$what" = kern ]; then  # issue 14 round: resources, then the benchmark with variants, then the tests
    step "tools and resources"
    which ncu nsys cuobjdump 2>&1 | head -3
    cuobj=$(command -v cuobjdump || python3 -c 'import triton, pathlib; print(next(pathlib.Path(triton.__file__).parent.rglob("cuobjdump")))' 2>/dev/null)
    echo "cuobjdump: ${cuobj:-none}"
    timeout 90 python3 -m tools.compile_check --formats nvfp4,bf16,fp8_ds_mla --heads 16 --versions v1,v2 ${cuobj:+--cuobjdump $cuobj} \
        2>&1 | grep -E "attention .*split=False" | sed 's/  */ /g'
    step "benchmark v2 (variants at (b))"
    timeout ${BENCH_TIMEOUT:-180} python3 -m benchmarks.kernel_bench --out "$OUT" --variants ${BENCH_FORMATS:+--formats $BENCH_FORMATS} \
        2> "$OUT/bench.err" | grep -E "b_dense|a_sparse|c_prefill|GPU|saved"
    echo "bench exit ${PIPESTATUS[0]}"
    tail -3 "$OUT/bench.err"
    step "benchmark v1 (the fallback kernel, every shape)"
    mkdir -p "$OUT/v1"
    MLA_EVAL_ATTENTION_KERNEL=v1 timeout ${BENCH_TIMEOUT:-180} python3 -m benchmarks.kernel_bench --out "$OUT/v1" \
        ${BENCH_FORMATS:+--formats $BENCH_FORMATS} 2> "$OUT/v1/bench.err" | grep -E "b_dense|a_sparse|c_prefill|GPU|saved"
    echo "bench v1 exit ${PIPESTATUS[0]}"
    if [ -n "${PROFILE:-}" ] && command -v ncu >/dev/null; then
        step "ncu: dense decode h=16 64K batch 32, v2, nvfp4 and bf16"
        timeout 120 ncu --clock-control none -k regex:MlaAttention --launch-count 2 --section SpeedOfLight --section Occupancy \
            --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats \
            python3 -m benchmarks.profile_dense --formats nvfp4,bf16 > "$OUT/ncu.txt" 2>&1
        echo "ncu exit $?"
        grep -E "^  [a-zA-Z_]|Duration|Throughput|Occupancy|Registers|Stall|Warp Cycles|Issued|Eligible|launched|==PROF==|==ERR" "$OUT/ncu.txt" | head -60
    fi
    what=tests
fi
if [ "$what" = all ] || [ "$what" = tests ]; then
    step "GPU tests"
    timeout ${TEST_TIMEOUT:-330} python3 -m pytest tests/test_kernels_gpu.py tests/test_decode_steps_gpu.py tests/test_dispatch_backends.py tests/test_random_models_gpu.py -q -n 8 -rfEP -p no:cacheprovider ${kexpr:+-k "$kexpr"} \
        > "$OUT/pytest.log" 2>&1
    rc=$?
    grep -E "cos=|FAILED|ERROR|Error|error:|passed|failed" "$OUT/pytest.log" | grep -v "^E  " | sort | uniq | tail -80
    echo "pytest exit $rc"
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
    step "benchmark"
    timeout 240 python3 -m benchmarks.kernel_bench --out "$OUT" ${BENCH_ARGS:-} 2> "$OUT/bench.err"
    echo "bench exit $?"
    tail -5 "$OUT/bench.err"
fi
step "done"
exit $rc
