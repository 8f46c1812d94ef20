"""GPU tests of the v3 dense-decode kernel (`mla_attention_v3`, issue 14) against the torch reference.

Fresh random caches and queries per case, outputs and split partials poisoned with NaN first (every
element the kernel owns must be written), error bounds of tests/test_kernels_gpu.py. Lengths cover
1 key, one short of / exactly / one past the 64-key tile, lengths that are not a multiple of the tile,
and 64K keys; for the fp8 records, whose raw ring holds parts of tiles, lengths around the 16- and 32-key parts
and every ring that fits (bit-identical outputs). Also:
The sparse and 32-head launches (held off by `V3_LAUNCHES_AWAITING_GPU_TESTS` until these tests passed on the H200):
sparse top-k lists at h = 16, 64, 128 (topk 2048 and 777, -1 padding, an all-invalid row, out-of-range ids, a
sink) and the 32-head tile for dense h = 32, 64, 128, each with and without splits. The 32-head tile with two producer
warpgroups and per-role registers (`setmaxnreg`; held by `V3_TILE_32_TWO_PRODUCERS` until its case passed on the H200
the 32-head tile's default), against the reference and bit-identical to the one-producer kernel.
MLA_EVAL_ATTENTION_KERNEL=v3 routes dense and sparse launches to v3 and everything v3 does not cover (formats it
refuses, launches still held outside these tests) to v2; unset, the per-format default
(`attention_tuning.generation_for`) runs v3 only for the launches it names, and dispatch
records the generation each launch ran.
"""

from __future__ import annotations

import sys
import time
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
    kernels_under_test,  # noqa: E402, F401 (the autouse fixture, in force here too)
    needs_cuda,
)

from mla_eval.attention import reference  # noqa: E402
from mla_eval.formats import get_format  # noqa: E402
from mla_eval_kernels.cute import compile_cache  # noqa: E402
from mla_eval_kernels.plan import tuning as attention_tuning  # noqa: E402
from mla_eval_kernels.plan.device_limits import HOPPER_SMEM_PER_BLOCK  # noqa: E402
from mla_eval_kernels.plan.record_plan import plan_for  # noqa: E402

# what v3 can run, including formats held on v2 by V3_AWAITING_GPU_TESTS (these tests are what clears them:
# fixture `kernels_under_test`)
V3_FORMATS = [
    f for f in FORMATS if attention_tuning.v3_blocker(plan_for(get_format(f)), False, HOPPER_SMEM_PER_BLOCK, gated=False) is None
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

    from mla_eval_kernels.cute.mla_attention import swizzled_offset

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
    deadline_s=None, **probe,
):
    """One v3 launch into NaN-poisoned outputs. `deadline_s`: wait for it by polling an event, failing the test after
    that many seconds (a kernel whose barriers deadlock then fails, not hangs: no pytest-timeout in the test extras;
    the GPU context stays stuck, so the device script's step timeout ends the run after reporting it)."""
    from mla_eval_kernels.cute.launch import mla_attention_v3

    n, h = q.shape[:2]
    out = torch.full((n, h, 512), float("nan"), device="cuda")
    lse = torch.full((n, h), float("nan"), device="cuda")
    mla_attention_v3(
        plan_for(spec), q, cache, softmax_scale=scale, block_table=block_table, seq_lens=seq_lens, indices=indices,
        sink=sink, outer_scale=outer_scale, num_splits=num_splits, out=out, lse=lse, workspace_fill=float("nan"), **probe,
    )
    if deadline_s is not None:
        done = torch.cuda.Event()
        done.record()
        start = time.monotonic()
        while not done.query():
            if time.monotonic() - start > deadline_s:
                why = f"v3 launch {probe} did not finish in {deadline_s} s: a deadlock (the GPU context is stuck now)"
                print(why, file=sys.stderr, flush=True)  # in the log even if the stuck context then hangs the exit
                pytest.fail(why)
            time.sleep(0.01)
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
    assert any(k[0] == "mla_attention_v3" and k[2] == plan_for(spec) for k in compile_cache.keys())


PROBES = [
    dict(l2_prefetch=attention_tuning.V3_L2_PREFETCH_PROBE), dict(producer_wgs=1), dict(producer_wgs=2),
    dict(l2_prefetch=attention_tuning.V3_L2_PREFETCH_PROBE, producer_wgs=1),
]


@needs_cuda
@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("fmt", ["nvfp4", "bf16", "mxfp4", "fp8_ds_mla"])
def test_v3_benchmark_probes_match_reference(fmt, probe):
    """The variants the benchmark times beside v3 (L2 prefetch on: v3-pf; the other producer warpgroup count)."""
    spec, q, cache, scale, sink_t, s_l, lists, ref_out, ref_lse, bound = _case(fmt, 16, LENGTHS, 4)
    for splits in (None, 1):
        out, lse = _v3(spec, q, cache, scale, outer_scale=s_l, num_splits=splits, **lists, **probe)
        _check(out, lse, ref_out, ref_lse, bound, f"v3 {fmt} {probe} splits={splits}")


