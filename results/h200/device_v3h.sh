#!/usr/bin/env bash
# GPU validation of v3 at h > 16 (session 9): sparse top-k lists and the 32-head tile (validated in session 9: `kern`),
# and the 32-head tile with two producer warpgroups and per-role registers (setmaxnreg: consumer 232, producers 136),
# a probe held by attention_tuning.V3_LAUNCHES_AWAITING_GPU_TESTS["head_tile_32_two_producers"] until `kernp2` passes.
# After device_setup's wheel calls (results/h200/README.md; carry .devwheels/b .devwheels/js), one call each:
#   bash results/h200/device_v3h.sh kernp2   then, the machine still warm:   bash results/h200/device_v3h.sh bench
#   kern     the session-9 cases of tests/test_kernels_v3_gpu.py (sparse h=16/64/128, the 32-head tile at h=32/64/128,
#            held launches, routing) and every v3 case of tests/test_kernels_gpu.py (dense and sparse, h=8..128)
#   kernp2   the two-producer cases (nvfp4, mxfp4, bf16, fp8_ds_mla; dense h=32/128, sparse h=128; 1 and 3 splits; vs
#            the reference with NaN-poisoned outputs and bit-identical to one producer), its compile checks, and the
#            32-head tile's cases beside them (the default kernel)
#   kernfull the whole v3 GPU test file
#   bench    (a) sparse decode h=128 topk 2048 batch 64/128 with --variants and (d) dense decode h=128 batch 32, 8K /
#            32K: default row (v2), v3-t16, v3-t32, v3-t32-p2 (marked v3_held while held), for bf16, nvfp4, fp8_ds_mla,
#            nvfp4_fp8_ds_mla
#   benchmore (a) and (d) at h=128 for fp8_ds_mla_pow2, fp8_e4m3 and the other E2M1 records, then at h=64 and h=32 (--heads)
#            for the four formats of `bench`: what V3_WIDE_DEFAULT may add, by measurement
#   pair     (session 11) the CTA pair, held by V3_LAUNCHES_AWAITING_GPU_TESTS["head_tile_32_cta_pair"]: its GPU tests
#            (tests/test_kernels_v3_gpu.py -k pair: vs the reference with NaN-poisoned outputs and bit-identical to the
#            unpaired two-producer kernel, nvfp4 / mxfp4 / bf16 / fp8_ds_mla / nvfp4_fp8_ds_mla x dense h=64/128 and
#            sparse h=128, 1 and 3 splits; each pair launch fails after 60 s instead of hanging, -x stops there), then
#            bench (a) and (d) at h=128 with --variants: the default row, v3-t16, v3-t32, v3-t32-p1 and v3-t32-pair
#            (marked v3_held while held) for bf16, nvfp4, fp8_ds_mla, nvfp4_fp8_ds_mla; then (a)/(d) at h=64
#   pairncu  (after pair passed) ncu --set full of one dense h=128 8K launch per format (nvfp4, fp8_ds_mla), paired and not
#   If pair passes: delete V3_LAUNCHES_AWAITING_GPU_TESTS["head_tile_32_cta_pair"] only if v3-t32-pair beats v3-t32 (an
#   unheld pair is the default of every launch v3_pair_blocker allows: h % 64 == 0 at the 32-head tile); the default
#   generation (V3_WIDE_DEFAULT: v3 vs v2) changes only where a v3 row beats the default row.
# If kernp2 passes: delete V3_LAUNCHES_AWAITING_GPU_TESTS["head_tile_32_two_producers"] (commit with the logs); make two
# producer warpgroups the 32-head tile's default (V3_WIDE_PRODUCER_WGS = 2) only where v3-t32-p2 beats v3-t32; the
# default policy (generation_for: v2 for sparse lists and h > 16) changes only where a v3 row beats the default row.
. "$(dirname "$0")/device_setup.sh"  # log, step timer, CuTe DSL + jsonschema
mkdir -p "$OUT/runs"
for w in "$@"; do
case "$w" in
kern)
    step "v3 session-9 GPU tests: sparse lists, 32-head tile"
    gpu_pytest 280 v3h -n 8 tests/test_kernels_v3_gpu.py -k "sparse or head_tile or held or environment_routes"
    step "every v3 case of the kernel GPU tests (dense and sparse, h=8..128), all-invalid rows"
    gpu_pytest 280 v3h-all -n 8 tests/test_kernels_gpu.py -k "(matches_reference and v3) or all_invalid"
    ;;
