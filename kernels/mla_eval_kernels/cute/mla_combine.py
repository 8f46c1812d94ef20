"""Combine the split-KV partials of `mla_attention` into the final output, applying the sink.

Inputs: partial out `[S, N, H, 512]` fp32 (each normalised by its own sum) and partial lse
`[S, N, H]` fp32 (natural log, -inf for a split that saw no valid key). Output, per row (n, h):
    M = max_s lse_s,  w_s = e^{lse_s - M},  W = sum_s w_s
    out = sum_s w_s o_s / (W + e^{sink_h - M}),  lse = M + log W
and out = 0, lse = -inf when every split was empty (M = -inf), with or without a sink.

Kernel: one warp per row, lane l owns columns [16 l, 16 l + 16) (four 16-byte loads per split).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453
WARPS_PER_CTA = 4
D_V = 512


class MlaCombine:
    def __init__(self, has_sink: bool):
        self.has_sink = has_sink

    @cute.jit
    def __call__(
        self,
        part_out_ptr: cute.Pointer,
        part_lse_ptr: cute.Pointer,
        sink_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        lse_ptr: cute.Pointer,
        num_rows: Int32,
        num_heads: Int32,
        num_splits: Int32,
        stream: cuda.CUstream,
    ):
        grid = (num_rows + WARPS_PER_CTA - 1) // WARPS_PER_CTA
        self.kernel(part_out_ptr, part_lse_ptr, sink_ptr, out_ptr, lse_ptr, num_rows, num_heads, num_splits).launch(
            grid=[grid, 1, 1], block=[32 * WARPS_PER_CTA, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        part_out_ptr: cute.Pointer,
        part_lse_ptr: cute.Pointer,
        sink_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        lse_ptr: cute.Pointer,
        num_rows: Int32,
        num_heads: Int32,
        num_splits: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = bidx * WARPS_PER_CTA + tidx // 32
        if row < num_rows:
            m_lse = cute.make_tensor(part_lse_ptr, cute.make_layout((num_rows, num_splits), stride=(1, num_rows)))
            mx = -Float32.inf
            for s in range(num_splits):
                mx = cute.arch.fmax(mx, m_lse[row, s])
            acc = cute.make_rmem_tensor((16,), Float32)
            acc.fill(0.0)
            total = Float32(0.0)
            if mx > -Float32.inf:
                for s in range(num_splits):
                    w = cute.math.exp2((m_lse[row, s] - mx) * Float32(LOG2_E), fastmath=True)
                    total = total + w
                    src = cute.make_tensor(
                        part_out_ptr + (Int64(s) * Int64(num_rows) + Int64(row)) * Int64(D_V) + Int64(16 * lane),
                        cute.make_layout(16),
                    )
                    r = cute.make_rmem_tensor((16,), Float32)
                    cute.autovec_copy(src, r)
                    acc.store(acc.load() + r.load() * w)
            denom = total
            if cutlass.const_expr(self.has_sink):
                sink = cute.make_tensor(sink_ptr, cute.make_layout(num_heads))[row % num_heads]
                denom = total + cute.math.exp2((sink - mx) * Float32(LOG2_E), fastmath=True)
            inv = Float32(0.0)
            lse = -Float32.inf
            if total > Float32(0.0):
                inv = Float32(1.0) / denom
                lse = mx + cute.math.log2(total, fastmath=False) * Float32(LN_2)
            acc.store(acc.load() * inv)
            dst = cute.make_tensor(out_ptr + Int64(row) * Int64(D_V) + Int64(16 * lane), cute.make_layout(16))
            cute.autovec_copy(acc, dst)
            if lane == 0:
                cute.make_tensor(lse_ptr, cute.make_layout(num_rows))[row] = lse
