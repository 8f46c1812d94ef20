"""GPU tests of the v3 dense-decode kernel (`mla_attention_v3`, issue 14) against the torch reference.

Fresh random caches and queries per case, outputs and split partials poisoned with NaN first (every
element the kernel owns must be written), error bounds of tests/test_kernels_gpu.py. Lengths cover
1 key, one short of / exactly / one past the 64-key tile, lengths that are not a multiple of the tile,
and 64K keys; for the fp8 records, whose raw ring holds parts of tiles, lengths around the 16- and 32-key parts
and every ring that fits (bit-identical outputs). Also:
The sparse and 32-head launches (held off until these tests passed on an H200):
sparse top-k lists at h = 16, 64, 128 (topk 2048 and 777, -1 padding, an all-invalid row, out-of-range ids, a
sink) and the 32-head tile for dense h = 32, 64, 128, each with and without splits. The 32-head tile with two producer
warpgroups and per-role registers (`setmaxnreg`; held until its case passed on an H200
the 32-head tile's default), against the reference and bit-identical to the one-producer kernel.
MLA_EVAL_ATTENTION_KERNEL=v3 routes dense and sparse launches to v3 and everything v3 does not cover (formats it
refuses, launches still held outside these tests) to v2; unset, the per-format default
(`attention_tuning.generation_for`) runs v3 only for the launches it names, and dispatch
records the generation each launch ran.
"""

from __future__ import annotations

import zlib

import pytest
import torch

cutlass = pytest.importorskip("cutlass")

from test_kernels_gpu import (  # noqa: E402
    BLOCK,
    FORMATS,
    _bound,
    _check,
    _dense_lists,
    _random_cache,
    _run,
    _sparse_lists,
    needs_cuda,
)

from benchmarks.probes import v3_probe_plan  # noqa: E402
from mla_eval.attention import reference  # noqa: E402
from mla_eval.formats import get_format  # noqa: E402
from mla_eval_kernels.cute import compile_cache  # noqa: E402
from mla_eval_kernels.plan import launch as launch_plan_mod  # noqa: E402
from mla_eval_kernels.plan import tuning as attention_tuning  # noqa: E402
from mla_eval_kernels.plan.device_limits import HOPPER_FACTS, HOPPER_SMEM_PER_BLOCK  # noqa: E402
from mla_eval_kernels.plan.record_plan import plan_for  # noqa: E402

# what v3 can run
V3_FORMATS = [
    f for f in FORMATS if attention_tuning.v3_blocker(plan_for(get_format(f)), False, HOPPER_SMEM_PER_BLOCK) is None
]
V3_BLOCKED = [f for f in FORMATS if f not in V3_FORMATS]
V3_DECODED = [f for f in V3_FORMATS if not attention_tuning.is_bf16_plan(plan_for(get_format(f)))]
# records too large for two whole tiles beside the K ring: the raw ring holds parts of tiles (`v3_raw_ring`)
V3_PART_RING = [f for f in V3_DECODED if attention_tuning.v3_raw_ring(plan_for(get_format(f))) != attention_tuning.V3_RAW_WHOLE]
LENGTHS = [1, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 17, 1000, 777]


def _sw128(off: int) -> int:
    """Element offset (bf16) after the hardware's 128-byte swizzle: 16-byte chunk ^= 128-byte row % 8."""
    b = 2 * off
    return (b ^ (((b >> 7) & 7) << 4)) // 2


def test_v3_shared_layouts_are_the_hand_written_offsets():
    """No GPU needed. The producer writes K (cp.async / decode), the consumer Q and P^T, by hand
    (`swizzled_offset`); wgmma reads them through the layouts' descriptors. K, its V^T view, Q and P^T
    must name the same bytes: the layouts' offsets, swizzled as the hardware does, equal the hand ones."""
    import cutlass.cute as cute
    from cutlass import BFloat16
    from cutlass.cute.nvgpu import warpgroup

    from mla_eval_kernels.cute.smem import swizzled_offset

    got = {}
    coords = [(0, 0, 0), (1, 8, 0), (9, 70, 0), (63, 575, 0), (5, 130, 1), (17, 300, 1), (23, 511, 1), (40, 200, 1), (62, 63, 1)]

    @cute.jit
    def probe():
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
        mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, BFloat16)
        sk = cute.tile_to_shape(k_atom, (64, 576, 2), (0, 1, 2)).outer
        vt = cute.append(cute.tile_to_shape(mn_atom, (512, 64), (1, 0)).outer, cute.make_layout(2, stride=64 * 576))
        for nh in (16, 32):  # the head tiles (`attention_tuning.V3_HEAD_TILES`): Q and P^T have nh rows
            sq = cute.tile_to_shape(k_atom, (nh, 576), (0, 1)).outer
            sp = cute.tile_to_shape(k_atom, (nh, 64), (0, 1)).outer
            for key, d, s in coords:
                got[("k", key, d, s)] = cute.crd2idx((key, d, s), sk)
                got[("v", key, d % 512, s)] = cute.crd2idx((d % 512, key, s), vt)
                got[(f"q{nh}", key % nh, d)] = cute.crd2idx((key % nh, d), sq)
                got[(f"p{nh}", key % nh, d % 64)] = cute.crd2idx((key % nh, d % 64), sp)

    probe()
    assert attention_tuning.V3_HEAD_TILES == (16, 32)
    assert len(got) >= 6 * len(coords) - 6
    for (kind, r, c, *s), idx in got.items():
        rows = 64 if kind in "kv" else int(kind[1:])
        want = swizzled_offset(r, c, rows) + (s[0] * 64 * 576 if s else 0)
        assert _sw128(idx) == want, (kind, r, c, s, idx, want)


