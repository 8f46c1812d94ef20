"""The built-in cache formats. Each is written once here; everything else reads these specs.

Byte layouts follow the public sources named in each spec's `source`. The formats that no engine
defines (nvfp4_fp8rope_st, mxfp4, fp8_e4m3) are our own choices, documented at their specs.

Published 512 + 64 NVFP4 records not built in, and why (searched 2026-12-03: the search tool's code,
issues and pages corpora, GitHub snapshots of sgl-project/sglang and NVIDIA/TensorRT-LLM):
- SGLang PR 35237 (sgl-project/sglang, open, "Add SM100 NVFP4 KV cache support for GLM-5.2 DSA"): the
  PR text gives a 416 B record (256 B E2M1 latent, 32 B block-16 E4M3 scales, 128 B bf16 rope) with a
  per-layer fp32 global K scale. Its source (the writer's arithmetic) is not in any stored copy: the PR
  branch is not on sglang main, the author's fork is not indexed, and sglang's snapshot (1.2 GB) is over
  the fetch limit. Without the writer there is no engine port, so no spec. Searched again 2026-12-04: the
  issues corpus holds the PR description only (no review thread with code); of the author's (Njuapp)
  indexed repositories none is an sglang fork; the code corpus and exact-string search find no 416 B
  NVFP4 writer (tried: the PR title, "416-byte", global K scale / flashmla_kv / NSA pool queries).
- TensorRT-LLM's NVFP4 DSA cache is built in twice (below): `trtllm_nvfp4_dsa` (324 B, residual dim 0: the
  DSACacheManager V1 sizing read at 0bbb76d22e61) and `trtllm_nvfp4_dsa_r64` (360 B, residual dim 64: the rope
  stored as E2M1 plus an E2M1 residual, what GLM-5.2 gets under DSACacheManagerV2). Which one a deployment
  writes depends on the manager and its residual setting (PR 19305 ties DeepSeek-V4's to
  TRTLLM_NVFP4_MLA_RESIDUAL_QUANTIZATION, default on); where the DSA managers set it was not found in a
  stored copy, so the residual dim is named in the format rather than assumed.
"""

from __future__ import annotations

from mla_eval.formats.spec import (
    FLT_MIN,
    LATENT_DIM,
    ROPE_DIM,
    TOKEN_SCALE_DENOMINATOR,
    Engine,
    Field,
    FormatSpec,
    GlobalScale,
    OuterScale,
    ScaleApply,
    ScaleOrder,
    ScaleRule,
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
VLLM_NVFP4_FP8_DS_MLA = Engine(
    name="vLLM",
    repository="vllm-project/vllm",
    path="csrc/libtorch_stable/nvfp4_ds_mla_cache_kernels.cu",
    symbol="concat_and_cache_nvfp4_ds_mla_kernel",
    commit="03b6016490cc6603e031cda092a005f10bdc71ee",
    flag="--kv-cache-dtype nvfp4_fp8_ds_mla",
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


# Engine names that several records share, each with the formats it may mean: a bare one is refused
# (the user names the record), the '<engine>:<name>' aliases of the specs select one format each.
# The local-inference-lab vLLM fork's --kv-cache-dtype nvfp4_ds_mla writes 432 B, or 368 B under KV_FP8_ROPE=1.
AMBIGUOUS_ENGINE_NAMES: dict[str, tuple[str, ...]] = {"nvfp4_ds_mla": ("nvfp4", "nvfp4_fp8rope")}

BUILTIN_FORMATS: tuple[FormatSpec, ...] = (
    FormatSpec(
        name="bf16",
        title="bf16",
        description="Uncompressed reference: 512 bf16 latent + 64 bf16 rope.",
        source="DeepSeek-V3 MLA cache (FlashMLA / vLLM bf16 MLA cache)",
        record_bytes=1152,
        latent=VectorCoding(LATENT_DIM, "bf16", Field("latent", 0, "bf16", LATENT_DIM), ScaleRule.NONE, LATENT_DIM),
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
        rope=VectorCoding(
            ROPE_DIM,
            "e4m3",
            Field("rope", 304, "e4m3", ROPE_DIM),
            ScaleRule.AMAX_FP32_MUL,
            ROPE_DIM,
            Field("rope_scale", 288, "fp32", 1),
            apply=ScaleApply.MUL_RCP_APPROX,
            zero_scale_clears=True,
        ),
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
        source="upstream vLLM --kv-cache-dtype nvfp4_fp8_ds_mla (PR 51724) / vllm-project/FlashMLA PR 18",
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
        aliases=("vllm:nvfp4_fp8_ds_mla",),
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
)
