#!/usr/bin/env bash
# The one entry point for work on a lent GPU machine (an H200 or H100; sm_90). Run from the repository root:
#
#   bash tools/device/run.sh SUBCOMMAND [SUBCOMMAND ...]        (in the order given; `help` lists them)
#
# Everything it writes goes under $OUT (default /tmp/out): the whole console log in $OUT/log, every subcommand's
# logs and JSON under $OUT/runs, packed on exit into one $OUT/runs-<pid>.tgz (a device call returns at most 8
# files; unpack with `tar xzf`). Restartable: `install` is skipped once CuTe DSL imports, each subcommand (and each
# step of `long`, `semantics`, `multigpu`) writes its own files under a time limit, so a rerun names only what is
# missing; `train` resumes from the full checkpoint in /tmp/mla_train while the machine is warm.
#
# Subcommands
#   install    CuTe DSL (nvidia-cutlass-dsl) into /tmp/site, the jsonschema wheels of .devwheels/js, this checkout
#              (pip -e, no dependencies); prints the versions. Every other subcommand runs it first.
#   kern       the kernel GPU tests (v1/v2/v3 attention, writer, dispatch): need no model file. KEXPR=pytest -k expr
#   tests      every GPU test file but the long-context one (kernels, decode steps, random preset models, semantics);
#              needs mla_eval/default_model/model.safetensors. TESTS="files" overrides the list (tests/test_long_gpu.py:
#              the 64K / 128K windows and needles), KEXPR selects.
#   compile    tools.compile_check of the v1/v2/v3 h=16 kernels (nvfp4, bf16, fp8_ds_mla) with the machine's cuobjdump:
#              registers and stack frames.
#   bench      python -m benchmarks.kernel_bench (ceilings in the same run); BENCH_ARGS adds options, e.g.
#              BENCH_ARGS="--shapes b --variants" (shape (b): dense decode h=16 batch 32, with every probe row) or
#              BENCH_ARGS="--shapes a,d --variants" (h=128: sparse top-2048 and dense)
#   ncu        `ncu --set full` of one v3 launch (benchmarks.profile_dense; PROFILE_ARGS, default "--formats nvfp4":
#              shape (b) 64K): the details page and the SASS source page (CSV, stall samples per instruction)
#   revs       the held v3 instruction cuts (docs/kernels.md#held-revisions): consumer rev 2 and decode rev 2, each
#              bitwise against rev 1 and against the reference; then bench rows v3 / v3-c2 / v3-d2 / v3-c2-d2 at (b)
#              and (d) and v3-t32 / v3-t32-c2 at (a) and (d). Flip a default only where its tests pass and its rows win.
#              REVS="tests bench t32" picks steps (each under its own limit: REVS_TEST_TIMEOUT, REVS_BENCH_TIMEOUT).
#   power      issue 30 on the GPU (POWER="grid topk"): needle --power with the real formats and control:* on the
#              embedded model under --latent-profile glm-5.2 (4K/16K/64K, single + multikey, held-out Wikipedia
#              haystack .devdata/wiki-long.txt), and kld with the DSA top-k overlap on random:glm-5.2 (same profile)
#   pair       the held CTA pair (docs/kernels.md#the-cta-pair): one launch first under a 180 s limit (a cluster
#              deadlock leaves the GPU context stuck), then its GPU tests, then bench (a)/(d) at h=128 and 64 with
#              --pair; each stage only after the previous passed.
#   pairncu    ncu of a paired and an unpaired 32-head launch at (d) 8K, nvfp4 and fp8_ds_mla
#   kld-kernels  mla-eval kld on the embedded model under forced v2 and forced v3 (wikitext-2 test, 16K tokens),
#              every format v3 serves: v3 must reproduce v2 within the kernel tolerance (needs .devdata/wiki.test.raw)
#   forward    python -m benchmarks.forward_bench: kld window and 64K needle cell vs the stock bf16 SDPA forward;
#              FORWARD_ARGS adds options (e.g. "--parts kld --model random:deepseek-v3 --profile-kld P.txt")
#   prod       python -m benchmarks.production_bench: every preset geometry, cost per layer and format, kernel vs
#              reference KLD, projected full-depth runs (needs .devdata/wiki.test.raw)
#   eval       mla-eval run RECIPE (default recipes/h200-full.toml: wikitext-2 KLD of nine formats and the pass-key
#              grid; needs .devdata/wiki.test.raw) and mla-eval report of it
#   formats    mla-eval kld of every registered format on the embedded model (wikitext-2 test, 64K tokens) and the
#              engine residual measurements (tools.measure.*)
#   semantics  the attention semantics tables (SEMANTICS="default prod qp" by default): cache / engine:C / vllm x
#              bf16 / fp8-q math on the embedded model, the same at DeepSeek-V3 geometry (random weights), fp8-qp
#   long       the long-context runs (LONG="grid kld64 yarn96 yarn128" by default) on held-out Wikipedia
#              (.devdata/wiki-long.txt from `python -m tools.make_wiki_long`): the 3-task needle grid at 4K/16K/64K for
#              bf16 + GRID_FORMATS, KLD of KLD_FORMATS at ctx 64K with depth buckets, 96K / 128K cells under
#              --rope-scaling yarn:2 for bf16 + YARN_FORMATS; `confirm` (bf16 alone at 64K) and `calib` (outer scales
#              of MODEL) on request. MODEL=<folder> measures a checkpoint instead of the embedded model.
#   multigpu   on an x2 / x4 / x8 machine: torchrun data-parallel kld and --device-map auto, each compared with the
#              single-GPU document of the same windows (MULTIGPU="ckpt dp devmap needle fail" by default)
#   memory     python -m benchmarks.memory_bench: peak GPU memory per phase of random DeepSeek-V3.2 and GLM-5 layers at
#              ctx 2K/4K/8K (MEM_ARGS replaces the options, MEM_TIMEOUT the limit)
#   moe        python -m benchmarks.moe_bench: one MoE block per preset geometry (DeepSeek-V3.2, Kimi-K2, GLM-5.2) at
#              2K/16K/64K tokens, eager / grouped_mm / fp8 (DeepGEMM) beside the dense bf16 ceiling of the same run
#              (MOE_ARGS replaces the options, MOE_TIMEOUT the limit); needs the sgl-deep-gemm wheel in .whl/ for fp8
#   fp8        the FP8 weight-math GPU tests (DeepGEMM dense and grouped against the torch reference) and the compute
#              paths' KLD checks (expert paths and weight maths give the same rows), MLA_EVAL_FP8_GEMM=deepgemm: a
#              DeepGEMM that cannot load fails them. Carry .whl (the sgl-deep-gemm wheel: README "wheels")
#   stream     python -m benchmarks.stream_bench: a full-width DeepSeek-V3.2 FP8 checkpoint written to /tmp/ckpt, the
#              disk's O_DIRECT read rate, kld streamed and resident (equal formats), projected full-depth GLM-5.2 and
#              DeepSeek-V3.2 runs (STREAM_ARGS adds options, e.g. "--steps project"; STREAM_TIMEOUT the limit)
#   plan       a mixed per-layer plan (fp8_ds_mla, nvfp4+s_l, nvfp4_fp8_ds_mla, nvfp4_fp8rope: several formats in one
#              forward) through the kernels and through the torch reference: kld --formats plan:FILE on
#              random:glm-5.2:layers=4 (DSA: the sparse path) and random:deepseek-v3:layers=4 (dense), kernel KLD equal
#              to reference KLD within 2 % (self-samples, no data needed)
#   train-tok  copy training shards (SHARDS, default .train_data/a) to /tmp/mla_train/shards and tokenise them
#   train      python -m tools.train train for TRAIN_S seconds (RECIPE, default recipes/train-default-model.toml;
#              INIT / INIT_STATE / RESTART_CURRICULUM=1 for a continuation recipe; DATA, default the tokenised shards);
#              the bf16 export comes back as $OUT/model.safetensors.partNN + $OUT/meta.tar
#   train-check  the export's wikitext-2 perplexity and pass key (tools.train eval), per-layer latent statistics,
#              and a bf16 needle grid of the five tasks at 4K/16K/64K (EXPORT, default /tmp/mla_train/export)
#
# Carry (the `run` tool moves at most 64 MiB per call; never commit .devwheels, .devdata or .train_data):
#   CuTe DSL, tested procedure (../shared/device/README.md): here `bash ../shared/device/prepare-cutedsl.sh`, then
#     call 1, carry [".devwheels/a"]:   mkdir -p /tmp/cutedsl-half && cp .devwheels/a/part.aa /tmp/cutedsl-half/
#     call 2 at once, carry [".devwheels/b", ".devwheels/js"]:   bash tools/device/run.sh install kern ...
#   Later calls on the warm machine need no wheels. When the tree is too large to carry a 47 MB half:
#     - three pieces: split part.aa into .devwheels/a1/p1 and .devwheels/a2/p2 and move part.ab alone to .devwheels/bp;
#       calls: `mkdir -p /tmp/cutedsl-half && cp .devwheels/a1/p1 /tmp/cutedsl-half/`,
#       `cat /tmp/cutedsl-half/p1 .devwheels/a2/p2 > /tmp/cutedsl-half/part.aa`, `cp .devwheels/bp/part.ab
#       /tmp/cutedsl-half/`, then this script carrying .devwheels/b without part.ab (it takes /tmp/cutedsl-half's);
#     - six 16 MB parts, made here after prepare-cutedsl.sh:
#         for i in 1 2 3 4 5 6; do mkdir -p .devwheels/c$i; done
#         split -b 16M -d -a 1 .devwheels/dl/nvidia_cutlass_dsl_libs_cu13-*.whl /tmp/cu13part.
#         i=1; for f in /tmp/cu13part.*; do mv $f .devwheels/c$i/; i=$((i+1)); done
#         cp .devwheels/b/*.whl .devwheels/b/BIG_WHEEL_NAME .devwheels/c6/
#       calls 1-5 (carry .devwheels/cN): `mkdir -p /tmp/cutedsl-half && cp .devwheels/cN/* /tmp/cutedsl-half/`;
#       call 6 (carry .devwheels/c6) runs this script.
#   The tracked tree with the model file (~55 MB) leaves little room: move mla_eval/default_model/model.safetensors
#   aside for the wheel calls and for `kern`, `compile`, `bench`, `ncu`, `revs`, `pair`, `pairncu`; put it back
#   before any commit. Text for the model runs: .devdata/wiki.test.raw (wikitext-2 test), .devdata/wiki-long.txt.
set -o pipefail
cd "$(dirname "$0")/../.." || exit 2
OUT=${OUT:-/tmp/out}
R=$OUT/runs
mkdir -p "$R"
exec > >(tee -a "$OUT/log") 2>&1
t0=$(date +%s)
step() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; }
# one archive per script run: several runs in one call each leave one file, none overwrites another's
pack_runs() { [ -n "$(ls -A "$R" 2>/dev/null)" ] && tar czf "$OUT/runs-$$.tgz" -C "$OUT" runs && rm -rf "$R"; }
trap pack_runs EXIT
export PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
TEXT=.devdata/wiki.test.raw
LONG_TEXT=.devdata/wiki-long.txt
SCALES=${SCALES:-results/published/default-model/outer_scales-wikipedia-heldout.json}
W=/tmp/mla_train
quiet() { grep -v -E "scoring|prompts +[0-9━╸ ]|^[│┃┏┡└]" | tail -"${1:-30}"; }
need() { [ -f "$1" ] || { echo "missing $1: $2"; return 3; }; }