@pytest.mark.parametrize("nh", [16, 32])
def test_v3_accumulator_fragments_are_what_the_softmax_assumes(nh):
    """No GPU needed. The consumer groups S^T values by head as v % 2 + 2 * (v // 4) (nh / 4 heads per thread)
    and reduces a head's keys over lanes xor 4, 8, 16 and the 4 warps: check that against the wgmma partitions,
    for both head tiles (N = 16, 32)."""
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import BFloat16, Float32
    from cutlass.cute.nvgpu import OperandMajorMode

    got = {}

    @cute.jit
    def probe():
        for major in (OperandMajorMode.K, OperandMajorMode.MN):
            mma = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, major, OperandMajorMode.K, Float32, (1, 1, 1), (64, nh))
            for t in cutlass.range_constexpr(128):
                c = mma.get_slice(t).partition_C(cute.make_identity_tensor((64, nh)))
                o = mma.get_slice(t).partition_C(cute.make_identity_tensor((512, nh)))
                got[(major, t)] = ([c[i] for i in range(cute.size(c))], [o[i] for i in range(cute.size(o))])

    probe()
    for (major, t), (s_vals, o_vals) in got.items():
        lane, warp = t % 32, t // 32
        n_s = nh // 2
        assert len(s_vals) == n_s and len(o_vals) == 4 * nh
        assert {head for _, head in s_vals} == {2 * (lane % 4) + j % 2 + 8 * (j // 2) for j in range(nh // 4)}
        for v, (key, head) in enumerate(s_vals):
            assert head == 2 * (lane % 4) + v % 2 + 8 * (v // 4), (t, v)  # head slot v % 2 + 2 * (v // 4)
            assert key == 16 * warp + lane // 4 + 8 * ((v // 2) % 2), (t, v)  # lane // 4 and the warp pick the key
        for i, (d, head) in enumerate(o_vals):
            assert head == s_vals[i % n_s][1] and d == 64 * (i // n_s) + s_vals[i % n_s][0], (t, i)


def _v3(
    spec, q, cache, scale, *, sink=None, outer_scale=None, num_splits=None, block_table=None, seq_lens=None, indices=None,
    **probe,
):
    """One v3 launch into NaN-poisoned outputs (and split partials)."""
    from benchmarks.probes import mla_attention_v3

    n, h = q.shape[:2]
    out = torch.full((n, h, 512), float("nan"), device="cuda")
    lse = torch.full((n, h), float("nan"), device="cuda")
    mla_attention_v3(
        plan_for(spec), q, cache, softmax_scale=scale, block_table=block_table, seq_lens=seq_lens, indices=indices,
        sink=sink, outer_scale=outer_scale, num_splits=num_splits, out=out, lse=lse, workspace_fill=float("nan"), **probe,
    )
    torch.cuda.synchronize()
    return out, lse


def _case(fmt, heads, lengths, seed, blocks=24, sink=False):
    spec = get_format(fmt)
    gen = torch.Generator().manual_seed(zlib.crc32(f"v3/{fmt}/{heads}/{seed}".encode()))
    s_l = 0.05 if spec.outer_scale is not None else None
    cache = _random_cache(spec, blocks, gen, outer_scale=s_l)
    table, seq_lens, slots = _dense_lists(gen, lengths, blocks)
    q = torch.randn(len(lengths), heads, 576, generator=gen).to(torch.bfloat16).cuda()
    sink_t = torch.randn(heads, generator=gen).cuda() if sink else None
    scale = 576**-0.5
    lists = dict(block_table=table.cuda(), seq_lens=seq_lens.cuda())
    ref_out, ref_lse = reference.mla_attention(spec, q, cache, softmax_scale=scale, sink=sink_t, outer_scale=s_l, **lists)
    bound = _bound(spec, q.cpu(), cache.cpu(), slots, scale, s_l)
    return spec, q, cache, scale, sink_t, s_l, lists, ref_out, ref_lse, bound


@needs_cuda
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("heads", [16, 8, 2, 32])
@pytest.mark.parametrize("fmt", V3_FORMATS)
def test_v3_matches_reference(fmt, heads, sink):
    if heads != 16 and fmt not in ("nvfp4", "bf16"):
        pytest.skip("other head counts on nvfp4 and bf16 only (the head tile is format-independent)")
    spec, q, cache, scale, sink_t, s_l, lists, ref_out, ref_lse, bound = _case(fmt, heads, LENGTHS, 1, sink=sink)
    for splits in (None, 1, 3):  # the heuristic, one CTA per query (no combine), forced partials + combine
        out, lse = _v3(spec, q, cache, scale, sink=sink_t, outer_scale=s_l, num_splits=splits, **lists)
        _check(out, lse, ref_out, ref_lse, bound, f"v3 {fmt} h={heads} sink={sink} splits={splits}")
    assert any(k[0] == "mla_attention_v3" and k[2].plan == plan_for(spec) for k in compile_cache.keys())


PROBES = [dict(producer_wgs=1), dict(producer_wgs=2)]


@needs_cuda
@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("fmt", ["nvfp4", "bf16", "mxfp4", "fp8_ds_mla"])
def test_v3_benchmark_probes_match_reference(fmt, probe):
    """The variants the benchmark times beside v3 (the other producer warpgroup count)."""
    spec, q, cache, scale, sink_t, s_l, lists, ref_out, ref_lse, bound = _case(fmt, 16, LENGTHS, 4)
    for splits in (None, 1):
        out, lse = _v3(spec, q, cache, scale, outer_scale=s_l, num_splits=splits, **lists, **probe)
        _check(out, lse, ref_out, ref_lse, bound, f"v3 {fmt} {probe} splits={splits}")


@needs_cuda
@pytest.mark.parametrize("fmt", V3_FORMATS)
def test_v3_probes_write_the_same_k_tiles(fmt):
    """The producer warpgroup count only moves work between threads: the K tiles, hence the outputs, are
    bit-identical to the default launch;
    plus the reference check. A query of 0 keys, lengths off the 64-key tile, 1 and 3 splits."""
    spec, q, cache, scale, sink_t, s_l, lists, ref_out, ref_lse, bound = _case(fmt, 16, [0, *LENGTHS], 6)
    for splits in (1, 3):
        out, lse = _v3(spec, q, cache, scale, outer_scale=s_l, num_splits=splits, **lists)
        _check(out[1:], lse[1:], ref_out[1:], ref_lse[1:], bound, f"v3 {fmt} splits={splits}")
        assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))
        for probe in PROBES:
            o, l_ = _v3(spec, q, cache, scale, outer_scale=s_l, num_splits=splits, **lists, **probe)
            assert torch.equal(o, out) and torch.equal(l_, lse), (fmt, probe, splits)


@needs_cuda
@pytest.mark.parametrize("probe", ["nodec", "nomma"])
def test_v3_timing_probes_run_to_the_end(probe):
    """The benchmark's timing probes (wrong output by design) keep the pipeline's protocol: they finish
    (no hang), with and without splits, and write every output row (no NaN left from the poison) where
    the K tile is still multiplied (nomma: p = softmax of zeros, O = 0)."""
    spec, q, cache, scale, sink_t, s_l, lists, ref_out, ref_lse, bound = _case("nvfp4", 16, LENGTHS, 7)
    for splits in (1, 3):
        out, lse = _v3(spec, q, cache, scale, outer_scale=s_l, num_splits=splits, timing_probe=probe, **lists)
        if probe == "nomma":
            assert torch.all(out == 0) and not torch.isnan(lse).any()


@needs_cuda
@pytest.mark.parametrize("fmt", ["nvfp4", "bf16", "fp8_ds_mla", "fp8_e4m3"])
def test_v3_at_64k_keys(fmt):
    """64K keys (1024 tiles; 3 queries: 65536, 65536 - 37 and 1 key), with and without splits (fp8: 4 x 1024
    part-tile units through fp8_ds_mla's raw ring, 2 x 1024 through fp8_e4m3's)."""
    lengths = [65536, 65536 - 37, 1]
    spec, q, cache, scale, sink_t, s_l, lists, ref_out, ref_lse, bound = _case(fmt, 16, lengths, 2, blocks=1024 + 8)
    for splits in (None, 1):
        out, lse = _v3(spec, q, cache, scale, outer_scale=s_l, num_splits=splits, **lists)
        _check(out, lse, ref_out, ref_lse, bound, f"v3 {fmt} 64K splits={splits}")


@needs_cuda
@pytest.mark.parametrize("fmt", V3_PART_RING)
def test_v3_part_tile_raw_rings(fmt):
    """The fp8 records go through a raw ring of 16- or 32-key parts of a tile: lengths at and around the parts
    (a tile whose last parts are all past the end, or hold one key), a query of 0 keys, with and without splits,
    for the default ring (reference check) and every other ring that fits (`v3_raw_rings`, the bench's
    v3-r<S>x<K> rows): they only move the copies, so the outputs are bit-identical to the default's."""
    lengths = [0, 15, 16, 17, 31, 32, 33, 48, 49, 96, 97, 128 + 31, 40]
    spec, q, cache, scale, sink_t, s_l, lists, ref_out, ref_lse, bound = _case(fmt, 16, lengths, 9, sink=True)
    rings = attention_tuning.v3_raw_rings(plan_for(spec))
    assert len(rings) > 1 and rings[0] == attention_tuning.v3_raw_ring(plan_for(spec))
    for splits in (None, 1, 3):
        out, lse = _v3(spec, q, cache, scale, sink=sink_t, outer_scale=s_l, num_splits=splits, **lists)
        _check(out[1:], lse[1:], ref_out[1:], ref_lse[1:], bound, f"v3 {fmt} part ring splits={splits}")
        assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))
        for ring in rings[1:]:
            o, l_ = _v3(spec, q, cache, scale, sink=sink_t, outer_scale=s_l, num_splits=splits, raw_ring=ring, **lists)
            assert torch.equal(o, out) and torch.equal(l_, lse), (fmt, ring, splits)
    with pytest.raises(ValueError, match="raw_ring"):
        _v3(spec, q, cache, scale, raw_ring=(2, 64), **lists)  # two whole tiles do not fit


