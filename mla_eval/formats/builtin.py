"""The built-in cache formats. Each is written once here; everything else reads these specs.

Byte layouts follow the public sources named in each spec's `source`. The formats that no engine
defines (nvfp4_fp8rope_st, mxfp4, fp8_e4m3) are our own choices, documented at their specs. What each
engine calls each record, per version, is `ENGINE_NAMES` (below the formats): the one table behind the
`<engine>:<name>` aliases' documentation, `mla-eval formats` and the refusal of ambiguous engine names.

A record whose bytes depend on a deployment setting is built in once per setting, the setting in its name:
- TensorRT-LLM's NVFP4 DSA cache is built in twice (below): `trtllm_nvfp4_dsa` (324 B, residual dim 0: the
  DSACacheManager V1 sizing read at 0bbb76d22e61) and `trtllm_nvfp4_dsa_r64` (360 B, residual dim 64: the rope
  stored as E2M1 plus an E2M1 residual, what GLM-5.2 gets under DSACacheManagerV2). Which one a deployment
  writes depends on the manager and its residual setting (PR 19305 ties DeepSeek-V4's to
  TRTLLM_NVFP4_MLA_RESIDUAL_QUANTIZATION, default on); where the DSA managers set it was not found in a
  stored copy, so the residual dim is named in the format rather than assumed.
- SGLang's GLM-5.2 DSA record takes a per-layer global scale g whose source was not found: built in at g = 1
  (`sglang_nvfp4_dsa`); another g is another record (register a copy of the spec).
"""

from __future__ import annotations

from mla_eval.formats.spec import (
    FLT_MIN,
    GGML_BLOCK_BYTES,
    GGML_BLOCK_VALUES,
    LATENT_DIM,
    ROPE_DIM,
    TOKEN_SCALE_DENOMINATOR,
    Engine,
    EngineName,
    Field,
    FormatSpec,
    GlobalScale,
    OuterScale,
    ScaleApply,
    ScaleOrder,
    ScaleRule,
    TokenScaleRule,
    VectorCoding,
)

# The per-layer s_l of the nvfp4_ds_mla records (432 B, and 368 B under KV_FP8_ROPE=1), as the
# local-inference-lab vLLM fork applies it, read at local-inference-lab/vllm@7e39fe0969a03377cc1aaea06a7f1511268a4fd5
# vllm/model_executor/layers/mla.py `MultiHeadLatentAttentionWrapper.forward`: `kv_c_normed /
# self._nvfp4_mla_outer_scale` on the bf16 latent only (k_pe stays unscaled), in torch, before the cache
# writer, when s_l != 1.0 (VLLM_NVFP4_MLA_SCALES_FILE, schema nvfp4_ds_mla_outer_scale_v1). On CUDA torch
# computes a bf16 tensor / Python float as bf16(float(x) * (1.0f / float(s_l)))
# (pytorch/pytorch@0f57f050df0e969d03e76495ace7ea90ba2b05d8 aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu:
# a CPU-scalar divisor becomes a multiplication by its opmath reciprocal). The CuTe readers multiply s_l back.
NVFP4_OUTER = OuterScale(required=False, denominator=TOKEN_SCALE_DENOMINATOR, bf16_result=True)

# vLLM's writer of the 656 B DeepSeek-V3.2 record. Read at this commit: tile_scale =
# fmaxf(max_abs / kFp8ScaleDivisor, FLT_MIN) with kFp8ScaleDivisor = 448 (224 only on gfx942), rope
# bf16 copied through, codes by fp8::scaled_convert, which is `__nv_cvt_float_to_fp8(float(x) / scale,
# __NV_SATFINITE, E4M3)` (csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh): a true division.
VLLM_FP8_DS_MLA = Engine(
    name="vLLM",
    repository="vllm-project/vllm",
    path="csrc/libtorch_stable/cache_kernels.cu",
    symbol="concat_and_cache_ds_mla_kernel",
    commit="37cb21c1695d11baba8e369b071d2f44c1561c8f",
    flag="--kv-cache-dtype fp8_ds_mla",
    note="codes x / scale (scaled_convert in csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh)",
)
# FlashMLA's test quantiser of the same record: scale_inv = 2^ceil(log2(clamp_min(amax / 448, 1e-4)))
# (the 1e-4 is HFAI FP8's FP8_AMAX_MARGIN), codes (x.float() / scale_inv).to(float8_e4m3fn).
FLASHMLA_FP8_POW2 = Engine(
    name="FlashMLA (tests)",
    repository="deepseek-ai/FlashMLA",
    path="tests/quant.py",
    symbol="quantize_k_cache (FP8KVCacheLayout.V32_FP8Sparse)",
    commit="520fec6a7fd98028705ccad373b7f0e3e2ae75fb",
    flag="V32_FP8Sparse",
    note="torch log2().ceil() equals the exact ceil(log2) for every bf16 input (see tests/test_engine_ports.py)",
)
# Upstream vLLM's 352 B NVFP4 record (vLLM PR 51724 with vllm-project/FlashMLA PR 18). Read at this
# commit: sf_f = fmaxf(amax / 6.0f, 2^-9); sf = __nv_fp8_e4m3(sf_f) (RN, satfinite) bumped one code up
# when float(sf) < sf_f and sf < 0x7E; inv_sf = 1.0f / sf; codes cvt.rn.satfinite.e2m1x2(x * inv_sf),
# even element in the low nibble; rope __nv_fp8_e4m3(float(x)) unscaled at [256,320); scales at
# [320,352) with block s at byte 320 + 8*(s&3) + (s>>2) (nvfp4_sf_byte). The divisions are IEEE
# (nvcc's default -prec-div); 1.0f / sf takes E4M3 values only, where rcp.approx.ftz.f32 equals the
# correctly rounded reciprocal too (mla_eval/formats/data/rcp_approx_ftz_f32.json).
# vLLM's own name for it is nvfp4_ds_mla (vllm/config/cache.py CacheDType at 002f10e0cfa1, the writer file's
# header at this commit, and FlashMLASparseBackend's "NVFP4 NoPE + FP8 RoPE (SM100 only)"); the spelling
# nvfp4_fp8_ds_mla is only PR 51724's text and release notes. Our format keeps the name nvfp4_fp8_ds_mla.
VLLM_NVFP4_FP8_DS_MLA = Engine(
    name="vLLM",
    repository="vllm-project/vllm",
    path="csrc/libtorch_stable/nvfp4_ds_mla_cache_kernels.cu",
    symbol="concat_and_cache_nvfp4_ds_mla_kernel",
    commit="03b6016490cc6603e031cda092a005f10bdc71ee",
    flag="--kv-cache-dtype nvfp4_ds_mla (DeepSeek-V3.2 geometry, SM100)",
    note="vLLM PR 51724 + vllm-project/FlashMLA PR 18; written on sm_100 (cvt e2m1x2), our writer computes the same on "
    "sm_90. vllm-project/FlashMLA PR 21 (merged 2026-09-10) rounds the tile scale to nearest instead of up; a vLLM "
    "release following it writes different scale bytes: re-check this commit before comparing with newer vLLM",
)
NVFP4_UP_FLOOR = 2.0**-9  # nvfp4_tile_scale: fmaxf(amax / max_val, 0.001953125f), the smallest E4M3 subnormal