install_stack() {
    if ! python3 -c 'import cutlass' 2>/dev/null; then
        # the three-piece layout leaves part.ab in /tmp/cutedsl-half instead of .devwheels/b
        [ -f .devwheels/b/install.sh ] && [ ! -f .devwheels/b/part.ab ] && [ -f /tmp/cutedsl-half/part.ab ] \
            && cp /tmp/cutedsl-half/part.ab .devwheels/b/
        if [ -f .devwheels/b/install.sh ]; then  # the shared two-call layout
            bash .devwheels/b/install.sh || { echo "CuTe DSL install failed (half 1 missing? repeat call 1)"; return 3; }
        elif [ -d .devwheels/c6 ]; then  # the wheel in 16 MB parts, earlier calls copied parts 0-4 to /tmp/cutedsl-half
            cp .devwheels/c6/cu13part.* /tmp/cutedsl-half/ && mkdir -p /tmp/cutedsl-wheels \
                && [ "$(ls /tmp/cutedsl-half/cu13part.* | wc -l)" = 6 ] \
                && cat /tmp/cutedsl-half/cu13part.* > "/tmp/cutedsl-wheels/$(cat .devwheels/c6/BIG_WHEEL_NAME)" \
                && cp .devwheels/c6/*.whl /tmp/cutedsl-wheels/ \
                && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/cutedsl-wheels/*.whl \
                || { echo "CuTe DSL install failed (parts missing: $(ls /tmp/cutedsl-half 2>/dev/null))"; return 3; }
        else
            echo "CuTe DSL is not installed and no wheels were carried: see the header of tools/device/run.sh"; return 3
        fi
    fi
    # mla-eval validates every result with jsonschema, which the image lacks: the wheels of .devwheels/js
    if [ -d .devwheels/js ] && ! python3 -c 'import jsonschema' 2>/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devwheels/js/*.whl 2>&1 | tail -2
    fi
    # DeepGEMM (the sgl-deep-gemm wheel, carried in .whl/): FP8 weight math's kernels (mla_eval.model.deepgemm)
    if ls .whl/sgl_deep_gemm-*.whl >/dev/null 2>&1 && ! python3 -c 'import deep_gemm' 2>/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/sgl_deep_gemm-*.whl \
            2>&1 | tail -2
        python3 -c 'import deep_gemm; print("deep_gemm", deep_gemm.__file__)' 2>&1 | tail -1
    fi
    python3 -m pip install -q -e . --no-deps --no-build-isolation 2>&1 | grep -v "WARNING: Running pip as" | tail -3
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
    python3 - <<'EOF' || return 4
import torch, cutlass, mla_eval_kernels
print("torch", torch.__version__, "cutlass-dsl", getattr(cutlass, "__version__", "?"), torch.cuda.get_device_name(),
      torch.cuda.get_device_capability())
EOF
}

# gpu_pytest LIMIT NAME ARGS...: pytest ARGS into $R/pytest-NAME.log, then its status (124 = timeout) and summary;
# returns pytest's status, so a step can stop after a failure
gpu_pytest() {
    local limit=$1 name=$2; shift 2
    timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rfE "$@" > "$R/pytest-$name.log" 2>&1
    local rc=$?
    echo "pytest $name rc=$rc (124 = timeout)"
    grep -E "FAILED|ERROR|passed|failed" "$R/pytest-$name.log" | grep -v "^E " | tail -30
    return $rc
}
# gpu_bench LIMIT NAME ARGS...: the kernel benchmark into $R/NAME/ (JSON) and $R/NAME.log, then its rows
gpu_bench() {
    local limit=$1 name=$2; shift 2
    timeout "$limit" python3 -m benchmarks.kernel_bench "$@" --out "$R/$name" > "$R/$name.log" 2>&1
    echo "bench $name rc=$? (124 = timeout)"
    grep -E "^GPU|dense|sparse|prefill|writer|saved|Error|error" "$R/$name.log" | tail -80
}
# gpu_ncu LIMIT NAME ARGS...: `ncu --set full` of one v3 launch of benchmarks.profile_dense ARGS, with its details
# page and SASS source page (CSV) beside the report
gpu_ncu() {
    local limit=$1 name=$2; shift 2
    command -v ncu > /dev/null || { echo "no ncu on this machine"; return 1; }
    local rep="$R/$name"
    timeout "$limit" ncu --clock-control none -k regex:MlaAttentionV3 -c 1 --set full --import-source no -o "$rep" \
        python3 -m benchmarks.profile_dense "$@" > "$rep-run.log" 2>&1
    echo "ncu $name rc=$?"; tail -2 "$rep-run.log"
    ncu -i "$rep.ncu-rep" --page details > "$rep-details.txt" 2>&1
    ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep-sass.csv" 2>&1
    grep -E "Duration|Issue Slots Busy|Eligible Warps|Executed Ipc A|DRAM Throughput|Registers Per" "$rep-details.txt" | head -10
}
# mla_eval LIMIT ARGS...: python -m mla_eval ARGS under a time limit, progress bars filtered out
mla_eval() { local limit=$1; shift; timeout "$limit" python3 -m mla_eval "$@" 2>&1 | quiet 40; echo "exit ${PIPESTATUS[0]}"; }
# needle NAME LIMIT LENGTHS FORMATS EXTRA...: the long-context needle grid on held-out prose, one JSON per call
needle() {
    local name=$1 limit=$2 lengths=$3 formats=$4; shift 4
    local tasks=${TASKS:-single:number,single:word,multikey:number}
    step "needle $name: $tasks, $lengths, bf16 + ${formats:-nothing}"
    mla_eval "$limit" needle --task "$tasks" --haystack "$LONG_TEXT" --lengths "$lengths" --depths "${DEPTHS:-0,25,50,75,100}" \
        --trials "${TRIALS:-10}" --formats "${formats:-bf16}" --scales "$SCALES" ${MODEL:+--model "$MODEL"} "$@" \
        --out "$R/needle-$name.json"
}
# multigpu helpers. mg_timed NAME N CMD...: CMD under a time limit, "NAME N seconds exit" appended to timing.tsv
mg_timed() {
    local name=$1 n=$2 s ms rc; shift 2
    s=$(date +%s%N)
    timeout "${STEP_TIMEOUT:-540}" "$@"; rc=$?
    ms=$(( ($(date +%s%N) - s) / 1000000 ))
    printf '%s\t%s\t%d.%03d\t%s\n' "$name" "$n" $((ms / 1000)) $((ms % 1000)) "$rc" >> "$R/timing.tsv"
    return $rc
}
# mg_compare ONE.json OTHER.json LABEL: every per-format metric identical, and what the other run recorded
mg_compare() {
    python3 - "$1" "$2" > "$R/compare-$3.txt" 2>&1 <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
same = a["formats"] == b["formats"]
diff = [(f, k) for f in a["formats"] for k in a["formats"][f] if a["formats"][f][k] != b["formats"].get(f, {}).get(k)]
keys = ("world_size", "device_map", "max_memory_per_gpu", "layer_devices")
print("identical" if same else f"DIFFERENT in {len(diff)} metrics, first: {diff[:5]}")
print({k: b["settings"].get(k) for k in keys})
print("seconds", a.get("seconds"), "->", b.get("seconds"))
sys.exit(0 if same else 1)
PY
    local rc=$?; echo "compare $3: $(head -1 "$R/compare-$3.txt")"; return $rc
}
# mg_memory LABEL: per-GPU memory every 2 s into memory-LABEL.txt until the caller kills $MEMPID
mg_memory() { nvidia-smi --query-gpu=index,memory.used --format=csv,noheader -l 2 > "$R/memory-$1.txt" 2>&1 & MEMPID=$!; }
# formats of a yarn step with bf16, for its time limit (about 50 s per format at 96K, 80 s at 128K)
n_formats() { echo "bf16,$1" | tr ',' '\n' | wc -l; }
KERNEL_TESTS="tests/test_kernels_gpu.py tests/test_kernels_v3_gpu.py tests/test_dispatch_backends.py"
GPU_TESTS="$KERNEL_TESTS tests/test_decode_steps_gpu.py tests/test_random_models_gpu.py tests/test_semantics_gpu.py"
V3_FORMATS=bf16,fp8_ds_mla,fp8_ds_mla_pow2,fp8_e4m3,nvfp4,nvfp4_fp8rope,nvfp4_fp8rope_st,nvfp4_fp8_ds_mla,mxfp4

run_one() {
case "$1" in
install) ;;  # done before every subcommand
kern)
    step "kernel GPU tests"
    gpu_pytest "${TEST_TIMEOUT:-550}" kernels -n 8 $KERNEL_TESTS ${KEXPR:+-k "$KEXPR"}
    ;;
tests)
    step "GPU tests: ${TESTS:-$GPU_TESTS}"
    gpu_pytest "${TEST_TIMEOUT:-550}" gpu -n 8 ${TESTS:-$GPU_TESTS} ${KEXPR:+-k "$KEXPR"}
    ;;
compile)
    step "compile_check of the h=16 kernels with the device's cuobjdump"
    local cuobj
    cuobj=$(command -v cuobjdump || python3 -c 'import triton, pathlib; print(next(pathlib.Path(triton.__file__).parent.rglob("cuobjdump")))' 2>/dev/null)
    echo "cuobjdump: ${cuobj:-none}"
    timeout 300 python3 -m tools.compile_check --formats nvfp4,bf16,fp8_ds_mla --heads 16 --versions v1,v2,v3 \
        ${cuobj:+--cuobjdump "$cuobj"} > "$R/compile_check.log" 2>&1
    echo "compile_check rc=$?"; tail -20 "$R/compile_check.log"
    ;;
bench)
    step "kernel benchmark ${BENCH_ARGS:-}"
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
    gpu_bench "${BENCH_TIMEOUT:-550}" bench ${BENCH_ARGS:-}
    ;;
ncu)
    step "ncu --set full: ${PROFILE_ARGS:---formats nvfp4}"
    # shellcheck disable=SC2086
    gpu_ncu 300 ncu-v3 ${PROFILE_ARGS:---formats nvfp4}
    ;;
revs)
    local w
    for w in ${REVS:-tests bench t32}; do
    case "$w" in
    tests)
        step "held revisions: consumer rev 2 and decode rev 2, bitwise vs rev 1 and the default kernel, vs the reference"
        gpu_pytest "${REVS_TEST_TIMEOUT:-550}" revs -n 8 tests/test_kernels_v3_gpu.py -k "(consumer or decode_rev) and not pair" \
            || { echo "revision tests failed: no bench"; return 1; } ;;
    bench)
        step "bench (b) and (d) with variants: v3 and its -c2 / -d2 / -c2-d2 rows"
        gpu_bench "${REVS_BENCH_TIMEOUT:-550}" bench-revs --shapes b,d --variants \
            --formats "${REVS_FORMATS:-nvfp4,nvfp4_fp8rope,nvfp4_fp8_ds_mla,bf16,fp8_ds_mla,mxfp4}" ;;
    t32)
        step "bench (a) and (d) at h=128: v3-t32 (rev 1) vs v3-t32-c2"
        gpu_bench "${REVS_BENCH_TIMEOUT:-550}" bench-revs-t32 --shapes a,d --variants --formats nvfp4,bf16,fp8_ds_mla ;;
    *) echo "unknown revs step $w (tests, bench, t32)"; return 2 ;;
    esac
    done
    ;;
pair)
    step "CTA pair: one launch first (nvfp4, dense h=64), 180 s limit"
    gpu_pytest 180 pair-smoke -x \
        "tests/test_kernels_v3_gpu.py::test_v3_cta_pair_matches_reference_and_the_unpaired_kernel_bitwise[nvfp4-dense h=64]" \
        || { echo "pair smoke failed: the rest of the pair step skipped"; return 1; }
    step "CTA pair: GPU tests (vs the reference, bitwise vs the unpaired kernel), compile and PTX checks"
    gpu_pytest 300 pair -n 8 -x tests/test_kernels_v3_gpu.py -k "pair" || { echo "pair tests failed: no pair bench"; return 1; }
    step "bench (a) and (d) at h=128 and h=64 with --pair"
    gpu_bench 300 bench-pair --shapes a,d --variants --pair --formats bf16,nvfp4,fp8_ds_mla,nvfp4_fp8_ds_mla
    gpu_bench 200 bench-pair-h64 --shapes a,d --variants --pair --heads 64 --formats nvfp4,fp8_ds_mla
    ;;
pairncu)
    for fmt in nvfp4 fp8_ds_mla; do
        for p in 0 1; do
            step "ncu --set full, v3 32-head tile $fmt (d) 8K, cta_pair=$p"
            gpu_ncu 200 "ncu-v3t32-pair$p-$fmt-d8k" --formats "$fmt" --heads 128 --context 8192 --cta-pair "$p"
        done
    done
    ;;
kld-kernels)
    need "$TEXT" "carry .devdata (wikitext-2 test)" || return 3
    for k in v2 v3; do
        step "kld, embedded model, kernel $k forced: ${KLD_V3_FORMATS:-$V3_FORMATS}"
        MLA_EVAL_ATTENTION_KERNEL=$k mla_eval 200 kld --text "$TEXT" --max-tokens 16384 --formats "${KLD_V3_FORMATS:-$V3_FORMATS}" \
            --no-layer-stats --prefill absorbed --out "$R/kld-default-$k.json"
    done
    ;;
forward)
    step "forward benchmark ${FORWARD_ARGS:-}"
    # shellcheck disable=SC2086
    timeout "${FORWARD_TIMEOUT:-300}" python3 -m benchmarks.forward_bench --out "$R/forward-bench.json" ${FORWARD_ARGS:-} 2>&1 \
        | grep -v USDT | tail -30
    ;;
prod)
    need "$TEXT" "carry .devdata (wikitext-2 test)" || return 3
    step "production bench"
    # shellcheck disable=SC2086
    timeout "${PRODBENCH_TIMEOUT:-300}" python3 -m benchmarks.production_bench --out "$R/production-bench.json" \
        ${PRODBENCH_ARGS:-} 2>&1 | tail -40
    ;;
eval)
    local recipe=${RECIPE:-recipes/h200-full.toml} name
    name=$(basename "$recipe" .toml)
    step "mla-eval run $recipe"
    mla_eval "${RECIPE_TIMEOUT:-420}" run "$recipe" --out "$R/$name"
    step "mla-eval report $R/$name"
    python3 -m mla_eval report "$R/$name" 2>&1 | tail -3
    ;;
formats)
    need "$TEXT" "carry .devdata (wikitext-2 test)" || return 3
    step "kld, embedded model, every format"
    local fmts
    fmts=$(python3 -c "from mla_eval.formats import format_names; print(','.join(n for n in format_names() if n != 'bf16'))")
    mla_eval 300 kld --text "$TEXT" --max-tokens 65536 --formats "$fmts" --no-layer-stats --prefill absorbed \
        --out "$R/kld-default-all-formats.json"
    for s in rope_rcp_residual sglang_fp4_residual trtllm_nvfp4_residual; do
        step "tools.measure.$s"; timeout 150 python3 -m tools.measure."$s" --out "$R/$s.json" 2>&1 | tail -12
    done
    ;;
semantics)
    need "$TEXT" "carry .devdata (wikitext-2 test)" || return 3
    local f=nvfp4,nvfp4+s_l,fp8_ds_mla w
    for w in ${SEMANTICS:-default prod qp}; do
    case "$w" in
    default)
        step "kld, embedded model: cache / engine:512 / vllm x bf16 / fp8-q, explain nvfp4"
        mla_eval 170 kld --text "$TEXT" --max-tokens 16384 --formats "$f" --no-layer-stats --prefill absorbed \
            --semantics cache,engine:512,vllm --math bf16,fp8-q --explain nvfp4 --out "$R/kld-default-semantics.json" ;;
    prod)
        step "kld, random:deepseek-v3:layers=2 (random weights): cache / engine:2048 / vllm x bf16 / fp8-q"
        mla_eval 170 kld --model random:deepseek-v3:layers=2 --text "$TEXT" --max-tokens 16384 --ctx 4096 --stride 2048 \
            --min-context 2048 --formats "$f" --no-layer-stats --prefill absorbed --semantics cache,engine:2048,vllm \
            --math bf16,fp8-q --explain nvfp4 --out "$R/kld-deepseek-v3-semantics.json" ;;
    qp)
        step "kld, embedded model: fp8-qp (torch reference on the GPU)"
        mla_eval 170 kld --text "$TEXT" --max-tokens 8192 --formats nvfp4,fp8_ds_mla --scales none --no-layer-stats \
            --prefill absorbed --semantics cache,engine:512 --math bf16,fp8-q,fp8-qp --explain nvfp4 --backend reference \
            --out "$R/kld-default-fp8qp.json" ;;
    *) echo "unknown semantics step $w (default, prod, qp)"; return 2 ;;
    esac
    done
    ;;
power)
    # issue 30's GPU steps: a needle grid with measured power (controls beside the real formats) on the embedded model
    # under GLM-5.2's latent profile, and the DSA indexer's top-k overlap per format and depth on a random GLM-5.2
    local w real=${POWER_FORMATS:-fp8_ds_mla,nvfp4,nvfp4+s_l,nvfp4_fp8rope,nvfp4_fp8rope+s_l,mxfp4}
    for w in ${POWER:-grid topk}; do
    case "$w" in
    grid)
        need "$LONG_TEXT" "build it with python -m tools.make_wiki_long and carry .devdata" || return 3
        step "needle --power, embedded model, --latent-profile glm-5.2: $real + control:*"
        mla_eval "${GRID_TIMEOUT:-560}" needle --latent-profile glm-5.2 --task "${TASKS:-single:number,multikey:number}" \
            --haystack "$LONG_TEXT" --lengths "${LENGTHS:-4K,16K,64K}" --depths "${DEPTHS:-0,25,50,75,100}" \
            --trials "${TRIALS:-6}" --formats "$real,control:*" --scales auto --power \
            --out "$R/needle-power-glm52-profile.json" ;;
    topk)
        need "$TEXT" "carry .devdata (wikitext-2 test)" || return 3
        step "kld + top-k overlap, random:glm-5.2:layers=${TOPK_LAYERS:-8} under --latent-profile glm-5.2, ctx 8192"
        mla_eval "${TOPK_TIMEOUT:-500}" kld --model "random:glm-5.2:layers=${TOPK_LAYERS:-8}" --latent-profile glm-5.2 \
            --text "$TEXT" --max-tokens "${TOPK_TOKENS:-34816}" --ctx 8192 --stride 7168 --min-context 1024 --prefill absorbed \
            --formats "$real,control:*" --scales auto --out "$R/kld-topk-random-glm52-profile.json" ;;
    *) echo "unknown power step $w (grid, topk)"; return 2 ;;
    esac
    done
    ;;
plan)
    local m rc=0
    python3 -c "
from mla_eval.formats import get_format
from mla_eval.formats.variant import Variant
from mla_eval.layer_plan import LayerPlan
v = [Variant(get_format('fp8_ds_mla')), Variant(get_format('nvfp4'), True), Variant(get_format('nvfp4_fp8_ds_mla')),
     Variant(get_format('nvfp4_fp8rope'))]
LayerPlan(tuple(v), (None, 0.01, None, None), model={'name': 'random', 'layers': 4}).save('$R/mixed4.json')
" || return 1
    for m in glm-5.2 deepseek-v3; do
        step "plan: mixed per-layer kld on random:$m:layers=4, kernels vs reference"
        mla_eval 300 kld --model "random:$m:layers=4" --formats "nvfp4,plan:$R/mixed4.json" --samples 2 \
            --sample-len 2048 --ctx 2048 --prefill absorbed --backend kernel --out "$R/plan-$m-kernel.json" --force
        mla_eval 300 kld --model "random:$m:layers=4" --formats "nvfp4,plan:$R/mixed4.json" --samples 2 \
            --sample-len 2048 --ctx 2048 --prefill absorbed --backend reference --out "$R/plan-$m-reference.json" --force
        python3 - "$R/plan-$m-kernel.json" "$R/plan-$m-reference.json" <<'PY' || rc=1
import json, sys
k, r = (json.load(open(p))["formats"] for p in sys.argv[1:3])
bad = [f for f in r if abs(k[f]["kld_mean"] - r[f]["kld_mean"]) > 0.02 * r[f]["kld_mean"] + 1e-6]
for f in r:
    print(f"{f}: kernel {k[f]['kld_mean']:.6f} reference {r[f]['kld_mean']:.6f}")
sys.exit(1 if bad else 0)
PY
    done
    return $rc
    ;;
long)
    need "$LONG_TEXT" "build it with python -m tools.make_wiki_long and carry .devdata" || return 3
    local note w grid=${GRID_FORMATS:-fp8_ds_mla,nvfp4,nvfp4+s_l,nvfp4_fp8rope,nvfp4_fp8_ds_mla,mxfp4,trtllm_nvfp4_dsa}
    local kld=${KLD_FORMATS:-fp8_ds_mla,nvfp4,nvfp4+s_l,nvfp4_fp8rope,nvfp4_fp8_ds_mla,mxfp4,trtllm_nvfp4_dsa}
    local yarn=${YARN_FORMATS:-nvfp4}
    note=$(cat "$LONG_TEXT.note" 2>/dev/null || echo "held-out Wikipedia articles concatenated (tools/make_wiki_long.py)")
    sha256sum "${MODEL:-mla_eval/default_model}/model.safetensors" | tee "$R/model-sha256.txt"
    for w in ${LONG:-grid kld64 yarn96 yarn128}; do
    case "$w" in
    calib)  # outer scales of MODEL (carry .train_data/eval): the CPU recipe of the default model's, on the GPU
        step "calibrate s_l: first 400,000 characters of the held-out articles, 32768 tokens, ctx 2048"
        python3 -c "import lzma,sys; sys.stdout.write(lzma.open('.train_data/eval/eval_docs.txt.xz','rt').read()
            .replace(chr(0), chr(10))[:400000])" > /tmp/calib_wiki.txt
        SCALES=$R/outer_scales-wikipedia-heldout.json
        mla_eval 200 calibrate --text /tmp/calib_wiki.txt --max-tokens 32768 --ctx 2048 ${MODEL:+--model "$MODEL"} \
            --out "$SCALES" --force ;;
    confirm) needle confirm 120 64K "" ;;
    grid) needle grid-short 200 4K,16K "$grid"; needle grid-64k 330 64K "$grid" ;;
    kld64)
        step "kld --ctx 65536: $kld"
        mla_eval 300 kld --text "$LONG_TEXT" --text-note "$note" --max-tokens $((65536 * 3 + 2048)) --ctx 65536 \
            --stride 65024 --min-context 512 --no-layer-stats --prefill absorbed --formats "$kld" --scales "$SCALES" \
            ${MODEL:+--model "$MODEL"} --out "$R/kld-ctx65536.json" --plot "$R/plots"
        python3 -m tools.plot_kld_depth "$R/plots/kld_by_depth_to_64k.png" "$R/kld-ctx65536.json" 2>&1 | tail -2 ;;
    yarn96) needle 96k-yarn2 $((60 + 50 * $(n_formats "$yarn"))) 96K "$yarn" --rope-scaling yarn:2 ;;
    yarn128) needle 128k-yarn2 $((60 + 80 * $(n_formats "$yarn"))) 128K "$yarn" --rope-scaling yarn:2 ;;
    *) echo "unknown long step $w (calib, confirm, grid, kld64, yarn96, yarn128)"; return 2 ;;
    esac
    done
    ;;
multigpu)
    # each step compares a multi-GPU document with the single-GPU one of the same windows: every metric identical
    local ckpt=${CKPT:-/tmp/ckpt-glm5-random} layers=${LAYERS:-16} ngpu steps w n wb cap
    local kargs=(--text "$TEXT" --max-tokens "${MAX_TOKENS:-65536}" --ctx 4096 --stride 2048 --min-context 2048
                 --formats "${FORMATS:-fp8_ds_mla,nvfp4,nvfp4_fp8rope}" --scales none --no-layer-stats --prefill absorbed)
    local nargs=(--formats nvfp4,fp8_ds_mla --scales none --lengths 16K --depths 50 --trials 2)
    need "$TEXT" "carry .devdata (wikitext-2 test)" || return 3
    ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
    echo "GPUs visible: $ngpu"; nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
    steps=${MULTIGPU:-ckpt dp devmap needle fail}
    [ -f "$ckpt/weights_bytes" ] || case " $steps " in *" ckpt "*) ;; *) steps="ckpt $steps" ;; esac  # a fresh machine
    for w in $steps; do
    case "$w" in
    ckpt)  # --device-map needs a checkpoint folder (random: specs are built on one device)
        [ -f "$ckpt/weights_bytes" ] && { echo "checkpoint $ckpt already there"; continue; }
        step "random glm-5 checkpoint, $layers layers -> $ckpt"
        timeout 300 python3 - "$ckpt" "$layers" <<'PY'
import json, shutil, sys
from pathlib import Path

import torch

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
PY
        echo "exit $?" ;;
    dp)
        step "kld 1 GPU"
        mg_memory dp-1
        mg_timed kld-dp 1 python3 -m mla_eval kld --model "$ckpt" "${kargs[@]}" --out "$R/kld-dp-1.json" 2>&1 | tail -12
        kill "$MEMPID"
        for n in 2 4 8; do
            [ "$n" -le "$ngpu" ] || continue
            step "kld torchrun --nproc-per-node $n"
            mg_memory "dp-$n"
            mg_timed kld-dp "$n" torchrun --nproc-per-node "$n" --master-port $((29500 + n)) -m mla_eval kld --model "$ckpt" \
                "${kargs[@]}" --out "$R/kld-dp-$n.json" 2>&1 | tail -12
            kill "$MEMPID"
            mg_compare "$R/kld-dp-1.json" "$R/kld-dp-$n.json" "dp-$n"
        done ;;
    devmap)  # a --max-memory cap of ~1.3/N of the weights, so the layers must spread over all N GPUs
        wb=$(cat "$ckpt/weights_bytes")
        [ -f "$R/kld-dp-1.json" ] || { step "kld 1 GPU (reference for devmap)";
            mg_timed kld-dp 1 python3 -m mla_eval kld --model "$ckpt" "${kargs[@]}" --out "$R/kld-dp-1.json" 2>&1 | tail -5; }
        for n in 2 4 8; do
            [ "$n" -le "$ngpu" ] || continue
            cap=$(( wb * 13 / 10 / n ))
            step "kld --device-map auto on $n GPUs, --max-memory $cap bytes per GPU"
            mg_memory "devmap-$n"
            mg_timed kld-devmap "$n" env CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((n - 1)))" python3 -m mla_eval kld \
                --model "$ckpt" "${kargs[@]}" --device-map auto --max-memory "$cap" --out "$R/kld-devmap-$n.json" 2>&1 | tail -12
            kill "$MEMPID"
            mg_compare "$R/kld-dp-1.json" "$R/kld-devmap-$n.json" "devmap-$n"
        done ;;
    needle)
        wb=$(cat "$ckpt/weights_bytes")
        step "needle 16K 1 GPU"
        mg_timed needle 1 python3 -m mla_eval needle --model "$ckpt" "${nargs[@]}" --out "$R/needle-1.json" 2>&1 | tail -8
        step "needle 16K --device-map auto on $ngpu GPUs"
        mg_memory "needle-$ngpu"
        mg_timed needle-devmap "$ngpu" python3 -m mla_eval needle --model "$ckpt" "${nargs[@]}" --device-map auto \
            --max-memory $(( wb * 13 / 10 / ngpu )) --out "$R/needle-devmap-$ngpu.json" 2>&1 | tail -8
        kill "$MEMPID"
        mg_compare "$R/needle-1.json" "$R/needle-devmap-$ngpu.json" "needle-devmap-$ngpu" ;;
    fail)
        # torchrun may stop rank 0 itself once rank 1 exits (rank 0 then says "interrupted by SIGTERM: no result
        # written"); otherwise rank 0's gather fails and it says "error: rank 0 of 2: gathering ... failed"
        step "failure: rank 1 dies after scoring (NCCL run, gloo gather), MLA_EVAL_DIST_TIMEOUT=60"
        mg_timed fail 2 env MLA_EVAL_DIST_TIMEOUT=60 torchrun --nproc-per-node 2 --master-port 29599 \
            tests/dist_fault_worker.py exit kld --model "$ckpt" "${kargs[@]}" --max-tokens 16384 \
            --out "$R/kld-fail.json" > "$R/fail.log" 2>&1
        echo "torchrun exit $? (expected non-zero); rank 0's line:"
        grep -E "^error:|^interrupted by" "$R/fail.log" | head -4
        if [ -e "$R/kld-fail.json" ]; then echo "FAIL: a document was written"; else echo "no document written (as required)"; fi ;;
    *) echo "unknown multigpu step $w (ckpt, dp, devmap, needle, fail)"; return 2 ;;
    esac
    done
    cat "$R/timing.tsv" 2>/dev/null
    ;;
memory)
    step "peak GPU memory per phase at production geometry: ${MEM_ARGS:-deepseek-v3.2 and glm-5, ctx 2K/4K/8K, 3 layers}"
    # shellcheck disable=SC2086  # MEM_ARGS is a list of options
    timeout "${MEM_TIMEOUT:-400}" python3 -m benchmarks.memory_bench --out "$R/memory" \
        ${MEM_ARGS:---presets deepseek-v3.2,glm-5 --ctx 2048,4096,8192 --layers 3 --budget-s 300} > "$R/memory.log" 2>&1
    echo "memory rc=$? (124 = timeout)"; grep -v -E "^ *[0-9]+%|━" "$R/memory.log" | tail -40
    ;;
moe)
    step "MoE block per preset geometry: ${MOE_ARGS:-deepseek-v3.2, kimi-k2, glm-5.2 at 2K/16K/64K tokens, every path}"
    # shellcheck disable=SC2086  # MOE_ARGS is a list of options
    timeout "${MOE_TIMEOUT:-560}" python3 -m benchmarks.moe_bench --out "$R/moe" ${MOE_ARGS:-} > "$R/moe.log" 2>&1
    echo "moe rc=$? (124 = timeout)"; grep -v -E "━|^\s*$" "$R/moe.log" | tail -60
    ;;
fp8)
    step "FP8 weight math on the GPU: DeepGEMM against the reference; KLD rows across expert paths and weight maths"
    MLA_EVAL_FP8_GEMM=deepgemm gpu_pytest "${TEST_TIMEOUT:-550}" fp8 tests/test_fp8_gpu.py tests/test_compute_paths_gpu.py \
        ${KEXPR:+-k "$KEXPR"}
    ;;
stream)
    step "layer streaming at full width: ${STREAM_ARGS:-5-layer DeepSeek-V3.2 FP8 checkpoint, ctx 8192; projections}"
    need "$TEXT" "copy ../shared/data/wikitext-2/wiki.test.raw to .devdata/" || return 3
    # shellcheck disable=SC2086  # STREAM_ARGS is a list of options
    timeout "${STREAM_TIMEOUT:-580}" python3 -m benchmarks.stream_bench --out "$R/stream" --text "$TEXT" ${STREAM_ARGS:-} \
        > "$R/stream.log" 2>&1
    echo "stream rc=$? (124 = timeout)"; grep -v -E "━|^\s*$" "$R/stream.log" | tail -60
    ;;
train-tok)
    step "copy and tokenise the training shards of ${SHARDS:-.train_data/a}"
    mkdir -p "$W/shards" && cp "${SHARDS:-.train_data/a}"/train_*.txt.xz "$W/shards/" && ls "$W/shards"
    python3 -c "
from pathlib import Path
from tools.train.trainer import TokenStore
TokenStore(['$W/shards'], Path('mla_eval/default_model/tokenizer.json'), Path('$W/tok'))" 2>&1 | tail -8
    ;;
train)
    local e=${EXPORT:-$W/export} init=()
    if [ -n "${INIT:-}" ]; then
        init=(--init "$INIT" ${INIT_STATE:+--init-state "$INIT_STATE"})
    elif [ ! -f "$W/ckpt.pt" ] && [ -f .train_data/weights/model.safetensors ]; then
        init=(--init .train_data/weights)  # a cold machine: resume from carried bf16 weights, fresh optimizer state
    fi
    # shellcheck disable=SC2206  # DATA is a list of folders
    local data=(${DATA:-$W/shards})
    step "train ${RECIPE:-recipes/train-default-model.toml} for ${TRAIN_S:?set TRAIN_S (seconds)} s from ${init[*]:-scratch or $W/ckpt.pt}"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
    mkdir -p "$W"
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=true PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python3 -m tools.train train --recipe "${RECIPE:-recipes/train-default-model.toml}" ${PROBE:+--probe} ${TINY:+--tiny} \
        --data "${data[@]}" .train_data/eval --words .train_data/eval/words.json --work "$W" "${init[@]}" \
        ${RESTART_CURRICULUM:+--restart-curriculum} --budget-s "$TRAIN_S" --export "$e" --log "$R/train_log.jsonl" 2>&1 \
        | grep -v "Writing model shards"
    echo "train rc=${PIPESTATUS[0]}"
    cp mla_eval/default_model/tokenizer.json mla_eval/default_model/tokenizer_config.json "$e/"
    [ -f mla_eval/default_model/generation_config.json ] && cp mla_eval/default_model/generation_config.json "$e/"
    # the weights come back beside the archive: each part below the size a call returns
    split -b 15M -d "$e/model.safetensors" "$OUT/model.safetensors.part"
    tar -cf "$OUT/meta.tar" -C "$e" config.json trainer_state.json
    sha256sum "$e/model.safetensors"
    ;;
train-check)
    local e=${EXPORT:-$W/export}
    step "check $e: wikitext-2 perplexity + pass key 4K/64K (recipe evaluator), latent statistics"
    HF_HUB_OFFLINE=1 timeout 150 python3 -m tools.train eval --model "$e" --wikitext .train_data/eval/wiki.test.raw \
        --haystack-docs .train_data/eval/eval_docs.txt.xz --words .train_data/eval/words.json --lengths 4096,65536 \
        --beyond "" --depths 3 --trials 2 --out "$R/quality_bf16.json" 2>&1 | grep -v "Loading weights" | tail -6
    python3 -m tools.train.latent_stats --model "$e" --text .train_data/eval/wiki.test.raw --json "$R/latent_stats.json" 2>&1 \
        | grep -v "Loading weights" | tail -12
    step "check: bf16 needle tasks 4K/16K/64K (3 depths x 4 trials)"
    python3 - <<'PY'
import lzma, pathlib
docs = lzma.open(".train_data/eval/eval_docs.txt.xz", "rt", encoding="utf-8").read().split("\x00")
pathlib.Path("/tmp/heldout.txt").write_text("\n\n".join(docs), encoding="utf-8")
PY
    mla_eval 200 needle --model "$e" --formats bf16 --task single:number,single:word,multikey:number,multivalue:number,vt \
        --haystack /tmp/heldout.txt --lengths 4K,16K,64K --depths 0,50,100 --trials 4 --out "$R/needle-tasks-check.json"
    ;;
help|-h|--help) sed -n '2,/^set -o pipefail/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; return 0 ;;
*) echo "unknown subcommand $1: bash tools/device/run.sh help"; return 2 ;;
esac
}

SUBCOMMANDS=" install kern tests compile bench ncu revs pair pairncu kld-kernels forward prod eval formats semantics long  power "
SUBCOMMANDS+="multigpu memory stream train-tok train train-check "
[ $# -gt 0 ] || { run_one help; exit 2; }
case " $* " in *" help "*|*" -h "*|*" --help "*) run_one help; exit 0 ;; esac
for cmd in "$@"; do  # every name checked before the install spends device time
    case "$SUBCOMMANDS" in *" $cmd "*) ;; *) echo "unknown subcommand $cmd: bash tools/device/run.sh help"; exit 2 ;; esac
done
step "install"
install_stack || exit $?
rc=0
for cmd in "$@"; do
    run_one "$cmd" || rc=$?
done
step "done (rc=$rc)"
exit $rc
