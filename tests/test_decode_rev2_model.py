"""CPU model of v3's decode rev 2 (`e2m1_bits`, the kernel's only E2M1 latent decode since 2026-12-05): the same bits as rev 1
for every code byte in every position of a word, and, run the kernel's way over whole records (word loads, scale
entries, the bf16 scale multiplier, one bf16 multiply per pair), the codec's decode exactly (times 2^9, and with the
outer scale s_l folded back in float32) for every E2M1 byte and every finite E4M3 scale byte: zero, subnormal, max.
Pure Python / numpy; the GPU test compares the kernels' outputs bitwise (tests/test_kernels_v3_gpu.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from mla_eval.formats import decode, get_format
from mla_eval_kernels.plan import e2m1_bits
from mla_eval_kernels.plan import tuning as attention_tuning
from mla_eval_kernels.plan.record_plan import ORDER_8X4, plan_for

FOLD_FORMATS = ("nvfp4", "nvfp4_fp8rope", "nvfp4_fp8_ds_mla")


def test_prmt_model_replicates_the_sign_bit_where_the_selector_nibble_asks():
    assert e2m1_bits.prmt(0x80, 0, 0x4448) == 0xFF  # nibble 0 = 8: byte 0's bit 7 over result byte 0; bytes 1-3 = b's 0
    assert e2m1_bits.prmt(0x7F, 0, 0x4448) == 0x00
    assert e2m1_bits.prmt(0x7F, 0, 0x4440) == 0x7F
    assert e2m1_bits.R2_SELECTORS == (0x8480, 0x9591, 0xA6A2, 0xB7B3)


def test_rev2_words_equal_rev1_for_every_byte_in_every_position():
    rng = random.Random(14)
    for pair in range(4):
        for byte in range(256):
            for _ in range(4):  # the other bytes (other pairs' codes) must not leak into this pair
                word = rng.getrandbits(32) & ~(0xFF << (8 * pair)) | (byte << (8 * pair))
                assert e2m1_bits.e2m1_word_to_bf16x2_bits_r2(word, pair) == e2m1_bits.e2m1_word_to_bf16x2_bits(word, pair)
    for word in (0, 0xFFFFFFFF, 0x88888888, 0x77777777):
        for pair in range(4):
            assert e2m1_bits.e2m1_word_to_bf16x2_bits_r2(word, pair) == e2m1_bits.e2m1_word_to_bf16x2_bits(word, pair)


def _bf16_rne(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even (`cvt.rn.bf16x2.f32`, `mul.rn.bf16x2`); finite inputs."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def _bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _kernel_decode(plan, records: np.ndarray, pair_bits) -> np.ndarray:
    """The latent of `records` [N, record_bytes] as the v3 producer writes it: bf16 bits [N, 512] of E2M1 * scale * 2^-9.
    Per key and 16-value block: two code words, the block's scale byte (entry order of the plan), scale * 2^117 to
    bf16 by RNE, then per pair `pair_bits(word, pair)` times that scale, rounded to bf16 (exact: 6 significant bits)."""
    lat = plan.latent
    n = records.shape[0]
    out = np.zeros((n, 512), dtype=np.uint16)
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    words = records[:, lat.data_offset : lat.data_offset + 256].copy().view("<u4")  # [N, 64]
    cache = {}
    for blk in range(32):
        entry = (16 * blk) // lat.group
        if lat.scale_order == ORDER_8X4:
            entry = 8 * (entry & 3) + (entry >> 2)
        scale = e4m3[records[:, lat.scale_offset + entry]] * np.float32(2.0**e2m1_bits.SCALE_BIAS_LOG2)
        s2 = _bf16_value(_bf16_rne(scale.astype(np.float32)))
        for h in range(2):
            for pair in range(4):
                w = words[:, 2 * blk + h]
                bits = np.array([cache.setdefault((int(x), pair), pair_bits(int(x), pair)) for x in w], dtype=np.uint64)
                for half in range(2):
                    v = _bf16_value(((bits >> (16 * half)) & 0xFFFF).astype(np.uint16))
                    prod = (v.astype(np.float64) * s2.astype(np.float64)).astype(np.float32)  # exact, then RNE below
                    out[:, 16 * blk + 8 * h + 2 * pair + half] = _bf16_rne(prod)
    return out


def _records(plan, rng: np.random.Generator) -> np.ndarray:
    """Records whose code bytes take every value in every byte position and whose scale bytes take every finite E4M3
    value (0, subnormals, 448, both signs) in every block."""
    finite = [b for b in range(256) if b & 0x7F != 0x7F]  # 0x7F / 0xFF are E4M3 NaN: no writer stores them
    n = 2 * len(finite)
    rec = rng.integers(0, 256, size=(n, plan.record_bytes), dtype=np.uint8)
    pos = np.arange(256)
    for r in range(n):
        rec[r, plan.latent.data_offset : plan.latent.data_offset + 256] = (pos + 37 * r) % 256
        rec[r, plan.latent.scale_offset : plan.latent.scale_offset + 32] = [finite[(r + 7 * b) % len(finite)] for b in range(32)]
    return rec


@pytest.mark.parametrize("name", FOLD_FORMATS)
def test_rev2_decode_model_equals_the_codec_and_rev1(name):
    spec = get_format(name)
    plan = plan_for(spec)
    assert attention_tuning.fast_e2m1_eligible(plan)  # a format the fold decode (and so rev 2) serves
    rec = _records(plan, np.random.default_rng(10))
    k2 = _kernel_decode(plan, rec, e2m1_bits.e2m1_word_to_bf16x2_bits_r2)
    k1 = _kernel_decode(plan, rec, e2m1_bits.e2m1_word_to_bf16x2_bits)
    assert np.array_equal(k2, k1)  # the K tile's bytes
    fold = np.float32(2.0**e2m1_bits.FOLD_LOG2)
    got = _bf16_value(k2) * fold
    outer = [None] + ([0.37109375, 3.1e-3] if plan.outer_allowed else [])
    for s_l in outer:
        want = decode(spec, torch.from_numpy(rec), outer_scale=s_l)[0].numpy()
        mine = got if s_l is None else (got * np.float32(s_l)).astype(np.float32)  # the fold: 2^9 * s_l after the decode
        assert np.array_equal(mine.view(np.uint32), want.view(np.uint32)), (name, s_l)  # bitwise: signed zeros too


def test_decode_rev2_only_for_the_fold_formats():
    """The v3 kernel decodes through rev 2's words exactly where the fold decode runs (`fast_e2m1_eligible`); the other
    formats keep v2's per-value path (whose kernels rev 2 never touched)."""
    for name in ("bf16", "mxfp4", "nvfp4_fp8rope_st", "fp8_ds_mla"):
        assert not attention_tuning.fast_e2m1_eligible(plan_for(get_format(name))), name
    assert attention_tuning.fast_e2m1_eligible(plan_for(get_format("nvfp4")))
