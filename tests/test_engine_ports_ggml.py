"""Engine ports of llama.cpp's MLA K cache types: ggml's reference block quantisers re-stated in numpy from
their C source and compared byte for byte with our codec (never calling it or its numerics).

Source: ggml-org/llama.cpp @ 36491e4024b3016e6e2d21afc140add042b44bec, ggml/src/ggml-quants.c
`quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`, `quantize_row_q5_1_ref` (the block structs of
ggml/src/ggml-common.h: q8_0 {fp16 d; int8 qs[32]}, q4_0 {fp16 d; uint8 qs[16]}, q5_1 {fp16 d, m; uint8 qh[4];
uint8 qs[16]}), applied to the 576-wide K row that llama.cpp caches for MLA (src/models/deepseek2.cpp @
59b9e36f872d: Kcur = concat(kv_cmpr, k_pe), V a view of K): 18 blocks of 32 consecutive values, in row order.
The C loops are followed as written (first-found maxima, strict comparisons, float32 arithmetic, C's truncating
float-to-integer conversions, roundf's halves away from zero, GGML_FP32_TO_FP16 as round to nearest even).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_engine_ports import EDGE_KINDS, _inputs

from mla_eval.formats import decode, encode, get_format

F32 = np.float32


def _fp16_le(x: np.ndarray) -> np.ndarray:
    """GGML_FP32_TO_FP16: round to nearest even (inf past 65504), as two little-endian bytes per value."""
    with np.errstate(over="ignore"):
        x = x.astype(np.float16)
    return x.view(np.uint16).astype("<u2").view(np.uint8).reshape(*x.shape, 2)


def _c_roundf(v: np.ndarray) -> np.ndarray:
    """roundf: halfway cases away from zero (the fraction of a float32 is exact)."""
    whole = np.trunc(v)
    return whole + np.where(np.abs(v - whole) >= F32(0.5), np.sign(v), F32(0.0))


def _inverse(d: np.ndarray) -> np.ndarray:
    """`const float id = d ? 1.0f/d : 0.0f;`"""
    with np.errstate(divide="ignore"):
        return np.where(d != 0, F32(1.0) / d, F32(0.0)).astype(F32)


def quantize_row_q8_0_ref(x: np.ndarray, rne: bool = False, x86_id: bool = False) -> np.ndarray:
    """[n, k] float32 -> [n, k/32 * 34]. `rne` / `x86_id` switch to the x86 AVX writer's choices (companion)."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(F32)
    amax = np.zeros(blocks.shape[:2], F32)
    for j in range(32):  # amax = MAX(amax, fabsf(v))
        v = np.abs(blocks[:, :, j])
        amax = np.where(amax > v, amax, v)
    d = (amax / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        ident = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32) if x86_id else _inverse(d)
    x0 = (blocks * ident[:, :, None]).astype(F32)
    q = np.rint(x0) if rne else _c_roundf(x0)
    return np.concatenate([_fp16_le(d), q.astype(np.int8).view(np.uint8)], axis=-1).reshape(x.shape[0], -1)


def _first_abs_max(blocks: np.ndarray) -> np.ndarray:
    """`if (amax < fabsf(v)) { amax = fabsf(v); max = v; }` from amax = max = 0."""
    amax = np.zeros(blocks.shape[:2], F32)
    mx = np.zeros(blocks.shape[:2], F32)
    for j in range(blocks.shape[2]):
        v = blocks[:, :, j]
        hit = amax < np.abs(v)
        amax, mx = np.where(hit, np.abs(v), amax), np.where(hit, v, mx)
    return mx


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """qs[j] = code of value j (low nibble) | code of value j + 16 (high nibble)."""
    return ((codes[:, :, :16] & 0xF) | ((codes[:, :, 16:] & 0xF) << 4)).astype(np.uint8)


def quantize_row_q4_0_ref(x: np.ndarray, offset: float = 8.5) -> np.ndarray:
    blocks = x.reshape(x.shape[0], -1, 32).astype(F32)
    d = (_first_abs_max(blocks) / F32(-8)).astype(F32)
    v = (blocks * _inverse(d)[:, :, None]).astype(F32) + F32(offset)  # x0 + 8.5f, a float32 sum
    codes = np.minimum(15, np.trunc(v).astype(np.int8).astype(np.int32))  # MIN(15, (int8_t)(x0 + 8.5f))
    return np.concatenate([_fp16_le(d), _pack_nibbles(codes)], axis=-1).reshape(x.shape[0], -1)


def quantize_row_q5_1_ref(x: np.ndarray) -> np.ndarray:
    blocks = x.reshape(x.shape[0], -1, 32).astype(F32)
    lo = np.full(blocks.shape[:2], np.finfo(F32).max, F32)
    hi = np.full(blocks.shape[:2], -np.finfo(F32).max, F32)
    for j in range(32):  # if (v < min) min = v; if (v > max) max = v;
        v = blocks[:, :, j]
        lo, hi = np.where(v < lo, v, lo), np.where(v > hi, v, hi)
    d = ((hi - lo) / F32(31)).astype(F32)
    v = ((blocks - lo[:, :, None]).astype(F32) * _inverse(d)[:, :, None]).astype(F32) + F32(0.5)
    codes = np.trunc(v).astype(np.uint8).astype(np.uint32)  # (uint8_t)(x0 + 0.5f)
    qh = np.zeros(blocks.shape[:2], np.uint32)
    for j in range(32):  # qh |= ((xi & 0x10u) >> 4) << j, value j + 16 at bit j + 16
        qh |= ((codes[:, :, j] & 0x10) >> 4) << np.uint32(j)
    qh_bytes = qh.astype("<u4").view(np.uint8).reshape(*qh.shape, 4)
    out = np.concatenate([_fp16_le(d), _fp16_le(lo), qh_bytes, _pack_nibbles(codes)], axis=-1)
    return out.reshape(x.shape[0], -1)


