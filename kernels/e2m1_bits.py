"""E2M1 pairs -> bf16x2 words by bit placement, and the fold constant that keeps them exact (pure Python).

Every E2M1 value {0, 0.5, 1, 1.5, 2, 3, 4, 6} times an E4M3 block scale (at most 4 significant bits)
has at most 6 significant bits, so it is exact in bf16 (8 bits). The attention kernel's fast decode
builds the two bf16 halves of a word straight from a byte of two codes:

- `prmt` puts the byte's low code in bits 0..3 and its high code in bits 16..19 (byte i of the word
  and of the word shifted right by 4: `PRMT_SELECTORS[i]`);
- the 3 magnitude bits (e e m) move to bf16 bits 8..6 of each half and the sign to bit 15: that bf16
  number is the E2M1 value times 2^-126 (code 1 = 0.5 becomes the bf16 subnormal 2^-127);
- one `mul.rn.bf16x2` by the block scale times 2^117 (`SCALE_BIAS`; at most 448 * 2^117 < 2^126,
  finite) makes E2M1 * scale * 2^-9, a normal bf16 number (at least 0.5 * 2^-9 * 2^-9), exactly.

The remaining 2^9 (`FOLD`) and the layer's outer scale s_l are not applied per element: the kernel
multiplies the latent part of each score and the output rows by FOLD * s_l in float32 instead.

`e2m1_byte_to_bf16x2_bits` is the word the kernel computes, written in Python; the CPU test checks
it against the codec's E2M1 table for all 256 bytes.
"""

from __future__ import annotations

PRMT_SELECTORS = (0x4400, 0x5511, 0x6622, 0x7733)  # byte i of a -> byte 0, byte i of b -> byte 2
MAG_MASK = 0x01C001C0  # (y << 6): the two 3-bit magnitudes at bf16 bits 8..6 of each half
SIGN_MASK = 0x80008000  # (y << 12): the two signs at bit 15 of each half
SCALE_BIAS_LOG2 = 117
FOLD_LOG2 = 126 - SCALE_BIAS_LOG2  # 9: scores and outputs are multiplied by 2^9 * s_l


def prmt(a: int, b: int, selector: int) -> int:
    """PTX `prmt.b32` in its default mode (no sign replication used: selector nibbles are 0..7)."""
    pool = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
    out = 0
    for j in range(4):
        src = (selector >> (4 * j)) & 0x7
        out |= ((pool >> (8 * src)) & 0xFF) << (8 * j)
    return out


def e2m1_word_to_bf16x2_bits(word: int, pair: int) -> int:
    """bf16x2 bits (high half = code 2*pair + 1, low half = code 2*pair) of E2M1 value * 2^-126."""
    y = prmt(word, word >> 4, PRMT_SELECTORS[pair])
    return ((y << 6) & MAG_MASK) | ((y << 12) & SIGN_MASK)


def e2m1_byte_to_bf16x2_bits(byte: int) -> int:
    return e2m1_word_to_bf16x2_bits(byte & 0xFF, 0)