@needs_cuda
@pytest.mark.parametrize("fmt", V3_FORMATS)
def test_v3_probes_write_the_same_k_tiles(fmt):
    """The L2 prefetch (off by default, bench v3-pf) only warms L2 and the producer warpgroup count only
    moves work between threads: the K tiles, hence the outputs, are bit-identical to the default launch;
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


def test_v3_raw_ring_is_in_the_compile_key(monkeypatch):
    """No GPU needed: the raw ring (stages x keys per stage), the head tile and sparse lists are specialisations;
    the key says them."""
    from mla_eval_kernels.cute import mla_attention_v3

    monkeypatch.setattr(mla_attention_v3, "arch_tag", lambda device: "sm_90")
    assert V3_PART_RING == ["fp8_ds_mla", "fp8_ds_mla_pow2", "fp8_e4m3"]

    def key(name):
        return mla_attention_v3.compile_key(plan_for(get_format(name)), False, False, False, None)

    assert "raw=2x32" in key("fp8_ds_mla") and "raw=2x32" in key("fp8_e4m3") and "raw=2x64" in key("nvfp4")
    assert key("fp8_ds_mla") != key("fp8_ds_mla_pow2")
    plan = plan_for(get_format("fp8_ds_mla"))
    other = mla_attention_v3.compile_key(plan, False, False, False, None, raw_ring=(5, 16))
    assert "raw=5x16" in other and other != key("fp8_ds_mla")
    # the head tile and the slot lists are specialisations too; the tile's default ring and producer count follow
    nvfp4 = plan_for(get_format("nvfp4"))
    assert "heads=16" in key("nvfp4") and "sparse=False" in key("nvfp4")
    wide = mla_attention_v3.compile_key(nvfp4, False, False, False, None, heads=32)
    assert "heads=32" in wide and "raw=5x16" in wide and wide[7] == 2 and key("nvfp4")[7] == 2, wide
    sparse = mla_attention_v3.compile_key(nvfp4, False, False, False, None, sparse=True)
    assert "sparse=True" in sparse and len({key("nvfp4"), wide, sparse}) == 3
    # two producer warpgroups at the 32-head tile (its default): per-role registers, named in the
    # key; one producer (the v3-t32-p1 probe) and the 16-head tile have none
    assert "setmaxnreg=232/136" in wide, wide
    wide1 = mla_attention_v3.compile_key(nvfp4, False, False, False, None, producer_wgs=1, heads=32)
    assert wide1[7] == 1 and "setmaxnreg=none" in wide1 and wide1 != wide, wide1
    assert "setmaxnreg=none" in key("nvfp4") and "setmaxnreg=none" in sparse
    assert "setmaxnreg=none" in mla_attention_v3.compile_key(nvfp4, False, False, False, None, producer_wgs=1)


@needs_cuda
def test_a_held_v3_format_runs_v2_when_v3_is_forced(monkeypatch):
    """While V3_AWAITING_GPU_TESTS lists a format (the state outside these tests), forcing v3 runs v2 for it."""
    monkeypatch.setitem(attention_tuning.V3_AWAITING_GPU_TESTS, "fp8_ds_mla", "held for this test")
    monkeypatch.setenv(attention_tuning.ENV, "v3")
    spec, q, cache, scale, sink_t, s_l, lists, ref_out, ref_lse, bound = _case("fp8_ds_mla", 16, [BLOCK + 1, 300], 10)
    compile_cache.clear()
    out, lse = _run(spec, q, cache, scale, outer_scale=s_l, num_splits=1, **lists)
    _check(out, lse, ref_out, ref_lse, bound, "held fp8_ds_mla forced v3 -> v2")
    assert {k[0] for k in compile_cache.keys()} == {"mla_attention"}


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
    return {k[10] for k in compile_cache.keys() if k[0] == "mla_attention_v3"}


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
    assert {k[11] for k in compile_cache.keys() if k[0] == "mla_attention_v3"} == {"sparse=True"}


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
    got = {(k[7], k[10], k[12]) for k in compile_cache.keys() if k[0] == "mla_attention_v3"}
    assert got == {(2, "heads=32", "setmaxnreg=232/136"), (1, "heads=32", "setmaxnreg=none")}, got


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
def test_held_v3_launches_run_v2_or_the_16_head_tile_when_v3_is_forced(monkeypatch):
    """While `V3_LAUNCHES_AWAITING_GPU_TESTS` holds sparse lists and the 32-head tile (as it did until their
    GPU run), forced v3 runs a sparse launch on v2 and an h = 64 dense launch on v3's 16-head tile."""
    monkeypatch.setattr(attention_tuning, "V3_LAUNCHES_AWAITING_GPU_TESTS", {
        attention_tuning.V3_SPARSE: "held for this test", attention_tuning.V3_TILE_32: "held for this test",
    })
    monkeypatch.setenv(attention_tuning.ENV, "v3")
    spec, q, cache, scale, sink_t, s_l, idx, ref_out, ref_lse, bound = _sparse_case("nvfp4", 16, 300, 3)
    compile_cache.clear()
    out, lse = _run(spec, q, cache, scale, sink=sink_t, outer_scale=s_l, num_splits=1, indices=idx)
    _check(out, lse, ref_out, ref_lse, bound, "held sparse forced v3 -> v2")
    assert {k[0] for k in compile_cache.keys()} == {"mla_attention"}
    spec, q, cache, scale, sink_t, s_l, lists, ref_out, ref_lse, bound = _case("nvfp4", 64, [BLOCK + 1, 300], 13)
    compile_cache.clear()
    out, lse = _run(spec, q, cache, scale, outer_scale=s_l, num_splits=1, **lists)
    _check(out, lse, ref_out, ref_lse, bound, "held 32-head tile forced v3 h=64 -> 16-head tiles")
    assert {k[0] for k in compile_cache.keys()} == {"mla_attention_v3"} and _tiles_compiled() == {"heads=16"}


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
    # sparse lists: v3 where it covers the format (the hold cleared, as here), v2 while held (outside these tests)
    idx = torch.randint(0, 24 * BLOCK, (2, 100), dtype=torch.int32)
    ref_out, ref_lse = reference.mla_attention(spec, q, cache, softmax_scale=scale, outer_scale=s_l, indices=idx.cuda())
    bound = _bound(spec, q.cpu(), cache.cpu(), idx, scale, s_l)
    for held in (False, True):
        if held:
            monkeypatch.setitem(attention_tuning.V3_LAUNCHES_AWAITING_GPU_TESTS, attention_tuning.V3_SPARSE, "held here")
        compile_cache.clear()
        out, lse = _run(spec, q, cache, scale, outer_scale=s_l, num_splits=1, indices=idx.cuda())
        ran = "mla_attention_v3" if fmt in V3_FORMATS and not held else "mla_attention"
        assert {k[0] for k in compile_cache.keys()} == {ran}, (fmt, held)
        _check(out, lse, ref_out, ref_lse, bound, f"dispatch v3 {fmt} sparse held={held} -> {ran}")


