#!/usr/bin/env bash
# There (the GPU machine), from the repository root. Call 1 (carry .devwheels/c1): `bash tools/device/bootstrap.sh
# stage1`. Call 2 at once, while the machine is warm (carry .devwheels/c2 and .devdata):
# `bash tools/device/bootstrap.sh STEP [options] [:: STEP [options] ...]`: installs CuTe DSL and jsonschema into
# /tmp/site (once per machine), unpacks the embedded model's weights if the tree came without them, installs this
# checkout (no dependencies), then runs `python -m tools.device` for each STEP in turn. Later calls on the warm machine
# carry nothing. Output: the whole console in $OUT/log, each step's files under $OUT/runs, packed on exit into
# $OUT/runs-<pid>.tgz (a call returns at most 8 files).
set -o pipefail
cd "$(dirname "$0")/../.." || exit 2
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/runs"
exec > >(tee -a "$OUT/log") 2>&1
pack() { [ -n "$(ls -A "$OUT/runs" 2>/dev/null)" ] && tar czf "$OUT/runs-$$.tgz" -C "$OUT" runs && rm -rf "$OUT/runs"; }
trap pack EXIT
export PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
if [ "${1:-}" = stage1 ]; then
    mkdir -p /tmp/devwheels && cp .devwheels/c1/* /tmp/devwheels/ && ls -la /tmp/devwheels && exit 0
    exit 3  # (the copy failed)
fi
if ! python3 -c 'import cutlass, jsonschema' 2>/dev/null; then
    [ -f /tmp/devwheels/cu13.part0 ] || { echo "call 1 (stage1) did not run on this machine (went cold?): run it again"; exit 3; }
    [ -d .devwheels/c2 ] || { echo "carry .devwheels/c2 (bash tools/device/prepare.sh)"; exit 3; }
    # the small wheels first (pip --target skips a top-level folder that exists), then the cu13 files into the same tree
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .devwheels/c2/*.whl || exit 4
    cat /tmp/devwheels/cu13.part0 .devwheels/c2/cu13.part1 | xz -dc | tar xf - -C /tmp/site || exit 4
fi
# DeepGEMM (the sgl-deep-gemm wheel, ~5 MB, prepare.sh puts it in .devwheels/fp8): FP8 weight math's kernels
# (mla_eval.model.deepgemm). Any call may carry it; installed once per machine.
if ls .devwheels/fp8/sgl_deep_gemm-*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/deep_gemm ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .devwheels/fp8/*.whl || exit 4
fi
model=mla_eval/default_model/model.safetensors
if [ ! -f "$model" ] && [ -f .devwheels/c2/model.safetensors.xz ]; then
    xz -dc .devwheels/c2/model.safetensors.xz > "$model"
    [ "$(sha256sum "$model" | cut -d' ' -f1)" = "$(cat .devwheels/c2/model.sha256)" ] || { echo "model weights corrupted in transit"; exit 4; }
fi
python3 -m pip install -q -e . --no-deps --no-build-isolation 2>&1 | grep -v "WARNING: Running pip as" | tail -3
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch, cutlass; print('torch', torch.__version__, 'cutlass-dsl', getattr(cutlass, '__version__', '?'),
torch.cuda.get_device_name(), torch.cuda.get_device_capability())" || exit 4
[ -d /tmp/site/deep_gemm ] && python3 -c "import torch, deep_gemm; print('deep_gemm', deep_gemm.__file__)" 2>&1 | tail -1
[ $# -gt 0 ] || exit 0
rc=0 args=()
for a in "$@" ::; do  # STEP [options] :: STEP [options] ...
    if [ "$a" = "::" ]; then
        [ ${#args[@]} -gt 0 ] && { python3 -m tools.device "${args[@]}" || rc=$?; }
        args=()
    else
        args+=("$a")
    fi
done
echo "=== done (rc=$rc)"
exit $rc