def _spec(plan, heads=16, sparse=False, sink=False, outer=False, split=False, **probe):
    """The `KernelSpec` of a v3 launch made as dispatch and the bench make it (`v3_plan` resolves every default)."""
    cfg = v3_probe_plan(plan, heads, sparse, HOPPER_FACTS, **probe).config
    return launch_plan_mod.KernelSpec(plan, cfg, sparse=sparse, has_sink=sink, has_outer=outer, split=split)


def _compile(spec, heads, dump):
    """Compile `spec` through `kernel_for` with placeholder arguments, its PTX and cubin kept in `dump`."""
    import cutlass.cute as cute

    from mla_eval_kernels.cute.launch import kernel_for, placeholder_args

    dump.mkdir(exist_ok=True)
    kern = kernel_for(spec)
    cute.compile(kern, *placeholder_args(heads), options=f"--keep-ptx --keep-cubin --dump-dir={dump}")
    return kern


def test_v3_raw_ring_is_in_the_compile_key():
    """No GPU needed: the raw ring (stages x keys per stage), the head tile, the producer warpgroups and sparse lists
    are specialisations: the config `v3_plan` resolves holds each concrete value and the compile key holds the
    config."""
    assert V3_PART_RING == ["fp8_ds_mla", "fp8_ds_mla_pow2", "fp8_e4m3"]

    def cfg(name, **kw):
        return v3_probe_plan(plan_for(get_format(name)), kw.pop("heads", 16), kw.pop("sparse", False),
                                       HOPPER_FACTS, **kw).config

    assert cfg("fp8_ds_mla").raw_ring == (2, 32) and cfg("fp8_e4m3").raw_ring == (2, 32) and cfg("nvfp4").raw_ring == (2, 64)
    fp8 = plan_for(get_format("fp8_ds_mla"))
    key = _spec(fp8).compile_key("sm_90")
    assert key != _spec(plan_for(get_format("fp8_ds_mla_pow2"))).compile_key("sm_90")
    other = _spec(fp8, raw_ring=(5, 16))
    assert other.config.raw_ring == (5, 16) and other.compile_key("sm_90") != key
    nvfp4 = plan_for(get_format("nvfp4"))
    wide = cfg("nvfp4", heads=128)
    assert wide.head_tile == 32 and wide.raw_ring == (5, 16) and wide.producer_wgs == 2 and cfg("nvfp4").producer_wgs == 2
    keys = {_spec(nvfp4).compile_key("sm_90"), _spec(nvfp4, heads=128).compile_key("sm_90"),
            _spec(nvfp4, sparse=True).compile_key("sm_90"), _spec(nvfp4, heads=128, producer_wgs=1).compile_key("sm_90"),
            _spec(nvfp4).compile_key("sm_100")}
    assert len(keys) == 5
    # two producer warpgroups at the 32-head tile (its default): per-role registers; one producer and the 16-head
    # tile have none
    assert attention_tuning.v3_reg_budget(32, 2) == (232, 136)
    assert attention_tuning.v3_reg_budget(32, 1) is None and attention_tuning.v3_reg_budget(16, 2) is None


@needs_cuda
def test_v3_zero_keys_and_empty_splits():
    """A query with 0 keys gets out = 0 and lse = -inf; splits past a short query's tiles write empty partials."""
    spec = get_format("nvfp4")
    gen = torch.Generator().manual_seed(5)
    cache = _random_cache(spec, 8, gen)
    q = torch.randn(3, 16, 576, generator=gen).to(torch.bfloat16).cuda()
    table = torch.arange(8, dtype=torch.int32).repeat(3, 1).cuda()
    seq_lens = torch.tensor([0, 3, 500], dtype=torch.int32).cuda()
    ref_out, ref_lse = reference.mla_attention(spec, q, cache, softmax_scale=0.1, block_table=table, seq_lens=seq_lens)
    for splits in (1, 8):
        out, lse = _v3(spec, q, cache, 0.1, num_splits=splits, block_table=table, seq_lens=seq_lens)
        assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        assert float((out - ref_out).abs().max()) < 2e-2 and float((lse[1:] - ref_lse[1:]).abs().max()) < 0.05


# the sparse and 32-head launches: the formats of issue 14's targets (bf16, nvfp4, fp8_ds_mla) and the DeepSeek-layout nvfp4
WIDE_FORMATS = ["bf16", "nvfp4", "fp8_ds_mla", "nvfp4_fp8_ds_mla"]