@needs_cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_default_policy_picks_the_generation_per_launch_and_dispatch_records_it(fmt, monkeypatch):
    """MLA_EVAL_ATTENTION_KERNEL unset: a dense decode launch (h = 16, one query per sequence) runs the kernel
    `generation_for` names (v3 for `V3_DEFAULT_FORMATS`, else v2), the prefill-as-decode shape (many queries
    per sequence) and sparse lists run v2; results match the reference and the dispatch log records what ran."""
    from mla_eval.attention import dispatch

    monkeypatch.delenv(attention_tuning.ENV, raising=False)
    monkeypatch.setattr(attention_tuning, "V3_DEFAULT_PENDING", None)  # this test is what validates the policy
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
    from mla_eval_kernels.cute.mla_attention import swizzled_offset

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
    import os

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass.cute as cute

    from mla_eval_kernels.cute.mla_attention_v3 import MlaAttentionV3
    from tools import compile_check

    a = compile_check.attention_args(16)
    plan = plan_for(get_format(fmt))
    kern = MlaAttentionV3(plan, False, plan.outer_allowed, True, timing_probe=probe)
    cute.compile(kern, *a, options=f"--keep-ptx --keep-cubin --dump-dir={tmp_path}")
    use = compile_check.cubin_usage(str(next(tmp_path.glob("*.cubin"))))
    assert use.get("frame", 0) == 0 and use.get("stack", 0) == 0, use
    with pytest.raises(ValueError, match="timing_probe"):
        MlaAttentionV3(plan_for(get_format("nvfp4")), False, True, True, timing_probe="fast")


def test_compile_check_reads_registers_from_the_cubin_and_checks_the_ptx(tmp_path):
    """No GPU needed: one v3 specialisation compiled for sm_90a; the cubin reader finds its register
    count and no stack frame, the PTX check passes it and flags a PTX missing what the design needs."""
    import os

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass.cute as cute

    from mla_eval_kernels.cute.mla_attention_v3 import MlaAttentionV3
    from tools import compile_check

    a = compile_check.attention_args(16)
    plan = plan_for(get_format("nvfp4"))
    cute.compile(MlaAttentionV3(plan, False, True, True), *a, options=f"--keep-ptx --keep-cubin --dump-dir={tmp_path}")
    use = compile_check.cubin_usage(str(next(tmp_path.glob("*.cubin"))))
    assert 64 <= use["regs"] <= 168 and use.get("frame", 0) == 0 and use.get("stack", 0) == 0, use
    ptx = next(tmp_path.glob("*.ptx")).read_text()
    assert compile_check.check_v3_ptx(ptx) == []
    broken = ptx.replace("wgmma.mma_async.sync.aligned.m64n16k16", "wgmma.mma_async.sync.aligned.m64n8k16", 1)
    assert "67 m64n16k16 wgmma (expected 68)" in compile_check.check_v3_ptx(broken)
    assert "expected one CTA-wide barrier" in compile_check.check_v3_ptx(ptx + "\n\tbar.sync \t0;\n")
    # the 32-head tile with sparse lists and one producer warpgroup (the v3-t32-p1 probe; two are the default, with
    # per-role registers: another test): m64n32k16 wgmma, 256 threads whose registers fit the SM without a stack
    # frame (O^T [512, 32] is 128 fp32 registers per consumer thread)
    wide = tmp_path / "wide"
    wide.mkdir()
    kern = MlaAttentionV3(plan, True, True, False, heads=32, sparse=True, producer_wgs=1)
    assert kern.pt == 128 and kern.slot_cols == 4
    cute.compile(kern, *a, options=f"--keep-ptx --keep-cubin --dump-dir={wide}")
    use = compile_check.cubin_usage(str(next(wide.glob("*.cubin"))))
    assert 128 < use["regs"] <= compile_check.REGS_PER_SM // 256 and use.get("frame", 0) == 0 and use.get("stack", 0) == 0, use
    ptx = next(wide.glob("*.ptx")).read_text()
    assert compile_check.check_v3_ptx(ptx, 32) == []
    assert "0 m64n16k16 wgmma (expected 68)" in compile_check.check_v3_ptx(ptx)
    with pytest.raises(ValueError, match="head tile"):
        MlaAttentionV3(plan, False, True, True, heads=64)


@pytest.mark.parametrize("sparse", [False, True])
def test_the_two_producer_32_head_tile_compiles_with_per_role_registers(sparse, tmp_path):
    """No GPU needed: the 32-head tile with two producer warpgroups compiles for sm_90a to the launch's even share
    (168 registers x 384 threads) without a stack frame, because `setmaxnreg` gives the consumer 232 (the PTX has the
    .inc / .dec and `.minnctapersm 1`, without which ptxas ignores them and spills: 352-416 B of stack in the first
    build); the one-producer kernel has no `setmaxnreg` and the check says so when one is expected."""
    import os

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass.cute as cute

    from mla_eval_kernels.cute.mla_attention_v3 import MlaAttentionV3
    from tools import compile_check

    a = compile_check.attention_args(128)
    plan = plan_for(get_format("nvfp4"))
    built = {}
    for wgs in (2, 1):
        kern = MlaAttentionV3(plan, True, True, False, producer_wgs=wgs, heads=32, sparse=sparse)
        dump = tmp_path / f"p{wgs}"
        dump.mkdir()
        cute.compile(kern, *a, options=f"--keep-ptx --keep-cubin --dump-dir={dump}")
        built[wgs] = (kern, compile_check.cubin_usage(str(next(dump.glob("*.cubin")))), next(dump.glob("*.ptx")).read_text())
    kern, use, ptx = built[2]
    assert kern.pt == 256 and kern.regs == (232, 136) and kern.launch_bounds() == dict(min_blocks_per_mp=1)
    assert use["regs"] == 168 and use.get("frame", 0) == 0 and use.get("stack", 0) == 0, use
    assert compile_check.check_v3_ptx(ptx, 32, kern.regs) == []
    assert compile_check.check_v3_ptx(ptx, 32) == ["setmaxnreg [('dec', '136'), ('inc', '232')] (expected [])"]
    bare = ptx.replace(".minnctapersm 1", "")
    assert compile_check.check_v3_ptx(bare, 32, kern.regs) == ["setmaxnreg without .minnctapersm 1 (ptxas ignores it)"]
    kern1, use1, ptx1 = built[1]
    assert kern1.regs is None and kern1.launch_bounds() == {} and use1["regs"] > 168 and use1.get("frame", 0) == 0
    assert compile_check.check_v3_ptx(ptx1, 32) == []
    assert compile_check.check_v3_ptx(ptx1, 32, (232, 136)) == [
        "setmaxnreg [] (expected [('dec', '136'), ('inc', '232')])", "setmaxnreg without .minnctapersm 1 (ptxas ignores it)",
    ]
    with pytest.raises(ValueError, match="producer_wgs"):
        MlaAttentionV3(plan, True, True, False, producer_wgs=3, heads=32)


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


