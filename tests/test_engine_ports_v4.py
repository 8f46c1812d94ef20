"""Engine ports of DeepSeek-V4's cache records: each writer re-stated in numpy from its source and compared byte for
byte with our codec (never calling it or its numerics), laid out as the engine lays out a cache block.

Sources (mla_eval/formats/v4.py names the same engines on each spec):
- dsv4_fp8_ds_mla, sliding-window entries: vllm-project/vllm @ 057dcc0c2b547a54af75d3d6c77506b76cf79ef5
  csrc/fused_deepseek_v4_qnorm_rope_kv_insert_kernel.cu `fusedDeepseekV4QNormRopeKVRopeQuantInsertKernel`: the 512
  values rounded to bf16, per 64-value block absmax = fmaxf(max|x|, 1e-4f), exponent = ceilf(log2f(absmax /
  448.0f)), codes __nv_cvt_float_to_fp8(clamp(x * exp2f(-exponent), +-448), SATFINITE, E4M3), scale byte
  clamp(exponent + 127, 0, 255), scale byte 7 = 0, the 64 rotated values bf16; block = [bs x 576 data | bs x 8 scales].
- dsv4_fp8_ds_mla, compressed entries: vllm-project/vllm @ 1bd28daa03df01a6b5955124cca638cbed474ee6
  vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py `_rope_quant_insert_kernel`: 8 tiles of 64 of the
  float32 values (the eighth, the unrotated rope, never stored), amax = max(max|x|, 1e-4), exponent = ceil(log2(amax
  * (1.0 / 448.0))) -- a product, not a division --, the same codes and scale bytes, the rope rotated in float32 and
  stored bf16.
- dsv4_fp8_ds_mla, SGLang: sgl-project/sglang @ 0efea6f4c6dd0807125d517a766952d20529107c
  python/sglang/jit_kernel/csrc/deepseek_v4/store.cuh `fused_store_flashmla_cache`: scale_raw = fmaxf(1e-4f, absmax) /
  448, cast_to_ue8m0 = biased exponent + (mantissa != 0), codes pack_fp8(x * 2^-e); the pad byte never written.
- dsv41_mxfp8: vllm-project/vllm @ b3ae0bbf2895fd8a1e82dc0f690b334335f1f91d
  vllm/models/deepseek_v41/common/ops/cache_utils.py `_quantize_and_insert_k_mxfp8_kernel` (and, on float32 rotated
  rope, fused_compress_quant_cache.py @ 1bd28daa03df `_rope_quant_insert_mxfp8_kernel`): 16 tiles of 32 of all 512
  values, amax = max(max|x|, 1e-4), exponent = ceil(log2(amax * (1/448))), clamp, E4M3; block = [bs x 512 | bs x 16].
- dsv41_nvfp4: fused_compress_quant_cache.py @ 1bd28daa03df `_rope_quant_insert_nvfp4_kernel`: 32 tiles of 16, scale
  = e4m3(clamp(amax * (1/6), 2^-9, 448)), codes cvt.rn.satfinite.e2m1x2(div_rn(x, scale)), even element in the low
  nibble; block = [bs x 256 | bs x 32].
- nvfp4 over the whole head (the fork's PR 632): local-inference-lab/vllm @ 42d67f7630d8b5c4652b31d2292d4fad1ad56f34
  csrc/libtorch_stable/nvfp4_kv_cache_kernels.cu `fused_deepseek_v4_qnorm_rope_nvfp4_mla_kernel`: the 512 values
  rounded to bf16, `cvt_warp_fp16_to_fp4<..., 1>(values, 1.0f, &scale)` per lane of 16 (the recipe ported in
  test_engine_ports.py), codes at 8 * lane, scale byte 256 + lane, [288,304) zero, the 64 rotated values bf16 at 304.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_engine_ports import (
    E4M3_VALUES,
    EDGE_KINDS,
    _inputs,
    _nvfp4_group,
    np_bf16_rn,
    np_e2m1_satfinite_rn,
    np_e4m3_satfinite_rn,
)

from mla_eval.formats import get_format
from mla_eval.formats.v4 import V4_CONFIGS, RecordUse, decode_head, encode_head, v4_config

F32 = np.float32
BLOCK = 4  # tokens per cache block in these tests (the layouts hold for any block size)


def _bf16(x: np.ndarray) -> np.ndarray:
    return (np_bf16_rn(x.astype(F32)).astype(np.uint32) << 16).view(F32)


def _heads(kind: str, bf16_rope: bool = True) -> np.ndarray:
    """[64, 512] float32 heads: the 448 as the bf16 values the model holds, the rope bf16 or float32 (a compressed
    entry's rope is rotated in float32 by the writer and quantised before any bf16 rounding)."""
    x = _inputs(kind)[:, :512].numpy().astype(F32)
    head = _bf16(x)
    if not bf16_rope:
        head[:, 448:] = x[:, 448:]
    return head


def _block(rows: list[np.ndarray]) -> np.ndarray:
    """The engine's blocks of BLOCK tokens: each region (data rows, then scale rows) of all its tokens in turn."""
    n = rows[0].shape[0]
    return np.concatenate([np.concatenate([r[b : b + BLOCK].reshape(-1) for r in rows])
                           for b in range(0, n, BLOCK)])


def _ours_block(spec_or_use, head: np.ndarray) -> np.ndarray:
    """Our codec's records of `head`, laid out by the spec's `buffers` as the engine's blocks."""
    use = spec_or_use if isinstance(spec_or_use, RecordUse) else RecordUse(spec_or_use)
    rec = encode_head(use, torch.from_numpy(head)).numpy()
    buffers = use.spec.buffers or (("record", 0, use.spec.record_bytes),)
    return _block([rec[:, a:b] for _, a, b in buffers])


def _ceil_log2(q: np.ndarray) -> np.ndarray:
    """ceil(log2 q) of positive float32 values, from float64 log2 (exact at powers of two)."""
    return np.ceil(np.log2(q.astype(np.float64))).astype(np.int32)


def _ue8m0_tiles(vals: np.ndarray, group: int, by_product: bool) -> tuple[np.ndarray, np.ndarray]:
    """(E4M3 codes [n, d], scale bytes [n, d / group]) of the UE8M0 rule: the quotient by 448 taken as the engine does."""
    n, d = vals.shape
    tiles = vals.reshape(n, d // group, group)
    amax = np.maximum(np.abs(tiles).max(axis=2), F32(1e-4)).astype(F32)
    q = (amax * F32(1.0 / 448.0)).astype(F32) if by_product else (amax / F32(448.0)).astype(F32)
    e = _ceil_log2(q)
    scaled = (tiles * np.ldexp(F32(1.0), -e)[..., None].astype(F32)).astype(F32)
    codes = np_e4m3_satfinite_rn(np.clip(scaled, F32(-448.0), F32(448.0)))
    return codes.reshape(n, d), np.clip(e + 127, 0, 255).astype(np.uint8)


# ---------------------------------------------------------------------------------------------------- the ports
def vllm_dsv4_swa_insert(head: np.ndarray) -> np.ndarray:
    """vLLM's fused CUDA writer of sliding-window entries (584 B record)."""
    vals = _bf16(head)
    codes, scales = _ue8m0_tiles(vals[:, :448], 64, by_product=False)
    data = np.concatenate([codes, np_bf16_rn(vals[:, 448:]).view(np.uint8).reshape(-1, 128)], axis=1)
    return _block([data, np.concatenate([scales, np.zeros((len(vals), 1), np.uint8)], axis=1)])


def vllm_dsv4_compressed_insert(head: np.ndarray) -> np.ndarray:
    """vLLM's Triton writer of compressed entries (584 B): eight tiles, the eighth (unrotated rope) never stored."""
    unrotated = head.copy()  # the kernel quantises its input row before the rotation; the eighth tile is dropped
    codes, scales = _ue8m0_tiles(unrotated, 64, by_product=True)
    data = np.concatenate([codes[:, :448], np_bf16_rn(head[:, 448:]).view(np.uint8).reshape(-1, 128)], axis=1)
    return _block([data, np.concatenate([scales[:, :7], np.zeros((len(head), 1), np.uint8)], axis=1)])


def sglang_dsv4_store(head: np.ndarray) -> np.ndarray:
    """SGLang's fused_store_flashmla_cache (584 B); the pad byte keeps the pool's zero."""
    vals = head.astype(F32)
    n = len(vals)
    tiles = vals[:, :448].reshape(n, 7, 64)
    scale_raw = (np.maximum(F32(1e-4), np.abs(tiles).max(axis=2)) / F32(448.0)).astype(F32)
    bits = scale_raw.view(np.uint32)
    ue8m0 = (((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0)).astype(np.int32)
    inv = (np.array(127 + 127 - ue8m0, np.uint32) << 23).view(F32)
    codes = np_e4m3_satfinite_rn(np.clip((tiles * inv[..., None]).astype(F32), F32(-448.0), F32(448.0)))
    data = np.concatenate([codes.reshape(n, 448), np_bf16_rn(vals[:, 448:]).view(np.uint8).reshape(-1, 128)], axis=1)
    return _block([data, np.concatenate([ue8m0.astype(np.uint8), np.zeros((n, 1), np.uint8)], axis=1)])


def vllm_dsv41_mxfp8_insert(head: np.ndarray) -> np.ndarray:
    """vLLM's V4.1 MXFP8 writers (528 B): all 512 values, 16 tiles of 32."""
    codes, scales = _ue8m0_tiles(head.astype(F32), 32, by_product=True)
    return _block([codes, scales])


def vllm_dsv41_nvfp4_insert(head: np.ndarray) -> np.ndarray:
    """vLLM's V4.1 NVFP4 compressed writer (288 B)."""
    n = len(head)
    tiles = head.astype(F32).reshape(n, 32, 16)
    sf = np.clip((np.abs(tiles).max(axis=2) * F32(1.0 / 6.0)).astype(F32), F32(2.0**-9), F32(448.0))
    sf_bits = np_e4m3_satfinite_rn(sf)
    scaled = (tiles / E4M3_VALUES[sf_bits].astype(F32)[..., None]).astype(F32)  # div_rn
    codes = np_e2m1_satfinite_rn(scaled).reshape(n, 512)
    return _block([codes[:, 0::2] | (codes[:, 1::2] << 4), sf_bits])


def fork_dsv4_nvfp4_mla(head: np.ndarray) -> np.ndarray:
    """The fork's fused V4 NVFP4 writer (432 B, PR 632): 32 lanes of 16 bf16 values, the rope also as bf16."""
    vals = _bf16(head)
    n = len(vals)
    out = np.zeros((n, 432), np.uint8)
    for lane in range(32):
        sf, packed = _nvfp4_group(vals[:, 16 * lane : 16 * (lane + 1)], clear_zero_scale=False)
        out[:, 8 * lane : 8 * lane + 8] = packed
        out[:, 256 + lane] = sf
    out[:, 304:432] = np_bf16_rn(vals[:, 448:]).view(np.uint8).reshape(n, 128)
    return _block([out])


# ---------------------------------------------------------------------------------------------------- the comparisons
def _diff(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape
    return int(np.count_nonzero(a != b))


@pytest.mark.parametrize("kind", EDGE_KINDS)
def test_dsv4_fp8_ds_mla_bytes_equal_vllm_sliding_window_writer(kind):
    head = _heads(kind)
    assert _diff(vllm_dsv4_swa_insert(head), _ours_block(get_format("dsv4_fp8_ds_mla"), head)) == 0


@pytest.mark.parametrize("kind", EDGE_KINDS)
def test_dsv4_fp8_ds_mla_bytes_equal_vllm_compressed_writer(kind):
    head = _heads(kind, bf16_rope=False)
    assert _diff(vllm_dsv4_compressed_insert(head), _ours_block(get_format("dsv4_fp8_ds_mla"), head)) == 0


@pytest.mark.parametrize("kind", EDGE_KINDS)
def test_dsv4_fp8_ds_mla_bytes_equal_sglang(kind):
    head = _heads(kind)
    assert _diff(sglang_dsv4_store(head), _ours_block(get_format("dsv4_fp8_ds_mla"), head)) == 0


@pytest.mark.parametrize("bf16_rope", [True, False], ids=["window", "compressed"])
@pytest.mark.parametrize("kind", EDGE_KINDS)
def test_dsv41_mxfp8_bytes_equal_vllm(kind, bf16_rope):
    head = _heads(kind, bf16_rope)
    assert _diff(vllm_dsv41_mxfp8_insert(head), _ours_block(get_format("dsv41_mxfp8"), head)) == 0


@pytest.mark.parametrize("kind", EDGE_KINDS)
def test_dsv41_nvfp4_bytes_equal_vllm(kind):
    head = _heads(kind, bf16_rope=False)
    assert _diff(vllm_dsv41_nvfp4_insert(head), _ours_block(get_format("dsv41_nvfp4"), head)) == 0


@pytest.mark.parametrize("kind", EDGE_KINDS)
def test_fork_nvfp4_over_the_whole_head_bytes_equal_pr_632(kind):
    head = _heads(kind)
    assert _diff(fork_dsv4_nvfp4_mla(head), _ours_block(v4_config("nvfp4").sliding, head)) == 0


# ---------------------------------------------------------------------------------------------------- can they fail
def test_the_comparison_sees_the_amax_floor_and_the_pad_byte():
    """Tiny tiles take their scale from the 1e-4 floor (2^-22 = byte 105, not FLT_MIN's): a port without the floor
    differs; and a nonzero pad byte (an engine that left garbage there) is seen."""
    head = _heads("tiny")
    ours = _ours_block(get_format("dsv4_fp8_ds_mla"), head)
    scales = ours[BLOCK * 576 : BLOCK * 584].reshape(BLOCK, 8)
    assert np.all(scales[:, :7] == 105) and np.all(scales[:, 7] == 0)
    vals = head[:, :448].reshape(-1, 7, 64)
    unfloored = _ceil_log2((np.abs(vals).max(axis=2) / F32(448.0)).astype(F32)) + 127
    assert np.all(unfloored[:BLOCK] != 105)
    garbage = vllm_dsv4_swa_insert(head)
    garbage[BLOCK * 576 + 7] = 0xA5
    assert _diff(garbage, _ours_block(get_format("dsv4_fp8_ds_mla"), head)) == 1


def test_the_v4_scale_is_a_ceiling_not_a_rounding():
    """2^ceil(log2(amax / 448)): rounding the exponent to nearest instead changes scale bytes on ordinary data."""
    head = _heads("normal")
    tiles = head[:, :448].reshape(-1, 7, 64)
    q = np.maximum(np.abs(tiles).max(axis=2), F32(1e-4)) / F32(448.0)
    assert np.any(np.rint(np.log2(q.astype(np.float64))) != _ceil_log2(q.astype(F32)))


def test_division_and_the_engines_product_by_f32_1_448_reach_the_same_power_of_two():
    """The CUDA writer divides by 448, the Triton writers multiply by f32(1/448): the ceiling of log2 of the two
    quotients agrees for every positive finite bf16 amax (exhaustive) and for every float32 within 64 ulps of
    448 * 2^k (k over the normal range): the only places a one-ulp difference could move a ceiling."""
    bits = np.arange(1, 0x7F80, dtype=np.uint32) << 16
    amax = np.maximum(bits.view(F32), F32(1e-4))
    assert np.array_equal(_ceil_log2((amax / F32(448.0)).astype(F32)), _ceil_log2((amax * F32(1.0 / 448.0)).astype(F32)))
    centres = np.ldexp(F32(448.0), np.arange(-126 + 9, 119)).astype(F32).view(np.int32)
    near = (centres[:, None] + np.arange(-64, 65)[None, :]).ravel().view(F32)
    near = near[np.isfinite(near) & (near > 0)]
    by_div, by_mul = (near / F32(448.0)).astype(F32), (near * F32(1.0 / 448.0)).astype(F32)
    assert np.array_equal(_ceil_log2(by_div), _ceil_log2(by_mul))


def test_nvfp4_v41_scale_floor_and_division_are_what_the_comparison_detects():
    """Tiny tiles take the 2^-9 floor (code 0x01); and multiplying by the reciprocal of the scale instead of dividing
    gives other codes on ordinary data, so the port tells the two arithmetics apart."""
    ours = _ours_block(get_format("dsv41_nvfp4"), _heads("tiny", bf16_rope=False))
    assert np.all(ours[BLOCK * 256 : BLOCK * 288] == 0x01)
    head = _heads("heavy_tailed", bf16_rope=False)
    tiles = head.reshape(-1, 32, 16)
    sf = E4M3_VALUES[np_e4m3_satfinite_rn(np.clip((np.abs(tiles).max(axis=2) * F32(1.0 / 6.0)).astype(F32),
                                                  F32(2.0**-9), F32(448.0)))].astype(F32)
    by_div = np_e2m1_satfinite_rn((tiles / sf[..., None]).astype(F32))
    by_rcp = np_e2m1_satfinite_rn((tiles * (F32(1.0) / sf)[..., None]).astype(F32))
    assert np.count_nonzero(by_div != by_rcp) > 0


def test_the_whole_head_binding_reads_the_rope_from_its_bf16_copy():
    """The fork's record stores the rope twice; we read the 448 from the NVFP4 codes and the rope from the bf16 copy.
    Reading the NVFP4 copy would differ (and `split` records hold only 448 + 64)."""
    use = v4_config("nvfp4").sliding
    head = torch.from_numpy(_heads("normal"))
    back = decode_head(use, encode_head(use, head))
    assert torch.equal(back[:, 448:], head[:, 448:])  # the bf16 rope is exact for bf16 inputs
    assert not torch.equal(back[:, :448], head[:, :448])
    with pytest.raises(ValueError, match="holds 448 \\+ 64"):
        RecordUse(use.spec)


def test_every_v4_configuration_names_a_record_for_every_kind_of_entry():
    names = [c.name for c in V4_CONFIGS]
    assert names == ["bf16", "dsv4_fp8_ds_mla", "dsv41_mxfp8", "dsv41_nvfp4", "nvfp4"]
    nvfp4 = v4_config("dsv41_nvfp4")
    assert nvfp4.record("sliding").spec.name == "dsv41_mxfp8" and nvfp4.record("compressed_csa").spec.name == "dsv41_nvfp4"
    assert all(c.indexer_bytes == 132 for c in V4_CONFIGS)


def test_nvfp4_v41_scale_multiplies_by_one_sixth():
    """At amax = 0.8906249403953552 (one float32 ulp below 6 * 0.1484375, an E4M3 midpoint) amax / 6 rounds to 0.140625
    and amax * f32(1/6) to 0.15625: the port and the codec take the engine's product (a division fails here)."""
    head = np.zeros((BLOCK, 512), F32)
    head[:, 0] = F32(0.8906249403953552)
    engine = vllm_dsv41_nvfp4_insert(head)
    assert E4M3_VALUES[engine[BLOCK * 256]] == 0.15625
    assert _diff(engine, _ours_block(get_format("dsv41_nvfp4"), head)) == 0


# ---------------------------------------------------------------------------------------------------- kernels, specs
def test_the_kernels_refuse_v4_records_by_geometry_and_v4_rules_by_name():
    import dataclasses

    from mla_eval.formats import Field, VectorCoding
    from mla_eval.formats.spec import ScaleRule
    from mla_eval_kernels.plan.record_plan import UnsupportedFormat, plan_for

    for name in ("dsv4_bf16", "dsv4_fp8_ds_mla", "dsv41_mxfp8", "dsv41_nvfp4"):
        with pytest.raises(UnsupportedFormat, match="built for the 512 \\+ 64 MLA record; .* holds 448 \\+ 64 values"):
            plan_for(get_format(name))
    # the same UE8M0 rule on a 512 + 64 record (a user's format) is refused by its rule, never run unimplemented
    mla = dataclasses.replace(get_format("fp8_ds_mla"), name="ue8m0_mla", aliases=(), engine=None, latent=VectorCoding(
        512, "e4m3", Field("latent", 0, "e4m3", 512), ScaleRule.UE8M0_CEIL, 128, Field("latent_scale", 512, "e8m0", 4),
        scale_floor=1e-4), rope=dataclasses.replace(get_format("fp8_ds_mla").rope, data=Field("rope", 516, "bf16", 64)),
        pads=(Field("pad", 644, "pad", 12),))
    with pytest.raises(UnsupportedFormat, match="DeepSeek-V4's scale rule"):
        plan_for(mla)
    assert plan_for(v4_config("nvfp4").sliding.spec).record_bytes == 432  # the fork's V4 record is the MLA nvfp4 bytes


def test_v4_specs_are_validated():
    import dataclasses

    from mla_eval.formats import Field
    from mla_eval.formats.spec import ScaleApply

    spec = get_format("dsv4_fp8_ds_mla")
    with pytest.raises(ValueError, match="latent \\+ rope of 512 \\+ 64 \\(mla\\), 448 \\+ 64 \\(deepseek_v4\\)"):
        dataclasses.replace(spec, latent=dataclasses.replace(spec.latent, dim=384))
    with pytest.raises(ValueError, match="UE8M0 rule is E4M3 codes"):
        dataclasses.replace(spec, latent=dataclasses.replace(spec.latent, apply=ScaleApply.MUL_RCP_APPROX))
    nv = get_format("dsv41_nvfp4")
    with pytest.raises(ValueError, match="clamped E4M3 rule is E2M1 codes divided"):
        dataclasses.replace(nv, latent=dataclasses.replace(nv.latent, apply=ScaleApply.MUL_RCP))
    with pytest.raises(ValueError, match="starts at"):  # the fields still tile the record
        dataclasses.replace(spec, pads=(Field("pad", 582, "pad", 2),))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", [c.name for c in V4_CONFIGS])
def test_v4_records_encode_and_decode_on_a_gpu_as_on_the_cpu(config):
    """The torch reference serves the V4 records on a GPU: its bytes and read-back equal the CPU's."""
    head = torch.from_numpy(np.concatenate([_heads(k, bf16_rope=False) for k in EDGE_KINDS]))
    for use in (v4_config(config).sliding, v4_config(config).compressed):
        cpu = encode_head(use, head)
        gpu = encode_head(use, head.cuda())
        assert torch.equal(gpu.cpu(), cpu)
        assert torch.equal(decode_head(use, gpu).cpu(), decode_head(use, cpu))
