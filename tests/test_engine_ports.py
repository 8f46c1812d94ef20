"""Engine ports: each format's defining engine re-stated in plain numpy/torch from its source, and
compared BYTE for byte with our codec. The ports never call mla_eval's codec or numerics.

Sources (the spec of each format names the same engine, `FormatSpec.engine`):
- fp8_ds_mla: vllm-project/vllm @ 37cb21c1695d11baba8e369b071d2f44c1561c8f,
  csrc/libtorch_stable/cache_kernels.cu `concat_and_cache_ds_mla_kernel`: per 128-value tile
  tile_scale = fmaxf(max_abs / 448.f, FLT_MIN); codes fp8::scaled_convert = __nv_cvt_float_to_fp8(
  float(x) / scale, __NV_SATFINITE, E4M3) (csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh);
  bytes [0,512) codes, [512,528) four fp32 scales, [528,656) the bf16 rope copied through.
- nvfp4_fp8_ds_mla: vllm-project/vllm @ 03b6016490cc6603e031cda092a005f10bdc71ee,
  csrc/libtorch_stable/nvfp4_ds_mla_cache_kernels.cu `concat_and_cache_nvfp4_ds_mla_kernel` and
  `nvfp4_tile_scale`: sf_f = fmaxf(amax / 6.0f, 2^-9), sf = e4m3(sf_f) bumped one code up when below
  sf_f (and below 0x7E), inv_sf = 1.0f / sf, codes cvt.rn.satfinite.e2m1x2(x * inv_sf) with the even
  element in the low nibble; rope unscaled e4m3 at [256,320); scale of block s at byte 320 + nvfp4_sf_byte(s)
  = 320 + 8 * (s & 3) + (s >> 2).
- nvfp4 (432 B): NVIDIA's NVFP4 recipe `cvt_warp_fp16_to_fp4` in vllm-project/vllm @
  bde90062eb908dec6a314970a5edb554f6e8a0cc csrc/libtorch_stable/quantization/fp4/nvfp4_utils.cuh, as the
  local-inference-lab vLLM fork's `concat_and_cache_nvfp4_mla` calls it (SFScaleVal = 1.0): SFValue =
  vecMax * rcp.approx.ftz(6), E4M3 (RN, satfinite), outputScale = SFValue != 0 ? rcp.approx.ftz(SFValue *
  rcp.approx.ftz(1)) : 0, codes e2m1(x * outputScale); scales at [256,288), zero pad, bf16 rope at 304.
- nvfp4_fp8rope (368 B): local-inference-lab/b12x @ 1eed7483540585e4d84b705375309766c9317db9,
  b12x/attention/_shared/mla/kv_cache.py `ConcatAndCacheNvfp4MlaFp8RopeKernel` (static scale): the latent as
  above but a group with a zero decoded scale stores 8 zero bytes; rope scale = amax * f32(1/448) at
  [288,292), codes e4m3(v * rcp.approx.ftz(scale)) at [304,368), zeros when the scale is 0.
  rcp.approx.ftz results for E4M3 values and 6 come from the H200 table (mla_eval/formats/data/
  rcp_approx_ftz_f32.json, read here directly); for the rope's arbitrary fp32 scale the port, like the
  codec, uses the correctly rounded reciprocal (kernels/measure_rope_rcp_residual.py measures the rest).
- the per-layer outer scale s_l of nvfp4 / nvfp4_fp8rope: local-inference-lab/vllm @
  7e39fe0969a03377cc1aaea06a7f1511268a4fd5, vllm/model_executor/layers/mla.py
  `MultiHeadLatentAttentionWrapper.forward`: `kv_c_for_cache = kv_c_normed / self._nvfp4_mla_outer_scale`
  (the bf16 latent only, skipped at s_l = 1.0) before the writers above; a bf16 CUDA tensor divided by a
  Python float is `bf16(float(x) * (1.0f / float(s_l)))` (pytorch/pytorch @
  0f57f050df0e969d03e76495ace7ea90ba2b05d8 aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu).
- sglang_fp4_e2m1: sgl-project/sglang @ 0e6b6cf0ac719aca12987b393d17e8caaabcaa87,
  python/sglang/srt/layers/quantization/kvfp4_tensor.py `KVFP4QuantizeUtil.batched_quantize` on the 576
  values of a token (MLATokenToKVPoolFP4): data buffer [288] then scale buffer [36] here. The engine's
  function is @torch.compile'd (float32 compute for bf16 inputs); this port runs it eagerly in float32.
- trtllm_nvfp4_dsa: NVIDIA/TensorRT-LLM @ 727f68b662aad70d1cbe8e9d4292499824183dfc,
  cpp/tensorrt_llm/kernels/mlaKernels.cu `applyMLARopeAppendPagedKVAssignQKernel` -> `quantizeAndWriteMlaFp4`
  (288 B data / 36 B scale pools: no residual) -> `cvt_warp_fp16_to_fp4<T, 16, false>(values, quant_scale_kv,
  scaleOut)` per 8-value vector v of the 576: data bytes [4v, 4v+4), scale byte v/2 for even v. The recipe
  (cpp/tensorrt_llm/kernels/quantization.cuh @ 2a0ce833a998456f870104c1923815b03c5f87c9): SFValue =
  SFScaleVal * (vecMax * rcp.approx.ftz(6)), E4M3 (RN, satfinite), outputScale = vecMax != 0 ?
  rcp.approx.ftz(SFValue * rcp.approx.ftz(SFScaleVal)) : 0, codes cvt.rn.satfinite.e2m1x2(x * outputScale).
  SFScaleVal = f32(1 / (amax / 2688)), amax = TRTLLM_NVFP4_MLA_KV_CACHE_AMAX (default 100.0)
  (tensorrt_llm/_torch/attention/backends/sparse/dsa/backend.py @ 29c0516aff38c6a2bfd1429d847db2b746e808be).
  The two rcp.approx of arbitrary fp32 values are rcp.rn here, as in the codec
  (kernels/measure_trtllm_nvfp4_residual.py measures the rest on the GPU). The reader,
  cpp/tensorrt_llm/kernels/nvfp4MlaKvCacheGather.cu `dequantizeRow` (@ 727f68b662aa): e4m3(code * (float(scale)
  * dequant)), dequant = f32(amax / 2688).
- trtllm_nvfp4_dsa_r64: the same writer with 320 B / 40 B pool strides: latent as above; each rope group g of 16
  through `quantizeAndWriteMlaFp4Residual` (mlaKernels.cu @ 727f68b662aa): input = float(x) * SFScaleVal, main
  scale e4m3(fmaxf(max|input| * rcp.approx.ftz(6), 0.001953125)), codes e2m1(input * rcp.approx.ftz(decoded)),
  residual = input - code * decoded, then the same on the residual; data [256 + 16g, +8) main, [+8, +16) residual
  codes; scales at 352 + 2g (main), 353 + 2g (residual). Its reader adds residual * (scale * dequant) to
  code * (scale * dequant), one fused multiply-add, before the E4M3 conversion.
- sglang_nvfp4_dsa (416 B): YAMY1234/sglang @ 8f7708d81993e15e268de1bb47d11baaf5a88d1d (sgl-project/sglang PR 35237's
  branch), python/sglang/srt/layers/attention/dsa/nvfp4_k_cache.py `quantize_nvfp4_k_cache_into_reference` and
  `_e2m1_rne_scaled_torch`: x = nan_to_num(x, nan=0).clamp(+-6*448*g); scale = (amax / (6 * g)).clamp(0, 448) cast
  to E4M3; D = float(scale) * g; codes count |x| > D*0.25, >= D*0.75, > D*1.25, >= D*1.75, > D*2.5, >= D*3.5,
  > D*5 (each product a float32), sign bit from signbit(x), all 0 where D = 0; even element in the low nibble;
  scales [256,288); rope nan_to_num(nan=0, +-inf=+-bf16 max) as bf16 at [288,416). Reader
  `dequantize_nvfp4_k_cache_paged_reference`: (code * scale) * g.
- nvfp4_fp8rope_dyn (368 B): local-inference-lab/b12x @ 36bce2c1552ba2d47dc09f20a6f64fbfc8ec4ff8,
  b12x/attention/_shared/mla/kv_cache.py `ConcatAndCacheNvfp4MlaFp8RopeKernel` with per_token_scale=True:
  s_t = token_amax * f32(1/2688) at [292,296); if s_t != 0: r_t = rcp.approx.ftz(s_t), scale = e4m3((group_amax *
  r_t) * rcp.approx.ftz(6)), codes e2m1(x * (rcp.approx.ftz(decoded) * r_t)), zero codes where decoded = 0; s_t = 0
  stores zero codes and scale bytes; [296,304) zero; rope as nvfp4_fp8rope. rcp.approx of E4M3 values and 6 from
  the H200 table; of s_t with the correctly rounded reciprocal, as the codec (not tabulable).
- fp8_ds_mla_pow2: deepseek-ai/FlashMLA @ 520fec6a7fd98028705ccad373b7f0e3e2ae75fb, tests/quant.py
  `quantize_k_cache` (V32_FP8Sparse) and `_cast_scale_inv_to_ue8m0`: scale_inv = 2 ** ceil(log2(
  clamp_min(amax.float() / 448.0, 1e-4))) in float32 torch, codes (x.float() / scale_inv).to(float8_e4m3fn).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pytest
import torch

from mla_eval.errors import NonFiniteInputError, UserError
from mla_eval.formats import GlobalScale, decode, encode, get_format

N_TOKENS = 64


# ---------------------------------------------------------------- independent numpy element codecs
def _e4m3_table() -> np.ndarray:
    """Every non-negative finite E4M3 (fn) value, code 0..126, from the format definition."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals, dtype=np.float64)