kernp2)
    step "v3 32-head tile, two producer warpgroups (setmaxnreg): GPU tests, compile checks; the 32-head tile's cases"
    gpu_pytest 300 t32p2 -n 8 tests/test_kernels_v3_gpu.py -k "two_producer or head_tile or sass_role or compile_key"
    ;;
kernfull)
    step "the whole v3 GPU test file"
    gpu_pytest 550 v3h-full -n 8 tests/test_kernels_v3_gpu.py
    ;;
bench)
    step "bench (a) variants and (d): v2, v3-t16, v3-t32, v3-t32-p2 at h=128"
    gpu_bench 550 bench-v3h --shapes a,d --variants --formats bf16,nvfp4,fp8_ds_mla,nvfp4_fp8_ds_mla
    ;;
benchmore)
    step "bench (a)/(d) at h=128 for the v3 formats session 10 did not time there, then h=64 and h=32"
    gpu_bench 300 bench-v3h-more --shapes a,d --variants --formats fp8_ds_mla_pow2,fp8_e4m3,nvfp4_fp8rope,nvfp4_fp8rope_st,mxfp4
    for h in 64 32; do
        gpu_bench 300 "bench-v3h-h$h" --shapes a,d --variants --heads "$h" --formats bf16,nvfp4,fp8_ds_mla,nvfp4_fp8_ds_mla
    done
    ;;
pair)
    # one launch first, under a short limit: a cluster-protocol deadlock leaves the GPU context stuck, and everything
    # after it in this call would wait out its own limit; the bench runs only after every pair test passed
    step "v3 CTA pair (session 11): one launch first (nvfp4, dense h=64)"
    gpu_pytest 180 pair-smoke -x "tests/test_kernels_v3_gpu.py::test_v3_cta_pair_matches_reference_and_the_unpaired_kernel_bitwise[nvfp4-dense h=64]" \
        || { echo "pair smoke failed: the rest of the pair step skipped"; continue; }
    step "v3 CTA pair: GPU tests (vs the reference, bitwise vs unpaired), its compile and PTX checks"
    gpu_pytest 300 pair -n 8 -x tests/test_kernels_v3_gpu.py -k "pair" \
        || { echo "pair tests failed: no pair bench"; continue; }
    step "bench (a) variants and (d) at h=128: default, v3-t16, v3-t32, v3-t32-p1, v3-t32-pair"
    gpu_bench 300 bench-pair --shapes a,d --variants --pair --formats bf16,nvfp4,fp8_ds_mla,nvfp4_fp8_ds_mla
    gpu_bench 200 bench-pair-h64 --shapes a,d --variants --pair --heads 64 --formats nvfp4,fp8_ds_mla
    ;;
pairncu)
    # after `pair` passed: where the pair's time goes (the MEMBAR.ALL.GPU of each cluster-scope release, the remote
    # stores), beside the unpaired kernel; dense h=128, batch 32, 8K (shape (d)), one launch each
    for fmt in nvfp4 fp8_ds_mla; do
        for p in 0 1; do
            step "ncu --set full, v3 32-head tile $fmt (d) 8K, cta_pair=$p"
            gpu_ncu 200 "ncu-v3t32-pair$p-$fmt-d8k" --formats "$fmt" --heads 128 --context 8192 --cta-pair "$p"
        done
    done
    ;;
*) echo "unknown step $w (kern, kernp2, kernfull, bench, benchmore, pair, pairncu)"; exit 2 ;;
esac
done
step "done"
