"""MLA attention over the paged quantised cache (absorbed form), every format, dense or sparse.

Problem, per query n (`q [N, H, 576]` bf16 = latent-space q_nope 512 + q_pe 64): the keys are the
decoded cache records K_j [576] of its slot list, the values their first 512 dims (the latent):
    s_hj = softmax_scale * q_h . K_j,  out_h = sum_j p_hj K_j[:512] / (sum_j e^{s_hj} + e^{sink_h})
    lse_h = log sum_j e^{s_hj}   (natural log, over valid keys only: the sink is not in it)
Slot lists: dense causal (`block_table [N, max_blocks]` int32 per query, `seq_lens [N]` int32:
keys 0..seq_lens[n]-1, key j in slot block_table[n, j // block_size] * block_size + j % block_size)
or sparse (`indices [N, topk]` int32 global slot ids; ids outside [0, num_slots) are invalid).
A query with no valid key gets out = 0 and lse = -inf, never NaN.

Kernel (FlashAttention-2 style, bf16 `mma.sync.m16n8k16` with fp32 accumulation, sm_80+):
- CTA = (KV split, head tile of M heads, query); M = 16 / 32 / 64 rows (heads padded with zero
  rows); 8 warps form an R x C grid (R = M / 16 rows of 16, C = 8 / R column groups): h <= 16
  -> 1 x 8, h <= 32 -> 2 x 4, more heads -> 4 x 2 per 64-head tile (`tile_config`).
- Key tiles of BN slots: slot ids computed P + 1 tiles ahead into shared memory; the raw records
  of the next P tiles (`Tuning.prefetch`, a ring of P + 1 stages) are copied with 16-byte
  `cp.async` (zero-filled for invalid slots) while the current tile is decoded in shared memory
  into bf16 K [BN, 576] (E2M1 x E4M3 block scale x s_t x s_l, E4M3 x fp32 group scale, E2M1 x E8M0
  (mxfp4's latent, SGLang's latent and rope), bf16 copy; TensorRT-LLM's E2M1 x (E4M3 x dequant), or its
  residual rope fma(q2, s2 D, q1 s1 D), rounded to E4M3, as its reader's fp8 copy). Records
  that are not a multiple of 16 B (324 B) are copied in 8- or 4-byte chunks (`record_chunk`). For
  the bf16 format the records are the K rows and are copied straight into a double-buffered K tile
  (P = 1).
- Kernel generations (`tuning`): v1 (P = 1, Q re-read from shared memory per tile, one
  S chain, E2M1 decoded per value in fp32) stays selectable; v2 adds the deeper ring, Q held in
  registers at h <= 16, two S chains, and E2M1 x E4M3 decoded a byte at a time into exact bf16x2
  (`e2m1_bits`) with 2^9 * s_l applied to the latent part of each score and to the output.
- Launch grid: x = queries x KV splits, y = head tiles (`launch_grid`; any number of queries).
- S = Q K^T: warp (r, c) computes rows 16r.. and a 1/C share of the BN keys; row maxima are
  combined across the C warps of a row through shared memory; P (bf16) goes through shared
  memory so that each warp multiplies the whole P row block by its 512/C columns of V = K[:, :512].
- Online softmax in fp32 (exp2 with log2(e) folded into the scale); masked keys get p = 0 by a
  select and never enter the running max, whose start value is the finite -FLT_MAX.
- `split=True`: each CTA covers `tiles_per_split` key tiles and writes a partial (out / l, lse)
  that `mla_combine` merges (and applies the sink); `split=False` writes the final result.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.nvgpu import warp

from mla_eval_kernels.cute import ptx
from mla_eval_kernels.cute.ptx import LN_2, LOG2_E
from mla_eval_kernels.cute.record_decode import RecordDecode
from mla_eval_kernels.cute.smem import cp_async_16, cp_async_small, swizzle_atom, swizzled_offset
from mla_eval_kernels.plan import e2m1_bits
from mla_eval_kernels.plan.launch import D_QK, D_V, V2Config
from mla_eval_kernels.plan.record_plan import RecordPlan, record_chunk
from mla_eval_kernels.plan.tuning import fast_e2m1_eligible, is_bf16_plan


class MlaAttention(RecordDecode):
    """One compiled attention kernel per (plan, tile, mode, sink, outer scale, split).

    The head count is a run-time argument; it selects the tile (`tile_config`), which is part
    of the compile key.
    """

    def __init__(self, plan: RecordPlan, config: V2Config, *, sparse: bool, has_sink: bool, has_outer: bool, split: bool):
        # built only by `cute.launch.kernel_for` from a `KernelSpec` (the one construction path)
        if not isinstance(config, V2Config):
            raise TypeError(f"MlaAttention takes a V2Config, not {type(config).__name__}")
        tile, tuning = config.tile, config.tuning
        self.plan = plan
        self.tuning = tuning
        # E2M1 latent with E4M3 block scales, no per-token scale, s_l not on the rope: the latent is
        # decoded exactly into bf16 up to 2^-9 (e2m1_bits) and 2^9 * s_l is folded into scores and output
        self.fold = bool(tuning.fast_e2m1 and fast_e2m1_eligible(plan))
        self.sparse = sparse
        self.has_sink = has_sink
        self.has_outer = has_outer
        self.split = split
        self.m, self.wm, self.wn, self.bn = tile
        self.num_threads = 32 * self.wm * self.wn
        self.copy_k = is_bf16_plan(plan)
        self.k_stages = 2 if self.copy_k else 1
        # tiles of records in flight ahead of the one being decoded (the bf16 path copies into K: 1)
        self.prefetch = 1 if self.copy_k else tuning.prefetch
        self.raw_stages = self.prefetch + 1
        self.slot_bufs = self.prefetch + 2
        assert (self.bn * 64) % self.num_threads == 0 and (self.bn * 8) % self.num_threads == 0
        assert self.bn % ((16 if self.bn % (16 * self.wn) == 0 else 8) * self.wn) == 0

    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer,
        cache_ptr: cute.Pointer,
        idx_ptr: cute.Pointer,
        seqlen_ptr: cute.Pointer,
        sink_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        lse_ptr: cute.Pointer,
        num_queries: Int32,
        num_heads: Int32,
        idx_stride: Int32,
        num_slots: Int32,
        block_size: Int32,
        softmax_scale: Float32,
        s_l: Float32,
        tiles_per_split: Int32,
        num_splits: Int32,
        stream: cuda.CUstream,
    ):
        m, bn = self.m, self.bn
        atom = swizzle_atom(64)
        sQ_layout = cute.tile_to_shape(atom, (m, D_QK), (0, 1))
        sK_layout = cute.tile_to_shape(atom, (bn, D_QK, self.k_stages), (0, 1, 2))
        sP_layout = cute.tile_to_shape(swizzle_atom(bn), (m, bn), (0, 1))
        raw_bytes = 16 if self.copy_k else self.raw_stages * bn * self.plan.record_bytes

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sP_layout)], 1024]
            raw: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, raw_bytes], 128]
            slots: cute.struct.Align[cute.struct.MemRange[Int32, self.slot_bufs * bn], 16]
            red: cute.struct.Align[cute.struct.MemRange[Float32, self.wn * m], 16]

        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)),
            (self.wm, self.wn, 1),
            permutation_mnk=(16 * self.wm, (16 if self.bn % (16 * self.wn) == 0 else 8) * self.wn, 16),
        )
        # queries and splits share grid x (launch_grid.attention_grid; y and z stop at 65535)
        grid = (num_queries * num_splits, (num_heads + m - 1) // m, 1)
        self.kernel(
            q_ptr, cache_ptr, idx_ptr, seqlen_ptr, sink_ptr, out_ptr, lse_ptr,
            num_queries, num_heads, idx_stride, num_slots, block_size,
            softmax_scale, s_l, tiles_per_split, num_splits,
            sQ_layout, sK_layout, sP_layout, tiled_mma, SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        q_ptr: cute.Pointer,
        cache_ptr: cute.Pointer,
        idx_ptr: cute.Pointer,
        seqlen_ptr: cute.Pointer,
        sink_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        lse_ptr: cute.Pointer,
        num_queries: Int32,
        num_heads: Int32,
        idx_stride: Int32,
        num_slots: Int32,
        block_size: Int32,
        softmax_scale: Float32,
        s_l: Float32,
        tiles_per_split: Int32,
        num_splits: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        m, bn = self.m, self.bn
        rec = self.plan.record_bytes
        tidx, _, _ = cute.arch.thread_idx()
        block_x, head_tile, _ = cute.arch.block_idx()
        split_idx = block_x % num_splits  # launch_grid.cta_coords
        qi = block_x // num_splits
        warp_n = (tidx // 32) // self.wm
        lane = tidx % 32
        h0 = head_tile * m

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sK_layout)
        sP = storage.sP.get_tensor(sP_layout)
        sSlot = storage.slots.get_tensor(cute.make_layout((bn, self.slot_bufs), stride=(1, bn)))
        sRed = storage.red.get_tensor(cute.make_layout((m, self.wn), stride=(1, m)))
        sQ_addr = storage.sQ.data_ptr().toint()
        sK_addr = storage.sK.data_ptr().toint()
        raw_addr = storage.raw.data_ptr().toint()
        cache_addr = cache_ptr.toint()

        # ---- this CTA's key range ----
        num_keys = idx_stride
        if cutlass.const_expr(not self.sparse):
            num_keys = cute.make_tensor(seqlen_ptr, cute.make_layout(num_queries))[qi]
        num_tiles = (num_keys + bn - 1) // bn
        t_begin = split_idx * tiles_per_split
        t_end = cutlass.min(t_begin + tiles_per_split, num_tiles)
        n_local = cutlass.max(t_end - t_begin, 0)
        # this query's row of the slot lists (64-bit offset: N x stride may pass 2^31 entries)
        m_idx = cute.make_tensor(idx_ptr + Int64(qi) * Int64(idx_stride), cute.make_layout(idx_stride))

        # ---- prologue: Q, slot ids of the first P + 1 tiles, records of the first P (one group each) ----
        pf = self.prefetch
        self.load_q(q_ptr, sQ_addr, qi, h0, num_heads, tidx)
        cute.arch.cp_async_commit_group()
        if tidx < bn:
            for t in cutlass.range_constexpr(pf + 1):
                sSlot[tidx, t] = self.slot_of(m_idx, (t_begin + t) * bn + tidx, num_keys, num_slots, block_size, t < n_local)
        cute.arch.barrier()
        for t in cutlass.range_constexpr(pf):
            if t < n_local:
                self.load_tile(sSlot, t, t, raw_addr, sK_addr, cache_addr, tidx)
            cute.arch.cp_async_commit_group()

        # ---- MMA partitions ----
        thr_mma = tiled_mma.get_slice(tidx)
        sVt = cute.composition(sK, cute.make_layout((D_V, bn, self.k_stages), stride=(bn, 1, bn * D_QK)))
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK[None, None, 0]))
        tOrP = thr_mma.make_fragment_A(thr_mma.partition_A(sP))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt[None, None, 0]))
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((m, D_V)), Float32)
        acc_O.fill(0.0)

        ldsm = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
        ldsm_t = warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4)
        copy_Q = cute.make_tiled_copy_A(cute.make_copy_atom(ldsm, BFloat16), tiled_mma)
        copy_K = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm, BFloat16), tiled_mma)
        copy_P = cute.make_tiled_copy_A(cute.make_copy_atom(ldsm, BFloat16), tiled_mma)
        copy_V = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm_t, BFloat16), tiled_mma)
        thr_copy_Q = copy_Q.get_slice(tidx)
        thr_copy_K = copy_K.get_slice(tidx)
        thr_copy_P = copy_P.get_slice(tidx)
        thr_copy_V = copy_V.get_slice(tidx)
        tSsQ = thr_copy_Q.partition_S(sQ)
        tSrQ_v = thr_copy_Q.retile(tSrQ)
        tSsK = thr_copy_K.partition_S(sK)
        tSrK_v = thr_copy_K.retile(tSrK)
        tOsP = thr_copy_P.partition_S(sP)
        tOrP_v = thr_copy_P.retile(tOrP)
        tOsVt = thr_copy_V.partition_S(sVt)
        tOrVt_v = thr_copy_V.retile(tOrVt)

        store_P = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16), tiled_mma)
        thr_store_P = store_P.get_slice(tidx)
        tPsP = thr_store_P.partition_D(sP)

        # coordinates of this thread's accumulator elements: (row in tile, key in tile)
        tScS = thr_mma.partition_C(cute.make_identity_tensor((m, bn)))
        tScS_mn = self.mn_view(tScS)
        n_rows = cute.size(tScS_mn, mode=[0])
        n_cols = cute.size(tScS_mn, mode=[1])
        row_max = cute.make_rmem_tensor((n_rows,), Float32)
        row_sum = cute.make_rmem_tensor((n_rows,), Float32)
        row_max.fill(-ptx.FLT_MAX)
        row_sum.fill(0.0)
        scale_log2 = softmax_scale * Float32(LOG2_E)
        n_k = cute.size(tSsQ.shape[2])
        n_k_latent = n_k * D_V // D_QK  # k-steps over the latent dims; the rest cover the rope
        chains = self.tuning.s_chains
        # factor of the latent part of each score and of the output (see e2m1_bits)
        fold = Float32(2.0**e2m1_bits.FOLD_LOG2)
        if cutlass.const_expr(self.has_outer):
            fold = fold * s_l
        if cutlass.const_expr(self.tuning.q_regs):
            cute.arch.cp_async_wait_group(pf)  # the Q group (the first tiles' records may still be in flight)
            cute.arch.barrier()
            for k in cutlass.range_constexpr(n_k):
                cute.copy(copy_Q, tSsQ[None, None, k], tSrQ_v[None, None, k])

        # ---- main loop over this CTA's key tiles ----
        # P = prefetch tiles of records in flight: tile `it` arrives in raw stage it % (P + 1) while
        # tiles it + 1 .. it + P load; its slot ids sit in buffer it % (P + 2), written one tile earlier
        for it in range(n_local):
            stage = it % self.raw_stages
            cute.arch.cp_async_wait_group(pf - 1)  # tile it's group is complete (one group per tile)
            cute.arch.barrier()
            # the stage refilled here was decoded in the previous iteration, before its barrier
            if it + pf < n_local:
                self.load_tile(
                    sSlot, (it + pf) % self.slot_bufs, (it + pf) % self.raw_stages, raw_addr, sK_addr, cache_addr, tidx
                )
            cute.arch.cp_async_commit_group()
            if tidx < bn:
                sSlot[tidx, (it + pf + 1) % self.slot_bufs] = self.slot_of(
                    m_idx, (t_begin + it + pf + 1) * bn + tidx, num_keys, num_slots, block_size, it + pf + 1 < n_local
                )
            k_stage = 0
            if cutlass.const_expr(self.copy_k):
                k_stage = stage
            else:
                if cutlass.const_expr(not self.tuning.skip_decode):
                    self.decode_tile(raw_addr + stage * (bn * rec), sK_addr, s_l, tidx)
                cute.arch.barrier()

            # S = Q K^T, k-step k into chain k % chains (independent MMA chains, summed below)
            accs = []
            for c in cutlass.range_constexpr(chains):
                accs.append(cute.make_rmem_tensor(thr_mma.partition_shape_C((m, bn)), Float32))
                accs[c].fill(0.0)
            for k in cutlass.range_constexpr(n_k):
                if cutlass.const_expr(not self.tuning.q_regs):
                    cute.copy(copy_Q, tSsQ[None, None, k], tSrQ_v[None, None, k])
                cute.copy(copy_K, tSsK[None, None, k, k_stage], tSrK_v[None, None, k])
                acc = accs[k % chains]
                cute.gemm(tiled_mma, acc, tSrQ[None, None, k], tSrK[None, None, k], acc)
                if cutlass.const_expr(self.fold and k == n_k_latent - 1):
                    # the latent part of the score times 2^9 * s_l, before the rope part is added
                    for c in cutlass.range_constexpr(1, chains):
                        accs[0].store(accs[0].load() + accs[c].load())
                        accs[c].fill(0.0)
                    accs[0].store(accs[0].load() * fold)
            acc_S = accs[0]
            for c in cutlass.range_constexpr(1, chains):
                acc_S.store(acc_S.load() + accs[c].load())

            # online softmax; the running max is shared by the C warps of a row
            acc_S_mn = self.mn_view(acc_S)
            slot_col = it % self.slot_bufs
            for r in cutlass.range_constexpr(n_rows):
                mx = Float32(-ptx.FLT_MAX)
                for c in cutlass.range_constexpr(n_cols):
                    valid = sSlot[tScS_mn[0, c][1], slot_col] >= 0
                    if valid:
                        mx = ptx.max_f32(mx, acc_S_mn[r, c])
                mx = self.quad_max(mx)
                if lane % 4 == 0:
                    sRed[tScS_mn[r, 0][0], warp_n] = mx
            cute.arch.barrier()
            for r in cutlass.range_constexpr(n_rows):
                row = tScS_mn[r, 0][0]
                m_new = row_max[r]
                for c in cutlass.range_constexpr(self.wn):
                    m_new = ptx.max_f32(m_new, sRed[row, c])
                alpha = cute.math.exp2((row_max[r] - m_new) * scale_log2, fastmath=True)
                m_scaled = m_new * scale_log2
                s = Float32(0.0)
                for c in cutlass.range_constexpr(n_cols):
                    p = cute.math.exp2(acc_S_mn[r, c] * scale_log2 - m_scaled, fastmath=True)
                    valid = sSlot[tScS_mn[0, c][1], slot_col] >= 0
                    p = p if valid else Float32(0.0)
                    acc_S_mn[r, c] = p
                    s = s + p
                row_sum[r] = row_sum[r] * alpha + s
                row_max[r] = m_new
                self.scale_row(acc_O, r, alpha)
            rP = cute.make_fragment_like(acc_S, BFloat16)
            rP.store(acc_S.load().to(BFloat16))
            cute.copy(store_P, thr_store_P.retile(rP), tPsP)
            cute.arch.barrier()

            # O += P V
            for k in cutlass.range_constexpr(cute.size(tOsP.shape[2])):
                cute.copy(copy_P, tOsP[None, None, k], tOrP_v[None, None, k])
                cute.copy(copy_V, tOsVt[None, None, k, k_stage], tOrVt_v[None, None, k])
                cute.gemm(tiled_mma, acc_O, tOrP[None, None, k], tOrVt[None, None, k], acc_O)

        # ---- epilogue: combine the C partial row sums, normalise, store ----
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        for r in cutlass.range_constexpr(n_rows):
            l_sum = self.quad_sum(row_sum[r])
            if lane % 4 == 0:
                sRed[tScS_mn[r, 0][0], warp_n] = l_sum
        cute.arch.barrier()

        base_row = qi * num_heads + h0
        if cutlass.const_expr(self.split):
            base_row = (split_idx * num_queries + qi) * num_heads + h0
        gO = cute.make_tensor(out_ptr + Int64(base_row) * Int64(D_V), cute.make_layout((m, D_V), stride=(D_V, 1)))
        tOgO_mn = self.mn_view(thr_mma.partition_C(gO))
        acc_O_mn = self.mn_view(acc_O)
        m_lse = cute.make_tensor(lse_ptr + Int64(base_row), cute.make_layout(m))
        rows_valid = cutlass.min(num_heads - h0, m)
        for r in cutlass.range_constexpr(n_rows):
            row = tScS_mn[r, 0][0]
            l_sum = Float32(0.0)
            for c in cutlass.range_constexpr(self.wn):
                l_sum = l_sum + sRed[row, c]
            denom = l_sum
            if cutlass.const_expr(self.has_sink and not self.split):
                sink = cute.make_tensor(sink_ptr, cute.make_layout(num_heads))[cutlass.min(h0 + row, num_heads - 1)]
                denom = l_sum + cute.math.exp2(sink * Float32(LOG2_E) - row_max[r] * scale_log2, fastmath=True)
            inv = Float32(0.0)
            if l_sum > Float32(0.0):
                inv = Float32(1.0) / denom
                if cutlass.const_expr(self.fold):
                    inv = inv * fold  # V = K[:, :512] was decoded up to 2^9 * s_l
            lse = -Float32.inf
            if l_sum > Float32(0.0):
                lse = row_max[r] * softmax_scale + cute.math.log2(l_sum, fastmath=False) * Float32(LN_2)
            if row < rows_valid:
                for c in cutlass.range_constexpr(cute.size(tOgO_mn, mode=[1])):
                    tOgO_mn[r, c] = acc_O_mn[r, c] * inv
                if lane % 4 == 0 and warp_n == 0:
                    m_lse[row] = lse

    # ------------------------------------------------------------------ helpers (inlined)
    @cute.jit
    def load_q(self, q_ptr: cute.Pointer, sQ_addr: Int32, qi: Int32, h0: Int32, num_heads: Int32, tidx: Int32):
        """Q rows h0..h0+M of query qi into sQ by 16-byte cp.async; rows past the heads are zeros."""
        q_addr = q_ptr.toint()
        chunks = D_QK // 8
        total = self.m * chunks
        for u in cutlass.range_constexpr((total + self.num_threads - 1) // self.num_threads):
            i = cutlass.min(u * self.num_threads + tidx, total - 1)  # a repeated chunk is harmless
            r = i // chunks
            c = (i % chunks) * 8
            h = h0 + r
            ok = h < num_heads
            src = q_addr + (Int64(qi) * Int64(num_heads) + Int64(cutlass.min(h, num_heads - 1))) * Int64(2 * D_QK) + Int64(2 * c)
            cp_async_16(sQ_addr + 2 * swizzled_offset(r, c, self.m), src, 16 if ok else 0)

    @cute.jit
    def load_tile(
        self, sSlot: cute.Tensor, slot_buf: Int32, stage: Int32, raw_addr: Int32, sK_addr: Int32, cache_addr: Int64, tidx: Int32
    ):
        """cp.async the BN records of a tile: into the raw stage, or straight into K (bf16 format)."""
        rec = self.plan.record_bytes
        size = record_chunk(rec)
        chunks = rec // size
        total = self.bn * chunks
        for i in range(tidx, total, self.num_threads):
            key = i // chunks
            ch = i % chunks
            slot = sSlot[key, slot_buf]
            ok = slot >= 0
            src = cache_addr + Int64(cutlass.max(slot, 0)) * Int64(rec) + Int64(size * ch)
            dst = raw_addr + stage * (self.bn * rec) + key * rec + size * ch
            if cutlass.const_expr(self.copy_k):
                dst = sK_addr + 2 * (stage * (self.bn * D_QK) + swizzled_offset(key, 8 * ch, self.bn))
            if cutlass.const_expr(size == 16):
                cp_async_16(dst, src, 16 if ok else 0)
            else:
                cp_async_small(dst, src, size, size if ok else 0)

    @cute.jit
    def scale_row(self, acc_O: cute.Tensor, r: cutlass.Constexpr, alpha: Float32):
        acc_O_mn = self.mn_view(acc_O)
        for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
            acc_O_mn[r, c] = acc_O_mn[r, c] * alpha

    def mn_view(self, acc: cute.Tensor) -> cute.Tensor:
        """((2, MMA_M), (2, MMA_N)) row/column view of an m16n8 accumulator partition."""
        shape = cute.make_layout(acc.layout.shape)
        mn = cute.make_layout(
            ((shape.shape[0][1], shape.shape[1]), (shape.shape[0][0], shape.shape[2])),
            stride=((shape.stride[0][1], shape.stride[1]), (shape.stride[0][0], shape.stride[2])),
        )
        return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))

    def quad_max(self, x):
        x = ptx.max_f32(x, cute.arch.shuffle_sync_bfly(x, offset=2))
        return ptx.max_f32(x, cute.arch.shuffle_sync_bfly(x, offset=1))

    def quad_sum(self, x):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
        return x + cute.arch.shuffle_sync_bfly(x, offset=1)