E4M3_VALUES = _e4m3_table()


def np_e4m3_satfinite_rn(x: np.ndarray) -> np.ndarray:
    """float32 -> E4M3 codes like cvt.rn.satfinite: nearest value, ties to the even code, clamp to 448."""
    a = np.minimum(np.abs(x.astype(np.float64)), 448.0)
    hi = np.clip(np.searchsorted(E4M3_VALUES, a, side="left"), 0, 126)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - E4M3_VALUES[lo], E4M3_VALUES[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << 7)


E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def np_e2m1_satfinite_rn(x: np.ndarray) -> np.ndarray:
    """float32 -> E2M1 codes (0..15) like cvt.rn.satfinite.e2m1x2: nearest, ties to the even code, clamp 6."""
    a = np.minimum(np.abs(x.astype(np.float64)), 6.0)
    hi = np.clip(np.searchsorted(E2M1_VALUES, a, side="left"), 0, 7)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - E2M1_VALUES[lo], E2M1_VALUES[hi] - a
    code = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << 3)


def np_bf16_rn(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even (finite inputs)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).astype(np.uint16)


_TABLE = json.loads((pathlib.Path(__file__).parents[1] / "mla_eval/formats/data/rcp_approx_ftz_f32.json").read_text())
_RCP = dict(zip(_TABLE["inputs"], _TABLE["outputs"]))


def rcp_approx_ftz(x: np.ndarray) -> np.ndarray:
    """rcp.approx.ftz.f32 of tabulated float32 inputs, read from the H200 measurement (KeyError otherwise)."""
    keys = x.astype(np.float32).view(np.int32)
    return np.array([_RCP[int(k)] for k in keys.ravel()], dtype=np.int32).view(np.float32).reshape(x.shape)


# ---------------------------------------------------------------- the engine ports
def vllm_concat_and_cache_ds_mla(kv_c: np.ndarray, k_pe: np.ndarray) -> np.ndarray:
    """vLLM's 656 B record, token by token, in float32 as the CUDA kernel computes it."""
    n = kv_c.shape[0]
    out = np.zeros((n, 656), dtype=np.uint8)
    for tile in range(4):
        vals = kv_c[:, 128 * tile : 128 * (tile + 1)].astype(np.float32)
        max_abs = np.abs(vals).max(axis=1)
        tile_scale = np.maximum(max_abs / np.float32(448.0), np.finfo(np.float32).tiny).astype(np.float32)
        out[:, 512 + 4 * tile : 516 + 4 * tile] = tile_scale.reshape(n, 1).view(np.uint8)
        q = (vals / tile_scale[:, None]).astype(np.float32)  # IEEE division, as `float(x) / scale`
        out[:, 128 * tile : 128 * (tile + 1)] = np_e4m3_satfinite_rn(q)
    out[:, 528:656] = np_bf16_rn(k_pe).view(np.uint8).reshape(n, 128)
    return out


def vllm_concat_and_cache_nvfp4_ds_mla(kv_c: np.ndarray, k_pe: np.ndarray) -> np.ndarray:
    """Upstream vLLM's 352 B record: warp 0 lane `tile` writes one 16-value block, warp 1 the rope."""
    n = kv_c.shape[0]
    out = np.zeros((n, 352), dtype=np.uint8)
    for tile in range(32):
        vals = kv_c[:, 16 * tile : 16 * (tile + 1)].astype(np.float32)
        amax = np.abs(vals).max(axis=1)
        sf_f = np.maximum(amax / np.float32(6.0), np.float32(0.001953125)).astype(np.float32)
        sf_bits = np_e4m3_satfinite_rn(sf_f)
        bump = (E4M3_VALUES[sf_bits] < sf_f) & (sf_bits < 0x7E)
        sf_bits = sf_bits + bump.astype(np.uint8)
        out[:, 320 + 8 * (tile & 3) + (tile >> 2)] = sf_bits
        inv_sf = (np.float32(1.0) / E4M3_VALUES[sf_bits].astype(np.float32)).astype(np.float32)
        codes = np_e2m1_satfinite_rn((vals * inv_sf[:, None]).astype(np.float32))
        out[:, 8 * tile : 8 * (tile + 1)] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    out[:, 256:320] = np_e4m3_satfinite_rn(k_pe.astype(np.float32))
    return out