def _sparse_case(fmt, heads, topk, seed, blocks=40):
    """Five queries of `topk` random slot ids: -1 from topk / 3 on, all -1, every fifth out of range, one valid key,
    all valid (tests/test_kernels_gpu.py `_sparse_lists`); a sink per head."""
    spec = get_format(fmt)
    gen = torch.Generator().manual_seed(zlib.crc32(f"v3-sparse/{fmt}/{heads}/{topk}/{seed}".encode()))
    s_l = 0.05 if spec.outer_scale is not None else None
    cache = _random_cache(spec, blocks, gen, outer_scale=s_l)
    idx, slots = _sparse_lists(gen, 5, topk, blocks * BLOCK)
    q = torch.randn(5, heads, 576, generator=gen).to(torch.bfloat16).cuda()
    sink_t = torch.randn(heads, generator=gen).cuda()
    scale = 576**-0.5
    ref_out, ref_lse = reference.mla_attention(
        spec, q, cache, softmax_scale=scale, sink=sink_t, outer_scale=s_l, indices=idx.cuda()
    )
    bound = _bound(spec, q.cpu(), cache.cpu(), slots, scale, s_l)
    return spec, q, cache, scale, sink_t, s_l, idx.cuda(), ref_out, ref_lse, bound


def _tiles_compiled():
    return {f"heads={k[2].config.head_tile}" for k in compile_cache.keys() if k[0] == "mla_attention_v3"}


@needs_cuda
@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("fmt", WIDE_FORMATS)
def test_v3_sparse_matches_reference(fmt, heads):
    """Sparse top-k lists through v3: topk 2048 (32 key tiles) and 777 (not a multiple of the 64-key tile), -1
    padding, an all-invalid row (out 0, lse -inf, as v2 and the reference), out-of-range ids, a sink; the split
    heuristic and one CTA per query. h > 16 runs the 32-head tile (`v3_head_tile`, the hold cleared here)."""
    compile_cache.clear()
    for topk in (2048, 777):
        spec, q, cache, scale, sink_t, s_l, idx, ref_out, ref_lse, bound = _sparse_case(fmt, heads, topk, 1)
        assert torch.all(torch.isneginf(ref_lse[1]))  # the all-invalid row
        for splits in (None, 1):
            out, lse = _v3(spec, q, cache, scale, sink=sink_t, outer_scale=s_l, num_splits=splits, indices=idx)
            _check(out, lse, ref_out, ref_lse, bound, f"v3 sparse {fmt} h={heads} topk={topk} splits={splits}")
    assert _tiles_compiled() == {f"heads={16 if heads <= 16 else 32}"}
    assert {k[2].sparse for k in compile_cache.keys() if k[0] == "mla_attention_v3"} == {True}


@needs_cuda
@pytest.mark.parametrize("heads", [32, 64, 128])
@pytest.mark.parametrize("fmt", WIDE_FORMATS)
def test_v3_32_head_tile_matches_reference(fmt, heads):
    """Dense lists through the 32-head tile (h = 32: one tile; 64, 128: 2, 4 tiles in grid y), lengths around the
    64-key tile, a sink, the split heuristic and one CTA per query; the part-tile raw rings the 32-head tile gives
    nvfp4 (5 x 16) and nvfp4_fp8_ds_mla (3 x 32) run the E2M1 fast decode per part."""
    compile_cache.clear()
    spec, q, cache, scale, sink_t, s_l, lists, ref_out, ref_lse, bound = _case(fmt, heads, LENGTHS, 11, sink=True)
    for splits in (None, 1):
        out, lse = _v3(spec, q, cache, scale, sink=sink_t, outer_scale=s_l, num_splits=splits, **lists)
        _check(out, lse, ref_out, ref_lse, bound, f"v3 32-head tile {fmt} h={heads} splits={splits}")
    assert _tiles_compiled() == {"heads=32"}


TWO_PRODUCER_FORMATS = ["nvfp4", "mxfp4", "bf16", "fp8_ds_mla"]


@needs_cuda
@pytest.mark.parametrize("launch", ["dense h=32", "dense h=128", "sparse h=128"])
@pytest.mark.parametrize("fmt", TWO_PRODUCER_FORMATS)
def test_v3_32_head_tile_two_producers_match_reference_and_one_producer(fmt, launch):
    """The 32-head tile with two producer warpgroups and per-role registers (`setmaxnreg`; the default since this
    passed, the bench's v3-t32-p1 row is the other count): poisoned outputs against the reference, without and with
    splits (forced 1 and 3: partials + combine), dense h = 32 (one head tile) and 128 (4, lengths around the 64-key
    tile, a sink) and sparse h = 128 (topk 777, -1 padding, an all-invalid row, out-of-range ids, a sink); and
    bit-identical to the one-producer kernel: the producers write the same K tiles, only split over
    256 threads instead of 128 (nvfp4 / mxfp4: the E2M1 fast decode per 16-key part, 2 items per thread instead of 4;
    fp8_ds_mla: v2's decode path; bf16: the copy)."""
    compile_cache.clear()
    heads = int(launch.split("=")[1])
    if launch.startswith("sparse"):
        spec, q, cache, scale, sink_t, s_l, idx, ref_out, ref_lse, bound = _sparse_case(fmt, heads, 777, 5)
        lists = dict(indices=idx)
    else:
        spec, q, cache, scale, sink_t, s_l, lists, ref_out, ref_lse, bound = _case(fmt, heads, LENGTHS, 15, sink=True)
    for splits in (1, 3):
        out, lse = _v3(spec, q, cache, scale, sink=sink_t, outer_scale=s_l, num_splits=splits, head_tile=32, producer_wgs=2,
                       **lists)
        _check(out, lse, ref_out, ref_lse, bound, f"v3 32-head tile, 2 producers {fmt} {launch} splits={splits}")
        one, lse1 = _v3(spec, q, cache, scale, sink=sink_t, outer_scale=s_l, num_splits=splits, head_tile=32,
                        producer_wgs=1, **lists)
        assert torch.equal(out, one) and torch.equal(lse, lse1), (fmt, launch, splits)
    got = {(k[2].config.producer_wgs, k[2].config.head_tile, attention_tuning.v3_reg_budget(32, k[2].config.producer_wgs))
           for k in compile_cache.keys() if k[0] == "mla_attention_v3"}
    assert got == {(2, 32, (232, 136)), (1, 32, None)}, got


@needs_cuda
@pytest.mark.parametrize("sparse", [False, True])
def test_v3_16_head_tile_at_h128_matches_reference(sparse):
    """h = 128 through the 16-head tile (8 tiles; what forced v3 runs while the 32-head tile is held, and the
    bench's v3-t16 row), dense and sparse, nvfp4."""
    compile_cache.clear()
    if sparse:
        spec, q, cache, scale, sink_t, s_l, idx, ref_out, ref_lse, bound = _sparse_case("nvfp4", 128, 777, 2)
        lists = dict(indices=idx)
    else:
        spec, q, cache, scale, sink_t, s_l, lists, ref_out, ref_lse, bound = _case("nvfp4", 128, LENGTHS, 12, sink=True)
    out, lse = _v3(spec, q, cache, scale, sink=sink_t, outer_scale=s_l, head_tile=16, **lists)
    _check(out, lse, ref_out, ref_lse, bound, f"v3 16-head tile nvfp4 h=128 sparse={sparse}")
    assert _tiles_compiled() == {"heads=16"}


