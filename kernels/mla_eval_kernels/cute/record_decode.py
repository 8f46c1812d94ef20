"""The record -> bf16 K decode both attention generations share (v2 `mla_attention.MlaAttention`, v3
`mla_attention_v3.MlaAttentionV3`): a key's slot id, and a tile's raw records in shared memory decoded 8 values per
work item into the swizzled bf16 K tile (`smem.swizzled_offset`), exactly as the codec decodes them (E2M1 / E4M3 / bf16
values times their group scale, the per-token scale, s_l; the engines' residual and E4M3 read-back steps; the fold of
E2M1 x E4M3 latents into exact bf16 up to 2^-9, `e2m1_bits`).

`RecordDecode` is a mixin: the kernel class provides `plan`, `sparse`, `has_outer`, `fold`, `bn` (keys per tile) and
`num_threads` (the threads that decode).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32

from mla_eval_kernels.cute import ptx
from mla_eval_kernels.cute.smem import ld_shared_u8, ld_shared_u32, ld_shared_v4, st_shared_v4, swizzled_offset
from mla_eval_kernels.plan import e2m1_bits
from mla_eval_kernels.plan.launch import D_V
from mla_eval_kernels.plan.record_plan import ORDER_8X4


class RecordDecode:
    """Slot ids and the record decode of one attention kernel (a mixin; see the module docstring)."""

    @cute.jit
    def slot_of(self, m_idx: cute.Tensor, j: Int32, num_keys: Int32, num_slots: Int32, block_size: Int32, live) -> Int32:
        """Global slot id of key j of this CTA's query (`m_idx`: its row), or -1 (past the end,
        invalid index, tile not used)."""
        slot = Int32(-1)
        if live and j < num_keys:
            if cutlass.const_expr(self.sparse):
                s = m_idx[j]
                if s >= 0 and s < num_slots:
                    slot = s
            else:
                slot = m_idx[j // block_size] * block_size + j % block_size
        return slot

    @cute.jit
    def decode_tile(
        self, raw: Int32, sK_addr: Int32, s_l: Float32, tidx: Int32, key0: cutlass.Constexpr = 0,
        nkeys: cutlass.Constexpr = None,
    ):
        """Raw records of one tile (shared memory) -> bf16 K [BN, 576], 8 values per work item. v3 decodes
        part of a tile at a time: `nkeys` records at `raw` (default BN) into K rows key0.. key0 + nkeys."""
        plan = self.plan
        rec = plan.record_bytes
        nkeys = self.bn if nkeys is None else nkeys
        assert nkeys * 64 % self.num_threads == 0
        for u in cutlass.range_constexpr(nkeys * 64 // self.num_threads):
            i = u * self.num_threads + tidx
            key = i // 64
            d0 = (i % 64) * 8
            if cutlass.const_expr(self.fold):
                w0, w1, w2, w3 = self.decode8_e2m1_folded(plan.latent, raw + key * rec, d0)
            else:
                w0, w1, w2, w3 = self.decode8(plan.latent, raw + key * rec, d0, s_l, self.has_outer, True)
            self.store_k(sK_addr + 2 * swizzled_offset(key0 + key, d0, self.bn), w0, w1, w2, w3)
        n_rope = nkeys * 8  # v3's 16-key stages: fewer rope items than producer threads
        for u in cutlass.range_constexpr((n_rope + self.num_threads - 1) // self.num_threads):
            i = u * self.num_threads + tidx
            if cutlass.const_expr(n_rope % self.num_threads):
                i = cutlass.min(i, n_rope - 1)  # a repeated item is harmless (the same bytes to the same address)
            self.decode_rope_item(raw, sK_addr, s_l, i, key0)

    @cute.jit
    def decode_rope_item(self, raw: Int32, sK_addr: Int32, s_l: Float32, i: Int32, key0: cutlass.Constexpr):
        """Rope item i (8 values of raw key i // 8) -> K row key0 + i // 8: of `decode_tile`, and of v3's fast E2M1
        decode, which leaves its rope items to this path (`MlaAttentionV3.decode_tile_v3`)."""
        plan = self.plan
        key = i // 8
        d0 = (i % 8) * 8
        rec = raw + key * plan.record_bytes
        w0, w1, w2, w3 = self.decode8(plan.rope, rec, d0, s_l, self.has_outer and plan.outer_on_rope, False)
        self.store_k(sK_addr + 2 * swizzled_offset(key0 + key, D_V + d0, self.bn), w0, w1, w2, w3)

    def store_k(self, addr, w0, w1, w2, w3):
        """16 decoded bytes into the K tile."""
        st_shared_v4(addr, w0, w1, w2, w3)

    @cute.jit
    def decode8_e2m1_folded(self, coding: cutlass.Constexpr, rec: Int32, d0: Int32):
        """Latent values d0..d0+8 as E2M1 * E4M3 block scale * 2^-9, exact bf16 (e2m1_bits)."""
        word = ld_shared_u32(rec + coding.data_offset + d0 // 2)
        entry = d0 // coding.group
        if cutlass.const_expr(coding.scale_order == ORDER_8X4):
            entry = 8 * (entry & 3) + (entry >> 2)
        f = ptx.e4m3_to_f32(ld_shared_u8(rec + coding.scale_offset + entry)) * Float32(2.0**e2m1_bits.SCALE_BIAS_LOG2)
        return ptx.e2m1x8_scaled_bf16x2(word, ptx.bf16x2(f, f))

    @cute.jit
    def decode8(
        self, coding: cutlass.Constexpr, rec: Int32, d0: Int32, s_l: Float32, outer: cutlass.Constexpr,
        is_latent: cutlass.Constexpr,
    ):
        """Values d0..d0+8 of one vector of the record at shared address `rec`, as 4 bf16x2 words."""
        if cutlass.const_expr(coding.elem == "bf16" and not outer):
            a, b, c, d = ld_shared_v4(rec + coding.data_offset + 2 * d0)
            return a, b, c, d
        else:
            v = cute.make_rmem_tensor((8,), Float32)
            if cutlass.const_expr(coding.residual):
                self.residual8(coding, rec, d0, v)
            elif cutlass.const_expr(coding.elem == "e2m1"):
                word = ld_shared_u32(rec + coding.data_offset + d0 // 2)
                for i in cutlass.range_constexpr(8):
                    v[i] = ptx.e2m1_nibble_to_f32(word, i)
            elif cutlass.const_expr(coding.elem == "e4m3"):
                for h in cutlass.range_constexpr(2):
                    x0, x1, x2, x3 = ptx.e4m3x4_to_f32x4(ld_shared_u32(rec + coding.data_offset + d0 + 4 * h))
                    v[4 * h] = x0
                    v[4 * h + 1] = x1
                    v[4 * h + 2] = x2
                    v[4 * h + 3] = x3
            else:
                for h in cutlass.range_constexpr(4):
                    word = ld_shared_u32(rec + coding.data_offset + 2 * d0 + 4 * h)
                    v[2 * h] = ptx.bits_f32(word << Uint32(16))
                    v[2 * h + 1] = ptx.bits_f32(word & Uint32(0xFFFF0000))
            f = Float32(1.0)
            entry = d0 // coding.group  # the scale entry of this group (its position, when permuted)
            if cutlass.const_expr(coding.scale_order == ORDER_8X4):
                entry = 8 * (entry & 3) + (entry >> 2)
            if cutlass.const_expr(coding.residual):
                pass  # both scales (and the global dequant) are applied in residual8
            elif cutlass.const_expr(coding.scale_dtype == "fp32"):
                f = ptx.bits_f32(ld_shared_u32(rec + coding.scale_offset + 4 * entry))
            elif cutlass.const_expr(coding.scale_dtype == "e4m3"):
                f = ptx.e4m3_to_f32(ld_shared_u8(rec + coding.scale_offset + entry))
            elif cutlass.const_expr(coding.scale_dtype == "e8m0"):
                f = ptx.pow2(Int32(ld_shared_u8(rec + coding.scale_offset + entry)) - Int32(127))
            if cutlass.const_expr(coding.global_dequant is not None and not coding.residual):
                f = ptx.mul_rn(f, Float32(coding.global_dequant))  # the engine's reader: q * (s * dequant)
            if cutlass.const_expr(is_latent and self.plan.token_scale_offset >= 0):
                f = f * ptx.bits_f32(ld_shared_u32(rec + self.plan.token_scale_offset))
            if cutlass.const_expr(outer):
                f = f * s_l
            if cutlass.const_expr(self.plan.reader_e4m3):
                # the engine's attention reads an E4M3 copy (RN, satfinite) of q * (s * dequant); E4M3 values
                # are bf16 numbers, so K holds exactly the codec's decoded values (no s_t / s_l with this flag)
                for h in cutlass.range_constexpr(2):
                    lo = ptx.e4m3x2(ptx.mul_rn(v[4 * h + 1], f), ptx.mul_rn(v[4 * h], f))
                    hi = ptx.e4m3x2(ptx.mul_rn(v[4 * h + 3], f), ptx.mul_rn(v[4 * h + 2], f))
                    x0, x1, x2, x3 = ptx.e4m3x4_to_f32x4(lo | (hi << Uint32(16)))
                    v[4 * h] = x0
                    v[4 * h + 1] = x1
                    v[4 * h + 2] = x2
                    v[4 * h + 3] = x3
                f = Float32(1.0)
            return (
                ptx.bf16x2(v[1] * f, v[0] * f),
                ptx.bf16x2(v[3] * f, v[2] * f),
                ptx.bf16x2(v[5] * f, v[4] * f),
                ptx.bf16x2(v[7] * f, v[6] * f),
            )

    @cute.jit
    def residual8(self, coding: cutlass.Constexpr, rec: Int32, d0: Int32, v: cute.Tensor):
        """Residual E2M1 values d0..d0+8 (spec step 5, the engine's reader): fma(q2, s2 * D, q1 * (s1 * D)),
        group g = d0 / 16 with [q1 | q2] code bytes at 16 g and scale bytes [s1, s2] at 2 g; D = the dequant."""
        g = d0 // coding.group
        base = rec + coding.data_offset + g * coding.group + (d0 % coding.group) // 2
        w1 = ld_shared_u32(base)
        w2 = ld_shared_u32(base + coding.group // 2)
        f1 = ptx.e4m3_to_f32(ld_shared_u8(rec + coding.scale_offset + 2 * g))
        f2 = ptx.e4m3_to_f32(ld_shared_u8(rec + coding.scale_offset + 2 * g + 1))
        if cutlass.const_expr(coding.global_dequant is not None):
            f1 = ptx.mul_rn(f1, Float32(coding.global_dequant))
            f2 = ptx.mul_rn(f2, Float32(coding.global_dequant))
        for i in cutlass.range_constexpr(8):
            main = ptx.mul_rn(ptx.e2m1_nibble_to_f32(w1, i), f1)
            v[i] = ptx.fma_rn(ptx.e2m1_nibble_to_f32(w2, i), f2, main)
