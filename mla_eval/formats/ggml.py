"""ggml's block quantisers (llama.cpp KV cache types) as vectorised torch, bit for bit.

llama.cpp stores an MLA layer's cache as one K row per token: the 512 latent values followed by the 64
rotated rope values (576 values, V a view of the latent part), quantised with the `-ctk` block type in
blocks of 32 consecutive values: 16 latent blocks, then 2 rope blocks. The arithmetic follows ggml's
reference quantisers, `quantize_row_q8_0_ref`, `quantize_row_q4_0_ref` and `quantize_row_q5_1_ref` in
ggml-org/llama.cpp@36491e4024b3016e6e2d21afc140add042b44bec ggml/src/ggml-quants.c, which the CPU backend's
`from_float` (the K cache's set_rows) calls for q4_0 and q5_1 on every architecture (ggml/src/ggml-cpu/quants.c
forwards `quantize_row_q4_0` / `_q5_1` to them) and for q8_0 where no SIMD override exists (the llama.cpp
specs' engine notes in builtin.py name the x86, ARM and CUDA writers, which can differ). All steps are float32:

- q8_0 (34 B): amax = max |x|; d = amax / 127; id = d != 0 ? 1 / d : 0; stored fp16(d) (RNE); codes
  roundf(x * id) (half away from zero) as int8. Block = [d fp16 | 32 x int8].
- q4_0 (18 B): m = the first value of largest |x| (+0 for an all-zero block); d = m / -8; id as above; stored
  fp16(d); code = min(15, trunc(x * id + 8.5)); byte j holds value j (low nibble) and value j + 16 (high).
- q5_1 (24 B): lo / hi = the first minimal / maximal value; d = (hi - lo) / 31; id as above; stored fp16(d),
  fp16(lo); code = trunc((x - lo) * id + 0.5) (low 8 bits); nibbles as q4_0, bit 4 of value j's code is bit
  j of the little-endian uint32 qh. Block = [d fp16 | m fp16 | qh 4 B | 16 B nibbles].

The decoders are ggml's `dequantize_row_*`: q * d, (q - 8) * d, q * d + m (each product exact in float32, so
a fused multiply-add gives the same value). Inputs are finite (the codec checks); where a reciprocal
overflows (amax below about 127 * 2^-128) C's float-to-int conversion of inf / NaN is undefined in the
engine, and these codecs clamp to the code range and map NaN to code 0 instead.
"""

from __future__ import annotations

import torch

from mla_eval.formats.spec import GGML_BLOCK_BYTES
from mla_eval.formats.spec import GGML_BLOCK_VALUES as BLOCK  # QK8_0 = QK4_0 = QK5_1 = 32


def _f32(x: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, x)


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 [..., n] -> uint8 [..., 2n]: fp16 RNE (overflow to inf), little-endian (GGML_FP32_TO_FP16)."""
    return x.to(torch.float16).contiguous().view(torch.uint8)


def _fp16_values(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float16).to(torch.float32)


def _reciprocal(d: torch.Tensor) -> torch.Tensor:
    """`d ? 1.0f / d : 0.0f` (-0 counts as 0)."""
    return torch.where(d != 0, torch.ones_like(d) / d, torch.zeros_like(d))


def _first_where(mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x at the first index along the last dim where mask holds (mask holds somewhere in every row)."""
    idx = mask.to(torch.int8).argmax(dim=-1, keepdim=True)  # argmax returns the first maximal index
    return x.gather(-1, idx).squeeze(-1)


def _to_int(v: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """An integral float32 value as int32, clamped to [lo, hi]; NaN -> 0 (see the module note)."""
    return torch.nan_to_num(v, nan=0.0).clamp(lo, hi).to(torch.int32)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C roundf: the nearest integer, halves away from zero (exact: |v| + 0.5 is exact in float64)."""
    a = v.abs().double()
    return torch.copysign(torch.floor(a + 0.5), v.double()).float()


def _nibbles(lo_codes: torch.Tensor, hi_codes: torch.Tensor) -> torch.Tensor:
    return ((lo_codes & 0xF) | ((hi_codes & 0xF) << 4)).to(torch.uint8)


def encode(kind: str, x: torch.Tensor) -> torch.Tensor:
    """float32 [..., n] (n a multiple of 32) -> uint8 [..., n / 32 * block_bytes]."""
    b = x.reshape(*x.shape[:-1], -1, BLOCK)
    if kind == "q8_0":
        amax = b.abs().amax(dim=-1)
        d = amax / _f32(127.0, amax)
        q = _to_int(_round_half_away(b * _reciprocal(d).unsqueeze(-1)), -128, 127)
        block = torch.cat([_fp16_bytes(d.unsqueeze(-1)), q.to(torch.int8).view(torch.uint8)], dim=-1)
    elif kind == "q4_0":
        a = b.abs()
        amax = a.amax(dim=-1)
        m = torch.where(amax > 0, _first_where(a == amax.unsqueeze(-1), b), torch.zeros_like(amax))
        d = m / _f32(-8.0, m)
        v = b * _reciprocal(d).unsqueeze(-1) + 8.5
        q = _to_int(torch.trunc(v), -128, 127).clamp_max(15)  # (int8_t)(x0 + 8.5f), then MIN(15, .)
        block = torch.cat([_fp16_bytes(d.unsqueeze(-1)), _nibbles(q[..., :16], q[..., 16:])], dim=-1)
    elif kind == "q5_1":
        lo = _first_where(b == b.amin(dim=-1, keepdim=True), b)
        hi = _first_where(b == b.amax(dim=-1, keepdim=True), b)
        d = (hi - lo) / _f32(31.0, lo)
        v = (b - lo.unsqueeze(-1)) * _reciprocal(d).unsqueeze(-1) + 0.5
        q = _to_int(torch.trunc(v), 0, 255)  # (uint8_t)(x0 + 0.5f): no clamp to 31 in the engine either
        bit4 = ((q >> 4) & 1).to(torch.int64)
        qh = (bit4 << torch.arange(BLOCK, device=x.device)).sum(dim=-1)  # bit j = bit 4 of value j's code
        qh_bytes = torch.stack([(qh >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8)
        block = torch.cat([_fp16_bytes(torch.stack([d, lo], dim=-1)), qh_bytes, _nibbles(q[..., :16], q[..., 16:])],
                          dim=-1)
    else:
        raise AssertionError(kind)
    return block.flatten(-2)


def decode(kind: str, raw: torch.Tensor) -> torch.Tensor:
    """uint8 [..., blocks * block_bytes] -> float32 [..., blocks * 32] (ggml's dequantize_row_*)."""
    b = raw.reshape(*raw.shape[:-1], -1, GGML_BLOCK_BYTES[kind])
    d = _fp16_values(b[..., 0:2])  # [..., blocks, 1]
    if kind == "q8_0":
        vals = b[..., 2:].view(torch.int8).to(torch.float32) * d
    else:
        qs = b[..., -16:]
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1).to(torch.int32)
        if kind == "q4_0":
            vals = (q - 8).to(torch.float32) * d
        else:  # q5_1
            m = _fp16_values(b[..., 2:4])
            qh = sum(b[..., 4 + i].to(torch.int64) << (8 * i) for i in range(4))
            high = ((qh.unsqueeze(-1) >> torch.arange(BLOCK, device=raw.device)) & 1).to(torch.int32) << 4
            vals = (q | high).to(torch.float32) * d + m
    return vals.flatten(-2)