# consumer rev 2 (`attention_tuning.V3_CONSUMER_REV`, the default since these passed on an H200 and a bench timed it)
CONSUMER_FORMATS = ["nvfp4", "bf16", "fp8_ds_mla", "mxfp4"]
# dense lengths: 0 keys, 1 .. 4 + 1 tiles (even and odd tile counts: rev 2 runs tiles in pairs, then the remainder),
# one short of / past the 64-key tile, and 33 tiles (long runs where no head's running max moves: the skipped rescale)
CONSUMER_LENGTHS = [0, *LENGTHS, 4 * BLOCK + 1, 33 * BLOCK - 5]


@needs_cuda
@pytest.mark.parametrize("launch", ["dense h=16", "dense h=32", "sparse h=16", "sparse h=128"])
@pytest.mark.parametrize("fmt", CONSUMER_FORMATS)
def test_v3_consumer_rev2_bitwise_equals_rev1(fmt, launch):
    """Consumer rev 2 (tile loop unrolled by the K ring's stages, lazy O^T rescale) computes every value as rev 1 does:
    outputs and lse bit-identical to rev 1 (NaN-poisoned outputs and split partials), and within the reference bound;
    dense h = 16 (the 16-head tile) and h = 32 (the 32-head tile), sparse h = 16 and 128 (topk 777: -1 padding, an
    all-invalid row, out-of-range ids), a sink, the split heuristic, one CTA per query and 3 forced splits (empty
    splits and odd / even tile counts per split); the 32-head tile with one and with two producer warpgroups."""
    compile_cache.clear()
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
    # the 32-head tile with one producer warpgroup and two (per-role registers, `setmaxnreg`; unrolled there too)
    for wgs in (None,) if tile == 16 else (1, 2):
        kw = dict(sink=sink_t, outer_scale=s_l, head_tile=tile, producer_wgs=wgs, **lists)
        for splits in (None, 1, 3):
            one, lse1 = _v3(spec, q, cache, scale, num_splits=splits, consumer_rev=1, **kw)
            two, lse2 = _v3(spec, q, cache, scale, num_splits=splits, consumer_rev=2, **kw)
            what = f"v3 consumer rev 2 {fmt} {launch} producers={wgs} splits={splits}"
            _check(two[rows], lse2[rows], ref_out[rows], ref_lse[rows], bound, what)
            assert torch.equal(two, one) and torch.equal(lse2, lse1), what
            if rows.start == 1:
                assert torch.all(two[0] == 0) and torch.all(torch.isneginf(lse2[0]))
    got = {x for k in compile_cache.keys() if k[0] == "mla_attention_v3" for x in k if str(x).startswith("consumer=")}
    assert got == {"consumer=1", "consumer=2"}, got


@pytest.mark.parametrize(
    "launch", ["nvfp4 dense h=16", "nvfp4 sparse h=32", "nvfp4 dense h=32 p2", "bf16 dense h=32 p2", "fp8_ds_mla sparse h=32 p2"]
)
def test_v3_consumer_rev2_compiles_and_is_in_the_compile_key(launch, tmp_path, monkeypatch):
    """No GPU needed: consumer rev 2 compiles for sm_90a without a stack frame, its PTX holds the tile code
    `tile_copies` times (68 wgmma each: the loop body of two tiles and the remainder tile), also under `setmaxnreg`
    budgets (the 32-head tile with two producer warpgroups, "p2", where bf16 once spilled); rev 1, the
    default, once; the vote of the lazy rescale is there; the revision is a specialisation the compile key names;
    another is refused."""
    import os

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass.cute as cute

    from mla_eval_kernels.cute import mla_attention_v3
    from mla_eval_kernels.cute.mla_attention_v3 import MlaAttentionV3
    from tools import compile_check

    fmt, lists, tile = launch.split()[:3]
    heads, sparse = int(tile.split("=")[1]), lists == "sparse"
    wgs = 2 if launch.endswith("p2") else None
    a = compile_check.attention_args(heads)
    plan = plan_for(get_format(fmt))
    for rev in (1, 2):
        kern = MlaAttentionV3(
            plan, True, plan.outer_allowed, True, producer_wgs=wgs, heads=heads, sparse=sparse, consumer_rev=rev
        )
        copies = kern.tile_copies
        assert copies == (2 * attention_tuning.V3_K_STAGES - 1 if rev == 2 else 1), (rev, kern.regs)
        assert kern.regs is not None or wgs != 2  # two producer warpgroups at the 32-head tile: per-role registers
        dump = tmp_path / f"c{rev}"
        dump.mkdir()
        cute.compile(kern, *a, options=f"--keep-ptx --keep-cubin --dump-dir={dump}")
        use = compile_check.cubin_usage(str(next(dump.glob("*.cubin"))))
        assert use.get("frame", 0) == 0 and use.get("stack", 0) == 0, (rev, use)
        ptx = next(dump.glob("*.ptx")).read_text()
        assert compile_check.check_v3_ptx(ptx, heads, kern.regs, copies) == [], rev
        if copies > 1:
            assert compile_check.check_v3_ptx(ptx, heads, kern.regs) == [f"{68 * copies} m64n{heads}k16 wgmma (expected 68)"]
        assert ("vote.sync.any.pred" in ptx) == (rev == 2)  # the warp-uniform decision of the lazy rescale
    monkeypatch.setattr(mla_attention_v3, "arch_tag", lambda device: "sm_90")
    key = mla_attention_v3.compile_key(plan, False, False, False, None)
    assert f"consumer={attention_tuning.V3_CONSUMER_REV}" in key
    two = mla_attention_v3.compile_key(plan, False, False, False, None, consumer_rev=2)
    assert "consumer=2" in two and two != mla_attention_v3.compile_key(plan, False, False, False, None, consumer_rev=1)
    with pytest.raises(ValueError, match="consumer_rev"):
        MlaAttentionV3(plan, False, True, True, consumer_rev=3)


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