def dequantize_row(kind: str, rows: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_q8_0 / _q4_0 / _q5_1: [n, blocks * size] -> [n, blocks * 32] float32."""
    size = {"q8_0": 34, "q4_0": 18, "q5_1": 24}[kind]
    b = rows.reshape(rows.shape[0], -1, size)
    d = b[:, :, 0:2].copy().view("<f2").astype(F32)
    if kind == "q8_0":
        return (b[:, :, 2:].view(np.int8).astype(F32) * d).reshape(rows.shape[0], -1)
    qs = b[:, :, -16:].astype(np.int32)
    low, high = qs & 0xF, qs >> 4
    if kind == "q4_0":
        vals = np.concatenate([low - 8, high - 8], axis=-1).astype(F32) * d
    else:
        m = b[:, :, 2:4].copy().view("<f2").astype(F32)
        qh = b[:, :, 4:8].copy().view("<u4").astype(np.int64)
        j = np.arange(16)
        xh0 = ((qh >> j) << 4) & 0x10
        xh1 = (qh >> (j + 12)) & 0x10
        q = np.concatenate([low | xh0, high | xh1], axis=-1).astype(F32)
        vals = (q * d).astype(F32) + m
    return vals.astype(F32).reshape(rows.shape[0], -1)


PORTS = {"q8_0": quantize_row_q8_0_ref, "q4_0": quantize_row_q4_0_ref, "q5_1": quantize_row_q5_1_ref}
SIZES = {"q8_0": 612, "q4_0": 324, "q5_1": 432}


@pytest.mark.parametrize("kind", sorted(PORTS))
@pytest.mark.parametrize("inputs", EDGE_KINDS)
def test_llamacpp_bytes_equal_ggml(kind, inputs):
    """0 differing bytes, every input kind; llama.cpp quantises the K row in float32, so the inputs stay float32."""
    x = _inputs(inputs)
    spec = get_format(f"llama.cpp:{kind}")
    ours = encode(spec, x[:, :512], x[:, 512:]).numpy()
    engine = PORTS[kind](x.numpy())
    assert engine.shape[1] == spec.record_bytes == SIZES[kind]
    assert np.count_nonzero(engine != ours) == 0


@pytest.mark.parametrize("kind", sorted(PORTS))
@pytest.mark.parametrize("inputs", ["normal", "heavy_tailed", "neg_zero", "ties", "mixed"])
def test_llamacpp_decode_is_ggml_dequantize(kind, inputs):
    x = _inputs(inputs)
    rows = PORTS[kind](x.numpy())
    lat, rope = decode(f"llamacpp_{kind}", encode(f"llamacpp_{kind}", x[:, :512], x[:, 512:]))
    ours = np.concatenate([lat.numpy(), rope.numpy()], axis=1)
    with np.errstate(invalid="ignore"):  # an fp16 scale that overflowed to inf (the mixed input): inf * 0 = NaN
        engine = dequantize_row(kind, rows)
    same = (ours.view(np.uint32) == engine.view(np.uint32)) | (np.isnan(ours) & np.isnan(engine))
    assert same.all()


def test_llamacpp_comparison_detects_x86_rounding_a_one_ulp_offset_and_the_zero_block_sign():
    """The companions: ggml's x86 AVX q8_0 writer (id = 127 / amax, rounding half to even) differs from the
    reference on the ties input and, rarely, on ordinary data; q4_0 with its 8.5 moved one float32 ulp differs on
    ordinary data (a few bytes in 20000 rows); an all-zero q4_0 block stores d = 0 / -8 = -0 (bytes 00 80), a
    detail a sign-blind port would miss."""
    ties = _inputs("ties").numpy()
    ref = quantize_row_q8_0_ref(ties)
    assert np.count_nonzero(quantize_row_q8_0_ref(ties, rne=True) != ref) > 0
    many = np.random.default_rng(0).standard_normal((20000, 576)).astype(F32)  # 127 / amax vs 1 / (amax / 127):
    assert np.count_nonzero(quantize_row_q8_0_ref(many, x86_id=True) != quantize_row_q8_0_ref(many)) > 0  # rare
    off = float(np.nextafter(F32(8.5), F32(9.0)))
    assert np.count_nonzero(quantize_row_q4_0_ref(many, offset=off) != quantize_row_q4_0_ref(many)) > 0
    zero = encode("llamacpp_q4_0", _inputs("zero")[:, :512], _inputs("zero")[:, 512:]).numpy()
    assert (zero[0, 0], zero[0, 1], zero[0, 2]) == (0x00, 0x80, 0x88)


def test_llamacpp_capacity_is_ggml_row_size():
    """llama.cpp sizes the MLA cache by ggml_row_size(type_k, 576) = 576 / 32 blocks and keeps no V cache."""
    for kind, block in (("q8_0", 34), ("q4_0", 18), ("q5_1", 24)):
        spec = get_format(f"llamacpp_{kind}")
        assert spec.record_bytes == 576 // 32 * block
        assert spec.engine.commit == "36491e4024b3016e6e2d21afc140add042b44bec"
