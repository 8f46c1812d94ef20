# Sourced by the device scripts of results/h200/ (device_eval.sh, device_prod.sh): the log under $OUT,
# the step timer, and CuTe DSL + the jsonschema wheels (.devwheels/js) installed into /tmp/site.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/log") 2>&1
t0=$(date +%s); step() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; }
# A device call returns at most 8 files from $OUT (session 8 lost a whole recipe directory to that limit): on exit,
# each script packs $OUT/runs into one .tgz of its own name, so several scripts in one call each leave one file.
pack_runs() { [ -d "$OUT/runs" ] && tar czf "$OUT/runs-$(basename "$0" .sh)-$$.tgz" -C "$OUT" runs && rm -rf "$OUT/runs"; }
trap pack_runs EXIT
# kld runs in these scripts name --prefill absorbed (the path of every committed figure): the default became auto in
# session 8, which would silently take the mha path under --no-layer-stats.
export PYTHONUNBUFFERED=1
step "install"
bash tools/device/device_check.sh install > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 3; }
tail -2 "$OUT/install.log"
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
if [ -d .devwheels/js ] && ! python3 -c 'import jsonschema' 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devwheels/js/*.whl 2>&1 | tail -2
fi
# gpu_pytest TIMEOUT NAME ARGS...: pytest ARGS (quiet, no cache, failures listed) into $OUT/runs/pytest-NAME.log,
# then its exit status (124 = timeout) and the summary lines; returns pytest's status, so that a step can stop after a
# failure (session 11's CTA pair: a deadlocked launch leaves the GPU context stuck for everything after it)
gpu_pytest() {
    local limit=$1 name=$2; shift 2
    mkdir -p "$OUT/runs"
    timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rfE "$@" > "$OUT/runs/pytest-$name.log" 2>&1
    local rc=$?
    echo "pytest $name rc=$rc (124 = timeout)"
    grep -E "FAILED|ERROR|passed|failed" "$OUT/runs/pytest-$name.log" | grep -v "^E " | tail -30
    return $rc
}
# gpu_bench TIMEOUT NAME ARGS...: python -m benchmarks.kernel_bench ARGS --out $OUT/runs/NAME into $OUT/runs/NAME.log,
# then its exit status and the rows and summary lines
gpu_bench() {
    local limit=$1 name=$2; shift 2
    mkdir -p "$OUT/runs"
    timeout "$limit" python3 -m benchmarks.kernel_bench "$@" --out "$OUT/runs/$name" > "$OUT/runs/$name.log" 2>&1
    echo "bench $name rc=$? (124 = timeout)"
    grep -E "^GPU|dense|sparse|prefill|saved|Error|error" "$OUT/runs/$name.log" | tail -80
}
# gpu_ncu TIMEOUT NAME ARGS...: `ncu --set full` of one v3 launch of `python -m benchmarks.profile_dense ARGS` into
# $OUT/runs/NAME.ncu-rep, then its details page and SASS source page (CSV) beside it and the headline metrics
gpu_ncu() {
    local limit=$1 name=$2; shift 2
    command -v ncu > /dev/null || { echo "no ncu on this machine"; return 1; }
    mkdir -p "$OUT/runs"
    local rep="$OUT/runs/$name"
    timeout "$limit" ncu --clock-control none -k regex:MlaAttentionV3 -c 1 --set full --import-source no -o "$rep" \
        python3 -m benchmarks.profile_dense "$@" > "$rep-run.log" 2>&1
    echo "ncu $name rc=$?"; tail -2 "$rep-run.log"
    ncu -i "$rep.ncu-rep" --page details > "$rep-details.txt" 2>&1
    ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep-sass.csv" 2>&1
    grep -E "Duration|Issue Slots Busy|Eligible Warps|Executed Ipc A" "$rep-details.txt" | head -8
}
