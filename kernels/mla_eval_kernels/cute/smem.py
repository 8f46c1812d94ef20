"""Shared-memory addressing and the inline PTX that moves data into and out of it, for every attention kernel
(v2 `mla_attention`, v3 `mla_attention_v3`) and the record decode they share (`record_decode`).

`swizzled_offset` is the one definition of the K / Q / P tiles' byte layout that the kernels write by hand and the wgmma
descriptors (v3) read through CuTe layouts (tests check the two agree). Call the PTX helpers only inside `@cute.jit` /
`@cute.kernel` code.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32


def swizzle_atom(cols: int):
    bits = 3 if cols == 64 else 2
    return cute.make_composed_layout(cute.make_swizzle(bits, 3, 3), 0, cute.make_layout((8, cols), stride=(cols, 1)))


def swizzled_offset(r, c, rows: int):
    """Element offset of (r, c) in a [rows, 576] bf16 tile of `_swizzle_atom(64)` atoms, (0, 1) order.

    Equals `cute.crd2idx((r, c), layout)` of that layout (checked in tests); used to address
    16-byte chunks (8 consecutive columns) with cp.async / st.shared.
    """
    return (
        ((r >> 3) + (c >> 6) * (rows // 8)) * 512
        + (r & 7) * 64
        + ((((c >> 3) & 7) ^ (r & 7)) << 3)
        + (c & 7)
    )


def cp_async_16(smem_addr, gmem_addr, src_bytes):
    cute.arch.inline_ptx(
        "cp.async.cg.shared.global [{$r0}], [{$r1}], 16, {$r2};",
        read_only_args=[Int32(smem_addr), Int64(gmem_addr), Int32(src_bytes)],
    )


def cp_async_small(smem_addr, gmem_addr, nbytes: int, src_bytes):
    """cp.async of 4 or 8 bytes (records whose size is not a multiple of 16 B: only .ca takes these sizes)."""
    cute.arch.inline_ptx(
        f"cp.async.ca.shared.global [{{$r0}}], [{{$r1}}], {nbytes}, {{$r2}};",
        read_only_args=[Int32(smem_addr), Int64(gmem_addr), Int32(src_bytes)],
    )


def ld_shared_u32(addr) -> Uint32:
    return cute.arch.inline_ptx("ld.shared.b32 {$w0}, [{$r0}];", write_only_types=[Uint32], read_only_args=[Int32(addr)])


def ld_shared_u8(addr) -> Uint32:
    return cute.arch.inline_ptx("ld.shared.u8 {$w0}, [{$r0}];", write_only_types=[Uint32], read_only_args=[Int32(addr)])


def ld_shared_v4(addr):
    return cute.arch.inline_ptx(
        "ld.shared.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Uint32, Uint32, Uint32, Uint32],
        read_only_args=[Int32(addr)],
    )


def st_shared_v4(addr, a, b, c, d):
    cute.arch.inline_ptx(
        "st.shared.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
        read_only_args=[Int32(addr), Uint32(a), Uint32(b), Uint32(c), Uint32(d)],
    )


def ld_shared_v2(addr):
    return cute.arch.inline_ptx(
        "ld.shared.v2.b32 {{$w0}, {$w1}}, [{$r0}];", write_only_types=[Uint32, Uint32], read_only_args=[Int32(addr)]
    )


def st_shared_bf16(addr, x):
    cute.arch.inline_ptx(
        "{ .reg .b16 h; cvt.rn.bf16.f32 h, {$r1}; st.shared.b16 [{$r0}], h; }",
        read_only_args=[Int32(addr), Float32(x)],
    )