@needs_cuda
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_ds_mla"] + V3_BLOCKED[:1])
def test_environment_routes_dense_to_v3_and_the_rest_to_v2(fmt, monkeypatch):
    monkeypatch.setenv(attention_tuning.ENV, "v3")
    spec, q, cache, scale, sink_t, s_l, lists, ref_out, ref_lse, bound = _case(fmt, 16, [BLOCK + 1, 300], 3)
    compile_cache.clear()  # so that the keys below are this test's launches
    out, lse = _run(spec, q, cache, scale, outer_scale=s_l, num_splits=1, **lists)
    _check(out, lse, ref_out, ref_lse, bound, f"dispatch v3 {fmt}")
    names = {k[0] for k in compile_cache.keys()}
    assert names == {"mla_attention_v3" if fmt in V3_FORMATS else "mla_attention"}, names
    # sparse lists: v3 where it covers the format
    idx = torch.randint(0, 24 * BLOCK, (2, 100), dtype=torch.int32)
    ref_out, ref_lse = reference.mla_attention(spec, q, cache, softmax_scale=scale, outer_scale=s_l, indices=idx.cuda())
    bound = _bound(spec, q.cpu(), cache.cpu(), idx, scale, s_l)
    compile_cache.clear()
    out, lse = _run(spec, q, cache, scale, outer_scale=s_l, num_splits=1, indices=idx.cuda())
    ran = "mla_attention_v3" if fmt in V3_FORMATS else "mla_attention"
    assert {k[0] for k in compile_cache.keys()} == {ran}, fmt
    _check(out, lse, ref_out, ref_lse, bound, f"dispatch v3 {fmt} sparse -> {ran}")


@needs_cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_default_policy_picks_the_generation_per_launch_and_dispatch_records_it(fmt, monkeypatch):
    """MLA_EVAL_ATTENTION_KERNEL unset: a dense decode launch (h = 16, one query per sequence) runs the kernel
    `generation_for` names (v3 for `V3_DEFAULT_FORMATS`, else v2), the prefill-as-decode shape (many queries
    per sequence) and sparse lists run v2; results match the reference and the dispatch log records what ran."""
    from mla_eval.attention import dispatch

    monkeypatch.delenv(attention_tuning.ENV, raising=False)
    spec, q, cache, scale, sink_t, s_l, lists, ref_out, ref_lse, bound = _case(fmt, 16, [BLOCK + 1, 300, 5], 8)
    plan = plan_for(spec)
    want, _ = attention_tuning.generation_for(plan, sparse=False, heads=16, smem_limit=HOPPER_SMEM_PER_BLOCK)
    assert want == ("v3" if fmt in attention_tuning.V3_DEFAULT_FORMATS else "v2")
    name = {"v3": "mla_attention_v3", "v2": "mla_attention"}
    # 3: the shape of prefill-as-decode (dispatch is told; the kernel cannot see it). Dispatch allocates the
    # outputs itself (no NaN poison here); the kernel entry below writes into poisoned ones
    for qps in (1, 3):
        compile_cache.clear()
        with dispatch.use_backend("kernel") as log:
            out, lse = dispatch.mla_attention(
                spec, q, cache, softmax_scale=scale, outer_scale=s_l, num_splits=1, queries_per_seq=qps, **lists
            )
        _check(out, lse, ref_out, ref_lse, bound, f"default {fmt} queries_per_seq={qps}")
        ran = want if qps == 1 else "v2"
        assert {k[0] for k in compile_cache.keys()} == {name[ran]}, (fmt, qps)
        (recorded,) = log.generations[f"attend {fmt} on {cache.device}"]
        assert recorded.startswith(f"{ran} ("), recorded
        doc = log.as_dict()
        assert doc["kernel_version"] == "default" and doc["kernel_generations"] == {f"attend {fmt} on {cache.device}": [recorded]}
    # the same launch through the kernel entry, without dispatch: the same policy
    compile_cache.clear()
    out, lse = _run(spec, q, cache, scale, outer_scale=s_l, num_splits=1, **lists)
    _check(out, lse, ref_out, ref_lse, bound, f"default {fmt} kernel entry")
    assert {k[0] for k in compile_cache.keys()} == {name[want]}
    # a forced generation wins over the default
    monkeypatch.setenv(attention_tuning.ENV, "v2")
    compile_cache.clear()
    out, lse = _run(spec, q, cache, scale, outer_scale=s_l, num_splits=1, **lists)
    _check(out, lse, ref_out, ref_lse, bound, f"forced v2 {fmt}")
    assert {k[0] for k in compile_cache.keys()} == {"mla_attention"}