def _nvfp4_group(vals: np.ndarray, clear_zero_scale: bool) -> tuple[np.ndarray, np.ndarray]:
    """cvt_warp_fp16_to_fp4 at SFScaleVal = 1 for [n, 16] float32 values -> (scale bytes [n], packed [n, 8])."""
    vec_max = np.abs(vals).max(axis=1)
    sf_value = (vec_max * rcp_approx_ftz(np.array([6.0], np.float32))[0]).astype(np.float32)
    sf_bits = np_e4m3_satfinite_rn(sf_value)
    sf_dec = E4M3_VALUES[sf_bits].astype(np.float32)
    inv_one = rcp_approx_ftz(np.array([1.0], np.float32))[0]
    nz = sf_dec != 0
    out_scale = np.zeros_like(sf_dec)
    out_scale[nz] = rcp_approx_ftz((sf_dec[nz] * inv_one).astype(np.float32))
    codes = np_e2m1_satfinite_rn((vals * out_scale[:, None]).astype(np.float32))
    if clear_zero_scale:
        codes[~nz] = 0
    return sf_bits, codes[:, 0::2] | (codes[:, 1::2] << 4)


def vllm_fork_concat_and_cache_nvfp4_mla(kv_c: np.ndarray, k_pe: np.ndarray) -> np.ndarray:
    """The fork's 432 B record: one NVFP4 group of 16 per scale byte, zero pad, bf16 rope copied."""
    n = kv_c.shape[0]
    out = np.zeros((n, 432), dtype=np.uint8)
    for group in range(32):
        sf, packed = _nvfp4_group(kv_c[:, 16 * group : 16 * (group + 1)].astype(np.float32), clear_zero_scale=False)
        out[:, 256 + group] = sf
        out[:, 8 * group : 8 * (group + 1)] = packed
    out[:, 304:432] = np_bf16_rn(k_pe).view(np.uint8).reshape(n, 128)
    return out


def b12x_concat_and_cache_nvfp4_mla_fp8_rope(kv_c: np.ndarray, k_pe: np.ndarray) -> np.ndarray:
    """b12x's 368 B KV_FP8_ROPE=1 record (static scale)."""
    n = kv_c.shape[0]
    out = np.zeros((n, 368), dtype=np.uint8)
    for group in range(32):
        sf, packed = _nvfp4_group(kv_c[:, 16 * group : 16 * (group + 1)].astype(np.float32), clear_zero_scale=True)
        out[:, 256 + group] = sf
        out[:, 8 * group : 8 * (group + 1)] = packed
    rope = k_pe.astype(np.float32)
    rope_scale = (np.abs(rope).max(axis=1) * np.float32(1.0 / 448.0)).astype(np.float32)
    out[:, 288:292] = rope_scale.reshape(n, 1).view(np.uint8)
    nz = rope_scale != 0
    inv = np.zeros_like(rope_scale)
    inv[nz] = (np.float32(1.0) / rope_scale[nz]).astype(np.float32)  # rcp.approx.ftz on the GPU (not tabulable)
    codes = np_e4m3_satfinite_rn((rope * inv[:, None]).astype(np.float32))
    codes[~nz] = 0
    out[:, 304:368] = codes
    return out


def vllm_fork_outer_scaled_latent(kv_c: np.ndarray, s_l: float) -> np.ndarray:
    """The fork's `kv_c_normed / s_l` on the bf16 latent (float32 values of bf16 numbers) -> bf16 values."""
    if s_l == 1.0:  # the fork leaves the tensor untouched
        return kv_c
    inv_b = np.float32(1.0) / np.float32(s_l)  # opmath_t(1.0) / scalar_value<float>: an f32 division on the host
    prod = (kv_c.astype(np.float32) * inv_b).astype(np.float32)
    return (np_bf16_rn(prod).astype(np.uint32) << 16).view(np.float32)