# NVIDIA's NVFP4 quantisation recipe as vLLM ships it (read at this commit): SFValue = SFScaleVal *
# (vecMax * rcp.approx.ftz(6.0f)); E4M3 by __nv_fp8_e4m3 (RN, satfinite); outputScale = SFValue != 0 ?
# rcp.approx.ftz(SFValue * rcp.approx.ftz(SFScaleVal)) : 0; codes cvt.rn.satfinite.e2m1x2(x * outputScale).
# The local-inference-lab fork's 432 B writer (concat_and_cache_nvfp4_mla) calls it at SFScaleVal = 1.0.
VLLM_FORK_NVFP4 = Engine(
    name="vLLM fork (local-inference-lab)",
    repository="vllm-project/vllm",
    path="csrc/libtorch_stable/quantization/fp4/nvfp4_utils.cuh",
    symbol="cvt_warp_fp16_to_fp4 (SFScaleVal = 1.0)",
    commit="bde90062eb908dec6a314970a5edb554f6e8a0cc",
    flag="--kv-cache-dtype nvfp4_ds_mla (local-inference-lab/vllm, B12X_MLA_SPARSE)",
    note="record of the fork's concat_and_cache_nvfp4_mla (codes, scales, 16 B zero pad, bf16 rope copied), read in an "
    "unpinned copy; rcp.approx of E4M3 values and of 6 from the H200 table; s_l as the fork applies it before the writer: "
    "bf16(x * (1.0f / s_l)) on the latent (local-inference-lab/vllm@7e39fe0969a0 vllm/model_executor/layers/mla.py)",
)
# b12x's 368 B writer (KV_FP8_ROPE=1), read at this commit: latent as the recipe above but a group whose
# decoded scale is 0 stores 8 zero bytes; rope scale = rope_amax * f32(1/448) (a compile-time constant,
# no floor), fp32 at [288,292); rope codes cvt.rn.satfinite.e4m3x2(v * rcp.approx.ftz(scale)), all zero
# when the scale is 0. rcp.approx of that arbitrary fp32 scale cannot be tabulated: the codec uses rcp.rn,
# and kernels/measure_rope_rcp_residual.py measures how many rope codes the real instruction changes.
B12X_NVFP4_FP8ROPE = Engine(
    name="b12x (local-inference-lab)",
    repository="local-inference-lab/b12x",
    path="b12x/attention/_shared/mla/kv_cache.py",
    symbol="ConcatAndCacheNvfp4MlaFp8RopeKernel (per_token_scale=False)",
    commit="1eed7483540585e4d84b705375309766c9317db9",
    flag="--kv-cache-dtype nvfp4_ds_mla with KV_FP8_ROPE=1 (local-inference-lab/vllm)",
    note="rope codes use rcp.approx.ftz of an arbitrary fp32 (computed here with rcp.rn; residual: "
    "kernels/measure_rope_rcp_residual.py on the GPU); s_l as the vLLM fork applies it before the writer: "
    "bf16(x * (1.0f / s_l)) on the latent (local-inference-lab/vllm@7e39fe0969a0 vllm/model_executor/layers/mla.py)",
)

# b12x's same writer with per_token_scale=True (the vLLM fork serves it with VLLM_NVFP4_MLA_DYNAMIC_SCALE=1; b12x's
# "self-describing two-level NVFP4 records (per-token latent scale)", 2026-07-27), read at this commit: warp 0
# reduces the 32 group amaxes to the token amax; s_t = token_amax * f32(1/2688) (_TWO_LEVEL_RCP, a compile-time
# constant, no floor) stored fp32 at [292,296), [296,304) zero; when s_t != 0: r_t = rcp.approx.ftz(s_t), scale =
# e4m3((group_amax * r_t) * rcp.approx.ftz(6)), codes cvt.rn.satfinite.e2m1x2(x * (rcp.approx.ftz(decoded) * r_t)),
# 8 zero bytes where decoded = 0; s_t = 0 stores zero codes and scales. The rope as the static mode. Readers
# reconstruct e2m1 * e4m3_decode(scale) * s_t (the module docstring).
B12X_NVFP4_FP8ROPE_DYNAMIC = Engine(
    name="b12x (local-inference-lab)",
    repository="local-inference-lab/b12x",
    path="b12x/attention/_shared/mla/kv_cache.py",
    symbol="ConcatAndCacheNvfp4MlaFp8RopeKernel (per_token_scale=True)",
    commit="36bce2c1552ba2d47dc09f20a6f64fbfc8ec4ff8",
    flag="--kv-cache-dtype nvfp4_ds_mla with KV_FP8_ROPE=1 and VLLM_NVFP4_MLA_DYNAMIC_SCALE=1 (local-inference-lab/vllm)",
    note="rcp.approx.ftz of the arbitrary fp32 s_t and of the rope scale are taken with rcp.rn here (not tabulable; "
    "13 % of random fp32 inputs differ by one ulp on the H200, mla_eval/formats/data/rcp_approx_ftz_f32.json), so "
    "some codes may differ from the GPU's: no GPU measurement of the residual yet; s_t below 2^-126 meets the "
    "instruction's flush to zero (a token amax below 2688 * 2^-126)",
)