@pytest.mark.parametrize("pt", [128, 256])
@pytest.mark.parametrize("fmt", V3_DECODED)
def test_v3_copies_cover_each_chunk_once_and_stores_are_conflict_free(fmt, pt):
    """No GPU needed; a model of the producer's index arithmetic (`load_raw`, `decode_latent`).
    Copies: a raw stage holds keys key0 .. key0 + nk of a tile (nk: the keys per stage of each ring
    `v3_raw_rings` allows: 64, or 32 / 16 for the fp8 records); thread ptid < g * chunks takes chunk ptid % chunks of keys
    key0 + ptid // chunks + g u into record ptid // chunks + g u of the stage: over the tile's stages every
    (key, chunk) of the 64-key tile once, nothing past a stage. Latent stores: per quarter warp (8 lanes x
    16 bytes, one key row) the 8 chunks land in 8 distinct 16-byte bank groups (without the half swap:
    4, 2 wavefronts)."""
    from mla_eval_kernels.cute.smem import swizzled_offset

    plan = plan_for(get_format(fmt))
    rec = plan.record_bytes
    chunks, bn = rec // 16, 64
    g = pt // chunks
    for nk in {k for heads in attention_tuning.V3_HEAD_TILES for _, k in attention_tuning.v3_raw_rings(plan, heads)}:
        assert bn % nk == 0
        seen = []
        for key0 in range(0, bn, nk):  # the tile's parts
            for ptid in range(g * chunks):
                for u in range(-(-nk // g)):
                    pos = ptid // chunks + g * u  # the record's place in the stage
                    if pos < nk:
                        seen.append((key0 + pos, ptid % chunks))
        assert sorted(seen) == [(k, c) for k in range(bn) for c in range(chunks)], nk
        if attention_tuning.fast_e2m1_eligible(plan) and (nk * 32) % pt == 0:
            # the E2M1 latent decode per part (`decode_latent`): item u of thread ptid is block ptid % 32 of raw key
            # u (pt / 32) + ptid // 32 -> K row key0 + that key; the rope (`decode_rope_item`): item i < nk * 8 is 8
            # values of raw key i // 8. Over the parts: every (key, block) and (key, rope item) once
            lat, rope = [], []
            for key0 in range(0, bn, nk):
                for ptid in range(pt):
                    lat += [(key0 + u * (pt // 32) + ptid // 32, ptid % 32) for u in range(nk * 32 // pt)]
                    rope += [(key0 + i // 8, i % 8) for u in range(-(-nk * 8 // pt)) if (i := u * pt + ptid) < nk * 8]
            assert sorted(lat) == [(k, b) for k in range(bn) for b in range(32)], nk
            assert sorted(rope) == [(k, d) for k in range(bn) for d in range(8)], nk

    def groups(key, lanes, swap):
        out = []
        for blk in lanes:
            half = (blk >> 2) & 1 if swap else 0
            off = 2 * swizzled_offset(key, 16 * blk + 8 * half, bn)
            out.append((off % 128) // 16)
        return out

    for key in range(bn):
        for q0 in range(0, 32, 8):
            lanes = range(q0, q0 + 8)
            assert sorted(groups(key, lanes, True)) == list(range(8)), (key, q0)
            assert len(set(groups(key, lanes, False))) == 4
        for blk in range(32):  # the two stores of a lane are its two chunks
            half = (blk >> 2) & 1
            assert {16 * blk + 8 * half, 16 * blk + 8 - 8 * half} == {16 * blk, 16 * blk + 8}


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_ds_mla"])
@pytest.mark.parametrize("probe", ["nodec", "nomma"])
def test_v3_timing_probes_compile(probe, fmt, tmp_path):
    """No GPU needed: the benchmark's timing probes compile for sm_90a without a stack frame (whole-tile and
    part-tile raw rings)."""
    from tools import compile_check

    plan = plan_for(get_format(fmt))
    _compile(_spec(plan, outer=plan.outer_allowed, split=True, timing_probe=probe), 16, tmp_path)
    use = compile_check.cubin_usage(str(next(tmp_path.glob("*.cubin"))))
    assert use.get("frame", 0) == 0 and use.get("stack", 0) == 0, use
    with pytest.raises(ValueError, match="timing_probe"):
        _spec(plan_for(get_format("nvfp4")), timing_probe="fast")


def test_compile_check_reads_registers_from_the_cubin_and_checks_the_ptx(tmp_path):
    """No GPU needed: one v3 specialisation compiled for sm_90a; the cubin reader finds its register
    count and no stack frame, the PTX check passes it and flags a PTX missing what the design needs. The consumer's
    tile code is unrolled by the K ring's stages: 68 wgmma in each of its `tile_copies` (3) copies."""
    from tools import compile_check

    plan = plan_for(get_format("nvfp4"))
    kern = _compile(_spec(plan, outer=True, split=True), 16, tmp_path)
    assert kern.tile_copies == 2 * attention_tuning.V3_K_STAGES - 1 == 3
    use = compile_check.cubin_usage(str(next(tmp_path.glob("*.cubin"))))
    assert 64 <= use["regs"] <= 168 and use.get("frame", 0) == 0 and use.get("stack", 0) == 0, use
    ptx = next(tmp_path.glob("*.ptx")).read_text()
    assert compile_check.check_v3_ptx(ptx, 16, None, kern.tile_copies) == []
    assert compile_check.check_v3_ptx(ptx) == ["204 m64n16k16 wgmma (expected 68)"]  # one copy expected: flagged
    broken = ptx.replace("wgmma.mma_async.sync.aligned.m64n16k16", "wgmma.mma_async.sync.aligned.m64n8k16", 1)
    assert "203 m64n16k16 wgmma (expected 204)" in compile_check.check_v3_ptx(broken, 16, None, 3)
    assert "expected one CTA-wide barrier" in compile_check.check_v3_ptx(ptx + "\n\tbar.sync \t0;\n", 16, None, 3)
    assert "a cluster instruction (no v3 kernel runs as a cluster)" in compile_check.check_v3_ptx(
        ptx + "\n\tbarrier.cluster.arrive;\n", 16, None, 3)
    # the 32-head tile with sparse lists and one producer warpgroup (the v3-t32-p1 probe; two are the default, with
    # per-role registers: another test): m64n32k16 wgmma, 256 threads whose registers fit the SM without a stack
    # frame (O^T [512, 32] is 128 fp32 registers per consumer thread)
    wide = tmp_path / "wide"
    kern = _compile(_spec(plan, heads=128, sparse=True, sink=True, outer=True, producer_wgs=1), 128, wide)
    assert kern.pt == 128 and kern.slot_cols == 4 and kern.nh == 32
    use = compile_check.cubin_usage(str(next(wide.glob("*.cubin"))))
    assert 128 < use["regs"] <= compile_check.REGS_PER_SM // 256 and use.get("frame", 0) == 0 and use.get("stack", 0) == 0, use
    ptx = next(wide.glob("*.ptx")).read_text()
    assert compile_check.check_v3_ptx(ptx, 32, None, 3) == []
    assert "0 m64n16k16 wgmma (expected 204)" in compile_check.check_v3_ptx(ptx, 16, None, 3)
    with pytest.raises(ValueError, match="head tile"):
        _spec(plan, heads=128, head_tile=64)


@pytest.mark.parametrize("sparse", [False, True])
def test_the_two_producer_32_head_tile_compiles_with_per_role_registers(sparse, tmp_path):
    """No GPU needed: the 32-head tile with two producer warpgroups compiles for sm_90a to the launch's even share
    (168 registers x 384 threads) without a stack frame, because `setmaxnreg` gives the consumer 232 (the PTX has the
    .inc / .dec and `.minnctapersm 1`, without which ptxas ignores them and spills: 352-416 B of stack in the first
    build); the one-producer kernel has no `setmaxnreg` and the check says so when one is expected."""
    from tools import compile_check

    plan = plan_for(get_format("nvfp4"))
    built = {}
    for wgs in (2, 1):
        dump = tmp_path / f"p{wgs}"
        kern = _compile(_spec(plan, heads=128, sparse=sparse, sink=True, outer=True, producer_wgs=wgs), 128, dump)
        built[wgs] = (kern, compile_check.cubin_usage(str(next(dump.glob("*.cubin")))), next(dump.glob("*.ptx")).read_text())
    kern, use, ptx = built[2]
    assert kern.pt == 256 and kern.regs == (232, 136) and kern.launch_bounds() == dict(min_blocks_per_mp=1)
    assert use["regs"] == 168 and use.get("frame", 0) == 0 and use.get("stack", 0) == 0, use
    copies = kern.tile_copies
    assert compile_check.check_v3_ptx(ptx, 32, kern.regs, copies) == []
    assert compile_check.check_v3_ptx(ptx, 32, None, copies) == ["setmaxnreg [('dec', '136'), ('inc', '232')] (expected [])"]
    bare = ptx.replace(".minnctapersm 1", "")
    assert compile_check.check_v3_ptx(bare, 32, kern.regs, copies) == [
        "setmaxnreg without .minnctapersm 1 (ptxas ignores it)"]
    kern1, use1, ptx1 = built[1]
    assert kern1.regs is None and kern1.launch_bounds() == {} and use1["regs"] > 168 and use1.get("frame", 0) == 0
    assert compile_check.check_v3_ptx(ptx1, 32, None, copies) == []
    assert compile_check.check_v3_ptx(ptx1, 32, (232, 136), copies) == [
        "setmaxnreg [] (expected [('dec', '136'), ('inc', '232')])", "setmaxnreg without .minnctapersm 1 (ptxas ignores it)",
    ]
    with pytest.raises(ValueError, match="producer_wgs"):
        _spec(plan, heads=128, producer_wgs=3)


def test_sass_role_registers_reads_each_role_after_its_setmaxnreg():
    """No GPU needed: the per-role register count compile_check prints (with --cuobjdump) from a SASS listing in
    ptxas' layout (entry, the producers' DEALLOC, the consumer's ALLOC); RZ is not a register; a listing without that
    layout gives nothing rather than a wrong split."""
    from tools.compile_check import sass_role_registers

    def line(addr, text):
        return f"        /*{addr:04x}*/                   {text} ;   /* 0x0000000000000000 */"

    sass = "\n".join([
        line(0x10, "S2R R0, SR_TID.X"), line(0x20, "IMAD R13, R0, R12, RZ"),
        line(0x30, "USETMAXREG.DEALLOC.CTAPOOL 0x88"), line(0x40, "LDS R74, [R3]"), line(0x50, "EXIT"),
        line(0x60, "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8"), line(0x70, "FFMA R215, R2, R9, RZ"),
    ])
    assert sass_role_registers(sass) == {"entry": 14, "producer": 75, "consumer": 216}
    swapped = sass.replace("DEALLOC", "TMP").replace("TRY_ALLOC", "DEALLOC").replace("TMP", "TRY_ALLOC")
    assert sass_role_registers(swapped) == {}
    assert sass_role_registers(line(0x10, "MOV R1, c[0x0][0x28]")) == {}


# The consumer's unrolled tile loop (rev 2; rev 1, against which these were checked bit for bit on an H200 before it was
# deleted, ran one tile per trip): dense lengths 0 keys, 1 .. 4 + 1 tiles (even and odd tile counts: tiles run in pairs,
# then the remainder), one short of / past the 64-key tile, and 33 tiles (long runs where no head's running max moves:
# the skipped rescale)
CONSUMER_FORMATS = ["nvfp4", "bf16", "fp8_ds_mla", "mxfp4"]
CONSUMER_LENGTHS = [0, *LENGTHS, 4 * BLOCK + 1, 33 * BLOCK - 5]


@needs_cuda
@pytest.mark.parametrize("launch", ["dense h=16", "dense h=32", "sparse h=16", "sparse h=128"])
@pytest.mark.parametrize("fmt", CONSUMER_FORMATS)
def test_v3_unrolled_consumer_matches_reference(fmt, launch):
    """The unrolled consumer within the reference bound (NaN-poisoned outputs and split partials): dense h = 16 (the
    16-head tile) and h = 32 (the 32-head tile), sparse h = 16 and 128 (topk 777: -1 padding, an all-invalid row,
    out-of-range ids), a sink, the split heuristic, one CTA per query and 3 forced splits (empty splits and odd / even
    tile counts per split); the 32-head tile with one and with two producer warpgroups."""
    heads = int(launch.split("=")[1])
    if launch.startswith("sparse"):
        spec, q, cache, scale, sink_t, s_l, idx, ref_out, ref_lse, bound = _sparse_case(fmt, heads, 777, 21)
        lists, rows = dict(indices=idx), slice(None)
    else:
        blocks = -(-max(CONSUMER_LENGTHS) // BLOCK) + 4
        spec, q, cache, scale, sink_t, s_l, lists, ref_out, ref_lse, bound = _case(
            fmt, heads, CONSUMER_LENGTHS, 21, blocks=blocks, sink=True
        )
        rows = slice(1, None)  # row 0 has no key: out 0, lse -inf (checked below)
    tile = 16 if heads <= 16 else 32
    for wgs in (None,) if tile == 16 else (1, 2):
        kw = dict(sink=sink_t, outer_scale=s_l, head_tile=tile, producer_wgs=wgs, **lists)
        for splits in (None, 1, 3):
            out, lse = _v3(spec, q, cache, scale, num_splits=splits, **kw)
            what = f"v3 {fmt} {launch} producers={wgs} splits={splits}"
            _check(out[rows], lse[rows], ref_out[rows], ref_lse[rows], bound, what)
            if rows.start == 1:
                assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))


@pytest.mark.parametrize(
    "launch", ["nvfp4 dense h=16", "nvfp4 sparse h=32", "nvfp4 dense h=32 p2", "bf16 dense h=32 p2", "fp8_ds_mla sparse h=32 p2"]
)
def test_v3_unrolled_consumer_compiles_without_a_stack_frame(launch, tmp_path):
    """No GPU needed: the unrolled consumer compiles for sm_90a without a stack frame, its PTX holds the tile code
    `tile_copies` times (68 wgmma each: the loop body of two tiles and the remainder tile), also under `setmaxnreg`
    budgets (the 32-head tile with two producer warpgroups, "p2", where bf16 once spilled); the vote of the lazy
    rescale is there."""
    from tools import compile_check

    fmt, lists, tile = launch.split()[:3]
    heads, sparse = int(tile.split("=")[1]), lists == "sparse"
    wgs = 2 if launch.endswith("p2") else None
    plan = plan_for(get_format(fmt))
    kern = _compile(_spec(plan, heads, sparse, sink=True, outer=plan.outer_allowed, split=True, producer_wgs=wgs), heads,
                    tmp_path)
    assert kern.tile_copies == 2 * attention_tuning.V3_K_STAGES - 1
    assert kern.regs is not None or wgs != 2  # two producer warpgroups at the 32-head tile: per-role registers
    use = compile_check.cubin_usage(str(next(tmp_path.glob("*.cubin"))))
    assert use.get("frame", 0) == 0 and use.get("stack", 0) == 0, use
    ptx = next(tmp_path.glob("*.ptx")).read_text()
    assert compile_check.check_v3_ptx(ptx, kern.nh, kern.regs, kern.tile_copies) == []
    assert "vote.sync.any.pred" in ptx  # the warp-uniform decision of the lazy rescale


def test_sass_consumer_tiles_counts_each_tile_and_the_skipped_rescale():
    """No GPU needed: the consumer's per-tile SASS counts compile_check prints (with --cuobjdump), from a listing in
    ptxas' layout: the loop is the conditional backward branch around the HGMMA (not an out-of-line retry stub's
    unconditional one, nor the producer's loop without HGMMA), tiles end at the stage release (SYNCS.ARRIVE), the
    block a VOTE.ANY branch jumps over is counted apart, predicated instructions count."""
    from tools.compile_check import sass_consumer_tiles

    def line(addr, text):
        return f"        /*{addr:04x}*/                   {text} ;   /* 0x0000000000000000 */"

    body = [
        "LDS R1, [R2]", "@!P0 BRA 0x10",  # the producer's loop: no HGMMA
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R9+URZ], R3", "@!P0 BRA 0x300",  # tile 0 starts at 0x30
        "HGMMA.64x16x16.F32.BF16 R24, gdesc[UR12], R24", "FMNMX R4, R4, R5, !PT", "VOTE.ANY P0, P0", "FSEL R6, R5, RZ, !P2",
        "@!P0 BRA 0xc0", "FMUL R88, R88, R7", "FMUL R89, R89, R7",  # skipped when no max moved
        "HGMMA.64x16x16.F32.BF16 R88, gdesc[UR16].tnspA, R88", "SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR5+0x10], RZ",
        "HGMMA.64x16x16.F32.BF16 R24, gdesc[UR12], R24", "SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR5+0x18], RZ",
        "@P1 BRA 0x30", "EXIT", "BRA 0x40",  # the back edge, then the retry stub (unconditional)
    ]
    tiles = sass_consumer_tiles("\n".join(line(0x10 * (i + 1), t) for i, t in enumerate(body)))
    assert [dict(c) for c, _ in tiles] == [
        {"SYNCS.PHASECHK.TRANS64.TRYWAIT": 1, "BRA": 2, "HGMMA.64x16x16.F32.BF16": 2, "FMNMX": 1, "VOTE.ANY": 1, "FSEL": 1,
         "SYNCS.ARRIVE.TRANS64.A1T0": 1},
        {"HGMMA.64x16x16.F32.BF16": 1, "SYNCS.ARRIVE.TRANS64.A1T0": 1, "BRA": 1},
    ]
    assert [dict(skip) for _, skip in tiles] == [{"FMUL": 2}, {}]
    assert sass_consumer_tiles(line(0x10, "MOV R1, c[0x0][0x28]")) == []


# ---------------------------------------------------------------------------------- the E2M1 decode (rev 2)
DECODE_FORMATS = [f for f in V3_FORMATS if attention_tuning.fast_e2m1_eligible(plan_for(get_format(f)))]
# (sparse, heads, head tile, producer warpgroups): 256 producer threads (8 keys per pass: one store base per thread)
# and 128 (4 keys per pass: two, by the key's parity of 4), whole tiles and the 32-head tile's 16 / 32-key parts
DECODE_LAUNCHES = {
    "dense h=16": (False, 16, None, None),
    "dense h=16 p1": (False, 16, None, 1),
    "sparse h=16": (True, 16, None, None),
    "dense h=32": (False, 32, 32, None),
    "dense h=128 p2": (False, 128, 32, 2),
    "sparse h=128": (True, 128, 32, None),
}


@needs_cuda
@pytest.mark.parametrize("launch", list(DECODE_LAUNCHES))
@pytest.mark.parametrize("fmt", DECODE_FORMATS)
def test_v3_e2m1_decode_matches_reference(fmt, launch):
    """The E2M1 decode (rev 2; checked bit for bit against rev 1 on an H200 before rev 1 was deleted): NaN-poisoned
    outputs against the reference, unsplit and 3 splits. Every fold format (the outer scale where the format has one),
    dense and sparse lists, the 16-head tile (one and two producer warpgroups) and the 32-head tile (one producer; two
    with per-role registers)."""
    sparse, heads, tile, wgs = DECODE_LAUNCHES[launch]
    if sparse:
        spec, q, cache, scale, sink_t, s_l, idx, ref_out, ref_lse, bound = _sparse_case(fmt, heads, 777, 7)
        lists = dict(indices=idx)
    else:
        spec, q, cache, scale, sink_t, s_l, lists, ref_out, ref_lse, bound = _case(fmt, heads, LENGTHS, 17, sink=True)
    kw = dict(sink=sink_t, outer_scale=s_l, head_tile=tile, producer_wgs=wgs, **lists)
    for splits in (1, 3):
        out, lse = _v3(spec, q, cache, scale, num_splits=splits, **kw)
        _check(out, lse, ref_out, ref_lse, bound, f"v3 decode {fmt} {launch} splits={splits}")


@pytest.mark.parametrize("pt", [128, 256])
def test_v3_decode_rev2_store_addresses_are_the_swizzled_offsets(pt):
    """No GPU needed: `decode_latent`'s per-thread store bases (decode rev 2; one per value of K & 7) plus 512 elements
    per 8 rows are `swizzled_offset` of the key row and the lane's two 16-byte chunks (upper 8 values first where blk & 4), for
    every part key0 the rings give, item u, warp w = ptid // 32 and block; and its 4-byte loads are the words rev 1
    selected from its 8-byte load (the layout the GPU tests checked bitwise against rev 1 before it was deleted)."""
    from mla_eval_kernels.cute.smem import swizzled_offset

    bn, kpp = 64, pt // 32
    for nkeys in (64, 32, 16):
        for key0 in range(0, bn, nkeys):
            for u in range(nkeys * 32 // pt):
                k = key0 + u * kpp
                kk = k & 7
                for w in range(kpp):
                    for blk in range(32):
                        half = (blk >> 2) & 1
                        chunk_first = ((2 * blk + half) & 7) ^ w
                        chunk_second = ((2 * blk + 1 - half) & 7) ^ w
                        col_block = (blk >> 2) * (bn // 8) * 512
                        first = col_block + (kk + w) * 64 + ((chunk_first ^ kk) << 3) + 512 * (k >> 3)
                        second = col_block + (kk + w) * 64 + ((chunk_second ^ kk) << 3) + 512 * (k >> 3)
                        row = k + w
                        assert first == swizzled_offset(row, 16 * blk + 8 * half, bn), (pt, key0, u, w, blk)
                        assert second == swizzled_offset(row, 16 * blk + 8 - 8 * half, bn), (pt, key0, u, w, blk)
                        # rev 1's `first` word: w1 (bytes 4..7 of the block) where blk & 4, else w0
                        assert 4 * half == (4 if blk & 4 else 0)
