"""Cache writer: latent [T, 512] + rope [T, 64] -> records in a paged cache, for every format.

`write_cache(plan, latent, rope, slot_mapping, cache, outer_scale=None)` encodes token t into the
record of slot `slot_mapping[t]` (block = slot // block_size, offset = slot % block_size; the
cache `uint8 [num_blocks, block_size, record_bytes]` is contiguous, so that is record `slot` of
the flat [num_slots, record_bytes] view); slots < 0 are skipped. The bytes are those of
`mla_eval.formats.encode` for the same inputs, bit for bit: the arithmetic follows
`mla_eval/formats/spec.py` step by step (see kernels/ptx.py for the PTX of each rounding).

Kernel: one warp per token, 4 warps per CTA. Lane l owns latent values [16 l, 16 l + 16) (one
32-byte load) and rope values [2 l, 2 l + 2). Group amax: a butterfly max over the group's lanes
(group / 16 lanes), the token amax (s_t) and the rope amax over all 32 (over 8 lanes for an E2M1
rope with a scale per 16). Every field is stored as 32-bit words; byte-sized scales, fp8 rope bytes
and E2M1 rope bytes are gathered into words with shuffles; zero
padding is written too, so a record is fully defined whatever the cache held before.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32

from mla_eval.formats.spec import TOKEN_SCALE_DENOMINATOR
from mla_eval_kernels.cute import ptx
from mla_eval_kernels.cute.compile_cache import arch_tag, compiled
from mla_eval_kernels.plan.record_plan import (
    APPLY_DIV,
    APPLY_MUL_RCP_APPROX,
    ORDER_8X4,
    ROUND_TIES_AWAY,
    RULE_AMAX_E4M3,
    RULE_AMAX_E4M3_RCP6,
    RULE_AMAX_E4M3_UP,
    RULE_AMAX_FP32,
    RULE_AMAX_FP32_MUL,
    RULE_AMAX_FP32_POW2,
    RULE_E8M0_CEIL,
    RULE_OCP_E8M0,
    RecordPlan,
)

WARPS_PER_CTA = 4
_TORCH_TO_CUTE = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32}


def _amax_rcp6(amax) -> Float32:
    """amax * rcp.approx.ftz(6): NVIDIA's NVFP4 block-scale step (codec `_amax_rcp6`; the measured rcp.approx(6)
    equals f32(1/6), mla_eval/formats/approx.py), shared by the E4M3_RCP6 rule and the residual coding."""
    return ptx.mul_rn(amax, ptx.rcp_approx_ftz(Float32(6.0)))


def _e2m1_code(coding, v) -> Uint32:
    """The E2M1 code of v under the coding's rounding (a compile-time choice): RNE, or SGLang's ties away."""
    if coding.elem_rounding == ROUND_TIES_AWAY:
        return ptx.e2m1_code_ties_away(v)
    return ptx.e2m1_code(v)


class CacheWriter:
    """One compiled writer per (plan, input dtype, outer scale on/off)."""

    def __init__(self, plan: RecordPlan, in_dtype: type, has_outer: bool):
        self.plan = plan
        self.in_dtype = in_dtype
        self.has_outer = has_outer

    @cute.jit
    def __call__(
        self,
        latent_ptr: cute.Pointer,
        rope_ptr: cute.Pointer,
        slot_ptr: cute.Pointer,
        cache_ptr: cute.Pointer,
        num_tokens: Int32,
        s_l: Float32,
        stream: cuda.CUstream,
    ):
        m_latent = cute.make_tensor(latent_ptr, cute.make_layout((num_tokens, 512), stride=(512, 1)))
        m_rope = cute.make_tensor(rope_ptr, cute.make_layout((num_tokens, 64), stride=(64, 1)))
        m_slot = cute.make_tensor(slot_ptr, cute.make_layout(num_tokens))
        grid = (num_tokens + WARPS_PER_CTA - 1) // WARPS_PER_CTA
        self.kernel(m_latent, m_rope, m_slot, cache_ptr, num_tokens, s_l).launch(
            grid=[grid, 1, 1], block=[32 * WARPS_PER_CTA, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        m_latent: cute.Tensor,
        m_rope: cute.Tensor,
        m_slot: cute.Tensor,
        cache_ptr: cute.Pointer,
        num_tokens: Int32,
        s_l: Float32,
    ):
        plan = self.plan
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        token = bidx * WARPS_PER_CTA + tidx // 32
        slot = Int64(-1)
        if token < num_tokens:
            slot = Int64(m_slot[token])
        if slot >= Int64(0):
            record = cute.make_tensor(cache_ptr + slot * Int64(plan.record_words), cute.make_layout(plan.record_words))

            # ---- load: 16 latent values and 2 rope values per lane, as float32 (exact) ----
            g_lat = cute.local_tile(m_latent[token, None], (16,), (lane,))
            r_lat = cute.make_rmem_tensor((16,), self.in_dtype)
            cute.autovec_copy(g_lat, r_lat)
            v = cute.make_rmem_tensor((16,), Float32)
            v.store(r_lat.load().to(Float32))
            g_rope = cute.local_tile(m_rope[token, None], (2,), (lane,))
            r_rope = cute.make_rmem_tensor((2,), self.in_dtype)
            cute.autovec_copy(g_rope, r_rope)
            w = cute.make_rmem_tensor((2,), Float32)
            w.store(r_rope.load().to(Float32))

            # ---- 1. outer scale: v = c * rcp.rn(s_l), rounded to bf16 where the engine scales in bf16 ----
            if cutlass.const_expr(self.has_outer):
                r_l = ptx.rcp_rn(s_l)
                for i in cutlass.range_constexpr(16):
                    v[i] = ptx.mul_rn(v[i], r_l)
                if cutlass.const_expr(plan.outer_bf16):
                    for i in cutlass.range_constexpr(8):
                        pair = ptx.bf16x2(v[2 * i + 1], v[2 * i])  # RNE; [31:16] odd value, [15:0] even value
                        v[2 * i] = ptx.bits_f32(pair << Uint32(16))
                        v[2 * i + 1] = ptx.bits_f32(pair & Uint32(0xFFFF0000))
                if cutlass.const_expr(plan.outer_on_rope):
                    for i in cutlass.range_constexpr(2):
                        w[i] = ptx.mul_rn(w[i], r_l)

            # ---- 2. per-token scale s_t = max(amax / 2688, FLT_MIN) ----
            if cutlass.const_expr(plan.token_scale_offset >= 0):
                amax = self._local_amax(v, 16)
                amax = ptx.warp_max(amax, 32)
                s_t = ptx.max_f32(ptx.div_rn(amax, Float32(TOKEN_SCALE_DENOMINATOR)), ptx.bits_f32(ptx.FLT_MIN_BITS))
                r_t = ptx.rcp_rn(s_t)
                for i in cutlass.range_constexpr(16):
                    v[i] = ptx.mul_rn(v[i], r_t)
                if lane == 0:
                    record[plan.token_scale_offset // 4] = ptx.f32_bits(s_t)

            # ---- 3./4. latent: group scale, elements ----
            lat = plan.latent
            lanes_per_group = lat.group // 16
            if cutlass.const_expr(lat.scale_dtype != ""):
                amax = ptx.warp_max(self._local_amax(v, 16), lanes_per_group)
                s_bits, r, s = self._group_scale(lat, amax)
                r = self._reciprocal(lat, r, s)
                for i in cutlass.range_constexpr(16):
                    v[i] = self._apply_scale(lat, v[i], r, s, amax)
                self._store_scales(record, lat, s_bits, lane, lanes_per_group)
            self._store_latent(record, lat, v, lane)

            # ---- rope ----
            rope = plan.rope
            if cutlass.const_expr(rope.residual):
                self._store_rope_residual(record, rope, w, lane)
            elif cutlass.const_expr(rope.scale_dtype != ""):
                rope_lanes = rope.group // 2  # lanes per rope group (2 values per lane): 32, or 8 for E4M3 per 16
                amax = ptx.warp_max(self._local_amax(w, 2), rope_lanes)
                s_bits, r, s = self._group_scale(rope, amax)
                r = self._reciprocal(rope, r, s)
                for i in cutlass.range_constexpr(2):
                    w[i] = self._apply_scale(rope, w[i], r, s, amax)
                if cutlass.const_expr(rope.scale_dtype == "fp32"):
                    if lane == 0:
                        record[rope.scale_offset // 4] = s_bits
                else:
                    # one byte per group, group g's scale held by lane g * rope_lanes; bytes 4k..4k+3 in word k
                    word = Uint32(0)
                    for j in cutlass.range_constexpr(4):
                        word = word | (ptx.shfl_idx(s_bits, ((lane * 4 + j) * rope_lanes) % 32) << Uint32(8 * j))
                    if lane < rope.n_groups // 4:
                        record[rope.scale_offset // 4 + lane] = word
            if cutlass.const_expr(not rope.residual):
                self._store_rope(record, rope, w, lane)

            # ---- zero padding ----
            for p in cutlass.range_constexpr(len(plan.pads)):
                if lane < plan.pads[p][1] // 4:
                    record[plan.pads[p][0] // 4 + lane] = Uint32(0)

    # ------------------------------------------------------------------ helpers (inlined)
    @cute.jit
    def _local_amax(self, x: cute.Tensor, n: cutlass.Constexpr[int]) -> Float32:
        a = ptx.abs_f32(x[0])
        for i in cutlass.range_constexpr(1, n):
            a = ptx.max_f32(a, ptx.abs_f32(x[i]))
        return a

    @cute.jit
    def _reciprocal(self, coding: cutlass.Constexpr, r: Float32, s: Float32) -> Float32:
        """The engine's reciprocal of the group scale: rcp.approx.ftz of an E4M3 scale where the engine
        uses it (the codec reads the same values from the H200 table), 0 for s = 0. For an fp32 scale
        the codec, and so this writer, keeps rcp.rn (not tabulable; the residual is measured apart)."""
        if cutlass.const_expr(coding.apply == APPLY_MUL_RCP_APPROX and coding.scale_dtype == "e4m3"):
            if cutlass.const_expr(coding.global_quant is not None):
                # TensorRT-LLM: rcp.approx.ftz(s * rcp.approx.ftz(SFScaleVal)); the codec takes both with rcp.rn,
                # which the H200 measurement found equal for the default S and every E4M3 s
                # (results/published/h200/engine-formats/trtllm_nvfp4_residual.json: table_differs_from_correctly_rounded = 0)
                prod = ptx.mul_rn(s, ptx.rcp_approx_ftz(Float32(coding.global_quant)))
                r = ptx.rcp_approx_ftz(prod)
                r = Float32(0.0) if prod == Float32(0.0) else r
            else:
                r = ptx.rcp_approx_ftz(s)
                r = Float32(0.0) if s == Float32(0.0) else r
        return r

    @cute.jit
    def _apply_scale(self, coding: cutlass.Constexpr, x: Float32, r: Float32, s: Float32, amax: Float32) -> Float32:
        """Step 4 of spec.py: div.rn(x, s) where the engine divides, else mul.rn(x, r); +0 for a
        zero scale where the engine clears such a group; +-6 (+6 for a zero) where the engine's factor is
        rcp.approx(0) = +inf because the scale underflowed although the group amax is not 0."""
        if cutlass.const_expr(coding.apply == APPLY_DIV):
            y = ptx.div_rn(x, s)
        else:
            y = ptx.mul_rn(x, r)
        if cutlass.const_expr(coding.zero_scale_clears):
            y = Float32(0.0) if s == Float32(0.0) else y
        if cutlass.const_expr(coding.zero_scale_saturates):
            six = Float32(6.0)
            if x != Float32(0.0):  # -0.0 == 0: 0 * inf is NaN, which cvt .satfinite takes to +MAX_NORM
                six = ptx.bits_f32((ptx.f32_bits(x) & Uint32(0x80000000)) | ptx.f32_bits(Float32(6.0)))
            if s == Float32(0.0) and amax > Float32(0.0):
                y = six
        return y

    @cute.jit
    def _group_scale(self, coding: cutlass.Constexpr, amax: Float32):
        """(stored scale as a u32: fp32 bits or a code byte, reciprocal r, decoded scale s) for one group."""
        # The spec's floor of amax / qmax (a float32 constant: FLT_MIN for vLLM, 1e-4 for FlashMLA).
        floor = Float32(coding.scale_floor)
        if cutlass.const_expr(coding.rule == RULE_AMAX_FP32):
            s = ptx.max_f32(ptx.div_rn(amax, Float32(coding.qmax)), floor)
            return ptx.f32_bits(s), ptx.rcp_rn(s), s
        if cutlass.const_expr(coding.rule == RULE_AMAX_FP32_POW2):
            s0 = ptx.max_f32(ptx.div_rn(amax, Float32(coding.qmax)), floor)
            b = ptx.f32_bits(s0)
            up = ((b >> Uint32(23)) + Uint32(1)) << Uint32(23)
            b = b if (b & Uint32(0x007FFFFF)) == Uint32(0) else up
            s = ptx.bits_f32(b)
            return b, ptx.rcp_rn(s), s
        if cutlass.const_expr(coding.rule == RULE_AMAX_E4M3):
            code = ptx.e4m3x2(Float32(0.0), ptx.div_rn(amax, Float32(6.0))) & Uint32(0xFF)
            s = ptx.e4m3_to_f32(code)
            r = ptx.rcp_rn(s)
            r = Float32(0.0) if s == Float32(0.0) else r
            return code, r, s
        if cutlass.const_expr(coding.rule == RULE_AMAX_E4M3_RCP6):
            # NVIDIA's recipe: amax * rcp.approx.ftz(6), times the engine's SFScaleVal (rounded after the
            # inner product), RN satfinite to E4M3
            sf = _amax_rcp6(amax)
            if cutlass.const_expr(coding.global_quant is not None):
                sf = ptx.mul_rn(sf, Float32(coding.global_quant))
            code = ptx.e4m3x2(Float32(0.0), sf) & Uint32(0xFF)
            s = ptx.e4m3_to_f32(code)
            return code, ptx.rcp_rn(s), s
        if cutlass.const_expr(coding.rule == RULE_AMAX_FP32_MUL):
            s = ptx.mul_rn(amax, Float32(1.0 / coding.qmax))  # b12x: a compile-time f32 constant, no floor
            return ptx.f32_bits(s), ptx.rcp_rn(s), s
        if cutlass.const_expr(coding.rule == RULE_AMAX_E4M3_UP):
            # upstream vLLM nvfp4_tile_scale: RN to E4M3, then one code up while below the wanted scale
            want = ptx.max_f32(ptx.div_rn(amax, Float32(6.0)), floor)
            code = ptx.e4m3x2(Float32(0.0), want) & Uint32(0xFF)
            if ptx.e4m3_to_f32(code) < want and code < Uint32(0x7E):
                code = code + Uint32(1)
            s = ptx.e4m3_to_f32(code)
            return code, ptx.rcp_rn(s), s
        if cutlass.const_expr(coding.rule == RULE_OCP_E8M0):
            e = Int32(-127)
            if amax > Float32(0.0):
                e = ptx.floor_log2(amax) - Int32(2)
            e = cutlass.max(cutlass.min(e, Int32(127)), Int32(-127))
            return Uint32(e + Int32(127)), ptx.pow2(-e), ptx.pow2(e)
        if cutlass.const_expr(coding.rule == RULE_E8M0_CEIL):
            # SGLang's KVFP4 scale: t = max(amax / 6, floor) (div.rn, float32 floor), e = ceil(log2 t) read from the
            # bits (t >= 1e-10 is a normal float: biased exponent - 127, + 1 unless the mantissa is 0, which is the
            # codec's frexp rule), clamped to [-127, 127]; s = 2^e exactly, stored as the byte e + 127
            t = ptx.max_f32(ptx.div_rn(amax, Float32(6.0)), floor)
            b = ptx.f32_bits(t)
            e = Int32(b >> Uint32(23)) - Int32(127)
            if (b & Uint32(0x007FFFFF)) != Uint32(0):
                e = e + Int32(1)
            e = cutlass.max(cutlass.min(e, Int32(127)), Int32(-127))
            return Uint32(e + Int32(127)), ptx.pow2(-e), ptx.pow2(e)
        raise NotImplementedError(coding.rule)

    @cute.jit
    def _store_scales(
        self, record: cute.Tensor, coding: cutlass.Constexpr, s_bits: Uint32, lane: Int32, lanes_per_group: cutlass.Constexpr[int]
    ):
        base = coding.scale_offset // 4
        if cutlass.const_expr(coding.scale_dtype == "fp32"):
            if lane % lanes_per_group == 0:
                record[base + lane // lanes_per_group] = s_bits
        else:
            # one byte per group; byte p of the field holds group p (or, transposed 8x4, group
            # 4*(p&7) + (p>>3)), owned by lane group * lanes_per_group; word w holds bytes 4w..4w+3
            word = Uint32(0)
            for j in cutlass.range_constexpr(4):
                grp = lane * 4 + j
                if cutlass.const_expr(coding.scale_order == ORDER_8X4):
                    grp = (grp & 7) * 4 + (grp >> 3)
                src = (grp * lanes_per_group) % 32
                word = word | (ptx.shfl_idx(s_bits, src) << Uint32(8 * j))
            if lane < coding.n_groups // 4:
                record[base + lane] = word

    @cute.jit
    def _store_latent(self, record: cute.Tensor, coding: cutlass.Constexpr, v: cute.Tensor, lane: Int32):
        base = coding.data_offset // 4
        if cutlass.const_expr(coding.elem == "e2m1"):
            for h in cutlass.range_constexpr(2):
                word = Uint32(0)
                for i in cutlass.range_constexpr(8):
                    word = word | (_e2m1_code(coding, v[8 * h + i]) << Uint32(4 * i))
                record[base + 2 * lane + h] = word
        elif cutlass.const_expr(coding.elem == "e4m3"):
            for h in cutlass.range_constexpr(4):
                lo = ptx.e4m3x2(v[4 * h + 1], v[4 * h])
                hi = ptx.e4m3x2(v[4 * h + 3], v[4 * h + 2])
                record[base + 4 * lane + h] = lo | (hi << Uint32(16))
        else:
            for h in cutlass.range_constexpr(8):
                record[base + 8 * lane + h] = ptx.bf16x2(v[2 * h + 1], v[2 * h])

    @cute.jit
    def _residual_scale(self, coding: cutlass.Constexpr, amax: Float32):
        """Spec step 5's group scale: (E4M3 code, s, rcp.approx.ftz(s)) of max(amax * rcp.approx(6), floor)
        (the codec reads the same reciprocals from the H200 table; s >= the floor, never 0)."""
        sf = ptx.max_f32(_amax_rcp6(amax), Float32(coding.scale_floor))
        code = ptx.e4m3x2(Float32(0.0), sf) & Uint32(0xFF)
        s = ptx.e4m3_to_f32(code)
        return code, s, ptx.rcp_approx_ftz(s)

    @cute.jit
    def _store_rope_residual(self, record: cute.Tensor, coding: cutlass.Constexpr, w: cute.Tensor, lane: Int32):
        """TensorRT-LLM's residual rope (spec step 5), 8 lanes per group of 16: v = x * S; main codes q1 of
        v * rcp(s1); residual v - q1 * s1 (exact product, one rounding); its codes q2 the same way. Group g's
        16 data bytes are [q1 | q2] (lane 8g + j's two codes in byte j of each half), its scale bytes [s1, s2]."""
        v = cute.make_rmem_tensor((2,), Float32)
        for i in cutlass.range_constexpr(2):
            v[i] = w[i]
            if cutlass.const_expr(coding.global_quant is not None):
                v[i] = ptx.mul_rn(w[i], Float32(coding.global_quant))
        lanes = coding.group // 2
        code1, s1, r1 = self._residual_scale(coding, ptx.warp_max(self._local_amax(v, 2), lanes))
        a0 = ptx.e2m1_code(ptx.mul_rn(v[0], r1))
        a1 = ptx.e2m1_code(ptx.mul_rn(v[1], r1))
        res = cute.make_rmem_tensor((2,), Float32)
        res[0] = ptx.sub_rn(v[0], ptx.mul_rn(ptx.e2m1_nibble_to_f32(a0, 0), s1))
        res[1] = ptx.sub_rn(v[1], ptx.mul_rn(ptx.e2m1_nibble_to_f32(a1, 0), s1))
        code2, _, r2 = self._residual_scale(coding, ptx.warp_max(self._local_amax(res, 2), lanes))
        b1 = a0 | (a1 << Uint32(4))
        b2 = ptx.e2m1_code(ptx.mul_rn(res[0], r2)) | (ptx.e2m1_code(ptx.mul_rn(res[1], r2)) << Uint32(4))
        # data word k (16 of them): group k // 4; k % 4 = 0, 1: q1 bytes of lanes 8g + 4 (k % 2) + 0..3; 2, 3: q2
        word = Uint32(0)
        for j in cutlass.range_constexpr(4):
            src = (8 * (lane // 4) + 4 * (lane % 2) + j) % 32
            x1 = ptx.shfl_idx(b1, src)
            x2 = ptx.shfl_idx(b2, src)
            x = x1 if lane % 4 < 2 else x2
            word = word | (x << Uint32(8 * j))
        if lane < coding.dim // 4:
            record[coding.data_offset // 4 + lane] = word
        # scale word k (2 of them): bytes [s1, s2] of groups 2k and 2k + 1, held by lanes 8 (2k) and 8 (2k + 1)
        sw = Uint32(0)
        for j in cutlass.range_constexpr(4):
            src = (lanes * (2 * lane + j // 2)) % 32
            if cutlass.const_expr(j % 2 == 0):
                sw = sw | (ptx.shfl_idx(code1, src) << Uint32(8 * j))
            else:
                sw = sw | (ptx.shfl_idx(code2, src) << Uint32(8 * j))
        if lane < 2 * coding.n_groups // 4:
            record[coding.scale_offset // 4 + lane] = sw

    @cute.jit
    def _store_rope(self, record: cute.Tensor, coding: cutlass.Constexpr, w: cute.Tensor, lane: Int32):
        base = coding.data_offset // 4
        if cutlass.const_expr(coding.elem == "bf16"):
            record[base + lane] = ptx.bf16x2(w[1], w[0])
        elif cutlass.const_expr(coding.elem == "e2m1"):
            # lane l's two values are byte l (value 2l in the low nibble); word k = bytes 4k..4k+3
            byte = _e2m1_code(coding, w[0]) | (_e2m1_code(coding, w[1]) << Uint32(4))
            word = Uint32(0)
            for j in cutlass.range_constexpr(4):
                word = word | (ptx.shfl_idx(byte, (4 * lane + j) % 32) << Uint32(8 * j))
            if lane < 8:
                record[base + lane] = word
        else:
            pair = ptx.e4m3x2(w[1], w[0])  # 16 bits: this lane's two bytes
            lo = ptx.shfl_idx(pair, (2 * lane) % 32)
            hi = ptx.shfl_idx(pair, (2 * lane + 1) % 32)
            if lane < 16:
                record[base + lane] = lo | (hi << Uint32(16))


def compile_key(plan: RecordPlan, in_dtype: torch.dtype, has_outer: bool, device: torch.device) -> tuple:
    """Every specialisation of a compiled writer; s_l itself is a run-time argument."""
    return ("cache_writer", 4, plan, str(in_dtype), bool(has_outer), arch_tag(device))


def _ptr(t: torch.Tensor, dtype, align: int):
    from cutlass.cute.runtime import make_ptr

    return make_ptr(dtype, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def write_cache(
    plan: RecordPlan,
    latent: torch.Tensor,
    rope: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache: torch.Tensor,
    outer_scale: float | None = None,
) -> None:
    """Launch the writer (CUDA tensors; shapes and dtypes checked by the dispatcher)."""
    in_dtype = _TORCH_TO_CUTE[latent.dtype]
    has_outer = outer_scale is not None
    num_tokens = latent.shape[0]
    if num_tokens == 0:
        return
    args = (
        _ptr(latent, in_dtype, 16),
        _ptr(rope, in_dtype, 4),
        _ptr(slot_mapping, cutlass.Int64, 8),
        _ptr(cache, cutlass.Uint32, 16),
        Int32(num_tokens),
        Float32(outer_scale if has_outer else 1.0),
        cuda.CUstream(torch.cuda.current_stream(latent.device).cuda_stream),
    )
    key = compile_key(plan, latent.dtype, has_outer, latent.device)
    fn = compiled(key, lambda: cute.compile(CacheWriter(plan, in_dtype, has_outer), *args))
    fn(*args)
