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

Decode rev 2 (`tuning.V3_DECODE_REV`, the default since its H200 GPU tests and bench): the same bf16x2 words in fewer
instructions (ncu: rev 1 issued ~6 SASS per pair, the producer is issue-bound). Per 32-bit word of
8 codes, once: the even codes (low nibbles) and the odd codes (high nibbles, shifted down) each masked to clean
bytes (`NIBBLES`). Per pair i: one `prmt` puts even code 2i in byte 0 and odd code 2i + 1 in byte 2 and zeros in
bytes 1 and 3 (a selector nibble with bit 3 set replicates the selected byte's bit 7, which is 0 in a clean
byte: `R2_SELECTORS`); one multiply by `SPREAD` = 2^6 + 2^12 adds the code shifted by 6 (magnitude at bits
8..6) and by 12 (sign at bit 15) in each half (the two copies do not overlap, so the sum is their OR); one
`and` with `FIELDS` keeps the magnitude and the sign. Same word as rev 1, then the same `mul.rn.bf16x2`.
`e2m1_word_to_bf16x2_bits_r2` is that sequence in Python.
"""

from __future__ import annotations

PRMT_SELECTORS = (0x4400, 0x5511, 0x6622, 0x7733)  # byte i of a -> byte 0, byte i of b -> byte 2
MAG_MASK = 0x01C001C0  # (y << 6): the two 3-bit magnitudes at bf16 bits 8..6 of each half
SIGN_MASK = 0x80008000  # (y << 12): the two signs at bit 15 of each half
SCALE_BIAS_LOG2 = 117
FOLD_LOG2 = 126 - SCALE_BIAS_LOG2  # 9: scores and outputs are multiplied by 2^9 * s_l

# decode rev 2 (module docstring): clean code bytes, one prmt, one multiply and one and per pair
NIBBLES = 0x0F0F0F0F  # one code per byte: w & NIBBLES (even codes), (w >> 4) & NIBBLES (odd codes)
R2_SELECTORS = tuple(i | (8 | i) << 4 | (4 + i) << 8 | (8 | i) << 12 for i in range(4))  # 0x8480, 0x9591, ...
SPREAD = (1 << 6) | (1 << 12)  # code << 6 (magnitude to bits 8..6) + code << 12 (sign to bit 15)
FIELDS = MAG_MASK | SIGN_MASK


def prmt(a: int, b: int, selector: int) -> int:
    """PTX `prmt.b32` in its default mode: selector nibble j picks byte (nibble & 7) of b:a for result byte j;
    with the nibble's bit 3 set, the picked byte's bit 7 is replicated over the result byte (PTX ISA, prmt)."""
    pool = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
    out = 0
    for j in range(4):
        nib = (selector >> (4 * j)) & 0xF
        byte = (pool >> (8 * (nib & 0x7))) & 0xFF
        if nib & 0x8:
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * j)
    return out


def e2m1_word_to_bf16x2_bits(word: int, pair: int) -> int:
    """bf16x2 bits (high half = code 2*pair + 1, low half = code 2*pair) of E2M1 value * 2^-126."""
    y = prmt(word, word >> 4, PRMT_SELECTORS[pair])
    return ((y << 6) & MAG_MASK) | ((y << 12) & SIGN_MASK)


def e2m1_byte_to_bf16x2_bits(byte: int) -> int:
    return e2m1_word_to_bf16x2_bits(byte & 0xFF, 0)


def e2m1_word_to_bf16x2_bits_r2(word: int, pair: int) -> int:
    """Decode rev 2's instruction sequence for pair `pair` of a code word (the same bits as rev 1's)."""
    word &= 0xFFFFFFFF
    even, odd = word & NIBBLES, (word >> 4) & NIBBLES
    t = prmt(even, odd, R2_SELECTORS[pair])
    return ((t * SPREAD) & 0xFFFFFFFF) & FIELDS
