"""Scalar device helpers for the kernels: exact float32 arithmetic and fp8 conversions as PTX.

The cache writers must agree bit for bit with the torch codecs (`mla_eval.formats`), so every
rounding step is spelled out as the PTX instruction named in `mla_eval/formats/spec.py`: `div.rn`,
`rcp.rn`, `mul.rn` (never contracted into an FMA), `cvt.rn.satfinite.e4m3x2.f32`,
`cvt.rn.bf16x2.f32`. Hopper (sm_90) has no E2M1 conversion instruction (`cvt...e2m1x2` needs
sm_100a/sm_120a), so E2M1 codes are computed by comparisons, exactly as `numerics.e2m1_encode`.

Call these only inside `@cute.jit` / `@cute.kernel` code. Importing this module imports `cutlass`.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32

from mla_eval_kernels.plan import e2m1_bits

FLT_MIN_BITS = 0x00800000  # 2^-126, the all-zero-group guard
FLT_MAX = 3.4028234663852886e38
LOG2_E = 1.4426950408889634  # the softmaxes' exp2 scaling
LN_2 = 0.6931471805599453


def f32_bits(x) -> Uint32:
    return cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[Uint32], read_only_args=[Float32(x)])


def bits_f32(u) -> Float32:
    return cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[Uint32(u)])


def div_rn(a, b) -> Float32:
    """IEEE float32 a / b, round to nearest even."""
    return cute.arch.inline_ptx(
        "div.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32], read_only_args=[Float32(a), Float32(b)]
    )


def rcp_rn(a) -> Float32:
    """Correctly rounded 1 / a."""
    return cute.arch.inline_ptx("rcp.rn.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[Float32(a)])


def rcp_approx_ftz(a) -> Float32:
    """The approximate reciprocal engines' NVFP4 writers use (not IEEE; see mla_eval/formats/approx.py)."""
    return cute.arch.inline_ptx("rcp.approx.ftz.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[Float32(a)])


def mul_rn(a, b) -> Float32:
    """a * b rounded once (never fused with a following add)."""
    return cute.arch.inline_ptx(
        "mul.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32], read_only_args=[Float32(a), Float32(b)]
    )


def sub_rn(a, b) -> Float32:
    """a - b rounded once."""
    return cute.arch.inline_ptx(
        "sub.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32], read_only_args=[Float32(a), Float32(b)]
    )


def fma_rn(a, b, c) -> Float32:
    """a * b + c rounded once (fused multiply-add)."""
    return cute.arch.inline_ptx(
        "fma.rn.f32 {$w0}, {$r0}, {$r1}, {$r2};", write_only_types=[Float32], read_only_args=[Float32(a), Float32(b), Float32(c)]
    )


def max_f32(a, b) -> Float32:
    return cute.arch.inline_ptx(
        "max.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32], read_only_args=[Float32(a), Float32(b)]
    )


def abs_f32(a) -> Float32:
    return cute.arch.inline_ptx("abs.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[Float32(a)])


def e4m3x2(hi, lo) -> Uint32:
    """Two float32 -> E4M3 (RNE, saturating): bits [15:8] = hi, [7:0] = lo, upper half zero."""
    return cute.arch.inline_ptx(
        "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, {$r0}, {$r1}; cvt.u32.u16 {$w0}, t; }",
        write_only_types=[Uint32],
        read_only_args=[Float32(hi), Float32(lo)],
    )


def e4m3_to_f32(code) -> Float32:
    """One E4M3 code (low byte of a u32) -> float32, exact."""
    return cute.arch.inline_ptx(
        "{ .reg .b16 c, h0, h1; .reg .b32 h; cvt.u16.u32 c, {$r0}; cvt.rn.f16x2.e4m3x2 h, c;"
        " mov.b32 {h0, h1}, h; cvt.f32.f16 {$w0}, h0; }",
        write_only_types=[Float32],
        read_only_args=[Uint32(code)],
    )


def e4m3x4_to_f32x4(word):
    """Four E4M3 codes in a u32 (byte i = element i) -> four float32, exact."""
    return cute.arch.inline_ptx(
        "{ .reg .b16 lo, hi, a0, a1, a2, a3; .reg .b32 h01, h23; mov.b32 {lo, hi}, {$r0};"
        " cvt.rn.f16x2.e4m3x2 h01, lo; cvt.rn.f16x2.e4m3x2 h23, hi;"
        " mov.b32 {a0, a1}, h01; mov.b32 {a2, a3}, h23;"
        " cvt.f32.f16 {$w0}, a0; cvt.f32.f16 {$w1}, a1; cvt.f32.f16 {$w2}, a2; cvt.f32.f16 {$w3}, a3; }",
        write_only_types=[Float32, Float32, Float32, Float32],
        read_only_args=[Uint32(word)],
    )


def bf16x2(hi, lo) -> Uint32:
    """Two float32 -> bf16 (RNE): bits [31:16] = hi, [15:0] = lo."""
    return cute.arch.inline_ptx(
        "cvt.rn.bf16x2.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Uint32], read_only_args=[Float32(hi), Float32(lo)]
    )


def e2m1_code(v) -> Uint32:
    """float32 -> E2M1 code 0..15 (RNE, saturating to 6), the comparisons of numerics.e2m1_encode."""
    a = abs_f32(v)
    code = Uint32(0)
    code = code + Uint32(a > Float32(0.25))
    code = code + Uint32(a >= Float32(0.75))
    code = code + Uint32(a > Float32(1.25))
    code = code + Uint32(a >= Float32(1.75))
    code = code + Uint32(a > Float32(2.5))
    code = code + Uint32(a >= Float32(3.5))
    code = code + Uint32(a > Float32(5.0))
    sign = (f32_bits(v) >> Uint32(31)) << Uint32(3)
    return code | sign


def e2m1_code_ties_away(v) -> Uint32:
    """float32 -> E2M1 code 0..15 as numerics.e2m1_encode_ties_away (SGLang's KVFP4): the magnitude counts the
    bounds |v| reaches (`>=`: exact float32 comparisons, so a tie goes away from zero), saturating at 6; the
    sign bit only for v < 0 (-0.0 gives code 0, unlike `e2m1_code`). v < 0 is read from the bits (sign set, magnitude
    not 0), so a negative subnormal v (a tiny value beside a huge one in its group) keeps its sign whatever a
    float compare's flush-to-zero mode; the bound comparisons are >= 0.25, where flushing changes nothing."""
    a = abs_f32(v)
    code = Uint32(0)
    for bound in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        code = code + Uint32(a >= Float32(bound))
    b = f32_bits(v)
    negative = (b >> Uint32(31)) & Uint32((b & Uint32(0x7FFFFFFF)) != Uint32(0))
    return code | (negative << Uint32(3))


@cute.jit
def floor_log2(a: Float32) -> Int32:
    """floor(log2 a) for positive finite float32, subnormals included (read from the bits)."""
    b = f32_bits(a)
    e = Int32(b >> Uint32(23)) - Int32(127)
    if b < Uint32(FLT_MIN_BITS):
        e = Int32(31) - Int32(cute.arch.clz(b)) - Int32(149)
    return e


@cute.jit
def pow2(e: Int32) -> Float32:
    """2^e for integer e in [-127, 127], exact (2^-127 is a float32 subnormal)."""
    bits = Uint32(0x00400000)
    if e >= Int32(-126):
        bits = Uint32(e + Int32(127)) << Uint32(23)
    return bits_f32(bits)


def warp_max(x, width: int) -> Float32:
    """max of x over aligned groups of `width` lanes (a power of two, at most 32)."""
    offset = 1
    while offset < width:
        x = max_f32(x, cute.arch.shuffle_sync_bfly(x, offset=offset))
        offset *= 2
    return x


def opaque_zero(n) -> Int32:
    """0 for any n >= 0 (min(n, 0)), computed at run time by one `min.s32`: neither the DSL's MLIR passes (the inline PTX
    is opaque to them) nor ptxas (which does not fold it) know it is 0, so two values offset by it from different n are
    not merged into one (`MlaAttentionV3.q_descriptors`)."""
    return cute.arch.inline_ptx("min.s32 {$w0}, {$r0}, 0;", write_only_types=[Int32], read_only_args=[Int32(n)])


def shfl_idx(x, src_lane):
    return cute.arch.shuffle_sync(x, offset=src_lane)


def e2m1_nibble_to_f32(word, i: int) -> Float32:
    """E2M1 code in nibble i of `word` -> float32, exact, in 3 integer ops and one multiply.

    The code's magnitude bits (e e m) go to float32 bits 24..22 and its sign to bit 31: that is
    2^(e-127) * (1 + m/2) (a subnormal for e = 0), and times 2^126 exactly the E2M1 value
    {0, .5, 1, 1.5, 2, 3, 4, 6}. `mul.rn.f32` (no .ftz) keeps the subnormal input.
    """
    shift = 22 - 4 * i
    mag = (word << Uint32(shift)) if shift >= 0 else (word >> Uint32(-shift))
    sign = word << Uint32(28 - 4 * i)
    bits = (mag & Uint32(0x01C00000)) | (sign & Uint32(0x80000000))
    return mul_rn(bits_f32(bits), Float32(2.0**126))


def e2m1x8_scaled_bf16x2(word, scale2):
    """Eight E2M1 codes (nibble i = element i) -> four bf16x2 words of E2M1 * block scale * 2^-9, exact.

    `scale2` holds the block scale times 2^117 in both bf16 halves. The bit placement and its
    constants are in `e2m1_bits` (with a Python model the CPU tests check); here 4 prmt, shifts,
    masks and one `mul.rn.bf16x2` per pair, instead of a float32 multiply and a conversion per value.
    """
    sel = e2m1_bits.PRMT_SELECTORS
    mag, sgn = e2m1_bits.MAG_MASK, e2m1_bits.SIGN_MASK
    body = " ".join(
        f"prmt.b32 y, {{$r0}}, w4, {sel[i]:#x}; shl.b32 a, y, 6; shl.b32 b, y, 12; and.b32 a, a, {mag:#x};"
        f" and.b32 b, b, {sgn:#x}; or.b32 a, a, b; mul.rn.bf16x2 {{$w{i}}}, a, {{$r1}};"
        for i in range(4)
    )
    return cute.arch.inline_ptx(
        "{ .reg .b32 w4, y, a, b; shr.b32 w4, {$r0}, 4; " + body + " }",
        write_only_types=[Uint32, Uint32, Uint32, Uint32],
        read_only_args=[Uint32(word), Uint32(scale2)],
    )


def e2m1x8_scaled_bf16x2_r2(word, scale2):
    """`e2m1x8_scaled_bf16x2`'s four words (the same bits) in decode rev 2's sequence (`e2m1_bits`, its Python model):
    two masks and a shift per word, then per pair one prmt, one multiply, one and and the `mul.rn.bf16x2`."""
    sel = e2m1_bits.R2_SELECTORS
    body = " ".join(
        f"prmt.b32 t, e, o, {sel[i]:#x}; mul.lo.u32 t, t, {e2m1_bits.SPREAD:#x}; and.b32 t, t, {e2m1_bits.FIELDS:#x};"
        f" mul.rn.bf16x2 {{$w{i}}}, t, {{$r1}};"
        for i in range(4)
    )
    return cute.arch.inline_ptx(
        f"{{ .reg .b32 e, o, t; and.b32 e, {{$r0}}, {e2m1_bits.NIBBLES:#x}; shr.b32 o, {{$r0}}, 4;"
        f" and.b32 o, o, {e2m1_bits.NIBBLES:#x}; " + body + " }",
        write_only_types=[Uint32, Uint32, Uint32, Uint32],
        read_only_args=[Uint32(word), Uint32(scale2)],
    )