# SGLang's GLM-5.2 DSA NVFP4 key cache (sgl-project/sglang PR 35237, open), read in the author's branch at this
# commit: `quantize_nvfp4_k_cache_into_reference`, which the engine runs for CPU tensors and which its Triton
# writer is tested against byte for byte (the branch's test_cuda_writer_is_bit_exact_to_cpu_reference, at
# g = 1.375). Row [0,256) E2M1 (even element in the low nibble), [256,288) E4M3 block-16 scales (linear),
# [288,416) bf16 rope. Arithmetic: spec step 6 (g = the pool's per-layer fp32 global scale, outside the row).
# NaN / inf: _sanitize_nonfinite_torch (latent NaN -> +0, +-inf -> +-6*448*g) and the rope's nan_to_num (NaN -> 0,
# +-inf -> +-bf16 max). The reader (dequantize_nvfp4_k_cache_paged_reference): (e2m1 * scale) * g.
# Where the pool sets g was not found in a stored copy: the branch's tests and benchmark call the writer with
# g = 1.0 (torch.ones), 1.25 and 1.375 and a later revision reads it per layer (get_mla_kv_global_scale). We
# assume g = 1.0; another g is another record (register a copy with GlobalScale(amax=g, denominator=1.0)).
SGLANG_NVFP4_DSA = Engine(
    name="SGLang (PR 35237 branch)",
    repository="YAMY1234/sglang",
    path="python/sglang/srt/layers/attention/dsa/nvfp4_k_cache.py",
    symbol="quantize_nvfp4_k_cache_into_reference",
    commit="8f7708d81993e15e268de1bb47d11baaf5a88d1d",
    flag="--kv-cache-dtype fp4_e2m1 --fp4-kv-cache-recipe nvfp4 (GLM-5.2 DSA pool, 416 B rows)",
    note="g = 1.0 assumed (the pool's per-layer fp32 global scale; its source was not found); the Triton writer's "
    "bit-exactness to this reference is the engine's test, not measured here; the flags are those of the branch's "
    "DSA pool tests in a later revision (not read at this commit)",
)
SGLANG_DSA_GLOBAL = GlobalScale(amax=1.0, denominator=1.0, source="SGLang PR 35237 pool's per-layer g (assumed 1.0)")

# llama.cpp's MLA K cache: one 576-wide row per token, K = concat(kv_cmpr, k_pe) (latent then rope; V a view of
# the latent), read at ggml-org/llama.cpp@59b9e36f872df37454c1a01a5dd4ea69ede65832 src/models/deepseek2.cpp, quantised
# with the -ctk block type by ggml's reference quantisers (mla_eval/formats/ggml.py has the arithmetic and which
# writers differ). A row of 18 blocks; llama.cpp sizes the cache by ggml_row_size(type_k, 576) and keeps no V cache
# for MLA, so the record is the whole per-token cost.
# Which of ggml's writers give these bytes, per type (ggml.py has the arithmetic).
_GGML_CUDA = ("ggml-cuda's set_rows (ggml/src/ggml-cuda/cpy-utils.cuh quantize_f32_{kind}_block) states the same "
              "arithmetic but is built with -use_fast_math (ggml/src/ggml-cuda/CMakeLists.txt): its divisions are "
              "approximate, so its bytes can differ")
_GGML_WRITERS = {
    "q8_0": "the reference quantiser (the CPU backend's generic path); the x86 AVX/AVX2 writer "
    "(ggml/src/ggml-cpu/arch/x86/quants.c quantize_row_q8_0) takes id = 127 / amax and rounds half to even, ARM "
    "NEON (vcvtnq_s32_f32) rounds half to even: those bytes can differ; " + _GGML_CUDA.format(kind="q8_0"),
    "q4_0": "the reference quantiser, which the CPU backend calls on every architecture (ggml/src/ggml-cpu/quants.c "
    "quantize_row_q4_0); " + _GGML_CUDA.format(kind="q4_0"),
    "q5_1": "the reference quantiser, which the CPU backend calls on every architecture (ggml/src/ggml-cpu/quants.c "
    "quantize_row_q5_1); " + _GGML_CUDA.format(kind="q5_1"),
}


def _ggml_engine(kind: str) -> Engine:
    return Engine(
        name="llama.cpp (ggml)",
        repository="ggml-org/llama.cpp",
        path="ggml/src/ggml-quants.c",
        symbol=f"quantize_row_{kind}_ref (CPU set_rows of the MLA K row)",
        commit="36491e4024b3016e6e2d21afc140add042b44bec",
        flag=f"-ctk {kind} (MLA: one K row of 512 + 64, V a view of K)",
        note=_GGML_WRITERS[kind] + "; llama.cpp's attention also quantises Q for its dot products (not modelled)",
    )


def _ggml_format(kind: str, title: str, description: str) -> FormatSpec:
    blocks_lat, blocks_rope = LATENT_DIM // GGML_BLOCK_VALUES, ROPE_DIM // GGML_BLOCK_VALUES
    block_bytes = GGML_BLOCK_BYTES[kind]
    return FormatSpec(
        name=f"llamacpp_{kind}",
        title=title,
        description=description,
        source="llama.cpp MLA K cache (-ctk): ggml blocks of 32 over the 576-wide latent+rope row",
        record_bytes=(blocks_lat + blocks_rope) * block_bytes,
        latent=VectorCoding(LATENT_DIM, kind, Field("latent", 0, kind, blocks_lat), ScaleRule.GGML_BLOCK,
                            GGML_BLOCK_VALUES),
        rope=VectorCoding(ROPE_DIM, kind, Field("rope", blocks_lat * block_bytes, kind, blocks_rope),
                          ScaleRule.GGML_BLOCK, GGML_BLOCK_VALUES),
        align=2,
        engine=_ggml_engine(kind),
        aliases=(f"llama.cpp:{kind}",),
    )


