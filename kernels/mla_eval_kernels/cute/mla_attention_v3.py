"""v3 of the decode MLA attention kernel (issue 14): wgmma, warp-specialised, mbarrier pipeline (sm_90a).

Same problem and entry as `mla_attention.mla_attention`, dense or sparse lists (`tuning.v3_blocker`
says which launches can run here, `tuning.generation_for` which do). Built only by `cute.launch.kernel_for` from a
`KernelSpec` whose `V3Config` is concrete (no default is resolved here). Why this shape, measured against the v2
diagnosis in docs/kernels.md (255 registers + spills, one 8-warp CTA per SM, load -> decode -> S -> softmax -> PV
serial in a CTA):

- Swapped operands ("swap AB"): wgmma's M is 64 rows, and a decode step has h = 16 heads per query.
  Packing 4 queries into M would need 4 queries that read the same keys; the dense decode queries are
  different sequences (own block_table rows and lengths), so M must be keys instead: per key tile of
  64 slots, S^T [64 keys, 16 heads] = K [64, 576] Q^T (A = K tile, B = Q, both K-major in shared
  memory), and O^T [512, 16] += V^T [512, 64] P^T [64, 16] (A = V^T, an MN-major view of the same
  bytes as the K tile, B = P^T). Nothing is padded at h = 16 (padding heads to 64 would quadruple
  the MMA work); N = 16 heads is one "head tile", larger h runs ceil(h / N) head tiles in grid y.
  O^T lives in 64 fp32 registers per consumer thread (512 x 16 / 128), S^T in 8 (16 with the fold).
  h > 16 may run N = 32 (`tuning.v3_head_tile`): each wgmma then reads its 2 KB A tile (K or V^T)
  for 16 clocks of math instead of 8 (N = 16 is shared-memory bound 2x at 128 B/clock), and every record is
  decoded once per 32 heads; O^T takes 128 registers, S^T 16 (32 with the fold), more than an even share of 384
  threads holds, so two producer warpgroups at N = 32 (the default; one, 256 threads with up to
  255 registers each, is the bench's v3-t32-p1 probe) move registers between the roles with
  `setmaxnreg` (`tuning.v3_reg_budget`: the producers .dec to 136, the consumer .inc to 232, out of 168
  each at launch; `.minnctapersm 1` so that ptxas knows the 168: `launch_bounds`).
- Warp specialisation: warpgroup 0 consumes (Q load, wgmma S^T, online softmax over the key rows, P^T
  to shared memory, wgmma O^T), warpgroups 1.. produce (slot ids, 16-byte cp.async of the records,
  decode into the bf16 K ring; `v3_producer_wgs`: 2, bf16's copy included). A 2-stage K ring
  with full / empty mbarriers (`pipeline.PipelineAsync`; every producer thread arrives on full, the 128
  consumers on empty) replaces the CTA-wide barriers of v1/v2; each role syncs internally with its
  own named barrier (ids 1 and 2). bf16 records are copied straight into the K ring (cp.async, no
  decode); the other formats go through a raw ring (`tuning.v3_raw_ring`): 2 whole tiles (tile
  t+1 loads while tile t decodes) where they fit beside the K ring, else S stages of 16 or 32 keys for the
  fp8 records (fp8_ds_mla 5 x 16, fp8_e4m3 3 x 32: S - 1 parts load while one decodes, 64 keys in flight).
- Decode: E2M1 x E4M3 latents through `ptx.e2m1x8_scaled_bf16x2_r2` (a byte of two codes -> one bf16x2
  word, one multiply per 8 values by the block scale); 2^9 * s_l is folded into the latent part of
  each score (a second S accumulator for the rope k-steps) and into the output, as in v2. Other
  formats decode with the per-element path v2 also runs (`record_decode.RecordDecode.decode8`). The producer copies one
  fixed 16-byte chunk per thread, loads all of a thread's E2M1 blocks before its stores, and stores K free
  of bank conflicts (bit-identical to the first producer and faster; docs/kernels.md).
- No L2 prefetch of records: measured slower for the decoded formats and level for bf16, it was a bench probe
  (v3-pf) until it was deleted with the other variants that lost (docs/kernels.md#l2-prefetch).
- `setmaxnreg` only where the even share does not hold a role (`v3_reg_budget`): the 16-head tile's 384 threads
  compile to 124-150 of their 168, the one-producer 32-head tile's 256 threads may hold 255 each; only the
  two-producer 32-head tile (384 threads, consumer O^T [512, 32]) splits them.
- Softmax runs along M (keys), which spans the 4 warps: per head a butterfly over the 8 lanes that
  hold its rows and a 4-warp exchange through shared memory (double-buffered by tile parity, one
  named barrier per tile). Masked keys (past the query's length; sparse: an index of -1 or outside the cache,
  whose slot id the producer hands over with the K stage) get p = 0 by a select and never enter the running
  max, whose start value is the finite -FLT_MAX, exactly as in v2 (a query with no valid key: out 0, lse -inf).
- `split=True`: partial (out / l, lse) per split, merged by `mla_combine` (which applies the sink).
- Revisions: only the adopted consumer and decode code (rev 2, GPU-tested bitwise against rev 1 on an H200) is here;
  rev 1 and the never-run CTA pair were deleted (docs/kernels.md keeps their history and measurements).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from mla_eval_kernels.cute import ptx
from mla_eval_kernels.cute.ptx import LN_2, LOG2_E
from mla_eval_kernels.cute.record_decode import RecordDecode
from mla_eval_kernels.cute.smem import (
    cp_async_16,
    ld_shared_u8,
    ld_shared_u32,
    st_shared_bf16,
    st_shared_v4,
    swizzled_offset,
)
from mla_eval_kernels.plan import e2m1_bits
from mla_eval_kernels.plan.launch import D_QK, D_V, V3Config
from mla_eval_kernels.plan.record_plan import ORDER_8X4, RecordPlan
from mla_eval_kernels.plan.tuning import (
    V3_BN,
    V3_K_STAGES,
    fast_e2m1_eligible,
    is_bf16_plan,
    v3_raw_unit,
    v3_reg_budget,
)

WG = 128  # threads per warpgroup
BAR_CONSUMER = 1  # named barrier ids (0 is __syncthreads)
BAR_PRODUCER = 2


class MlaAttentionV3(RecordDecode):
    """One compiled v3 kernel per `KernelSpec` (cute.launch.kernel_for builds it; nothing else does): the record plan,
    the launch's `V3Config` (head tile, producer warpgroups, raw ring, L2 prefetch, timing probe: every value
    concrete, resolved once by `plan.launch.v3_plan`), the list kind, sink, outer scale and split.

    The record decode (`decode_tile`, `decode8`, `decode8_e2m1_folded`) is `record_decode.RecordDecode`, shared with
    v2: with `bn` = 64 and `num_threads` = the producer threads it writes the same swizzled bf16 K tile that wgmma reads.
    """

    def __init__(self, plan: RecordPlan, config: V3Config, *, sparse: bool, has_sink: bool, has_outer: bool, split: bool):
        # the config is concrete by construction (`V3Config.__post_init__`); the kernel reads it and resolves nothing
        if not isinstance(config, V3Config):
            raise TypeError(f"MlaAttentionV3 takes a V3Config, not {type(config).__name__}")
        heads = config.head_tile
        # benchmark only, wrong output: "nodec" leaves the K tile undecoded (the producer still copies and
        # hands over each tile), "nomma" drops the consumer's 68 wgmma per tile (softmax on zeros)
        self.probe = config.timing_probe
        self.plan = plan
        self.sparse = sparse  # slot ids from the launch's index list (-1 / out of range: no key), else block_table
        self.has_sink = has_sink
        self.has_outer = has_outer
        self.split = split
        self.fold = fast_e2m1_eligible(plan)
        self.copy_k = is_bf16_plan(plan)
        # producer warpgroups and, where the CTA's even share of the registers does not hold the roles, their
        # `setmaxnreg` budgets (consumer, producer; `v3_reg_budget`)
        self.producer_wgs = config.producer_wgs
        self.regs = v3_reg_budget(heads, self.producer_wgs)
        # the consumer's tile loop is unrolled by the K ring's stages: each copy's K stage is a compile-time constant,
        # and the copies after the first of a loop trip read Q's descriptors from a base ptxas cannot merge with the
        # first copy's (`q_descriptors`), without which the 32-head tile under `setmaxnreg` spilled them
        # (docs/kernels.md#consumer-rev-2). Copies of the tile code: a loop body of V3_K_STAGES tiles, then up to
        # V3_K_STAGES - 1 remainder tiles (compile_check counts wgmma by it)
        self.tile_copies = 2 * V3_K_STAGES - 1
        self.pt = WG * self.producer_wgs  # producer threads
        self.bn = V3_BN
        self.nh = heads  # the head tile: wgmma's N (`tuning.v3_head_tile`)
        self.num_threads = self.pt  # the producer threads decode (`RecordDecode.decode_tile` reads this)
        self.k_stages = V3_K_STAGES
        # raw ring: `raw_stages` stages of `raw_keys` records (whole tiles, or parts of one for the fp8 records)
        self.ring = config.raw_ring
        self.raw_stages = 0 if self.copy_k else self.ring[0]
        self.raw_keys = self.ring[1]
        self.raw_units = self.bn // self.raw_keys  # raw stages per key tile
        # slot ids in shared memory, columns of BN: the producer's 2 look-ahead buffers (by tile parity) and, sparse,
        # one per K stage: the ids of the keys in that stage, which the consumer masks by (an index of -1 or out of
        # range has no record: p = 0 exactly, as v2 masks by its slot ids), handed over with the stage's mbarrier
        self.slot_cols = 2 + (self.k_stages if sparse else 0)

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
        bn, nh, ks = self.bn, self.nh, self.k_stages
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
        mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, BFloat16)
        # K ring [BN keys, 576, stages]: keys fastest over the 8-row atoms, then 64-column blocks
        # (the byte layout of `swizzled_offset(key, d, BN)`, which the producer writes by hand)
        sK_layout = cute.tile_to_shape(k_atom, (bn, D_QK, ks), (0, 1, 2))
        # V^T [512, BN] over the same bytes: 64 dims contiguous per key row, keys fastest over atoms,
        # then 64-dim blocks at BN * 64 elements; a stage is BN * 576 elements further on
        vt_one = cute.tile_to_shape(mn_atom, (D_V, bn), (1, 0))
        sVt_outer = cute.append(vt_one.outer, cute.make_layout(ks, stride=bn * D_QK))
        sQ_layout = cute.tile_to_shape(k_atom, (nh, D_QK), (0, 1))
        sP_layout = cute.tile_to_shape(k_atom, (nh, bn), (0, 1))
        raw_bytes = max(16, self.raw_stages * self.raw_keys * self.plan.record_bytes)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, 2 * ks]
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sP_layout)], 1024]
            raw: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, raw_bytes], 128]
            slots: cute.struct.Align[cute.struct.MemRange[Int32, self.slot_cols * bn], 16]
            red: cute.struct.Align[cute.struct.MemRange[Float32, 2 * 4 * nh], 16]

        mma_s = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1), (bn, nh)
        )
        mma_o = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.MN, OperandMajorMode.K, Float32, (1, 1, 1), (bn, nh)
        )
        grid = (num_queries * num_splits, (num_heads + nh - 1) // nh, 1)
        self.kernel(
            q_ptr, cache_ptr, idx_ptr, seqlen_ptr, sink_ptr, out_ptr, lse_ptr,
            num_queries, num_heads, idx_stride, num_slots, block_size,
            softmax_scale, s_l, tiles_per_split, num_splits,
            sQ_layout, sK_layout, sVt_outer, vt_one.inner, sP_layout, mma_s, mma_o, SharedStorage,
        ).launch(grid=grid, block=[WG + self.pt, 1, 1], stream=stream, **self.launch_bounds())

    def launch_bounds(self) -> dict:
        """With per-role registers: one CTA per SM (`.minnctapersm 1`), which with `.reqntid` (the block) tells ptxas
        the registers each thread holds at entry (65536 / threads); without it ptxas drops every `setmaxnreg`
        ("unable to determine register count at entry", C7508) and spills at the even share. Nothing otherwise:
        the other kernels stay as they were compiled (and GPU-tested)."""
        return dict(min_blocks_per_mp=1) if self.regs is not None else {}

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
        sVt_outer: cute.Layout,
        sw: cute.Swizzle,
        sP_layout: cute.ComposedLayout,
        mma_s: cute.TiledMma,
        mma_o: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        bn = self.bn
        tidx, _, _ = cute.arch.thread_idx()
        block_x, head_tile, _ = cute.arch.block_idx()
        split_idx = block_x % num_splits  # launch_grid.cta_coords
        qi = block_x // num_splits
        h0 = head_tile * self.nh
        wg_idx = cute.arch.make_warp_uniform(tidx // WG)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        # the K ring's full / empty mbarriers: every producer thread arrives on full after its own
        # copies / decode are visible to the async proxy, every consumer thread on empty after its PV
        kpipe = pipeline.PipelineAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.k_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.pt),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, WG),
        )

        # ---- this CTA's key range (both roles compute the same): sparse, the list's width (topk), as in v2 ----
        num_keys = idx_stride
        if cutlass.const_expr(not self.sparse):
            num_keys = cute.make_tensor(seqlen_ptr, cute.make_layout(num_queries))[qi]
        num_tiles = (num_keys + bn - 1) // bn
        t_begin = split_idx * tiles_per_split
        t_end = cutlass.min(t_begin + tiles_per_split, num_tiles)
        n_local = cutlass.max(t_end - t_begin, 0)

        # every warpgroup past the first produces: decoded formats run 2 producer warpgroups (ptid 0..255);
        # `== 1` sent warpgroup 2 into the consumer (wrong tidx, 256 arrivals on a 128-thread named barrier)
        if wg_idx >= 1:
            if cutlass.const_expr(self.regs is not None):  # every warp of the warpgroup runs it (warp-uniform branch)
                cute.arch.setmaxregister_decrease(self.regs[1])
            self.producer(
                storage, kpipe, cache_ptr, idx_ptr, qi, idx_stride, num_keys, num_slots, block_size, s_l, t_begin, n_local,
                tidx - WG,
            )
        else:
            if cutlass.const_expr(self.regs is not None):  # waits until the producers' .dec returned the registers
                cute.arch.setmaxregister_increase(self.regs[0])
            self.consumer(
                storage, kpipe, q_ptr, sink_ptr, out_ptr, lse_ptr, num_queries, num_heads, softmax_scale, s_l,
                num_splits, split_idx, qi, h0, num_keys, t_begin, n_local, tidx,
                sQ_layout, sK_layout, sVt_outer, sw, sP_layout, mma_s, mma_o,
            )

    # ------------------------------------------------------------------ producer warpgroup
    @cute.jit
    def producer(
        self, storage, kpipe, cache_ptr: cute.Pointer, idx_ptr: cute.Pointer, qi: Int32, idx_stride: Int32,
        num_keys: Int32, num_slots: Int32, block_size: Int32, s_l: Float32, t_begin: Int32, n_local: Int32, ptid: Int32,
    ):
        bn = self.bn
        rec = self.plan.record_bytes
        sSlot = storage.slots.get_tensor(cute.make_layout((bn, self.slot_cols), stride=(1, bn)))
        sK_addr = storage.sK.data_ptr().toint()
        raw_addr = storage.raw.data_ptr().toint()
        cache_addr = cache_ptr.toint()
        # this query's block_table row or index list (64-bit offset: N x stride may pass 2^31 entries)
        m_idx = cute.make_tensor(idx_ptr + Int64(qi) * Int64(idx_stride), cute.make_layout(idx_stride))
        acq = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.k_stages)

        # look-ahead: thread ptid < BN writes the slot id of key ptid of the next tile into the slot ring. Each slot id
        # is loaded one iteration before its use, so the block_table read never stalls the thread that needs it.
        la_key = ptid % bn
        la_ahead = 1  # tiles ahead of the one being loaded
        if ptid < bn:
            sSlot[ptid, 0] = self.slot_of(m_idx, t_begin * bn + ptid, num_keys, num_slots, block_size, 0 < n_local)
        nxt = self.slot_of(m_idx, (t_begin + la_ahead) * bn + la_key, num_keys, num_slots, block_size, la_ahead < n_local)
        cute.arch.barrier(barrier_id=BAR_PRODUCER, number_of_threads=self.pt)
        if cutlass.const_expr(self.copy_k):
            # bf16: records are the K rows; cp.async straight into the ring, tile it + 1 in flight
            # while tile it completes. `com` trails `acq` by one tile.
            com = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.k_stages)
            if 0 < n_local:
                kpipe.producer_acquire(acq)
                self.load_tile(sSlot, 0, acq.index, sK_addr, cache_addr, ptid)
                self.stage_slots(sSlot, 0, acq.index, ptid)
                acq.advance()
            cute.arch.cp_async_commit_group()
            for it in range(n_local):
                nxt = self.look_ahead(
                    sSlot, m_idx, nxt, it, la_key, la_ahead, t_begin, n_local, num_keys, num_slots, block_size, cache_addr,
                    ptid,
                )
                cute.arch.barrier(barrier_id=BAR_PRODUCER, number_of_threads=self.pt)
                if it + 1 < n_local:
                    kpipe.producer_acquire(acq)
                    self.load_tile(sSlot, (it + 1) % 2, acq.index, sK_addr, cache_addr, ptid)
                    self.stage_slots(sSlot, (it + 1) % 2, acq.index, ptid)
                    acq.advance()
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(1)  # this thread's copies of tile it have landed
                cute.arch.fence_view_async_shared()  # ... and are visible to wgmma (async proxy)
                kpipe.producer_commit(com)
                com.advance()
        else:
            # decoded formats: a raw ring of S stages of nk records, U = BN / nk per key tile ("units"). Unit
            # u = U it + h sits in stage u % S; while it decodes, units u + 1 .. u + S - 1 load (one cp.async group
            # each, in order, so wait_group(S - 2) completes unit u). Loads run at most one tile ahead (S - 1 <= U,
            # `v3_raw_rings`), whose slot ids `look_ahead` wrote before the first barrier of the iteration.
            units, stages, nk = self.raw_units, self.raw_stages, self.raw_keys
            stage_bytes = nk * rec
            for j in cutlass.range_constexpr(stages - 1):  # units 0 .. S - 2: parts of tile 0
                _, part, stage = v3_raw_unit(self.ring, 0, j)
                if 0 < n_local:
                    self.load_raw(sSlot, 0, raw_addr + stage * stage_bytes, cache_addr, ptid, part * nk)
                cute.arch.cp_async_commit_group()
            for it in range(n_local):
                nxt = self.look_ahead(
                    sSlot, m_idx, nxt, it, la_key, la_ahead, t_begin, n_local, num_keys, num_slots, block_size, cache_addr,
                    ptid,
                )
                for h in cutlass.range_constexpr(units):
                    cute.arch.cp_async_wait_group(stages - 2)  # this thread's records of unit (it, h) have landed
                    # all threads' records landed, the next slot ids are written, and every thread has
                    # finished decoding the previous unit, whose raw stage is refilled next
                    cute.arch.barrier(barrier_id=BAR_PRODUCER, number_of_threads=self.pt)
                    j = h + stages - 1  # the unit loaded now: part j % U of tile it + j // U (this tile or the next)
                    tile, part, stage = v3_raw_unit(self.ring, it, j)
                    if cutlass.const_expr(j < units):
                        self.load_raw(sSlot, it % 2, raw_addr + stage * stage_bytes, cache_addr, ptid, part * nk)
                    else:
                        if tile < n_local:
                            self.load_raw(sSlot, tile % 2, raw_addr + stage * stage_bytes, cache_addr, ptid, part * nk)
                    cute.arch.cp_async_commit_group()
                    if cutlass.const_expr(h == 0):
                        kpipe.producer_acquire(acq)
                        self.stage_slots(sSlot, it % 2, acq.index, ptid)
                    if cutlass.const_expr(self.probe != "nodec"):
                        _, part, stage = v3_raw_unit(self.ring, it, h)
                        kbase = sK_addr + 2 * bn * D_QK * acq.index
                        self.decode_tile_v3(raw_addr + stage * stage_bytes, kbase, s_l, ptid, part * nk, self.raw_keys)
                cute.arch.fence_view_async_shared()
                kpipe.producer_commit(acq)
                acq.advance()

    @cute.jit
    def look_ahead(
        self, sSlot: cute.Tensor, m_idx: cute.Tensor, nxt: Int32, it: Int32, la_key: Int32, la_ahead: Int32, t_begin: Int32,
        n_local: Int32, num_keys: Int32, num_slots: Int32, block_size: Int32, cache_addr: Int64, ptid: Int32,
    ) -> Int32:
        """Use the slot id loaded last iteration (into the slot ring), load the next one."""
        bn = self.bn
        if ptid < bn:
            sSlot[ptid, (it + 1) % 2] = nxt
        t = it + 1 + la_ahead
        live = t < n_local
        if cutlass.const_expr(self.fold):
            # (decode rev 2, the fold formats: their kernels were GPU-tested with it) only the BN threads that write slot
            # ids need the next one (the others' value is unused); warp-uniform, it saves the block_table load and the
            # division in 6 of 8 warps
            live = live & (ptid < bn)
        return self.slot_of(m_idx, (t_begin + t) * bn + la_key, num_keys, num_slots, block_size, live)

    @cute.jit
    def stage_slots(self, sSlot: cute.Tensor, slot_buf: Int32, stage: Int32, ptid: Int32):
        """Sparse: the slot ids of the tile in look-ahead buffer `slot_buf` -> K stage `stage`'s column, for the
        consumer's mask. Thread ptid < BN copies the id it wrote itself (`look_ahead`), after acquiring the stage
        (the consumer released its previous ids) and before the stage's mbarrier arrive, which publishes it."""
        if cutlass.const_expr(self.sparse):
            if ptid < self.bn:
                sSlot[ptid, 2 + stage] = sSlot[ptid, slot_buf]

    @cute.jit
    def decode_tile_v3(
        self, raw: Int32, kbase: Int32, s_l: Float32, ptid: Int32, key0: cutlass.Constexpr, nkeys: cutlass.Constexpr,
    ):
        """Raw records of keys key0 .. key0 + nkeys of one tile (all of it, or a part with the part-tile raw
        stages) -> those rows of the bf16 K tile at `kbase`. E2M1 x E4M3 latents (the fold formats; whole tiles, or
        the 16 / 32-key parts their 32-head tile's raw ring holds): a work item is one block of 16 values (one
        8-byte load of codes, one scale load, conversion and multiply per 16 values, two 16-byte stores); lane =
        block, so a warp reads one record's 256 bytes of codes in two wavefronts and writes one swizzled 1 KB row.
        The rope and the other formats go through v2's path (`decode_tile` / `decode8`, 8 values per item: E4M3 ->
        fp32 exactly, times the fp32 group scale (and s_l) in fp32, that product to bf16 (RN), as v2 does)."""
        plan = self.plan
        lat = plan.latent
        rec = plan.record_bytes
        # one scale entry per 16 values: groups of 16 or 32 (all fold formats today); a smaller group
        # would need two entries per item, so it takes v2's path instead of reading the wrong scale
        # (a part needs whole warps of latent items per thread: nkeys * 32 blocks over the producer threads)
        fast = self.fold and lat.data_offset % 8 == 0 and rec % 8 == 0 and lat.group % 16 == 0
        if cutlass.const_expr(fast and (nkeys * 32) % self.pt == 0):
            blk = ptid % 32  # block of 16 values: 32 per 512-value latent
            entry = (16 * blk) // lat.group
            if cutlass.const_expr(lat.scale_order == ORDER_8X4):
                entry = 8 * (entry & 3) + (entry >> 2)
            self.decode_latent(raw, kbase, ptid, blk, entry, key0, nkeys)
            n_rope = nkeys * 8  # items of 8 rope values; a 16-key part with 256 threads has fewer than threads
            for u in cutlass.range_constexpr((n_rope + self.pt - 1) // self.pt):
                i = u * self.pt + ptid
                if cutlass.const_expr((u + 1) * self.pt <= n_rope):
                    self.decode_rope_item(raw, kbase, s_l, i, key0)
                else:
                    if i < n_rope:
                        self.decode_rope_item(raw, kbase, s_l, i, key0)
        else:
            self.decode_tile(raw, kbase, s_l, ptid, key0, nkeys)

    @cute.jit
    def decode_latent(
        self, raw: Int32, kbase: Int32, ptid: Int32, blk: Int32, entry: Int32, key0: cutlass.Constexpr, nkeys: cutlass.Constexpr,
    ):
        """The E2M1 x E4M3 latent of raw keys 0 .. nkeys (a whole tile or a part) -> K rows key0 .. key0 + nkeys
        (decode rev 2, docs/kernels.md#decode-rev-2). Every load of the thread's items first, then the conversions and
        stores (ptxas cannot tell the raw ring from the K ring: a load after a store would wait for it). The pairs go
        through `ptx.e2m1x8_scaled_bf16x2_r2`; the two 16-byte stores of a 16-value block go to chunks 2 blk,
        2 blk + 1, lanes with blk & 4 storing their upper 8 values first (each store covers all 8 bank groups); the
        word a lane converts and stores first is read by its own 4-byte load; the store addresses are worked out per
        thread, not per item. Item u is raw key u * kpp + w (kpp = keys
        per pass = producer threads / 32, w = ptid // 32 < kpp) and K row key0 + u * kpp + w: with key0 and u * kpp
        multiples of kpp (8 or 4), row & 7 = (K & 7) + w and row >> 3 = K >> 3 for K = key0 + u * kpp, so the swizzle
        (`swizzled_offset`) is a per-thread constant for each value of K & 7 (one with 256 producer threads, two
        with 128) plus 512 elements per 8 rows, an immediate in the store."""
        lat = self.plan.latent
        rec = self.plan.record_bytes
        bn = self.bn
        kpp = self.pt // 32
        if cutlass.const_expr(key0 % 8 != 0 or 8 % kpp != 0):  # the row arithmetic above
            raise ValueError(f"decode rev 2 needs key0 % 8 == 0 and 8 % kpp == 0 (key0 {key0}, kpp {kpp})")
        w = ptid // 32
        half = (blk >> 2) & 1  # 1: this lane converts and stores its upper 8 values first
        ld_first = raw + w * rec + lat.data_offset + 8 * blk + 4 * half
        ld_second = raw + w * rec + lat.data_offset + 8 * blk + 4 - 4 * half
        ld_scale = raw + w * rec + lat.scale_offset + entry
        chunk_first = ((2 * blk + half) & 7) ^ w  # 16-byte chunk (of 8) before the row's own XOR part K & 7
        chunk_second = ((2 * blk + 1 - half) & 7) ^ w
        col_block = (blk >> 2) * (bn // 8) * 512  # 64-column block of the first 8 rows, in elements
        items = []
        for u in cutlass.range_constexpr(nkeys * 32 // self.pt):
            off = u * kpp * rec
            w0 = ld_shared_u32(ld_first + off)
            w1 = ld_shared_u32(ld_second + off)
            code = ld_shared_u8(ld_scale + off)
            items.append((key0 + u * kpp, w0, w1, code))
        # per thread, once per value of K & 7 (hoisted out of the tile loop by ptxas)
        bases = {
            kk: (
                kbase + 2 * (col_block + (kk + w) * 64 + ((chunk_first ^ kk) << 3)),
                kbase + 2 * (col_block + (kk + w) * 64 + ((chunk_second ^ kk) << 3)),
            )
            for kk in sorted({it[0] & 7 for it in items})
        }
        for u in cutlass.range_constexpr(len(items)):
            k, w0, w1, code = items[u]
            st_first, st_second = bases[k & 7]
            f = ptx.e4m3_to_f32(code) * Float32(2.0**e2m1_bits.SCALE_BIAS_LOG2)
            s2 = ptx.bf16x2(f, f)
            a0, a1, a2, a3 = ptx.e2m1x8_scaled_bf16x2_r2(w0, s2)
            b0, b1, b2, b3 = ptx.e2m1x8_scaled_bf16x2_r2(w1, s2)
            self.store_k(st_first + 1024 * (k >> 3), a0, a1, a2, a3)
            self.store_k(st_second + 1024 * (k >> 3), b0, b1, b2, b3)

    @cute.jit
    def load_raw(
        self, sSlot: cute.Tensor, slot_buf: Int32, stage_addr: Int32, cache_addr: Int64, ptid: Int32, key0: cutlass.Constexpr,
    ):
        """cp.async of the records of keys key0 .. key0 + raw_keys of the tile whose slot ids are in buffer
        `slot_buf` into the raw stage at `stage_addr` (decoded formats): thread ptid copies 16-byte chunk
        ptid % chunks of keys ptid // chunks + g u (g = keys per pass), so the chunk and the addresses are
        worked out once, not per copy; all slot ids are read before the first copy. Zero-filled past the
        query's keys."""
        nk = self.raw_keys
        rec = self.plan.record_bytes
        chunks = rec // 16
        g = self.pt // chunks  # keys per pass (nvfp4, 256 producer threads: 9 keys, 243 threads)
        passes = (nk + g - 1) // g
        kk = ptid // chunks
        ch = ptid % chunks
        if ptid < g * chunks:
            src0 = cache_addr + Int64(16 * ch)
            dst0 = stage_addr + kk * rec + 16 * ch
            slots = []
            for u in cutlass.range_constexpr(passes):
                slots.append(sSlot[key0 + cutlass.min(kk + g * u, nk - 1), slot_buf])
            for u in cutlass.range_constexpr(passes):
                slot = slots[u]
                src = src0 + Int64(cutlass.max(slot, 0)) * Int64(rec)
                if cutlass.const_expr(g * (u + 1) > nk):  # the last pass: keys past the stage copy nothing
                    if kk + g * u < nk:
                        cp_async_16(dst0 + g * u * rec, src, 16 if slot >= 0 else 0)
                else:
                    cp_async_16(dst0 + g * u * rec, src, 16 if slot >= 0 else 0)

    @cute.jit
    def load_tile(self, sSlot: cute.Tensor, slot_buf: Int32, stage: Int32, sK_addr: Int32, cache_addr: Int64, ptid: Int32):
        """bf16: cp.async the BN records of a tile straight into K ring stage `stage` (zero-filled past the
        query's keys). Consecutive threads take consecutive 16-byte chunks of a record, so a warp reads
        whole records."""
        rec = self.plan.record_bytes
        chunks = rec // 16
        total = self.bn * chunks
        for i in range(ptid, total, self.pt):
            key = i // chunks
            ch = i % chunks
            slot = sSlot[key, slot_buf]
            src = cache_addr + Int64(cutlass.max(slot, 0)) * Int64(rec) + Int64(16 * ch)
            dst = sK_addr + 2 * (stage * (self.bn * D_QK) + swizzled_offset(key, 8 * ch, self.bn))
            cp_async_16(dst, src, 16 if slot >= 0 else 0)

    def store_k(self, addr, w0, w1, w2, w3):
        """16 decoded bytes into the K tile at `addr`."""
        st_shared_v4(addr, w0, w1, w2, w3)

    # ------------------------------------------------------------------ consumer warpgroup
    def key_valid(self, sSlot: cute.Tensor, stage: Int32, key0: Int32, key: Int32, num_keys: Int32):
        """Whether key `key` of the tile starting at key `key0` (in K stage `stage`) is one of the query's: dense, below
        its length; sparse, a valid index (the slot id the producer staged with the tile is >= 0). Plain Python,
        traced inline (a compile-time branch)."""
        if self.sparse:
            return sSlot[key, 2 + stage] >= 0
        return key0 + key < num_keys

    @cute.jit
    def rescale_o(self, acc_O, alpha, n_s: cutlass.Constexpr):
        """O^T *= the softmax correction of each value's head (`alpha`: one per head slot of the thread; value i of
        O^T holds head slot v % 2 + 2 (v // 4) of S^T's value v = i % n_s)."""
        for i in cutlass.range_constexpr(cute.size(acc_O)):
            v = i % n_s
            acc_O[i] = acc_O[i] * alpha[v % 2 + 2 * (v // 4)]

    @cute.jit
    def q_descriptors(self, it: Int32, t: dict):
        """Q's wgmma B operands (descriptors, as `t["tSrQ"]`) for a copy of the tile code after the first of an unrolled
        loop trip: the same shared-memory bytes, but at sQ's address + `ptx.opaque_zero(it)` (0: `it` >= 0).
        Built from the one address, every copy's 36 Q descriptors are the same values; ptxas then computed them once per
        trip and kept them from the first copy to the next, in vector registers where the uniform ones ran out (two
        R2UR per use), which at the 32-head tile under `setmaxnreg` (consumer 232) spilled 24-32 B even at 256. Per copy
        it costs one `min` and the descriptors' uniform adds, which the first copy pays anyway (docs/kernels.md,
        fewer SASS per tile at both head tiles, no stack frame)."""
        addr = t["sQ_addr"] + ptx.opaque_zero(it)
        base = cute.make_ptr(BFloat16, addr, cute.AddressSpace.smem, assumed_align=1024)  # sQ: Align 1024
        sQ = cute.make_tensor(cute.recast_ptr(base, t["sQ_layout"].inner, dtype=BFloat16), t["sQ_layout"].outer)
        return t["mma_s"].make_fragment_B(t["thr_s"].partition_B(sQ))

    @cute.jit
    def consume_tile(self, kpipe, state, stage, it: Int32, t: dict, fresh_q: cutlass.Constexpr = False):
        """One key tile of the consumer warpgroup: wait for K stage `stage` (`state`: its mbarrier index and phase), S^T,
        the online softmax, P^T to shared memory, O^T += V^T P^T, release the stage. `stage` is `state.index` as a
        compile-time constant (the unrolled loop); `t` holds the consumer's tensors; `fresh_q` (copies after the first
        of a loop trip): Q's descriptors from `q_descriptors`."""
        bn, nh = self.bn, self.nh
        hsl = nh // 4
        mma_s, mma_o, acc_lat, acc_rope, acc_O = t["mma_s"], t["mma_o"], t["acc_lat"], t["acc_rope"], t["acc_O"]
        tSrK, tSrQ, tOrVt, tOrP, tScS = t["tSrK"], t["tSrQ"], t["tOrVt"], t["tOrP"], t["tScS"]
        row_max, row_sum, alpha, sRed, sSlot = t["row_max"], t["row_sum"], t["alpha"], t["sRed"], t["sSlot"]
        sP_addr, scale_log2, fold, num_keys = t["sP_addr"], t["scale_log2"], t["fold"], t["num_keys"]
        warp, lane = t["warp"], t["lane"]
        n_s = cute.size(acc_lat)
        n_k = cute.size(tSrK, mode=[2])
        n_k_latent = n_k * D_V // D_QK
        n_kv = cute.size(tOrP, mode=[2])
        if cutlass.const_expr(fresh_q):
            tSrQ = self.q_descriptors(it, t)
        kpipe.consumer_wait(state)
        # ---- S^T = K Q^T (latent and rope k-steps in separate accumulators when folding) ----
        acc_lat.fill(0.0)
        acc_rope.fill(0.0)
        warpgroup.fence()
        for k in cutlass.range_constexpr(0 if self.probe == "nomma" else n_k):
            if cutlass.const_expr(self.fold and k >= n_k_latent):
                cute.gemm(mma_s, acc_rope, tSrK[None, None, k, stage], tSrQ[None, None, k], acc_rope)
            else:
                cute.gemm(mma_s, acc_lat, tSrK[None, None, k, stage], tSrQ[None, None, k], acc_lat)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

        # ---- online softmax along the key rows ----
        key0 = (t["t_begin"] + it) * bn
        buf = it % 2
        for i in cutlass.range_constexpr(n_s):
            s = acc_lat[i]
            if cutlass.const_expr(self.fold):
                s = acc_lat[i] * fold + acc_rope[i]
            valid = self.key_valid(sSlot, stage, key0, tScS[i][0], num_keys)
            acc_lat[i] = s if valid else -ptx.FLT_MAX
        for hs in cutlass.range_constexpr(hsl):
            v0 = hs % 2 + 4 * (hs // 2)
            mx = ptx.max_f32(acc_lat[v0], acc_lat[v0 + 2])
            mx = ptx.max_f32(mx, cute.arch.shuffle_sync_bfly(mx, offset=4))
            mx = ptx.max_f32(mx, cute.arch.shuffle_sync_bfly(mx, offset=8))
            mx = ptx.max_f32(mx, cute.arch.shuffle_sync_bfly(mx, offset=16))
            if lane < 4:
                sRed[tScS[v0][1], warp, buf] = mx
        cute.arch.barrier(barrier_id=BAR_CONSUMER, number_of_threads=WG)
        for hs in cutlass.range_constexpr(hsl):
            v0 = hs % 2 + 4 * (hs // 2)
            head = tScS[v0][1]
            m_new = row_max[hs]
            for w in cutlass.range_constexpr(4):
                m_new = ptx.max_f32(m_new, sRed[head, w, buf])
            alpha[hs] = cute.math.exp2((row_max[hs] - m_new) * scale_log2, fastmath=True)
            m_scaled = m_new * scale_log2
            psum = Float32(0.0)
            for j in cutlass.range_constexpr(2):
                v = v0 + 2 * j
                key = tScS[v][0]
                p = cute.math.exp2(acc_lat[v] * scale_log2 - m_scaled, fastmath=True)
                p = p if self.key_valid(sSlot, stage, key0, key, num_keys) else Float32(0.0)
                psum = psum + p
                st_shared_bf16(sP_addr + 2 * swizzled_offset(head, key, nh), p)
            row_sum[hs] = row_sum[hs] * alpha[hs] + psum
            row_max[hs] = m_new
        # lazy rescale: where every alpha of the warp is exactly 1.0 (no head's running max moved; NaN or any
        # other value rescales), O^T * 1.0f == O^T bit for bit (mul.f32, no ftz), so the 64 multiplies are
        # skipped; one vote keeps the branch warp-uniform (all 4 warps hold the same heads: same outcome)
        moved = alpha[0] != Float32(1.0)
        for hs in cutlass.range_constexpr(1, hsl):
            moved = moved | (alpha[hs] != Float32(1.0))
        if cute.arch.vote_any_sync(moved):
            self.rescale_o(acc_O, alpha, n_s)
        cute.arch.fence_view_async_shared()  # P^T stores -> visible to wgmma
        cute.arch.barrier(barrier_id=BAR_CONSUMER, number_of_threads=WG)

        # ---- O^T += V^T P^T ----
        warpgroup.fence()
        for k in cutlass.range_constexpr(0 if self.probe == "nomma" else n_kv):
            cute.gemm(mma_o, acc_O, tOrVt[None, None, k, stage], tOrP[None, None, k], acc_O)
        warpgroup.commit_group()
        warpgroup.wait_group(0)  # K stage and P^T read: the stage may be refilled, P rewritten
        kpipe.consumer_release(state)

    @cute.jit
    def consumer(
        self, storage, kpipe, q_ptr: cute.Pointer, sink_ptr: cute.Pointer, out_ptr: cute.Pointer, lse_ptr: cute.Pointer,
        num_queries: Int32, num_heads: Int32, softmax_scale: Float32, s_l: Float32, num_splits: Int32, split_idx: Int32,
        qi: Int32, h0: Int32, num_keys: Int32, t_begin: Int32, n_local: Int32, tidx: Int32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sVt_outer: cute.Layout, sw: cute.Swizzle,
        sP_layout: cute.ComposedLayout, mma_s: cute.TiledMma, mma_o: cute.TiledMma,
    ):
        bn, nh = self.bn, self.nh
        hsl = nh // 4  # heads per thread: the wgmma D fragment gives each thread 2 columns of each 8-column block
        warp = tidx // 32
        lane = tidx % 32
        sSlot = storage.slots.get_tensor(cute.make_layout((bn, self.slot_cols), stride=(1, bn)))
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sVt = storage.sK.get_tensor(sVt_outer, swizzle=sw)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        # the 4-warp exchange [head, warp, buffer]: the 4 warps of a head side by side (16 bytes, aligned), so a thread
        # reads a head's 4 partial maxima (and, in the epilogue, sums) with one 16-byte load instead of 4
        sRed = storage.red.get_tensor(cute.make_layout((nh, 4, 2), stride=(4, 1, 4 * nh)))
        sQ_addr = storage.sQ.data_ptr().toint()
        sP_addr = storage.sP.data_ptr().toint()

        # ---- Q [head tile, 576] into shared memory (rows past the heads are zeros) ----
        q_addr = q_ptr.toint()
        chunks = D_QK // 8
        for u in cutlass.range_constexpr(nh * chunks // WG):
            i = u * WG + tidx
            r = i // chunks
            c = (i % chunks) * 8
            h = h0 + r
            src = q_addr + (Int64(qi) * Int64(num_heads) + Int64(cutlass.min(h, num_heads - 1))) * Int64(2 * D_QK) + Int64(2 * c)
            cp_async_16(sQ_addr + 2 * swizzled_offset(r, c, nh), src, 16 if h < num_heads else 0)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BAR_CONSUMER, number_of_threads=WG)

        # ---- wgmma partitions ----
        thr_s = mma_s.get_slice(tidx)
        tSrK = mma_s.make_fragment_A(thr_s.partition_A(sK))  # (MMA, 1, 36, stages) descriptors
        tSrQ = mma_s.make_fragment_B(thr_s.partition_B(sQ))  # (MMA, 1, 36)
        thr_o = mma_o.get_slice(tidx)
        tOrVt = mma_o.make_fragment_A(thr_o.partition_A(sVt))  # (MMA, 8, 4, stages)
        tOrP = mma_o.make_fragment_B(thr_o.partition_B(sP))  # (MMA, 1, 4)
        acc_shape_s = thr_s.partition_shape_C((bn, nh))
        acc_lat = cute.make_rmem_tensor(acc_shape_s, Float32)
        acc_rope = cute.make_rmem_tensor(acc_shape_s, Float32)
        acc_O = cute.make_rmem_tensor(thr_o.partition_shape_C((D_V, nh)), Float32)
        acc_O.fill(0.0)
        mma_s.set(warpgroup.Field.ACCUMULATE, True)
        mma_o.set(warpgroup.Field.ACCUMULATE, True)
        n_s = cute.size(acc_lat)  # nh / 2 values: keys r, r + 8 x heads c, c + 1 of each 8-head block
        # (key, head) of each S^T value; (dim, head) of each O^T value (identity partitions)
        tScS = thr_s.partition_C(cute.make_identity_tensor((bn, nh)))
        tOcO = thr_o.partition_C(cute.make_identity_tensor((D_V, nh)))

        # per-thread state for its nh / 4 heads (value v of the nh / 2-value fragment belongs to head slot
        # v % 2 + 2 * (v // 4): the wgmma D fragment is ((2 columns, 2 row halves, N / 8 blocks), ...))
        row_max = cute.make_rmem_tensor((hsl,), Float32)
        row_sum = cute.make_rmem_tensor((hsl,), Float32)
        alpha = cute.make_rmem_tensor((hsl,), Float32)
        row_max.fill(-ptx.FLT_MAX)
        row_sum.fill(0.0)
        scale_log2 = softmax_scale * Float32(LOG2_E)
        fold = Float32(2.0**e2m1_bits.FOLD_LOG2)
        if cutlass.const_expr(self.has_outer):
            fold = fold * s_l

        # the per-tile state and constants `consume_tile` reads
        tile = dict(
            mma_s=mma_s, mma_o=mma_o, acc_lat=acc_lat, acc_rope=acc_rope, acc_O=acc_O, tSrK=tSrK, tSrQ=tSrQ, tOrVt=tOrVt,
            tOrP=tOrP, tScS=tScS, row_max=row_max, row_sum=row_sum, alpha=alpha, sRed=sRed, sSlot=sSlot, sP_addr=sP_addr,
            scale_log2=scale_log2, fold=fold, t_begin=t_begin, num_keys=num_keys, warp=warp, lane=lane,
            sQ_addr=sQ_addr, sQ_layout=sQ_layout, thr_s=thr_s,
        )
        # the tile loop unrolled by the ring's stages, so each tile's K stage is a compile-time constant. With the
        # stage a loop-carried run-time value (consumer rev 1, deleted), ptxas formed every K / V^T wgmma descriptor in
        # vector registers (an add, a move of the constant high word, two R2UR: ~280 of ~700 SASS per tile); with it
        # constant, a descriptor is the stage's base plus a constant, as Q's always were (uniform 64-bit adds).
        # Tile it sits in stage it % S with mbarrier phase (it // S) % 2 (what `PipelineState.advance` counts). The
        # trips hold whole rounds of S tiles; the last n_local % S tiles follow (a branch inside the loop for them
        # cost ptxas ~100 more uniform moves per tile in the second copy). Copies after the first of a trip (or of the
        # remainder) take Q's descriptors from `q_descriptors`.
        ks = self.k_stages
        rounds = n_local // ks
        for r in range(rounds):
            for st in cutlass.range_constexpr(ks):
                state = pipeline.PipelineState(ks, r * ks + st, Int32(st), r % 2)
                self.consume_tile(kpipe, state, st, r * ks + st, tile, fresh_q=st > 0)
        for st in cutlass.range_constexpr(ks - 1):
            if rounds * ks + st < n_local:
                it = rounds * ks + st
                self.consume_tile(kpipe, pipeline.PipelineState(ks, it, Int32(st), rounds % 2), st, it, tile, fresh_q=st > 0)

        # ---- epilogue: row sums over the 8 lanes and 4 warps of each head, normalise, store ----
        for hs in cutlass.range_constexpr(hsl):
            v0 = hs % 2 + 4 * (hs // 2)
            l_sum = row_sum[hs]
            l_sum = l_sum + cute.arch.shuffle_sync_bfly(l_sum, offset=4)
            l_sum = l_sum + cute.arch.shuffle_sync_bfly(l_sum, offset=8)
            l_sum = l_sum + cute.arch.shuffle_sync_bfly(l_sum, offset=16)
            if lane < 4:
                sRed[tScS[v0][1], warp, 0] = l_sum
        # (the last tile's max exchange used buffer (n_local - 1) % 2; a barrier separates its reads)
        cute.arch.barrier(barrier_id=BAR_CONSUMER, number_of_threads=WG)
        base_row = qi * num_heads + h0
        if cutlass.const_expr(self.split):
            base_row = (split_idx * num_queries + qi) * num_heads + h0
        gO = cute.make_tensor(out_ptr + Int64(base_row) * Int64(D_V), cute.make_layout((nh, D_V), stride=(D_V, 1)))
        m_lse = cute.make_tensor(lse_ptr + Int64(base_row), cute.make_layout(nh))
        rows_valid = cutlass.min(num_heads - h0, nh)
        inv_h = cute.make_rmem_tensor((hsl,), Float32)
        for hs in cutlass.range_constexpr(hsl):
            v0 = hs % 2 + 4 * (hs // 2)
            head = tScS[v0][1]
            l_sum = sRed[head, 0, 0] + sRed[head, 1, 0] + sRed[head, 2, 0] + sRed[head, 3, 0]
            denom = l_sum
            if cutlass.const_expr(self.has_sink and not self.split):
                sink = cute.make_tensor(sink_ptr, cute.make_layout(num_heads))[cutlass.min(h0 + head, num_heads - 1)]
                denom = l_sum + cute.math.exp2(sink * Float32(LOG2_E) - row_max[hs] * scale_log2, fastmath=True)
            inv = Float32(0.0)
            if l_sum > Float32(0.0):
                inv = Float32(1.0) / denom
                if cutlass.const_expr(self.fold):
                    inv = inv * fold  # V = K[:, :512] was decoded up to 2^9 * s_l
            inv_h[hs] = inv
            lse = -Float32.inf
            if l_sum > Float32(0.0):
                lse = row_max[hs] * softmax_scale + cute.math.log2(l_sum, fastmath=False) * Float32(LN_2)
            if warp == 0 and lane < 4 and head < rows_valid:
                m_lse[head] = lse
        for i in cutlass.range_constexpr(cute.size(acc_O)):
            v = i % n_s
            d, head = tOcO[i]
            if head < rows_valid:
                gO[head, d] = acc_O[i] * inv_h[v % 2 + 2 * (v // 4)]
