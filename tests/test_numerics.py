"""Element conversions against vectors derived by hand from the E2M1 / E4M3 / E8M0 definitions."""

import math

import pytest
import torch

from mla_eval.formats import numerics as nx


def f32(values):
    return torch.tensor(values, dtype=torch.float32)


# E2M1: s | e1 e0 | m ; value = 2^(e-1) * (1 + m/2) for e > 0, m * 0.5 for e = 0.
E2M1_TABLE = {0b0000: 0.0, 0b0001: 0.5, 0b0010: 1.0, 0b0011: 1.5, 0b0100: 2.0, 0b0101: 3.0, 0b0110: 4.0, 0b0111: 6.0}


def test_e2m1_every_code_point():
    for code, value in E2M1_TABLE.items():
        assert nx.e2m1_encode(f32([value])).item() == code
        assert nx.e2m1_encode(f32([-value])).item() == code | 0b1000
        assert nx.e2m1_decode(torch.tensor([code], dtype=torch.uint8)).item() == value
        assert nx.e2m1_decode(torch.tensor([code | 8], dtype=torch.uint8)).item() == -value


@pytest.mark.parametrize(
    "x, code",
    [
        # exact midpoints: ties go to the even code
        (0.25, 0b0000),  # 0 (code 0) vs 0.5 (code 1)
        (0.75, 0b0010),  # 0.5 (1) vs 1.0 (2)
        (1.25, 0b0010),  # 1.0 (2) vs 1.5 (3)
        (1.75, 0b0100),  # 1.5 (3) vs 2.0 (4)
        (2.5, 0b0100),  # 2 (4) vs 3 (5)
        (3.5, 0b0110),  # 3 (5) vs 4 (6)
        (5.0, 0b0110),  # 4 (6) vs 6 (7)
        # either side of each midpoint
        (0.2499, 0), (0.2501, 1), (0.7499, 1), (0.7501, 2), (1.2499, 2), (1.2501, 3),
        (1.7499, 3), (1.7501, 4), (2.4999, 4), (2.5001, 5), (3.4999, 5), (3.5001, 6),
        (4.9999, 6), (5.0001, 7),
        # saturation
        (6.5, 7), (7.0, 7), (1e30, 7),
    ],
)
def test_e2m1_rounding_boundaries(x, code):
    assert nx.e2m1_encode(f32([x])).item() == code
    assert nx.e2m1_encode(f32([-x])).item() == code | 8


def test_e2m1_negative_zero_and_tiny_negatives_keep_the_sign():
    assert nx.e2m1_encode(f32([-0.0])).item() == 0b1000
    assert nx.e2m1_encode(f32([-0.1])).item() == 0b1000
    assert nx.e2m1_encode(f32([0.0])).item() == 0


def test_e2m1_packing_low_nibble_first():
    codes = torch.tensor([0x7, 0xD, 0x1, 0x0], dtype=torch.uint8)
    packed = nx.e2m1_pack(codes)
    assert packed.tolist() == [0xD7, 0x01]
    assert nx.e2m1_unpack(packed).tolist() == codes.tolist()


# E4M3 (fn): s | eeee | mmm, bias 7; value = 2^(e-7) * (1 + m/8), subnormal (e=0) m * 2^-9.
@pytest.mark.parametrize(
    "x, bits",
    [
        (1.0, 0x38),  # e=7, m=0
        (1.125, 0x39),
        (448.0, 0x7E),  # e=15, m=6: largest finite
        (-448.0, 0xFE),
        (464.0, 0x7E),  # midpoint of 448 and the (NaN) 480: saturates
        (480.0, 0x7E),
        (1e9, 0x7E),
        (-1e9, 0xFE),
        (2.0**-6, 0x08),  # smallest normal
        (2.0**-9, 0x01),  # smallest subnormal
        (7 * 2.0**-9, 0x07),  # largest subnormal
        (2.0**-10, 0x00),  # tie between 0 and 2^-9: even -> 0
        (3 * 2.0**-10, 0x02),  # tie between 2^-9 (m=1) and 2^-8 (m=2): even -> m=2
        (1.0625, 0x38),  # tie between 1.0 (m=0) and 1.125 (m=1) -> m=0
        (1.1875, 0x3A),  # tie between 1.125 (m=1) and 1.25 (m=2) -> m=2
        (1.0626, 0x39),
        (0.0, 0x00),
        (-0.0, 0x80),
    ],
)
def test_e4m3_encode(x, bits):
    assert nx.e4m3_encode(f32([x])).item() == bits


def test_e4m3_decode_all_finite_codes():
    for b in range(256):
        if b & 0x7F == 0x7F:
            continue  # NaN
        s = -1.0 if b & 0x80 else 1.0
        e, m = (b >> 3) & 0xF, b & 0x7
        want = s * (m * 2.0**-9 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8))
        got = nx.e4m3_decode(torch.tensor([b], dtype=torch.uint8)).item()
        assert got == want or (want == 0 and got == 0), (b, got, want)


def test_e8m0_floor_log2_exact():
    xs = f32([6.0, 4.0, 3.999, 1.0, 0.75, 2.0**-126, 2.0**-140, 3.0 * 2.0**100])
    want = [2, 2, 1, 0, -1, -126, -140, 101]
    assert nx.e8m0_floor_log2(xs).tolist() == want


def test_bf16_bytes_little_endian_and_rne():
    raw = nx.bf16_encode(f32([1.0, -2.0]))
    assert raw.tolist() == [0x80, 0x3F, 0x00, 0xC0]
    # 1 + 2^-8 is the midpoint between 1.0 and 1 + 2^-7: ties to even -> 1.0
    assert nx.bf16_encode(f32([1.0 + 2.0**-8])).tolist() == [0x80, 0x3F]
    assert nx.bf16_encode(f32([1.0 + 3 * 2.0**-8])).tolist() == [0x82, 0x3F]
    assert nx.bf16_decode(raw).tolist() == [1.0, -2.0]


def test_f32_bytes_roundtrip():
    x = f32([1.0, 2.0**-126, -math.pi])
    raw = nx.f32_to_bytes(x)
    assert raw[:4].tolist() == [0x00, 0x00, 0x80, 0x3F]
    assert raw[4:8].tolist() == [0x00, 0x00, 0x80, 0x00]
    assert torch.equal(nx.f32_from_bytes(raw), x)