# SGLang's FP4 KV cache for MLA (--kv-cache-dtype fp4_e2m1), read at this commit: MLATokenToKVPoolFP4
# keeps per token a packed buffer of the 576 values (kv_lora_rank + rope, 288 B) and a separate scale
# buffer (576 / 16 = 36 B); KVFP4QuantizeUtil.batched_quantize per 16 values: scale_exp =
# ceil(log2(clamp(block_max / 6, min=1e-10))), byte scale_exp + 127, codes of x / 2^scale_exp by
# counting the bounds |x| >= (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) (ties away from zero), sign x < 0,
# even element in the low nibble. The function is @torch.compile'd: on a GPU its division and log2 are
# Triton's; kernels/measure_sglang_fp4_residual.py compares it there with this codec.
SGLANG_FP4_E2M1 = Engine(
    name="SGLang",
    repository="sgl-project/sglang",
    path="python/sglang/srt/layers/quantization/kvfp4_tensor.py",
    symbol="KVFP4QuantizeUtil.batched_quantize (MLATokenToKVPoolFP4, memory_pool.py)",
    commit="0e6b6cf0ac719aca12987b393d17e8caaabcaa87",
    flag="--kv-cache-dtype fp4_e2m1",
    note="two buffers per token (kv_buffer 288 B, kv_scale_buffer 36 B); exact division and log2 here, the engine's "
    "compiled ones on the GPU are compared by kernels/measure_sglang_fp4_residual.py",
)
SGLANG_FP4_FLOOR = 1e-10  # torch.clamp(block_max / E2M1_MAX, min=1e-10)