def sglang_kvfp4_batched_quantize(kv: torch.Tensor) -> np.ndarray:
    """SGLang's KVFP4 quantiser on [n, 576] float32 -> [n, 288 packed | 36 scale bytes]."""
    n = kv.shape[0]
    reshaped = kv.view(n, 576 // 16, 16)
    block_max = reshaped.abs().max(dim=-1, keepdim=True).values
    scale_exp = torch.ceil(torch.log2(torch.clamp(block_max / 6.0, min=1e-10)))
    scale_factors = (scale_exp + 127).squeeze(-1).to(torch.uint8)
    scaled = reshaped / torch.exp2(scale_exp)
    sign_bits = (scaled < 0).to(torch.uint8) << 3
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    magnitude_bits = torch.sum(scaled.abs().unsqueeze(-1) >= bounds, dim=-1)
    fp4 = (sign_bits + magnitude_bits.to(torch.uint8)).view(n, 576)
    packed = (fp4[..., 1::2] << 4) + fp4[..., 0::2]
    return torch.cat([packed, scale_factors], dim=-1).numpy()


def flashmla_quantize_k_cache(kv: torch.Tensor) -> np.ndarray:
    """FlashMLA tests/quant.py for V32_FP8Sparse, one token per row of kv [n, 576] (model dtype)."""
    n = kv.shape[0]
    out = torch.zeros((n, 656), dtype=torch.uint8)
    scales = out[:, 512:528].view(torch.float32)
    for tile in range(4):
        part = kv[:, 128 * tile : 128 * (tile + 1)]
        inv = torch.abs(part).max(dim=-1).values.float() / 448.0
        inv = torch.pow(2, torch.clamp_min(inv, 1e-4).log2().ceil()).to(torch.float32)
        scales[:, tile] = inv
        q = (part.float() / inv.unsqueeze(-1)).to(torch.float8_e4m3fn)
        out[:, 128 * tile : 128 * (tile + 1)] = q.view(torch.uint8)
    out[:, 528:656] = kv[:, 512:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return out.numpy()


TRTLLM_AMAX = 100.0  # backend.py _NVFP4_MLA_KV_CACHE_DEFAULT_AMAX
TRTLLM_DEQUANT = np.float32(TRTLLM_AMAX / (448.0 * 6.0))  # torch.full_like(float32 tensor, python double)
TRTLLM_QUANT = np.float32(1.0 / (TRTLLM_AMAX / (448.0 * 6.0)))


def np_cvt_e2m1_satfinite_nan_max(x: np.ndarray) -> np.ndarray:
    """cvt.rn.satfinite.e2m1x2 including non-finite inputs: +-inf saturate to +-6, NaN gives +6 (E2M1 has no
    NaN; the PTX ISA's satfinite rule for NaN-less formats as we read it)."""
    codes = np_e2m1_satfinite_rn(np.where(np.isnan(x), np.float32(0.0), x))
    return np.where(np.isnan(x), np.uint8(0x7), codes).astype(np.uint8)


def trtllm_cvt_warp_fp16_to_fp4(vals: np.ndarray, sf_scale: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """TensorRT-LLM's cvt_warp_fp16_to_fp4<T, 16, false> for [n, 16] values -> (scale bytes [n], packed [n, 8])."""
    vec_max = np.abs(vals).max(axis=1)
    sf_value = (sf_scale * (vec_max * rcp_approx_ftz(np.array([6.0], np.float32))[0]).astype(np.float32)).astype(np.float32)
    sf_bits = np_e4m3_satfinite_rn(sf_value)
    sf_dec = E4M3_VALUES[sf_bits].astype(np.float32)
    inv_sf_scale = np.float32(1.0) / sf_scale  # rcp.approx.ftz(SFScaleVal) on the GPU: rcp.rn here
    with np.errstate(divide="ignore", invalid="ignore"):
        out_scale = np.where(vec_max != 0, np.float32(1.0) / (sf_dec * inv_sf_scale).astype(np.float32), np.float32(0))
        prod = (vals * out_scale.astype(np.float32)[:, None]).astype(np.float32)  # 0 * inf = NaN where the scale is 0
    codes = np_cvt_e2m1_satfinite_nan_max(prod)
    return sf_bits, codes[:, 0::2] | (codes[:, 1::2] << 4)


def trtllm_append_paged_kv_nvfp4(kv: np.ndarray, sf_scale: np.float32 = TRTLLM_QUANT) -> np.ndarray:
    """One token's two pools, [n, 288 data | 36 scales], from the 576 bf16 values (rope already rotated):
    vector pair g (values 16g..16g+15) -> data bytes [8g, 8g+8) and scale byte g of the scale pool."""
    n = kv.shape[0]
    data, scales = np.zeros((n, 288), np.uint8), np.zeros((n, 36), np.uint8)
    for g in range(36):
        scales[:, g], data[:, 8 * g : 8 * (g + 1)] = trtllm_cvt_warp_fp16_to_fp4(kv[:, 16 * g : 16 * (g + 1)], sf_scale)
    return np.concatenate([data, scales], axis=1)


def trtllm_gather_fp8(records: np.ndarray, dequant: np.float32 = TRTLLM_DEQUANT) -> np.ndarray:
    """nvFp4MlaKvCacheGather's dequantizeRow<false> (dequant != 1): [n, 576] E4M3 bytes the sparse FMHA reads."""
    lo, hi = records[:, :288] & 0xF, records[:, :288] >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(-1, 576)
    q = np.where(codes & 0x8, -1.0, 1.0) * E2M1_VALUES[codes & 0x7]
    main_scale = (E4M3_VALUES[records[:, 288:] & 0x7F].astype(np.float32) * dequant).astype(np.float32)
    vals = (q.astype(np.float32) * np.repeat(main_scale, 16, axis=1)).astype(np.float32)
    return np_e4m3_satfinite_rn(vals)


def _signed_e2m1(codes: np.ndarray) -> np.ndarray:
    return np.where(codes & 0x8, -1.0, 1.0) * E2M1_VALUES[codes & 0x7]


def _trtllm_residual_pass(v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One pass of quantizeAndWriteMlaFp4Residual on [n, 16] float32: (scale bits, decoded scale, codes)."""
    r6 = rcp_approx_ftz(np.array([6.0], np.float32))[0]
    scale = np.maximum((np.abs(v).max(axis=1) * r6).astype(np.float32), np.float32(0.001953125))
    bits = np_e4m3_satfinite_rn(scale)
    dec = E4M3_VALUES[bits].astype(np.float32)
    return bits, dec, np_e2m1_satfinite_rn((v * rcp_approx_ftz(dec)[:, None]).astype(np.float32))


def trtllm_residual_group(vals: np.ndarray, sf_scale: np.float32) -> tuple[np.ndarray, ...]:
    """quantizeAndWriteMlaFp4Residual for [n, 16] values -> (main scale, residual scale, main packed, residual packed)."""
    inp = (vals * sf_scale).astype(np.float32)
    b1, dec1, q1 = _trtllm_residual_pass(inp)
    residual = (inp - (_signed_e2m1(q1) * dec1[:, None]).astype(np.float32)).astype(np.float32)  # exact product
    b2, _, q2 = _trtllm_residual_pass(residual)
    pack = lambda q: q[:, 0::2] | (q[:, 1::2] << 4)  # noqa: E731
    return b1, b2, pack(q1), pack(q2)


def trtllm_append_paged_kv_nvfp4_residual(kv: np.ndarray, sf_scale: np.float32 = TRTLLM_QUANT) -> np.ndarray:
    """[n, 320 data | 40 scales]: latent groups as cvt_warp_fp16_to_fp4, rope groups with a residual pass."""
    n = kv.shape[0]
    data, scales = np.zeros((n, 320), np.uint8), np.zeros((n, 40), np.uint8)
    for g in range(32):
        scales[:, g], data[:, 8 * g : 8 * (g + 1)] = trtllm_cvt_warp_fp16_to_fp4(kv[:, 16 * g : 16 * (g + 1)], sf_scale)
    for g in range(4):
        b1, b2, p1, p2 = trtllm_residual_group(kv[:, 512 + 16 * g : 512 + 16 * (g + 1)], sf_scale)
        data[:, 256 + 16 * g : 264 + 16 * g], data[:, 264 + 16 * g : 272 + 16 * g] = p1, p2
        scales[:, 32 + 2 * g], scales[:, 33 + 2 * g] = b1, b2
    return np.concatenate([data, scales], axis=1)


def trtllm_gather_fp8_residual(records: np.ndarray, dequant: np.float32 = TRTLLM_DEQUANT) -> np.ndarray:
    """dequantizeRow<false> with residual_dim 64: [n, 576] E4M3 bytes. The reader's `values += residual *
    residualScale` is one fused multiply-add (nvcc's default contraction); float64 holds it exactly here (the
    addend is a float32, the product has at most 2 + 24 significant bits and sits within 2^27 of it, or below
    half its ulp)."""
    n = records.shape[0]
    unpack = lambda b: np.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[0], -1)  # noqa: E731
    scale = lambda i: (E4M3_VALUES[records[:, 320 + i]].astype(np.float32) * dequant).astype(np.float32)  # noqa: E731
    latent = _signed_e2m1(unpack(records[:, :256])).astype(np.float32).reshape(n, 32, 16)
    lat = (latent * np.stack([scale(g) for g in range(32)], axis=1)[..., None]).astype(np.float32).reshape(n, 512)
    rope = []
    for g in range(4):
        main = _signed_e2m1(unpack(records[:, 256 + 16 * g : 264 + 16 * g])).astype(np.float32)
        res = _signed_e2m1(unpack(records[:, 264 + 16 * g : 272 + 16 * g]))
        part = (main * scale(32 + 2 * g)[:, None]).astype(np.float32).astype(np.float64)
        rope.append((part + res * scale(33 + 2 * g).astype(np.float64)[:, None]).astype(np.float32))
    return np_e4m3_satfinite_rn(np.concatenate([lat, *rope], axis=1))


BF16_MAX = np.float32(3.3895313892515355e38)  # torch.finfo(torch.bfloat16).max
# SGLang's `_e2m1_rne_scaled_torch`: (multiple of the denominator, strict comparison) per E2M1 midpoint
SGLANG_MIDPOINTS = ((0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False), (5.0, True))


def sglang_quantize_nvfp4_k_cache(kv: np.ndarray, g: float = 1.0, midpoint_ulps: int = 0) -> np.ndarray:
    """SGLang's 416 B GLM-5.2 DSA row for [n, 576] float32 (latent then rope); `midpoint_ulps` moves every midpoint
    product that many float32 ulps up (the companion test's perturbation; 0 = the engine)."""
    n = kv.shape[0]
    g32 = np.float32(g)
    bound = np.float32(np.float32(6.0 * 448.0) * g32)  # _E2M1_MAX * _E4M3_MAX * global_scale: python float * f32
    lat = np.nan_to_num(kv[:, :512].astype(np.float32), nan=0.0, posinf=np.inf, neginf=-np.inf)
    blocks = np.clip(lat, -bound, bound).reshape(n, 32, 16)
    scale = np.clip((np.abs(blocks).max(axis=2) / np.float32(np.float32(6.0) * g32)).astype(np.float32), 0, 448)
    scale_bits = np_e4m3_satfinite_rn(scale.astype(np.float32))
    denom = (E4M3_VALUES[scale_bits].astype(np.float32) * g32).astype(np.float32)[:, :, None]
    mag = np.abs(blocks)
    code = np.zeros(blocks.shape, np.uint8)
    for k, strict in SGLANG_MIDPOINTS:
        edge = (denom * np.float32(k)).astype(np.float32)
        for _ in range(midpoint_ulps):
            edge = np.nextafter(edge, np.float32(np.inf))
        code += (mag > edge) if strict else (mag >= edge)
    code |= np.signbit(blocks).astype(np.uint8) << 3
    code = np.where(denom > 0, code, 0).astype(np.uint8).reshape(n, 512)
    out = np.zeros((n, 416), np.uint8)
    out[:, :256] = code[:, 0::2] | (code[:, 1::2] << 4)
    out[:, 256:288] = scale_bits
    rope = np.nan_to_num(kv[:, 512:].astype(np.float32), nan=0.0, posinf=BF16_MAX, neginf=-BF16_MAX)
    out[:, 288:] = np_bf16_rn(rope).view(np.uint8).reshape(n, 128)
    return out


def sglang_dequantize_nvfp4_k_cache(rows: np.ndarray, g: float = 1.0) -> np.ndarray:
    """The branch's `dequantize_nvfp4_k_cache_paged_reference` in float32: [n, 576] values."""
    n = rows.shape[0]
    codes = np.stack([rows[:, :256] & 0xF, rows[:, :256] >> 4], axis=-1).reshape(n, 32, 16)
    scales = E4M3_VALUES[rows[:, 256:288]].astype(np.float32)[:, :, None]
    latent = ((_signed_e2m1(codes).astype(np.float32) * scales).astype(np.float32) * np.float32(g)).astype(np.float32)
    rope = (rows[:, 288:].copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.concatenate([latent.reshape(n, 512), rope], axis=1)


def b12x_concat_and_cache_per_token_scale(kv_c: np.ndarray, k_pe: np.ndarray, token_rcp: float = 1.0 / 2688.0) -> np.ndarray:
    """b12x's 368 B record with per_token_scale=True (`token_rcp` is _TWO_LEVEL_RCP; the companion test moves it)."""
    n = kv_c.shape[0]
    out = b12x_concat_and_cache_nvfp4_mla_fp8_rope(np.zeros_like(kv_c), k_pe)  # the rope lane is the static mode's
    out[:, :288] = 0
    vals = kv_c.astype(np.float32).reshape(n, 32, 16)
    group_amax = np.abs(vals).max(axis=2)
    token_amax = group_amax.max(axis=1)
    s_t = (token_amax * np.float32(token_rcp)).astype(np.float32)
    out[:, 292:296] = s_t.reshape(n, 1).view(np.uint8)
    live = s_t != 0
    r_t = np.zeros_like(s_t)
    r_t[live] = (np.float32(1.0) / s_t[live]).astype(np.float32)  # rcp.approx.ftz(s_t) on the GPU: rcp.rn here
    r6 = rcp_approx_ftz(np.array([6.0], np.float32))[0]
    sf = ((group_amax * r_t[:, None]).astype(np.float32) * r6).astype(np.float32)
    bits = np_e4m3_satfinite_rn(sf)
    dec = E4M3_VALUES[bits].astype(np.float32)
    nz = live[:, None] & (dec != 0)
    factor = np.zeros_like(dec)
    factor[nz] = (rcp_approx_ftz(dec[nz]) * np.broadcast_to(r_t[:, None], dec.shape)[nz]).astype(np.float32)
    codes = np_e2m1_satfinite_rn((vals * factor[:, :, None]).astype(np.float32))
    codes[~nz] = 0
    codes = codes.reshape(n, 512)
    out[:, :256] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    out[:, 256:288] = np.where(live[:, None], bits, 0)
    return out


# ---------------------------------------------------------------- inputs
def _inputs(kind: str, seed: int = 0) -> torch.Tensor:
    """[N_TOKENS, 576] float32 inputs of one kind (latent then rope)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_TOKENS, 576, generator=g)
    if kind == "normal":
        return x
    if kind == "heavy_tailed":  # Student-t with 1.5 degrees of freedom: rare huge values per tile
        chi = torch.distributions.Chi2(1.5).sample((N_TOKENS, 576))
        return x / torch.sqrt(chi / 1.5)
    if kind == "bf16":
        return (x * 3).bfloat16().float()
    if kind == "zero":
        return torch.zeros(N_TOKENS, 576)
    if kind == "tiny":  # amax well below 1e-4 in every tile (FlashMLA's 1e-4 floor decides)
        return x * 1e-7
    if kind == "huge":
        return x * 1e30
    if kind == "mixed":  # rows of each magnitude, and a few zero tiles
        x = x * torch.logspace(-20, 20, N_TOKENS).unsqueeze(1)
        x[::7, :128] = 0
        return x
    if kind == "neg_zero":  # -0.0 everywhere, groups of +-0 mixed, and groups with -0 among small values
        x = -torch.zeros(N_TOKENS, 576)
        x[1::4, ::2] = 0.0
        x[2::4, 17:32:2] = torch.randn(N_TOKENS // 4, 8, generator=g) * 1e-3
        return x
    if kind == "ties":
        return _ties(g)
    raise AssertionError(kind)


def _ties(g: torch.Generator) -> torch.Tensor:
    """Values on rounding boundaries, with power-of-two scales so that the boundaries are exact: even rows put
    every 16-group on E2M1 midpoints (amax 6 s), odd rows put every 32-block on half-integers of amax / 127
    (q8_0) or on the q4_0 / q5_1 boundaries (x * id + 8.5, + 0.5 landing on integers)."""
    mids = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.5])
    halves = torch.cat([torch.tensor([127.0]), torch.arange(-15, 15) + 0.5, torch.tensor([-8.0])])  # 32 values
    x = torch.empty(N_TOKENS, 576)
    for row in range(N_TOKENS):
        scales = 2.0 ** torch.randint(-6, 6, (36,), generator=g).float()
        if row % 2 == 0:
            x[row] = (mids.repeat(36).reshape(36, 16) * scales[:, None]).flatten()
        else:
            x[row] = (halves.repeat(18).reshape(18, 32) * scales[:18, None] / 16).flatten()
    return x


KINDS = ["normal", "heavy_tailed", "bf16", "zero", "tiny", "huge", "mixed"]
EDGE_KINDS = KINDS + ["neg_zero", "ties"]  # every input kind of the ports added for round 3


def _ours(fmt, x: torch.Tensor) -> np.ndarray:
    return encode(fmt, x[:, :512], x[:, 512:]).numpy()


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_ds_mla_bytes_equal_vllm(kind):
    x = _inputs(kind)
    # vLLM's rope is the model's bf16 k_pe: give the port the bf16-rounded rope the model would hold.
    engine = vllm_concat_and_cache_ds_mla(x[:, :512].numpy(), x[:, 512:].numpy())
    ours = _ours("fp8_ds_mla", x)
    assert np.count_nonzero(engine != ours) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_ds_mla_pow2_bytes_equal_flashmla(kind):
    x = _inputs(kind)
    engine = flashmla_quantize_k_cache(x)
    ours = _ours("fp8_ds_mla_pow2", x)
    assert np.count_nonzero(engine != ours) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_nvfp4_fp8_ds_mla_bytes_equal_vllm(kind):
    x = _inputs(kind)
    engine = vllm_concat_and_cache_nvfp4_ds_mla(x[:, :512].numpy(), x[:, 512:].numpy())
    ours = _ours("nvfp4_fp8_ds_mla", x)
    assert np.count_nonzero(engine != ours) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_nvfp4_bytes_equal_the_vllm_fork_recipe(kind):
    x = _inputs(kind)
    engine = vllm_fork_concat_and_cache_nvfp4_mla(x[:, :512].numpy(), x[:, 512:].numpy())
    assert np.count_nonzero(engine != _ours("nvfp4", x)) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_nvfp4_fp8rope_bytes_equal_b12x(kind):
    x = _inputs(kind)
    engine = b12x_concat_and_cache_nvfp4_mla_fp8_rope(x[:, :512].numpy(), x[:, 512:].numpy())
    assert np.count_nonzero(engine != _ours("nvfp4_fp8rope", x)) == 0


OUTER_SCALES = [1.0, 0.37, 2.5e-3, 5.2 / 2688, 7.0]
_FORK_WRITERS = {"nvfp4": vllm_fork_concat_and_cache_nvfp4_mla, "nvfp4_fp8rope": b12x_concat_and_cache_nvfp4_mla_fp8_rope}


@pytest.mark.parametrize("fmt", sorted(_FORK_WRITERS))
@pytest.mark.parametrize("kind", KINDS)
def test_outer_scale_bytes_equal_the_vllm_fork(fmt, kind):
    """s_l applied as the fork applies it (bf16 latent / s_l in torch, then the writer): 0 differing bytes.
    The engine's latent is bf16, so the inputs are bf16 values; the rope is never scaled."""
    x = _inputs(kind).bfloat16().float()
    lat, rope = x[:, :512].numpy(), x[:, 512:].numpy()
    for s_l in OUTER_SCALES:
        engine = _FORK_WRITERS[fmt](vllm_fork_outer_scaled_latent(lat, s_l), rope)
        ours = encode(fmt, x[:, :512], x[:, 512:], outer_scale=s_l).numpy()
        assert np.count_nonzero(engine != ours) == 0, f"{fmt} {kind} s_l={s_l}"


def test_outer_scale_bf16_rounding_is_what_the_comparison_detects():
    """Scaling in float32 without the fork's bf16 rounding gives different bytes on ordinary data, so the
    test above can tell the two orders apart."""
    x = _inputs("bf16", seed=5)
    lat, rope = x[:, :512].numpy(), x[:, 512:].numpy()
    in_f32 = (lat * (np.float32(1.0) / np.float32(0.37))).astype(np.float32)
    unrounded = vllm_fork_concat_and_cache_nvfp4_mla(in_f32, rope)
    assert np.count_nonzero(unrounded != encode("nvfp4", x[:, :512], x[:, 512:], outer_scale=0.37).numpy()) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_sglang_fp4_e2m1_bytes_equal_sglang(kind):
    x = _inputs(kind)
    assert np.count_nonzero(sglang_kvfp4_batched_quantize(x) != _ours("sglang_fp4_e2m1", x)) == 0


# (our format, the engine writer's port, the engine gather's port): both TensorRT-LLM records
TRTLLM_PORTS = [
    ("trtllm_nvfp4_dsa", trtllm_append_paged_kv_nvfp4, trtllm_gather_fp8),
    ("trtllm_nvfp4_dsa_r64", trtllm_append_paged_kv_nvfp4_residual, trtllm_gather_fp8_residual),
]


@pytest.mark.parametrize("fmt, writer, gather", TRTLLM_PORTS, ids=[p[0] for p in TRTLLM_PORTS])
@pytest.mark.parametrize("kind", KINDS)
def test_trtllm_bytes_equal_tensorrt_llm(kind, fmt, writer, gather):
    """TensorRT-LLM's writer takes bf16 (the model dtype; the rope rotated in bf16), so both get bf16 values."""
    x = _inputs(kind).bfloat16().float()
    assert np.count_nonzero(writer(x.numpy()) != _ours(fmt, x)) == 0


@pytest.mark.parametrize("fmt, writer, gather", TRTLLM_PORTS, ids=[p[0] for p in TRTLLM_PORTS])
@pytest.mark.parametrize("kind", KINDS)
def test_trtllm_decode_is_what_the_engine_gathers(kind, fmt, writer, gather):
    """decode() returns the E4M3 values TensorRT-LLM's gather stages for its FMHA, to the bit."""
    x = _inputs(kind).bfloat16().float()
    rec = torch.from_numpy(_ours(fmt, x))
    lat, rope = decode(fmt, rec)
    ours = torch.cat([lat, rope], dim=-1).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.count_nonzero(gather(rec.numpy()) != ours) == 0


def test_trtllm_global_scale_and_vecmax_test_are_what_the_comparison_detects():
    """At SFScaleVal = 1 (the vLLM copy's setting) the scale bytes differ from the engine's on ordinary data;
    tiny inputs (S * amax / 6 < 2^-10) reach the engine's `vecMax != 0` branch: scale 0, codes saturated to
    +-6 (0x7 / 0xF), where vLLM's `SFValue != 0` would store +-0."""
    x = _inputs("bf16", seed=4)
    unit = trtllm_append_paged_kv_nvfp4(x.numpy(), sf_scale=np.float32(1.0))
    assert np.count_nonzero(unit[:, 288:] != _ours("trtllm_nvfp4_dsa", x)[:, 288:]) > 0
    tiny = _inputs("tiny").bfloat16().float()
    rec = _ours("trtllm_nvfp4_dsa", tiny)
    assert np.all(rec[:, 288:] == 0)
    lo, hi = rec[:, :288] & 0xF, rec[:, :288] >> 4
    assert np.all((lo & 0x7) == 0x7) and np.all((hi & 0x7) == 0x7)
    zero_in_tiny = tiny.clone()
    zero_in_tiny[0, 1] = 0.0  # 0 * inf = NaN in the engine -> +6 (0x7) in the high nibble of byte 0
    assert _ours("trtllm_nvfp4_dsa", zero_in_tiny)[0, 0] >> 4 == 0x7


def test_trtllm_residual_floor_and_second_pass_are_exercised():
    """Zero or tiny rope groups get the 2^-9 floor (scale byte 0x01), never 0; on ordinary data the residual pass
    stores nonzero codes and halves the rope's error against the single pass of the 324 B record."""
    for kind in ("zero", "tiny"):
        assert np.all(_ours("trtllm_nvfp4_dsa_r64", _inputs(kind).bfloat16().float())[:, 352:] == 0x01)
    x = _inputs("normal", seed=2).bfloat16().float()
    rec = _ours("trtllm_nvfp4_dsa_r64", x)
    assert np.count_nonzero(rec[:, 264:272]) > 0
    err = {f: (decode(f, torch.from_numpy(_ours(f, x)))[1] - x[:, 512:]).norm().item()
           for f in ("trtllm_nvfp4_dsa", "trtllm_nvfp4_dsa_r64")}
    assert err["trtllm_nvfp4_dsa_r64"] < 0.5 * err["trtllm_nvfp4_dsa"]


def test_trtllm_global_scale_is_the_engine_default():
    spec = get_format("trtllm:nvfp4")
    assert spec.name == "trtllm_nvfp4_dsa" and spec.engine.commit == "727f68b662aad70d1cbe8e9d4292499824183dfc"
    gs = spec.latent.global_scale
    assert gs is spec.rope.global_scale and gs.amax == TRTLLM_AMAX
    assert np.float32(gs.quant) == TRTLLM_QUANT and np.float32(gs.dequant) == TRTLLM_DEQUANT


def test_sglang_ties_go_away_from_zero_and_negative_zero_is_positive():
    """amax 6 gives scale 2^0: 0.25 (a tie) -> 0.5 (code 1; RNE would give 0), -1.25 (a tie) -> -1.5
    (code 0xB; RNE: 0xA), -0.0 -> +0. The even element sits in the low nibble."""
    x = torch.zeros(1, 576)
    x[0, :4] = torch.tensor([6.0, 0.25, -1.25, -0.0])
    rec = _ours("sglang_fp4_e2m1", x)[0]
    assert (rec[0], rec[1], rec[288]) == (0x17, 0x0B, 127)
    assert np.array_equal(sglang_kvfp4_batched_quantize(x)[0, :2], rec[:2])


def test_nvfp4_recipe_multiplies_by_rcp6_not_divides():
    """Near an E4M3 midpoint the two arithmetics part: for amax = 0.8906249403953552 (one float32 ulp
    below 6 * 0.1484375, the midpoint of 0.140625 and 0.15625) amax / 6 rounds down, amax * f32(1/6)
    up. The codec follows the engine's product."""
    amax = np.array([0.8906249403953552], np.float32)
    by_mul = np_e4m3_satfinite_rn((amax * rcp_approx_ftz(np.array([6.0], np.float32))[0]).astype(np.float32))
    by_div = np_e4m3_satfinite_rn((amax / np.float32(6.0)).astype(np.float32))
    assert E4M3_VALUES[by_div[0]] == 0.140625 and E4M3_VALUES[by_mul[0]] == 0.15625
    x = torch.zeros(1, 576)
    x[0, 0] = float(amax[0])
    assert _ours("nvfp4", x)[0, 256] == by_mul[0]


def test_b12x_clears_groups_whose_scale_rounds_to_zero():
    """A 16-value group with tiny negative values: scale e4m3(amax/6) = 0, b12x stores 0x00 bytes, the
    vLLM recipe stores x * 0 = -0 codes (0x88 bytes)."""
    x = torch.zeros(1, 576)
    x[0, :16] = -1e-5
    assert np.all(_ours("nvfp4_fp8rope", x)[0, :8] == 0)
    assert np.all(_ours("nvfp4", x)[0, :8] == 0x88)


def test_nvfp4_fp8_ds_mla_bump_and_floor_are_exercised():
    """The inputs above reach both special rules: a scale bumped up, and the 2^-9 floor (code 0x01)."""
    x = _inputs("normal")
    vals = x[:, :512].numpy().reshape(-1, 16)
    sf_f = np.maximum(np.abs(vals).max(axis=1) / np.float32(6.0), np.float32(2.0**-9)).astype(np.float32)
    assert np.any(E4M3_VALUES[np_e4m3_satfinite_rn(sf_f)] < sf_f)
    tiny_scales = _ours("nvfp4_fp8_ds_mla", _inputs("tiny"))[:, 320:352]
    assert np.all(tiny_scales == 0x01)


def test_fp8_ds_mla_division_is_what_differs_from_a_reciprocal():
    """The engine's `x / scale` and `x * (1 / scale)` give different codes on ordinary data, so the
    comparison above can tell the two arithmetics apart (it failed with the old reciprocal codec)."""
    x = _inputs("bf16", seed=3)
    vals = x[:, :128].numpy()
    scale = np.maximum(np.abs(vals).max(axis=1) / np.float32(448.0), np.finfo(np.float32).tiny).astype(np.float32)
    by_div = np_e4m3_satfinite_rn((vals / scale[:, None]).astype(np.float32))
    by_rcp = np_e4m3_satfinite_rn((vals * (np.float32(1.0) / scale)[:, None]).astype(np.float32))
    assert np.count_nonzero(by_div != by_rcp) > 0


def test_flashmla_floor_changes_tiny_tiles():
    """With amax/448 < 1e-4 FlashMLA's scale is 2^-13 (ceil of log2 1e-4); a FLT_MIN floor would not be."""
    x = _inputs("tiny")
    scales = _ours("fp8_ds_mla_pow2", x)[:, 512:528].copy().view(np.float32)
    assert np.all(scales == np.float32(2.0**-13))


def test_flashmla_log2_ceil_equals_the_exact_power_of_two_for_every_bf16_amax():
    """Our codec rounds up with exact bit arithmetic; FlashMLA with float32 log2().ceil(). They agree for
    every positive finite bf16 amax (the engine's input dtype), checked exhaustively."""
    bits = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16)  # positive finite bf16 patterns
    amax = bits.view(torch.bfloat16).float()
    s0 = torch.clamp_min(amax / 448.0, 1e-4)
    by_log2 = torch.pow(2, s0.log2().ceil()).to(torch.float32)
    mant, exp = torch.frexp(s0)
    exact = torch.ldexp(torch.ones_like(s0), torch.where(mant == 0.5, exp - 1, exp))
    assert torch.equal(by_log2, exact)


def test_specs_name_the_engines_ported_here():
    assert get_format("fp8_ds_mla").engine.commit == "37cb21c1695d11baba8e369b071d2f44c1561c8f"
    assert get_format("fp8_ds_mla_pow2").engine.commit == "520fec6a7fd98028705ccad373b7f0e3e2ae75fb"


def test_trtllm_residual_script_with_rcp_rn_reproduces_the_codec():
    """kernels/measure_trtllm_nvfp4_residual.py ports the writer with the GPU's rcp.approx; given rcp.rn in its
    place it must give the codec's bytes, so any mismatch it reports on the GPU is the instruction's alone."""
    from tools.measure.trtllm_nvfp4_residual import engine_records

    x = torch.cat([_inputs(k).bfloat16().float() for k in ("normal", "heavy_tailed", "tiny", "mixed")])
    x[0, 3] = 0.0
    gs = get_format("trtllm_nvfp4_dsa").latent.global_scale
    got = engine_records(x, gs.quant, lambda t: torch.ones_like(t) / t)
    assert torch.equal(got, torch.from_numpy(_ours("trtllm_nvfp4_dsa", x)))


@pytest.mark.parametrize("g", [1.0, 1.375])
@pytest.mark.parametrize("kind", EDGE_KINDS)
def test_sglang_nvfp4_dsa_bytes_equal_sglang(kind, g):
    """0 differing bytes at the assumed g = 1 and at the engine test's g = 1.375 (a registered copy of the spec)."""
    spec = get_format("sglang_nvfp4_dsa")
    if g != 1.0:
        spec = dataclasses.replace(spec, name="sglang_nvfp4_dsa_g", aliases=(),
                                   latent=dataclasses.replace(spec.latent, global_scale=GlobalScale(g, 1.0)))
    x = _inputs(kind)
    assert np.count_nonzero(sglang_quantize_nvfp4_k_cache(x.numpy(), g) != _ours(spec, x)) == 0
    lat, rope = decode(spec, encode(spec, x[:, :512], x[:, 512:]))
    engine = sglang_dequantize_nvfp4_k_cache(sglang_quantize_nvfp4_k_cache(x.numpy(), g), g)
    assert np.array_equal(torch.cat([lat, rope], -1).numpy().view(np.uint32), engine.view(np.uint32))


def test_sglang_nvfp4_dsa_nonfinite_policy_is_the_engines():
    """NaN -> +0, +-inf -> the clamp bound (latent) or +-bf16 max (rope); the codec takes it only when asked."""
    x = _inputs("normal")
    x[0, 3], x[1, 20], x[2, 40], x[3, 520], x[4, 530], x[5, 575] = np.nan, np.inf, -np.inf, np.nan, np.inf, -np.inf
    x[6, :16] = np.inf  # a whole group at the bound: scale 448, codes +6
    ours = encode("sglang_nvfp4_dsa", x[:, :512], x[:, 512:], engine_nonfinite=True).numpy()
    assert np.count_nonzero(sglang_quantize_nvfp4_k_cache(x.numpy()) != ours) == 0
    assert ours[6, 256] == 0x7E and np.all(ours[6, :8] == 0x77)
    with pytest.raises(NonFiniteInputError):
        encode("sglang_nvfp4_dsa", x[:, :512], x[:, 512:])
    with pytest.raises(UserError, match="no engine policy"):
        encode("nvfp4", x[:, :512], x[:, 512:], engine_nonfinite=True)


def _on_float32_midpoints() -> torch.Tensor:
    """[29, 576]: every 16-group has amax 6 D for an E4M3 value D (so its scale is D exactly) and its other values
    at f32(D * k) for the E2M1 midpoints k: the products the engine compares against, which x * (1 / D) misses."""
    k = np.array([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, 0.5], np.float32)
    d = E4M3_VALUES[40:100].astype(np.float32)
    rows = [(d[i : i + 32, None] * k[None, :]).astype(np.float32).reshape(-1) for i in range(29)]
    return torch.from_numpy(np.concatenate([np.stack(rows), np.zeros((29, 64), np.float32)], axis=1))


def test_sglang_nvfp4_dsa_comparison_detects_a_one_ulp_midpoint_and_a_reciprocal():
    """The companion: the port with its midpoints one ulp higher, or codes by multiplying with 1 / D (what the
    engine's docstring says its comparisons avoid), give different bytes on values at the float32 midpoints."""
    x = _on_float32_midpoints()
    ours = _ours("sglang_nvfp4_dsa", x)
    assert np.count_nonzero(sglang_quantize_nvfp4_k_cache(x.numpy()) != ours) == 0
    assert np.count_nonzero(sglang_quantize_nvfp4_k_cache(x.numpy(), midpoint_ulps=1) != ours) > 0
    lat = x[:, :512].numpy().reshape(-1, 32, 16)
    scale = E4M3_VALUES[ours[:, 256:288]].astype(np.float32)
    by_rcp = np_e2m1_satfinite_rn((lat * (np.float32(1.0) / scale)[:, :, None]).astype(np.float32)).reshape(-1, 512)
    assert np.count_nonzero((by_rcp[:, 0::2] | (by_rcp[:, 1::2] << 4)) != ours[:, :256]) > 0


@pytest.mark.parametrize("kind", EDGE_KINDS)
def test_nvfp4_fp8rope_dyn_bytes_equal_b12x(kind):
    x = _inputs(kind)
    engine = b12x_concat_and_cache_per_token_scale(x[:, :512].numpy(), x[:, 512:].numpy())
    assert np.count_nonzero(engine != _ours("nvfp4_fp8rope_dyn", x)) == 0


def test_nvfp4_fp8rope_dyn_comparison_detects_our_arithmetic_and_a_one_ulp_constant():
    """The companion: mla-eval's own two-level arithmetic (nvfp4_fp8rope_st: s_t divided and floored, latent
    scaled first) differs from b12x's on ordinary data, and so does b12x's with f32(1/2688) one ulp off."""
    x = _inputs("bf16", seed=11)
    ours = _ours("nvfp4_fp8rope_dyn", x)
    assert np.count_nonzero(_ours("nvfp4_fp8rope_st", x)[:, :296] != ours[:, :296]) > 0
    off = float(np.nextafter(np.float32(1.0 / 2688.0), np.float32(1.0)))
    engine = b12x_concat_and_cache_per_token_scale(x[:, :512].numpy(), x[:, 512:].numpy(), token_rcp=off)
    assert np.count_nonzero(engine != ours) > 0
