"""Bit-exact element conversions used by every cache codec.

All conversions take float32 tensors and round to nearest, ties to even, saturating to the largest
finite value, exactly like the PTX instructions the GPU writers use (`cvt.rn.satfinite.e4m3x2.f32`,
`cvt.rn.satfinite.e2m1x2.f32`, `cvt.rn.bf16.f32`). Signs are kept, so -0.0 and negative values
that round to zero encode with the sign bit set. Inputs are assumed finite: the codec checks that
first, with a message naming the position.

Element types (OCP / NVIDIA definitions):
- E4M3 ("fn" variant): 1 sign, 4 exponent (bias 7), 3 mantissa bits; max 448; smallest normal
  2^-6, subnormals are multiples of 2^-9; no infinities, 0x7F/0xFF are NaN (never produced here).
- E2M1: 1 sign, 2 exponent (bias 1), 1 mantissa bit; magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
- E8M0: an unsigned biased exponent, value 2^(code - 127); 0xFF is NaN (never produced here).
"""

from __future__ import annotations

import torch

from mla_eval.formats.spec import FLT_MIN  # noqa: F401 - re-exported: the all-zero-group guard

E4M3_MAX = 448.0
E4M3_MAX_CODE = 0x7E  # the bit pattern of +448 (positive E4M3 codes are ordered like their values)
E2M1_MAX = 6.0

# Magnitude of each E2M1 code 0..7 (code 8..15 are the same values negated).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _check_f32(x: torch.Tensor) -> None:
    if x.dtype != torch.float32:
        raise TypeError(f"expected float32, got {x.dtype}")


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 -> uint8 E4M3 bit patterns, RNE with saturation to +-448."""
    _check_f32(x)
    # Clamping first turns torch's overflow-to-NaN cast into satfinite; values inside the range
    # are rounded by torch's bit-exact RNE conversion (subnormals included).
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(bits: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 bit patterns -> float32 (exact)."""
    return bits.view(torch.float8_e4m3fn).to(torch.float32)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 -> uint8 holding one E2M1 code (0..15) per element, RNE with saturation to +-6.

    The code of |x| counts the rounding boundaries it has passed. At a boundary that lies exactly
    between two representable values (a tie), RNE picks the one with the even code, so the
    comparison is `>` where the upper neighbour's code is odd and `>=` where it is even.
    """
    _check_f32(x)
    a = x.abs()
    code = (
        (a > 0.25).to(torch.uint8)  # 0 | 0.5 : tie goes down to code 0
        + (a >= 0.75).to(torch.uint8)  # 0.5 | 1 : tie goes up to code 2
        + (a > 1.25).to(torch.uint8)  # 1 | 1.5
        + (a >= 1.75).to(torch.uint8)  # 1.5 | 2
        + (a > 2.5).to(torch.uint8)  # 2 | 3
        + (a >= 3.5).to(torch.uint8)  # 3 | 4
        + (a > 5.0).to(torch.uint8)  # 4 | 6 ; everything above 6 saturates to code 7
    )
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_encode_ties_away(x: torch.Tensor) -> torch.Tensor:
    """float32 -> E2M1 codes as SGLang's KVFP4 quantiser: the magnitude code counts the bounds
    (0.25, 0.75, ..., 5) that |x| reaches (`>=`, so ties go away from zero), saturating at 6; the sign
    bit is set for x < 0 only (-0.0 stays +0)."""
    _check_f32(x)
    a = x.abs()
    code = sum((a >= b).to(torch.uint8) for b in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0))
    return code | ((x < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (0..15) -> float32 (exact)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def e2m1_pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes; element 2i in the low nibble, 2i+1 in the high nibble."""
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def e2m1_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] codes (inverse of e2m1_pack)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)


def e8m0_floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2(x)) for positive finite float32, exact (read from the bits; subnormals too)."""
    _check_f32(x)
    mantissa, exponent = torch.frexp(x)  # x = m * 2^e with m in [0.5, 1)
    del mantissa
    return exponent.to(torch.int32) - 1


def bf16_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 [..., n] -> uint8 [..., 2n]: bf16 RNE, little-endian bytes."""
    _check_f32(x)
    return x.to(torch.bfloat16).view(torch.uint8)


def bf16_decode(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2n] little-endian bf16 -> float32 [..., n] (exact)."""
    return raw.contiguous().view(torch.bfloat16).to(torch.float32)


def f32_to_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 [..., n] -> uint8 [..., 4n], little-endian."""
    _check_f32(x)
    return x.contiguous().view(torch.uint8)


def f32_from_bytes(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4n] little-endian -> float32 [..., n]."""
    return raw.contiguous().view(torch.float32)