def _sglang_fp4(dim: int, data_offset: int, scale_offset: int, name: str) -> VectorCoding:
    return VectorCoding(
        dim,
        "e2m1",
        Field(name, data_offset, "e2m1", dim),
        ScaleRule.E8M0_CEIL,
        16,
        Field(f"{name}_scale", scale_offset, "e8m0", dim // 16),
        apply=ScaleApply.DIV,
        scale_floor=SGLANG_FP4_FLOOR,
        elem_rounding="ties_away",
    )


# TensorRT-LLM's NVFP4 KV cache for DSA models (DeepSeek-V3.2 / GLM-5 sparse MLA).
# Writer, read at NVIDIA/TensorRT-LLM@727f68b662aad70d1cbe8e9d4292499824183dfc cpp/tensorrt_llm/kernels/mlaKernels.cu:
# `applyMLARopeAppendPagedKVAssignQKernel` (the DSA context and generation appends both use it) rotates the
# rope in bf16 and hands each 8-value vector v of the 576 (latent vecs 0..63, rope 64..71) to
# `quantizeAndWriteMlaFp4`; with a 288 B data / 36 B scale pool stride (no residual) that is
# `cvt_warp_fp16_to_fp4<T, 16, false>(values, quant_scale_kv, scaleOut)`: 4 bytes of E2M1 at data byte 4v of
# the token (even element in the low nibble), and for even v one E4M3 byte at scale byte v/2 (linear, no
# swizzle).
# Recipe, read in cpp/tensorrt_llm/kernels/quantization.cuh at NVIDIA/TensorRT-LLM@2a0ce833a998456f870104c1923815b03c5f87c9
# (the file is not stored at the writer's commit; the other TensorRT-LLM NVFP4 writers read, cvt_warp_fp16_to_fp4_impl_opt
# in fp4QuantizeAdaptive and PR 17985's MiniMax-M3 kernel, test amax != 0 alike): vecMax = max |x| over 16 bf16
# values; SFValue = SFScaleVal * (vecMax * rcp.approx.ftz(6)); E4M3 by __nv_fp8_e4m3 (RN, satfinite);
# outputScale = vecMax != 0 ? rcp.approx.ftz(SFValue_decoded * rcp.approx.ftz(SFScaleVal)) : 0 (vecMax, not
# SFValue as in vLLM's copy); codes cvt.rn.satfinite.e2m1x2.f32(x * outputScale).
# Global scale, read at NVIDIA/TensorRT-LLM@29c0516aff38c6a2bfd1429d847db2b746e808be
# tensorrt_llm/_torch/attention/backends/sparse/dsa/backend.py `DSATrtllmAttention.__init__`: amax =
# float(env TRTLLM_NVFP4_MLA_KV_CACHE_AMAX, default 100.0), dequant = amax / (448 * 6), quant = 1 / dequant,
# both torch.full_like of the float32 kv_cache_scaling_factor, the same for every layer (no calibration);
# quant is the writer's SFScaleVal (`mla_rope_append_paged_kv_assign_q`), dequant goes to the reader.
# Reader (cpp/tensorrt_llm/kernels/nvfp4MlaKvCacheGather.cu `dequantizeRow`, at the writer's commit): the
# selected tokens gathered as e4m3(q * (float(scale) * dequant)) into an fp8 scratch that the sparse FMHA reads.
TRTLLM_NVFP4_DSA = Engine(
    name="TensorRT-LLM",
    repository="NVIDIA/TensorRT-LLM",
    path="cpp/tensorrt_llm/kernels/mlaKernels.cu",
    symbol="applyMLARopeAppendPagedKVAssignQKernel -> quantizeAndWriteMlaFp4 -> cvt_warp_fp16_to_fp4",
    commit="727f68b662aad70d1cbe8e9d4292499824183dfc",
    flag="kv_cache_config dtype nvfp4 (DataType.NVFP4, DSACacheManager)",
    note="two pools per token (data + block scales: 288 + 36 B, or 320 + 40 B at residual dim 64, whose rope needs only "
    "tabulated reciprocals); global scale from TRTLLM_NVFP4_MLA_KV_CACHE_AMAX "
    "(default 100: quant = 26.88, dequant = 100/2688) for every layer; its rcp.approx of the arbitrary fp32 values "
    "SFScaleVal and SFValue * rcp(SFScaleVal) are taken with rcp.rn here (residual: kernels/"
    "measure_trtllm_nvfp4_residual.py on the GPU); the attention reads an E4M3 copy of the decoded values",
)
# The engine's default TRTLLM_NVFP4_MLA_KV_CACHE_AMAX. Another value is another record: register a copy of
# the spec with GlobalScale(amax=...) (mla_eval.formats.register_format).
TRTLLM_NVFP4_DEFAULT_AMAX = 100.0
TRTLLM_NVFP4_GLOBAL = GlobalScale(
    amax=TRTLLM_NVFP4_DEFAULT_AMAX, source="TRTLLM_NVFP4_MLA_KV_CACHE_AMAX (TensorRT-LLM default 100.0)"
)


def _trtllm_nvfp4(dim: int, data_offset: int, scale_offset: int, name: str) -> VectorCoding:
    return VectorCoding(
        dim,
        "e2m1",
        Field(name, data_offset, "e2m1", dim),
        ScaleRule.AMAX_E4M3_RCP6,
        16,
        Field(f"{name}_scale", scale_offset, "e4m3", dim // 16),
        apply=ScaleApply.MUL_RCP_APPROX,
        global_scale=TRTLLM_NVFP4_GLOBAL,
        zero_scale_saturates=True,
    )


# The residual layout (the cache manager's mla_kv_cache_residual_dim = 64: data 320 B, scales 40 B per token), read in
# mlaKernels.cu `quantizeAndWriteMlaFp4` / `quantizeAndWriteMlaFp4Residual` at the writer's commit: latent vecs as
# above; each 16-value rope group g: input = float(x) * SFScaleVal, main scale e4m3(fmaxf(max|input| * rcp.approx(6),
# 2^-9)), codes e2m1(input * rcp.approx(decoded)), residual = input - code * decoded, its scale and codes the same way;
# data bytes [256 + 16g, +8) main and [+8, +16) residual codes, scale bytes 320 + 32 + 2g (main) and + 1 (residual).
# GLM-5.2 under DSACacheManagerV2 gets this layout: NVIDIA/TensorRT-LLM's unit test test_glm52_nvfp4_page_table_geometry
# (GLM-5.2 NVFP4 KV-transfer coverage; read by content, its path and commit not resolved in the index) asserts
# mla_kv_cache_residual_dim == qk_rope_head_dim and key / key_block_scale regions of (576 + 64) / 2 and / 16 B per token.
TRTLLM_RESIDUAL_FLOOR = 2.0**-9  # quantizeAndWriteMlaFp4Residual's kMinFp4Scale = 0.001953125F


def _trtllm_residual_rope(data_offset: int, scale_offset: int) -> VectorCoding:
    return VectorCoding(
        ROPE_DIM,
        "e2m1",
        Field("rope", data_offset, "e2m1", 2 * ROPE_DIM),  # main and residual codes, interleaved per group
        ScaleRule.AMAX_E4M3_RCP6,
        16,
        Field("rope_scale", scale_offset, "e4m3", 2 * ROPE_DIM // 16),
        apply=ScaleApply.MUL_RCP_APPROX,
        scale_floor=TRTLLM_RESIDUAL_FLOOR,
        global_scale=TRTLLM_NVFP4_GLOBAL,
        residual=True,
    )


FLASHMLA_POW2_FLOOR = 1e-4  # FlashMLA tests/quant.py _cast_scale_inv_to_ue8m0: clamp_min(scale_inv, 1e-4)


def _bf16_rope(offset: int) -> VectorCoding:
    return VectorCoding(ROPE_DIM, "bf16", Field("rope", offset, "bf16", ROPE_DIM), ScaleRule.NONE, ROPE_DIM)


def _bf16_latent() -> VectorCoding:
    return VectorCoding(LATENT_DIM, "bf16", Field("latent", 0, "bf16", LATENT_DIM), ScaleRule.NONE, LATENT_DIM)


def _b12x_fp8_rope() -> VectorCoding:
    """b12x's E4M3 rope of its 368 B records: one fp32 scale (amax/448) at [288,292), codes at [304,368), the
    hardware reciprocal applied, a zero scale clearing the codes."""
    return VectorCoding(ROPE_DIM, "e4m3", Field("rope", 304, "e4m3", ROPE_DIM), ScaleRule.AMAX_FP32_MUL, ROPE_DIM,
                        Field("rope_scale", 288, "fp32", 1), apply=ScaleApply.MUL_RCP_APPROX, zero_scale_clears=True)


def _nvfp4_latent(
    rule: ScaleRule = ScaleRule.AMAX_E4M3, apply: ScaleApply = ScaleApply.MUL_RCP, clears: bool = False
) -> VectorCoding:
    # [0,256) packed E2M1, [256,288) one E4M3 scale per 16 values.
    return VectorCoding(
        LATENT_DIM,
        "e2m1",
        Field("latent", 0, "e2m1", LATENT_DIM),
        rule,
        16,
        Field("latent_scale", 256, "e4m3", LATENT_DIM // 16),
        apply=apply,
        zero_scale_clears=clears,
    )


def _fp8_ds_mla(
    name: str, rule: ScaleRule, title: str, description: str, source: str, engine: Engine, floor: float, alias: str
) -> FormatSpec:
    return FormatSpec(
        name=name,
        title=title,
        description=description,
        source=source,
        record_bytes=656,
        latent=VectorCoding(
            LATENT_DIM,
            "e4m3",
            Field("latent", 0, "e4m3", LATENT_DIM),
            rule,
            128,
            Field("latent_scale", 512, "fp32", LATENT_DIM // 128),
            apply=ScaleApply.DIV,
            scale_floor=floor,
        ),
        rope=_bf16_rope(528),
        engine=engine,
        aliases=(alias,),
    )


BUILTIN_FORMATS: tuple[FormatSpec, ...] = (
    FormatSpec(
        name="bf16",
        title="bf16",
        description="Uncompressed reference: 512 bf16 latent + 64 bf16 rope.",
        source="DeepSeek-V3 MLA cache (FlashMLA / vLLM bf16 MLA cache)",
        record_bytes=1152,
        latent=_bf16_latent(),
        rope=_bf16_rope(1024),
    ),
    _fp8_ds_mla(
        "fp8_ds_mla",
        ScaleRule.AMAX_FP32,
        "fp8_ds_mla",
        "E4M3 latent with one raw fp32 scale max(amax/448, FLT_MIN) per 128 values, codes x / scale; bf16 rope.",
        "vLLM fp8_ds_mla cache layout (DeepSeek-V3.2 sparse MLA)",
        VLLM_FP8_DS_MLA,
        FLT_MIN,
        "vllm:fp8_ds_mla",
    ),
    _fp8_ds_mla(
        "fp8_ds_mla_pow2",
        ScaleRule.AMAX_FP32_POW2,
        "fp8_ds_mla (pow2 scales)",
        "fp8_ds_mla with each scale max(amax/448, 1e-4) rounded up to a power of two (FlashMLA's test quantiser).",
        "FlashMLA sparse decode tests (quantize_k_cache: power-of-two scales)",
        FLASHMLA_FP8_POW2,
        FLASHMLA_POW2_FLOOR,
        "flashmla:V32_FP8Sparse",
    ),
    FormatSpec(
        name="nvfp4",
        title="nvfp4",
        description="E2M1 latent, one E4M3 scale e4m3(amax*rcp(6)) per 16 values (NVIDIA recipe); bf16 rope; optional s_l.",
        source="NVFP4 MLA cache: 256 B E2M1 + 32 B E4M3 scales + 16 B pad + 128 B bf16 rope",
        record_bytes=432,
        latent=_nvfp4_latent(ScaleRule.AMAX_E4M3_RCP6, ScaleApply.MUL_RCP_APPROX),
        rope=_bf16_rope(304),
        pads=(Field("pad", 288, "pad", 16),),
        outer_scale=NVFP4_OUTER,
        engine=VLLM_FORK_NVFP4,
        aliases=("vllm-fork:nvfp4_ds_mla",),
    ),
    FormatSpec(
        name="nvfp4_fp8rope",
        title="nvfp4 + fp8 rope",
        description="nvfp4 latent; rope as E4M3 with one fp32 scale (amax/448); optional s_l.",
        source="NVFP4 MLA cache with fp8 rope: 368 B",
        record_bytes=368,
        latent=_nvfp4_latent(ScaleRule.AMAX_E4M3_RCP6, ScaleApply.MUL_RCP_APPROX, clears=True),
        rope=_b12x_fp8_rope(),
        pads=(Field("pad", 292, "pad", 12),),
        outer_scale=NVFP4_OUTER,
        engine=B12X_NVFP4_FP8ROPE,
        aliases=("vllm-fork:nvfp4_ds_mla:KV_FP8_ROPE=1",),
    ),
    # Ours (engine=None): the arithmetic is mla-eval's, on the byte map of b12x's per_token_scale=True record
    # (local-inference-lab/b12x@36bce2c1552ba2d47dc09f20a6f64fbfc8ec4ff8 b12x/attention/_shared/mla/kv_cache.py,
    # VLLM_NVFP4_MLA_DYNAMIC_SCALE=1 in the vLLM fork). It exists to measure what a per-token second-level scale
    # buys over the static layout without a calibration file, with every step exactly reproducible on CPU. b12x's
    # writer differs: s_t = token_amax * f32(1/2688) (no floor, 0 for an all-zero token), group scale
    # e4m3((group_amax * rcp.approx(s_t)) * rcp.approx(6)), codes x * (rcp.approx(decoded) * rcp.approx(s_t)),
    # fp32 rope as nvfp4_fp8rope. rcp.approx of the arbitrary fp32 s_t cannot be tabulated, so an engine-exact
    # CPU codec of that mode would carry a measured residual, like nvfp4_fp8rope's rope.
    FormatSpec(
        name="nvfp4_fp8rope_st",
        title="nvfp4 two-level (s_t)",
        description="nvfp4_fp8rope layout plus a per-token fp32 scale s_t = amax/(6*448); block scales relative to s_t. "
        "mla-eval's own arithmetic, not an engine's (b12x's per_token_scale mode uses rcp.approx and other products).",
        source="mla-eval's two-level NVFP4 on the byte map of b12x's per_token_scale record (368 B, s_t at [292,296)); "
        "no engine writes these exact bytes",
        record_bytes=368,
        latent=_nvfp4_latent(),
        rope=VectorCoding(
            ROPE_DIM,
            "e4m3",
            Field("rope", 304, "e4m3", ROPE_DIM),
            ScaleRule.AMAX_FP32,
            ROPE_DIM,
            Field("rope_scale", 288, "fp32", 1),
        ),
        token_scale=Field("token_scale", 292, "fp32", 1),
        pads=(Field("pad", 296, "pad", 8),),
    ),
    FormatSpec(
        name="nvfp4_fp8_ds_mla",
        title="nvfp4 + fp8 rope (vLLM, 352 B)",
        description="E2M1 latent, E4M3 block scale per 16 rounded up (floor 2^-9), permuted; unscaled E4M3 rope.",
        source="upstream vLLM --kv-cache-dtype nvfp4_ds_mla (PR 51724) / vllm-project/FlashMLA PR 18",
        record_bytes=352,
        latent=VectorCoding(
            LATENT_DIM,
            "e2m1",
            Field("latent", 0, "e2m1", LATENT_DIM),
            ScaleRule.AMAX_E4M3_UP,
            16,
            Field("latent_scale", 320, "e4m3", LATENT_DIM // 16),
            scale_floor=NVFP4_UP_FLOOR,
            scale_order=ScaleOrder.TRANSPOSE_8X4,
        ),
        rope=VectorCoding(ROPE_DIM, "e4m3", Field("rope", 256, "e4m3", ROPE_DIM), ScaleRule.TENSOR, ROPE_DIM),
        engine=VLLM_NVFP4_FP8_DS_MLA,
        aliases=("vllm:nvfp4_ds_mla",),
    ),
    FormatSpec(
        name="sglang_fp4_e2m1",
        title="fp4_e2m1 (SGLang, 324 B)",
        description="All 576 values E2M1 with a power-of-two E8M0 scale per 16 (ceil, ties away); data and scales "
        "in two buffers.",
        source="SGLang --kv-cache-dtype fp4_e2m1 for MLA (PR 10078): MLATokenToKVPoolFP4 + KVFP4QuantizeUtil",
        record_bytes=324,
        latent=_sglang_fp4(LATENT_DIM, 0, 288, "latent"),
        rope=_sglang_fp4(ROPE_DIM, 256, 320, "rope"),
        align=4,
        engine=SGLANG_FP4_E2M1,
        aliases=("sglang:fp4_e2m1",),
        buffers=(("kv_buffer", 0, 288), ("kv_scale_buffer", 288, 324)),
    ),
    FormatSpec(
        name="trtllm_nvfp4_dsa",
        title="nvfp4 DSA (TensorRT-LLM, 324 B)",
        description="All 576 values E2M1, E4M3 scale e4m3(S*amax*rcp(6)) per 16 with global scale S = 2688/amax_env "
        "(default 26.88); residual dim 0; data and scales in two pools; read back as E4M3.",
        source="TensorRT-LLM NVFP4 KV cache for DSA (DSACacheManager, DataType.NVFP4): mlaKernels.cu + quantization.cuh",
        record_bytes=324,
        latent=_trtllm_nvfp4(LATENT_DIM, 0, 288, "latent"),
        rope=_trtllm_nvfp4(ROPE_DIM, 256, 320, "rope"),
        align=4,
        engine=TRTLLM_NVFP4_DSA,
        aliases=("trtllm:nvfp4",),
        buffers=(("kv_pool", 0, 288), ("block_scale_pool", 288, 324)),
        reader_e4m3=True,
    ),
    FormatSpec(
        name="trtllm_nvfp4_dsa_r64",
        title="nvfp4 DSA + residual rope (TensorRT-LLM, 360 B)",
        description="trtllm_nvfp4_dsa's latent; the rope as E2M1 plus an E2M1 residual pass, E4M3 scales floored at "
        "2^-9 (values pre-scaled by S); two pools; read back as E4M3.",
        source="TensorRT-LLM NVFP4 KV cache for DSA with mla_kv_cache_residual_dim = 64 (GLM-5.2 under DSACacheManagerV2)",
        record_bytes=360,
        latent=_trtllm_nvfp4(LATENT_DIM, 0, 320, "latent"),
        rope=_trtllm_residual_rope(256, 352),
        align=4,
        engine=TRTLLM_NVFP4_DSA,
        aliases=("trtllm:nvfp4:residual_dim=64",),
        buffers=(("kv_pool", 0, 320), ("block_scale_pool", 320, 360)),
        reader_e4m3=True,
    ),
    # Our choice: OCP MX v1.0 MXFP4 (E2M1, one E8M0 scale per 32 values). 256 B of codes, 16 B of
    # scales, 16 B of zero padding so the bf16 rope starts 16-byte aligned at 288; 416 B in all.
    FormatSpec(
        name="mxfp4",
        title="mxfp4 (OCP MX)",
        description="E2M1 latent, one E8M0 power-of-two scale per 32 values (OCP MX rule); bf16 rope.",
        source="OCP Microscaling Formats (MX) v1.0; record layout chosen by mla-eval",
        record_bytes=416,
        latent=VectorCoding(
            LATENT_DIM,
            "e2m1",
            Field("latent", 0, "e2m1", LATENT_DIM),
            ScaleRule.OCP_E8M0,
            32,
            Field("latent_scale", 256, "e8m0", LATENT_DIM // 32),
        ),
        rope=_bf16_rope(288),
        pads=(Field("pad", 272, "pad", 16),),
    ),
    # Our choice: the plain per-tensor fp8 KV cache of serving engines (one scale per layer, default
    # 1.0 as vLLM's kv-cache scale), applied to all 576 values.
    FormatSpec(
        name="fp8_e4m3",
        title="fp8_e4m3 (per-tensor)",
        description="All 576 values as E4M3 with one per-layer scale (default 1.0).",
        source="vLLM fp8 KV cache (kv_cache_dtype=fp8_e4m3, per-tensor k_scale)",
        record_bytes=576,
        latent=VectorCoding(LATENT_DIM, "e4m3", Field("latent", 0, "e4m3", LATENT_DIM), ScaleRule.TENSOR, LATENT_DIM),
        rope=VectorCoding(ROPE_DIM, "e4m3", Field("rope", 512, "e4m3", ROPE_DIM), ScaleRule.TENSOR, ROPE_DIM),
        outer_scale=OuterScale(required=False, denominator=448.0, applies_to_rope=True),
    ),
    FormatSpec(
        name="nvfp4_fp8rope_dyn",
        title="nvfp4 + fp8 rope, per-token scale (b12x, 368 B)",
        description="b12x's two-level record: s_t = amax * f32(1/2688) per token, block scales e4m3((amax_g / s_t) * "
        "rcp(6)), codes x * (rcp(s) / s_t); E4M3 rope as nvfp4_fp8rope.",
        source="b12x per_token_scale writer (vLLM fork VLLM_NVFP4_MLA_DYNAMIC_SCALE=1), 368 B, s_t at [292,296)",
        record_bytes=368,
        latent=_nvfp4_latent(ScaleRule.AMAX_E4M3_RCP6, ScaleApply.MUL_RCP_APPROX, clears=True),
        rope=_b12x_fp8_rope(),
        token_scale=Field("token_scale", 292, "fp32", 1),
        pads=(Field("pad", 296, "pad", 8),),
        engine=B12X_NVFP4_FP8ROPE_DYNAMIC,
        aliases=("vllm-fork:nvfp4_ds_mla:KV_FP8_ROPE=1:VLLM_NVFP4_MLA_DYNAMIC_SCALE=1",),
        token_scale_rule=TokenScaleRule.MUL_FOLDED,
    ),
    FormatSpec(
        name="sglang_nvfp4_dsa",
        title="nvfp4 DSA (SGLang GLM-5.2, 416 B)",
        description="E2M1 latent, E4M3 scale clamp(amax/(6g),0,448) per 16 (g = 1), codes by f32 midpoint "
        "comparisons (RNE, no reciprocal); bf16 rope.",
        source="SGLang PR 35237: GLM-5.2 DSA NVFP4 key cache (nvfp4_k_cache.py, 416 B rows)",
        record_bytes=416,
        latent=VectorCoding(
            LATENT_DIM,
            "e2m1",
            Field("latent", 0, "e2m1", LATENT_DIM),
            ScaleRule.AMAX_E4M3_DIV6G,
            16,
            Field("latent_scale", 256, "e4m3", LATENT_DIM // 16),
            elem_rounding="midpoints",
            global_scale=SGLANG_DSA_GLOBAL,
        ),
        rope=_bf16_rope(288),
        engine=SGLANG_NVFP4_DSA,
        aliases=("sglang:fp4_e2m1:fp4_kv_cache_recipe=nvfp4",),
        nonfinite="nan_zero_inf_saturate",
    ),
    _ggml_format("q8_0", "q8_0 (llama.cpp, 612 B)",
                 "ggml q8_0 over the 576-wide K row: per 32 values an fp16 scale amax/127 and 32 int8 roundf codes."),
    _ggml_format("q4_0", "q4_0 (llama.cpp, 324 B)",
                 "ggml q4_0 over the 576-wide K row: per 32 values an fp16 scale max/-8 and 32 4-bit codes."),
    _ggml_format("q5_1", "q5_1 (llama.cpp, 432 B)",
                 "ggml q5_1 over the 576-wide K row: per 32 values fp16 scale (max-min)/31 and minimum, 5-bit codes."),
)

# What engines call cache records, per engine and version (EngineName). A bare name listed here with more than one
# record is refused with the candidates (registry.get_format); `format` None marks a record known but not built in.
_VLLM_CACHE = "vllm-project/vllm@002f10e0cfa1 vllm/config/cache.py CacheDType"
_FORK = "local-inference-lab/vllm, B12X_MLA_SPARSE"
ENGINE_NAMES: tuple[EngineName, ...] = (
    EngineName("vLLM", "fp8_ds_mla", "DeepSeek-V3.2 geometry; " + _VLLM_CACHE, 656, "fp8_ds_mla"),
    EngineName("vLLM", "nvfp4_ds_mla", "PR 51724, DeepSeek-V3.2 geometry, SM100; " + _VLLM_CACHE, 352,
               "nvfp4_fp8_ds_mla"),
    EngineName("vLLM fork", "nvfp4_ds_mla", f"{_FORK}, PR 82", 432, "nvfp4"),
    EngineName("vLLM fork", "nvfp4_ds_mla", f"{_FORK}, KV_FP8_ROPE=1", 368, "nvfp4_fp8rope"),
    EngineName("vLLM fork", "nvfp4_ds_mla", f"{_FORK}, KV_FP8_ROPE=1 VLLM_NVFP4_MLA_DYNAMIC_SCALE=1", 368,
               "nvfp4_fp8rope_dyn"),
    EngineName("b12x / vLLM fork", "nvfp4_ds_mla", "b12x PR 266 GLM_NEXT (GLM-5.3-Flash), vLLM fork PR 549", 304, None,
               "rope-less record (256 B E2M1 + 32 E4M3 + 4 zero + fp32 s_t + 8 pad), no 64-d rope to store"),
    EngineName("FlashMLA (tests)", "V32_FP8Sparse", "deepseek-ai/FlashMLA tests/quant.py", 656, "fp8_ds_mla_pow2"),
    EngineName("SGLang", "fp4_e2m1", "sgl-project/sglang@0e6b6cf0ac71 MLATokenToKVPoolFP4", 324, "sglang_fp4_e2m1"),
    EngineName("SGLang", "fp4_e2m1", "PR 35237 branch (YAMY1234/sglang@8f7708d81993), GLM-5.2 DSA, "
               "--fp4-kv-cache-recipe nvfp4", 416, "sglang_nvfp4_dsa"),
    EngineName("TensorRT-LLM", "nvfp4", "DSACacheManager, residual dim 0", 324, "trtllm_nvfp4_dsa"),
    EngineName("TensorRT-LLM", "nvfp4", "DSACacheManagerV2, residual dim 64 (GLM-5.2)", 360, "trtllm_nvfp4_dsa_r64"),
    EngineName("llama.cpp", "q8_0", "-ctk q8_0, MLA K row of 576", 612, "llamacpp_q8_0"),
    EngineName("llama.cpp", "q4_0", "-ctk q4_0, MLA K row of 576", 324, "llamacpp_q4_0"),
    EngineName("llama.cpp", "q5_1", "-ctk q5_1, MLA K row of 576", 432, "llamacpp_q5_1"),
    EngineName("llama.cpp", "iq4_nl", "-ctk iq4_nl, MLA K row of 576", 324, None,
               "its CPU quantiser searches 7 scales per block and the CUDA one takes one weighted pass (not ported)"),
    EngineName("vLLM fork", "kvarn_mla_k5_g64", "local-inference-lab/vllm PR 424, b12x kvarn_mla reader", 482, None,
               "64-token tiles (per-channel fp16 scale and zero point, per-token scale) need a tile codec"),
)

# Known records outside the per-token codec, for `mla-eval formats --help` (DeepSeek-V4's: formats/v4.py V4_NOT_BUILT).
KNOWN_NOT_BUILT_IN: tuple[str, ...] = (
    "GLM-5.3-Flash's rope-less records (b12x GLM_NEXT: 304 B NVFP4, 528 B fp8): no rope to store",
    "KVarN (vLLM fork kvarn_mla_k5_g64, 290 / 418 / 482 B per token in 64-token tiles): needs a tile codec",
    "llama.cpp iq4_nl / q4_1 / q5_0 K caches: not ported",
)
