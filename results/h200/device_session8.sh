#!/usr/bin/env bash
# The GPU validation of session 7's CPU-only work, for the next device session (see results/h200/README.md,
# "Next device session"). After the wheel-halves call of device_setup.sh (model stashed, carry .devwheels/a):
#   call 2 (model stashed; carry .devwheels/b .devwheels/js .devdata):   bash results/h200/device_session8.sh kern bench
#   call 3 (model in place; carry .devwheels/js .devdata; machine warm):  bash results/h200/device_session8.sh model
#   kern   every kernel GPU test: the sglang_fp4_e2m1 writer and attention (record_plan.AWAITING_GPU_TESTS), the
#          per-format v3 default with V3_DEFAULT_PENDING cleared by the test, v3 without L2 prefetch, one producer
#   bench  (b) with variants for every format v3 covers (v2 vs v3 rows, the v3-pf probe) and (c) prefill-as-decode,
#          ceilings in the same run: decides V3_DEFAULT_FORMATS and whether to clear V3_DEFAULT_PENDING
#   model  the mha kld window path: its GPU agreement test, then forward_bench --parts kld (absorbed vs mha vs the
#          stock forward in one run: the issue-14 1.5x target), then decode steps under forced v3 (CUDA graphs)
#   sglang the sglang_fp4_e2m1 kernel tests again (session 8: the tests now clear AWAITING_GPU_TESTS) + its bench rows
#   agree  the mha window agreement test again with its figures printed (session 8: eps above the assumed 1e-3)
# If every test passes: delete the sglang entry of AWAITING_GPU_TESTS and set V3_DEFAULT_PENDING = None (commit with
# the logs); if the bench shows mha faster and the agreement test passes, consider DEFAULT_KLD_PREFILL = "auto".
. "$(dirname "$0")/device_setup.sh"  # log, step timer, CuTe DSL + jsonschema
mkdir -p "$OUT/runs"
for w in "$@"; do
case "$w" in
kern)
    step "kernel GPU tests (all formats, v1/v2/v3, default policy)"
    gpu_pytest 400 kernels -n 8 tests/test_kernels_gpu.py tests/test_kernels_v3_gpu.py tests/test_dispatch_backends.py
    ;;
bench)
    step "bench (b) variants + (c)"
    gpu_bench 300 bench --shapes b,c --variants \
        --formats bf16,nvfp4,nvfp4_fp8rope,nvfp4_fp8rope_st,nvfp4_fp8_ds_mla,mxfp4,fp8_ds_mla,sglang_fp4_e2m1
    ;;
model)
    step "kld mha window path vs the absorbed kernel path (GPU test)"
    gpu_pytest 200 mha-window tests/test_semantics_gpu.py -k mha_window
    step "forward_bench --parts kld"
    timeout 200 python3 -m benchmarks.forward_bench --parts kld --out "$OUT/runs/forward-bench-kld.json" 2>&1 | tail -25
    step "decode steps under v3 forced (CUDA graphs; the pending default would run v2)"
    MLA_EVAL_ATTENTION_KERNEL=v3 gpu_pytest 200 decode-steps tests/test_decode_steps_gpu.py
    ;;
sglang)
    # the first kern run failed every sglang_fp4_e2m1 test that goes through dispatch: AWAITING_GPU_TESTS refused
    # --backend kernel (the tests now clear it, fixture kernels_under_test); the direct attention tests passed
    step "sglang_fp4_e2m1 kernel GPU tests + the default policy test, AWAITING_GPU_TESTS cleared by the tests"
    gpu_pytest 400 sglang -n 8 tests/test_kernels_gpu.py tests/test_kernels_v3_gpu.py -k "sglang or scale_mode or default_policy"
    step "bench (b) sglang_fp4_e2m1 beside nvfp4 (v2 vs v3 rows)"
    # (session 8 ran this with the AWAITING_GPU_TESTS entry still in place: dispatch refused the format, the bench's
    # worker processes included; it was timed after the entry was deleted, results/kernels/*-session8-sglang.json)
    gpu_bench 200 bench-sglang --shapes b --formats nvfp4,sglang_fp4_e2m1
    ;;
agree)
    step "kld mha window path vs the absorbed kernel path, figures printed (-s)"
    gpu_pytest 200 mha-window-3 -s tests/test_semantics_gpu.py -k mha_window
    grep "mha-window agreement" "$OUT/runs/pytest-mha-window-3.log"
    ;;
*) echo "unknown step $w (kern, bench, model, sglang, agree)"; exit 2 ;;
esac
done
step "done"