# ---------------------------------------------------------------------------------- decode rev 2 (held)
DECODE_REV2_FORMATS = [f for f in V3_FORMATS if attention_tuning.v3_decode_rev(plan_for(get_format(f)), 2) == 2]
# (sparse, heads, head tile, producer warpgroups): 256 producer threads (8 keys per pass: one store base per thread)
# and 128 (4 keys per pass: two, by the key's parity of 4), whole tiles and the 32-head tile's 16 / 32-key parts
REV2_LAUNCHES = {
    "dense h=16": (False, 16, None, None),
    "dense h=16 p1": (False, 16, None, 1),
    "sparse h=16": (True, 16, None, None),
    "dense h=32": (False, 32, 32, None),
    "dense h=128 p2": (False, 128, 32, 2),
    "sparse h=128": (True, 128, 32, None),
}


def _rev2_case(fmt, launch, sparse_seed, dense_seed, lengths=LENGTHS):
    """A case of `REV2_LAUNCHES` for the held revisions' tests: (spec, q, cache, scale, launch keywords of `_v3` (sink,
    outer scale, head tile, producer warpgroups, slot lists), reference out / lse, error bound); dense lists of the
    query `lengths`."""
    sparse, heads, tile, wgs = REV2_LAUNCHES[launch]
    if sparse:
        spec, q, cache, scale, sink_t, s_l, idx, ref_out, ref_lse, bound = _sparse_case(fmt, heads, 777, sparse_seed)
        lists = dict(indices=idx)
    else:
        blocks = max(24, -(-max(lengths) // BLOCK) + 4)
        spec, q, cache, scale, sink_t, s_l, lists, ref_out, ref_lse, bound = _case(
            fmt, heads, lengths, dense_seed, blocks=blocks, sink=True
        )
    kw = dict(sink=sink_t, outer_scale=s_l, head_tile=tile, producer_wgs=wgs, **lists)
    return spec, q, cache, scale, kw, ref_out, ref_lse, bound


@needs_cuda
@pytest.mark.parametrize("launch", list(REV2_LAUNCHES))
@pytest.mark.parametrize("fmt", DECODE_REV2_FORMATS)
def test_v3_decode_rev2_matches_reference_and_rev1_bitwise(fmt, launch):
    """The E2M1 decode rev 2 (`attention_tuning.V3_DECODE_REV`, the default since this passed on an H200): NaN-poisoned
    outputs against the reference, unsplit and 3 splits, and bit for bit (int32 views: signed zeros, lse included) the
    outputs of rev 1, the GPU-tested decode, on the same launch: it writes the same bf16 K tiles. Every fold format
    (the outer scale where the format has one), dense and sparse lists, the 16-head tile (one and two producer
    warpgroups) and the 32-head tile (one producer; two with per-role registers)."""
    compile_cache.clear()
    spec, q, cache, scale, kw, ref_out, ref_lse, bound = _rev2_case(fmt, launch, 7, 17)
    for splits in (1, 3):
        out2, lse2 = _v3(spec, q, cache, scale, num_splits=splits, decode_rev=2, **kw)
        _check(out2, lse2, ref_out, ref_lse, bound, f"v3 decode rev 2 {fmt} {launch} splits={splits}")
        out1, lse1 = _v3(spec, q, cache, scale, num_splits=splits, decode_rev=1, **kw)
        assert torch.equal(out2.view(torch.int32), out1.view(torch.int32)), (fmt, launch, splits)
        assert torch.equal(lse2.view(torch.int32), lse1.view(torch.int32)), (fmt, launch, splits)
    revs = {k[14] for k in compile_cache.keys() if k[0] == "mla_attention_v3"}
    assert revs == {"decode_rev=1", "decode_rev=2"}, revs


@needs_cuda
@pytest.mark.parametrize("launch", ["dense h=16", "sparse h=16", "dense h=128 p2", "sparse h=128"])
@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_fp8_ds_mla"])
def test_v3_consumer_rev2_with_decode_rev2_bitwise_equals_the_default(fmt, launch):
    """Both held revisions together (the bench's v3-c2-d2 row: consumer rev 2 and the E2M1 decode rev 2,
    written on separate branches, each tested alone above): outputs and lse bit for bit those of the default kernel
    (rev 1 / rev 1), and within the reference bound, unsplit and 3 splits, NaN-poisoned outputs."""
    compile_cache.clear()
    spec, q, cache, scale, kw, ref_out, ref_lse, bound = _rev2_case(fmt, launch, 9, 19)
    for splits in (1, 3):
        new, lse_new = _v3(spec, q, cache, scale, num_splits=splits, consumer_rev=2, decode_rev=2, **kw)
        _check(new, lse_new, ref_out, ref_lse, bound, f"v3 consumer rev 2 + decode rev 2 {fmt} {launch} splits={splits}")
        old, lse_old = _v3(spec, q, cache, scale, num_splits=splits, consumer_rev=1, decode_rev=1, **kw)
        assert torch.equal(new.view(torch.int32), old.view(torch.int32)), (fmt, launch, splits)
        assert torch.equal(lse_new.view(torch.int32), lse_old.view(torch.int32)), (fmt, launch, splits)


@needs_cuda
@pytest.mark.parametrize("launch", ["dense h=128 p2", "sparse h=128"])
@pytest.mark.parametrize("fmt", ["nvfp4", "bf16", "fp8_ds_mla"])
def test_v3_consumer_rev2_unrolled_at_the_two_producer_32_head_tile(fmt, launch):
    """Consumer rev 2's unrolled tile loop at the 32-head tile with two producer warpgroups and per-role registers
    (`setmaxnreg`; Q's descriptors of the trip's second copy from `q_descriptors`, no spill): h = 128 (4
    head tiles), dense lists (`CONSUMER_LENGTHS`: 0 keys, odd and even tile counts, a 33-tile query) and sparse (topk
    777: -1 padding, an all-invalid row, out-of-range ids), a sink, the split heuristic, 1 and 3 splits, NaN-poisoned
    outputs: within the reference bound and bit for bit (int32 views) rev 1, the GPU-tested consumer."""
    compile_cache.clear()
    spec, q, cache, scale, kw, ref_out, ref_lse, bound = _rev2_case(fmt, launch, 13, 23, lengths=CONSUMER_LENGTHS)
    kw["producer_wgs"] = 2  # sparse h=128 runs the default count; two here whatever V3_WIDE_PRODUCER_WGS says
    assert attention_tuning.v3_reg_budget(kw["head_tile"], kw["producer_wgs"]) is not None  # the setmaxnreg kernel
    rows = slice(None) if "indices" in kw else slice(1, None)  # dense row 0 has no key: out 0, lse -inf (checked below)
    for splits in (None, 1, 3):
        two, lse2 = _v3(spec, q, cache, scale, num_splits=splits, consumer_rev=2, **kw)
        _check(two[rows], lse2[rows], ref_out[rows], ref_lse[rows], bound, f"v3 consumer rev 2 {fmt} {launch} splits={splits}")
        one, lse1 = _v3(spec, q, cache, scale, num_splits=splits, consumer_rev=1, **kw)
        assert torch.equal(two.view(torch.int32), one.view(torch.int32)), (fmt, launch, splits)
        assert torch.equal(lse2.view(torch.int32), lse1.view(torch.int32)), (fmt, launch, splits)
        if rows.start == 1:
            assert torch.all(two[0] == 0) and torch.all(torch.isneginf(lse2[0]))
    keys = [k for k in compile_cache.keys() if k[0] == "mla_attention_v3"]
    assert {k[12] for k in keys} == {"setmaxnreg=%d/%d" % attention_tuning.V3_REG_SPLIT}, keys
    assert {k[13] for k in keys} == {"consumer=1", "consumer=2"}, keys


@pytest.mark.parametrize("pt", [128, 256])
def test_v3_decode_rev2_store_addresses_are_the_swizzled_offsets(pt):
    """No GPU needed: `decode_latent_r2`'s per-thread store bases (one per value of K & 7) plus 512 elements per 8 rows
    are `swizzled_offset` of the key row and the lane's two 16-byte chunks (upper 8 values first where blk & 4), for
    every part key0 the rings give, item u, warp w = ptid // 32 and block; and its 4-byte loads are the words rev 1
    selected from its 8-byte load."""
    from mla_eval_kernels.cute.mla_attention import swizzled_offset

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


def test_v3_decode_rev_is_in_the_compile_key(monkeypatch):
    """No GPU needed: the decode revision is a specialisation where the fold decode runs; elsewhere always 1."""
    from mla_eval_kernels.cute import mla_attention_v3

    monkeypatch.setattr(mla_attention_v3, "arch_tag", lambda device: "sm_90")
    nvfp4 = plan_for(get_format("nvfp4"))
    one = mla_attention_v3.compile_key(nvfp4, False, False, False, None, decode_rev=1)
    two = mla_attention_v3.compile_key(nvfp4, False, False, False, None, decode_rev=2)
    assert one != two and one[14] == "decode_rev=1" and two[14] == "decode_rev=2"
    assert mla_attention_v3.compile_key(nvfp4, False, False, False, None)[14] == f"decode_rev={attention_tuning.V3_DECODE_REV}"
    bf16 = plan_for(get_format("bf16"))  # no fold decode: rev 2 changes nothing there, so the key says 1
    assert mla_attention_v3.compile_key(bf16, False, False, False, None, decode_rev=2)[14] == "decode_rev=1"


# ---- the CTA pair (cute/cta_pair.py): held by `V3_TILE_32_PAIR` until the GPU cases below pass ----
PAIR_FORMATS = ["nvfp4", "mxfp4", "bf16", "fp8_ds_mla", "nvfp4_fp8_ds_mla"]
PAIR_LAUNCHES = ["dense h=64", "dense h=128", "sparse h=128"]
PAIR_DEADLINE_S = 60  # the launches below take milliseconds; a barrier that never completes must fail the test


def _pair_case(fmt, launch, seed):
    heads = int(launch.split("=")[1])
    if launch.startswith("sparse"):  # topk 777 (not a multiple of 64), -1 padding, an all-invalid row, out-of-range ids
        spec, q, cache, scale, sink_t, s_l, idx, ref_out, ref_lse, bound = _sparse_case(fmt, heads, 777, seed)
        return spec, q, cache, scale, sink_t, s_l, dict(indices=idx), ref_out, ref_lse, bound
    return _case(fmt, heads, LENGTHS, seed, sink=True)  # lengths around the 64-key tile and its 16- / 32-key parts


@needs_cuda
@pytest.mark.parametrize("launch", PAIR_LAUNCHES)
@pytest.mark.parametrize("fmt", PAIR_FORMATS)
def test_v3_cta_pair_matches_reference_and_the_unpaired_kernel_bitwise(fmt, launch):
    """The CTA pair (two 32-head CTAs of a cluster, each decoding half of every raw unit into both CTAs' K stage):
    poisoned outputs against the reference, 1 and 3 splits (partials + combine), dense h = 64 (one pair) and 128 (two;
    lengths around the tile, a sink) and sparse h = 128; and bit-identical to the unpaired two-producer 32-head kernel,
    whose K tiles it must reproduce byte for byte (the same decode arithmetic per row, only which CTA runs it differs).
    A deadlock of the cluster protocol fails after `PAIR_DEADLINE_S`."""
    compile_cache.clear()
    spec, q, cache, scale, sink_t, s_l, lists, ref_out, ref_lse, bound = _pair_case(fmt, launch, 21)
    for splits in (1, 3):
        kw = dict(sink=sink_t, outer_scale=s_l, num_splits=splits, head_tile=32, producer_wgs=2, **lists)
        out, lse = _v3(spec, q, cache, scale, cta_pair=True, deadline_s=PAIR_DEADLINE_S, **kw)
        _check(out, lse, ref_out, ref_lse, bound, f"v3 CTA pair {fmt} {launch} splits={splits}")
        one, lse1 = _v3(spec, q, cache, scale, cta_pair=False, **kw)
        assert torch.equal(out, one) and torch.equal(lse, lse1), (fmt, launch, splits)
    got = {(k[10], k[-2]) for k in compile_cache.keys() if k[0] == "mla_attention_v3"}
    assert got == {("heads=32", "cta_pair=True"), ("heads=32", "cta_pair=False")}, got


@needs_cuda
@pytest.mark.parametrize("revs", [dict(decode_rev=2), dict(consumer_rev=2), dict(decode_rev=2, consumer_rev=2)])
@pytest.mark.parametrize("launch", ["dense h=128", "sparse h=128"])
def test_v3_cta_pair_with_the_held_revisions_equals_their_unpaired_kernel(launch, revs):
    """The pair with the held revisions (E2M1 decode rev 2, consumer rev 2: each the same bits as rev 1) equals
    the unpaired kernel of the same revisions bit for bit, and the reference (nvfp4: the fold decode both revisions
    cover)."""
    compile_cache.clear()
    spec, q, cache, scale, sink_t, s_l, lists, ref_out, ref_lse, bound = _pair_case("nvfp4", launch, 23)
    kw = dict(sink=sink_t, outer_scale=s_l, num_splits=3, head_tile=32, producer_wgs=2, **revs, **lists)
    out, lse = _v3(spec, q, cache, scale, cta_pair=True, deadline_s=PAIR_DEADLINE_S, **kw)
    _check(out, lse, ref_out, ref_lse, bound, f"v3 CTA pair nvfp4 {launch} {revs}")
    one, lse1 = _v3(spec, q, cache, scale, cta_pair=False, **kw)
    assert torch.equal(out, one) and torch.equal(lse, lse1), (launch, revs)


@needs_cuda
def test_v3_cta_pair_request_that_cannot_pair_is_refused():
    """`cta_pair=True` where the launch has no pairs of 32-head tiles (h = 96: 3 tiles) is refused by name."""
    spec, q, cache, scale, sink_t, s_l, lists, *_ = _case("nvfp4", 96, [70, 5], 3)
    with pytest.raises(ValueError, match="h % 64 == 0"):
        _v3(spec, q, cache, scale, head_tile=32, cta_pair=True, **lists)


def _pair_tile_stores(plan, rank: int, pt: int = 256) -> list[tuple[int, int, int]]:
    """A model of one pair CTA's producer per key tile (`load_raw` / `load_tile`, `decode_tile_v3` / `decode_tile`,
    the K base shifted by `v3_pair_keys`' first key): (K row, 16-byte column chunk, tile key of the raw record the
    row was decoded from) of every store; `store_k` / `forward_tile` send each to both CTAs at the same offset."""
    from mla_eval_kernels.cute.mla_attention import swizzled_offset

    bn, rec = 64, plan.record_bytes
    chunks = rec // 16
    out = []
    if attention_tuning.is_bf16_plan(plan):  # the copy: this CTA's half of the tile's chunks, forwarded as copied
        koff, half = attention_tuning.v3_pair_keys(bn, rank)
        return [(koff + i // chunks, i % chunks, koff + i // chunks) for i in range(half * chunks)]
    nk = attention_tuning.v3_raw_ring(plan, 32)[1]
    koff, half = attention_tuning.v3_pair_keys(nk, rank)
    g = pt // chunks
    kshift = swizzled_offset(koff, 0, bn)
    for key0 in range(0, bn, nk):  # the tile's raw units
        held = {}  # raw record position -> tile key (`load_raw`: chunk ptid % chunks of record ptid // chunks + g u)
        for ptid in range(g * chunks):
            for u in range(-(-half // g)):
                pos = ptid // chunks + g * u
                if pos < half:
                    held.setdefault(pos, []).append((key0 + koff + min(pos, half - 1), ptid % chunks))
        assert sorted(held) == list(range(half)) and all(sorted(c for _, c in v) == list(range(chunks)) for v in held.values())
        src = {pos: v[0][0] for pos, v in held.items()}
        items = []  # (raw record, K row relative to the shifted base, first column)
        if attention_tuning.fast_e2m1_eligible(plan) and (half * 32) % pt == 0:  # `decode_latent`: block ptid % 32
            items += [(u * (pt // 32) + p // 32, 16 * (p % 32) + 8 * h) for p in range(pt) for u in range(half * 32 // pt)
                      for h in (0, 1)]
        else:  # v2's `decode_tile`: 8 values per item
            items += [(i // 64, (i % 64) * 8) for i in range(half * 64)]
        items += [(i // 8, 512 + (i % 8) * 8) for i in range(half * 8)]  # rope items, none repeated in the pair
        for raw_key, col in items:
            row = key0 + raw_key
            # the shifted base: row key0 + raw_key of the base at kshift is tile row row + koff (whole 8-row atoms)
            assert kshift + swizzled_offset(row, col, bn) == swizzled_offset(row + koff, col, bn), (row, col)
            out.append((row + koff, col // 8, src[raw_key]))
    return out


@pytest.mark.parametrize("fmt", V3_FORMATS)
def test_v3_cta_pair_decodes_each_key_once_and_both_ctas_receive_the_whole_tile(fmt):
    """No GPU needed: over the two CTAs of a pair, every (key, 16-byte chunk) of the 64 x 576 K tile is decoded (or
    copied) exactly once, from that key's own record, and since each store goes to both CTAs (local and peer at the
    same offset), each CTA's stage receives the whole tile exactly once."""
    plan = plan_for(get_format(fmt))
    stores = [_pair_tile_stores(plan, rank) for rank in range(attention_tuning.V3_PAIR_CTAS)]
    every = [(k, c) for k in range(64) for c in range(72)]
    for rank_stores in stores:
        assert all(row == key for row, _, key in rank_stores)
    received = {cta: sorted((r, c) for rank_stores in stores for r, c, _ in rank_stores) for cta in range(2)}
    assert received[0] == received[1] == every
    halves = [{r for r, _, _ in rank_stores} for rank_stores in stores]
    assert not halves[0] & halves[1] and len(halves[0]) == len(halves[1]) == 32  # balanced, disjoint


@pytest.mark.parametrize("fmt,sparse", [("nvfp4", True), ("fp8_ds_mla", False), ("bf16", False)])
def test_the_cta_pair_compiles_with_its_cluster_protocol(fmt, sparse, tmp_path):
    """No GPU needed: the pair kernel (E2M1 fast decode, v2's decode path, bf16's copy + forward) compiles for sm_90a
    with the two-producer tile's registers (168 at launch, setmaxnreg kept) and no stack frame, and its PTX has the
    cluster protocol (`compile_check.check_pair_ptx`); the checks flag an unpaired PTX checked as a pair, the pair
    checked as unpaired, and a wait left at CTA scope."""
    import os

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass.cute as cute

    from mla_eval_kernels.cute.mla_attention_v3 import MlaAttentionV3
    from tools import compile_check

    a = compile_check.attention_args(128)
    plan = plan_for(get_format(fmt))
    kern = MlaAttentionV3(plan, True, plan.outer_allowed, False, producer_wgs=2, heads=32, sparse=sparse, cta_pair=True)
    unit = 64 if fmt == "bf16" else attention_tuning.v3_raw_ring(plan, 32, sparse)[1]
    assert kern.pair and kern.unit_keys == unit // 2 and kern.launch_cluster() == dict(cluster=[1, 2, 1])
    cute.compile(kern, *a, options=f"--keep-ptx --keep-cubin --dump-dir={tmp_path}")
    use = compile_check.cubin_usage(str(next(tmp_path.glob("*.cubin"))))
    assert use["regs"] == 168 and use.get("frame", 0) == 0 and use.get("stack", 0) == 0, use
    ptx = next(tmp_path.glob("*.ptx")).read_text()
    assert compile_check.check_v3_ptx(ptx, 32, kern.regs, pair=True) == []
    assert {"expected one CTA-wide barrier", "a cluster instruction outside the CTA pair"} <= set(
        compile_check.check_v3_ptx(ptx, 32, kern.regs)
    )
    cta_wait = ptx.replace("try_wait.parity.acquire.cluster.shared::cta", "try_wait.parity.shared::cta", 1)
    assert "an mbarrier wait at CTA scope in the CTA pair" in compile_check.check_v3_ptx(cta_wait, 32, kern.regs, pair=True)
    no_exit_sync = ptx.replace("barrier.cluster.arrive;", "", 1)
    assert "1 x cluster barrier (expected 2..2)" in compile_check.check_v3_ptx(no_exit_sync, 32, kern.regs, pair=True)
    unpaired = MlaAttentionV3(plan, True, plan.outer_allowed, False, producer_wgs=2, heads=32, sparse=sparse)
    assert not unpaired.pair and unpaired.launch_cluster() == {}
    with pytest.raises(ValueError, match="cta_pair: the CTA pair runs the 32-head tile only"):
        MlaAttentionV3(plan, True, False, False, heads=16, cta_pair=True)
    with pytest.raises(ValueError, match="cta_pair: the CTA pair runs two producer warpgroups"):
        MlaAttentionV3(plan, True, False, False, heads=32, producer_wgs=1, cta_pair=True)


def test_the_unpaired_kernel_fails_the_pair_checks(tmp_path):
    """No GPU needed: the unpaired two-producer 32-head kernel's PTX has none of the cluster protocol (checked as a pair,
    every item is missing) and passes as what it is."""
    import os

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass.cute as cute

    from mla_eval_kernels.cute.mla_attention_v3 import MlaAttentionV3
    from tools import compile_check

    plan = plan_for(get_format("nvfp4"))
    kern = MlaAttentionV3(plan, True, True, False, producer_wgs=2, heads=32)
    cute.compile(kern, *compile_check.attention_args(128), options=f"--keep-ptx --keep-cubin --dump-dir={tmp_path}")
    ptx = next(tmp_path.glob("*.ptx")).read_text()
    assert compile_check.check_v3_ptx(ptx, 32, kern.regs) == []
    problems = compile_check.check_v3_ptx(ptx, 32, kern.regs, pair=True)
    # (the unpaired kernel's `PipelineAsync` init has the same init fence: its release at cluster scope is the default)
    missing = {f"0 x {what}" for what in compile_check.PAIR_PTX if what != "mbarrier init fence"}
    assert {p.split(" (")[0] for p in problems if " x " in p} == missing, problems
    assert "an mbarrier wait at CTA scope in the CTA pair" in problems and len(problems) == len(missing) + 2, problems


def test_v3_cta_pair_is_in_the_compile_key(monkeypatch):
    """No GPU needed: the pair is another kernel (a cluster launch): the key names it; the default key names none."""
    from mla_eval_kernels.cute import mla_attention_v3

    monkeypatch.setattr(mla_attention_v3, "arch_tag", lambda device: "sm_90")
    nvfp4 = plan_for(get_format("nvfp4"))
    paired = mla_attention_v3.compile_key(nvfp4, True, False, False, None, heads=32, cta_pair=True)
    plain = mla_attention_v3.compile_key(nvfp4, True, False, False, None, heads=32)
    assert paired[-2] == "cta_pair=True" and plain[-2] == "cta_pair=False" and paired[:-2] == plain[:-2]
