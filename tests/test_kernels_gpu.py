"""GPU tests of the CuTe DSL kernels against the torch codecs and the torch reference.

Skipped without `nvidia-cutlass-dsl`; everything but the layout check is skipped without CUDA.

Error bound for attention (kernel vs the float32 reference on the same decoded cache): the kernel
rounds (i) each dequantised K element to bf16 (relative <= u = 2^-8; exactly 0 where the decoded
value is a bf16 number, e.g. E2M1 x E4M3 products), (ii) the probabilities p to bf16 before P V
(relative <= u). With |ds_j| <= delta = u * scale * max_j sum_d |q_d| |k_jd| on every score,
sum_j |dp_j| <= e^{2 delta} - 1, so
    |out - ref| <= max|v| * (u + u_k + e^{2 delta} - 1) + fp32 accumulation noise,
u_k = u if any K element is not bf16-exact, else 0 (delta = 0 then). The tests use that bound
(times 1.5 for the fp32 and ex2.approx noise) and, independently, cosine >= 0.9999.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import pytest
import torch

cutlass = pytest.importorskip("cutlass")

from format_fixtures import ODD_GROUP  # noqa: E402

from mla_eval.attention import reference  # noqa: E402
from mla_eval.formats import all_formats, decode, encode, get_format  # noqa: E402
from mla_eval_kernels.cute import compile_cache  # noqa: E402
from mla_eval_kernels.plan import tuning as attention_tuning  # noqa: E402
from mla_eval_kernels.plan.record_plan import UnsupportedFormat, plan_for  # noqa: E402


def needs_cuda(fn):
    """Marked `gpu` and skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(fn))


def _has_kernel(spec) -> bool:
    try:
        plan_for(spec)
    except UnsupportedFormat:
        return False
    return True


FORMATS = [s.name for s in all_formats() if _has_kernel(s)]  # the rest are served by the torch reference
REFERENCE_ONLY = [s.name for s in all_formats() if not _has_kernel(s)]
BLOCK = 64
U_BF16 = 2.0**-8


def test_swizzled_offset_matches_the_cute_layout():
    """The kernels address K/Q tiles by hand; the address must be the layout's (no GPU needed)."""
    import cutlass.cute as cute

    from mla_eval_kernels.cute.smem import swizzle_atom, swizzled_offset

    got = {}

    @cute.jit
    def probe():
        layout = cute.tile_to_shape(swizzle_atom(64), (32, 576, 2), (0, 1, 2))
        for r, c, s in [(0, 0, 0), (1, 8, 0), (9, 70, 0), (31, 575, 0), (5, 130, 1), (17, 300, 1), (23, 511, 1)]:
            got[(r, c, s)] = cute.crd2idx((r, c, s), layout)

    probe()
    for (r, c, s), idx in got.items():
        assert idx == swizzled_offset(r, c, 32) + s * 32 * 576


# ---------------------------------------------------------------------------------- writer
def _inputs(kind: str, t: int, gen: torch.Generator):
    lat = torch.randn(t, 512, generator=gen)
    rope = torch.randn(t, 64, generator=gen)
    if kind == "heavy":
        # heavy tails, outliers, all-zero groups/tokens, tiny values (subnormal E4M3 scales),
        # negative zeros, values past every format's range (saturation)
        lat = lat * torch.exp(2.0 * torch.randn(t, 512, generator=gen))
        lat[0] = 0.0
        lat[1, :16] = 0.0
        lat[1, 16:32] = -0.0
        lat[2] *= 1e-6
        lat[3, 5] = 3.0e4
        lat[4, 200:232] = 1e-30
        rope = rope * torch.exp(2.0 * torch.randn(t, 64, generator=gen))
        rope[5] = 0.0
        rope[6, 3] = -5e3
    return lat.to(torch.bfloat16), rope.to(torch.bfloat16)


def _outer_cases(spec):
    return [None, 0.37, 1.0, 2.5e-3] if spec.outer_scale is not None else [None]


@needs_cuda
@pytest.mark.parametrize("kind", ["random", "heavy"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_writer_bytes_identical_to_codec(fmt, kind):
    from mla_eval.attention import dispatch

    spec = get_format(fmt)
    gen = torch.Generator().manual_seed(zlib.crc32(f'{fmt}/{kind}'.encode()))
    t, blocks = 300, 6
    lat, rope = _inputs(kind, t, gen)
    slots = torch.randperm(blocks * BLOCK, generator=gen)[:t]
    slots[::7] = -1  # skipped
    for s_l in _outer_cases(spec):
        cache = torch.full((blocks, BLOCK, spec.record_bytes), 0xA5, dtype=torch.uint8, device="cuda")
        dispatch.write_cache(spec, lat.cuda(), rope.cuda(), slots.cuda(), cache, outer_scale=s_l, backend="kernel")
        want = torch.full((blocks, BLOCK, spec.record_bytes), 0xA5, dtype=torch.uint8)
        reference.write_cache(spec, lat, rope, slots, want, outer_scale=s_l)  # the CPU codec is the authority
        got = cache.cpu()
        if not torch.equal(got, want):
            bad = (got != want).nonzero()
            raise AssertionError(f"{fmt} {kind} s_l={s_l}: {len(bad)} bytes differ, first at {bad[0].tolist()}")


# TensorRT-LLM's engine formats (global scale, saturating zero scales, E4M3 read-back) that have a kernel
ENGINE_FORMATS = [f for f in FORMATS if get_format(f).reader_e4m3]


def _edge_inputs(kind: str, t: int, gen: torch.Generator):
    """Inputs at the ends of TensorRT-LLM's NVFP4 arithmetic (bf16): all zero (signed zeros), tiny (block
    scales that underflow E4M3 at the global scale S while the group amax is not 0: saturated codes, +6 for
    the zeros beside them), huge (block scales saturating at 448, S * amax overflowing float32 to inf)."""
    lat = torch.randn(t, 512, generator=gen)
    rope = torch.randn(t, 64, generator=gen)
    if kind == "zero":
        lat, rope = torch.zeros_like(lat), torch.zeros_like(rope)
        lat[::2, ::3] = -0.0
        rope[1::2, ::5] = -0.0
    elif kind == "tiny":
        lat = lat * torch.pow(10.0, -torch.empty(t, 32, 1).uniform_(2, 9, generator=gen)).expand(t, 32, 16).reshape(t, 512)
        rope = rope * torch.pow(10.0, -torch.empty(t, 4, 1).uniform_(2, 9, generator=gen)).expand(t, 4, 16).reshape(t, 64)
        lat[::3, 16:32] = 0.0  # one tiny value among (signed) zeros
        lat[::3, 20] = 1e-6
        lat[::3, 21] = -0.0
        rope[::3, :16] = -0.0
        rope[::3, 7] = -3e-7
    elif kind == "huge":
        lat = lat * torch.pow(10.0, torch.empty(t, 32, 1).uniform_(0, 38, generator=gen)).expand(t, 32, 16).reshape(t, 512)
        rope = rope * torch.pow(10.0, torch.empty(t, 4, 1).uniform_(0, 38, generator=gen)).expand(t, 4, 16).reshape(t, 64)
        lat[:, 5] = 3.0e38
        rope[:, 60] = -3.0e38
        lat = lat.clamp(-3.3e38, 3.3e38)
        rope = rope.clamp(-3.3e38, 3.3e38)
    return lat.to(torch.bfloat16), rope.to(torch.bfloat16)


def _kernel_bytes_equal_codec(spec, lat, rope, gen, label: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the T tokens through the CuTe writer (random slots, every 7th -1, the rest of the cache poisoned
    with 0xA5) and through the codec; assert identical caches; return (the written records, the kept mask)."""
    from mla_eval.attention import dispatch

    blocks = 6
    slots = torch.randperm(blocks * BLOCK, generator=gen)[: lat.shape[0]]
    slots[::7] = -1
    cache = torch.full((blocks, BLOCK, spec.record_bytes), 0xA5, dtype=torch.uint8, device="cuda")
    dispatch.write_cache(spec, lat.cuda(), rope.cuda(), slots.cuda(), cache, backend="kernel")
    want = torch.full((blocks, BLOCK, spec.record_bytes), 0xA5, dtype=torch.uint8)
    reference.write_cache(spec, lat, rope, slots, want)
    got = cache.cpu()
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        raise AssertionError(f"{spec.name} {label}: {len(bad)} bytes differ, first at {bad[0].tolist()}")
    kept = slots >= 0
    return want.view(-1, spec.record_bytes)[slots[kept]], kept


@needs_cuda
@pytest.mark.parametrize("kind", ["zero", "tiny", "huge"])
@pytest.mark.parametrize("fmt", ENGINE_FORMATS)
def test_engine_writer_bytes_identical_to_codec_at_the_edges(fmt, kind):
    """Writer bytes == codec bytes where TensorRT-LLM's arithmetic branches (random and heavy inputs are in
    test_writer_bytes_identical_to_codec); the edge must be reached, not only passed through."""
    spec = get_format(fmt)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{fmt}/{kind}".encode()))
    lat, rope = _edge_inputs(kind, 300, gen)
    rec, _ = _kernel_bytes_equal_codec(spec, lat, rope, gen, kind)
    scales = torch.cat([rec[:, c.scale.offset : c.scale.end] for c in (spec.latent, spec.rope)], 1)
    if kind == "tiny":  # zero block scales with nonzero groups: saturated codes (0x7 / 0xF nibbles) are written
        assert bool((scales == 0).any()) and bool(((rec[:, :288] & 0xF) == 0x7).any())
    if kind == "huge":
        assert bool((scales == 0x7E).any())  # 448


# SGLang's KVFP4 record (ties-away E2M1 codes, E8M0 scales 2^ceil(log2(max(amax / 6, 1e-10))) per 16 values)
TIES_AWAY_FORMATS = [f for f in FORMATS if get_format(f).latent.elem_rounding == "ties_away"]
SGLANG_KINDS = ["normal", "heavy", "bf16", "fp32", "zero", "tiny", "huge", "ties"]
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _groups(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """x [t, n] times one factor per 16 values (factor [t, n / 16])."""
    return (x.unflatten(-1, (-1, 16)) * factor.unsqueeze(-1)).flatten(-2)


def _sglang_inputs(kind: str, t: int, gen: torch.Generator):
    """Inputs at the ends of SGLang's arithmetic. bf16 tensors, except `bf16` (float32 holding bf16 values, the
    writer's float32 load) and `fp32` (arbitrary float32: amax / 6 and x / s round in float32). zero: signed
    zeros (the 1e-10 floor, scale byte 94); tiny: group amax 1e-2 .. 1e-13, below the floor's 6e-10 in part,
    with lone tiny negatives beside zeros (code 8, a negative zero, where -0.0 stays code 0); huge: group amax
    up to 3.3e38 (scale exponents to 126; beside 3.3e38, -1e-3 / 2^126 is a negative subnormal, -1e-9 / 2^126
    underflows to -0.0); ties: every value a bound or an E2M1 value times 2^e with the group
    amax 6, 5 or 3 times 2^e (amax / 6 a power of two in part), so x / s lands exactly on the bounds."""
    lat = torch.randn(t, 512, generator=gen)
    rope = torch.randn(t, 64, generator=gen)
    if kind == "heavy":
        lat = lat * torch.exp(2.0 * torch.randn(t, 512, generator=gen))
        rope = rope * torch.exp(2.0 * torch.randn(t, 64, generator=gen))
    elif kind == "fp32":
        lat, rope = lat * torch.exp(3.0 * torch.randn(t, 512, generator=gen)), rope * 1.1
        return lat, rope
    elif kind == "zero":
        lat, rope = torch.zeros_like(lat), torch.zeros_like(rope)
        lat[::2, ::3] = -0.0
        rope[1::2, ::5] = -0.0
    elif kind == "tiny":
        lat = _groups(lat, torch.pow(10.0, -torch.empty(t, 32).uniform_(2, 13, generator=gen)))
        rope = _groups(rope, torch.pow(10.0, -torch.empty(t, 4).uniform_(2, 13, generator=gen)))
        lat[::3, 16:32] = -0.0
        lat[::3, 20] = -1e-13
        rope[::3, :16] = 0.0
        rope[::3, 7] = -3e-13
    elif kind == "huge":
        lat = _groups(lat, torch.pow(10.0, torch.empty(t, 32).uniform_(0, 38, generator=gen)))
        rope = _groups(rope, torch.pow(10.0, torch.empty(t, 4).uniform_(0, 38, generator=gen)))
        lat[:, 5] = 3.3e38
        lat[:, 6] = -1e-3  # x / 2^126: a negative subnormal (code 8)
        lat[:, 7] = -1e-9  # x / 2^126 underflows to -0.0 (code 0)
        rope[:, 60] = -3.3e38
        lat, rope = lat.clamp(-3.3e38, 3.3e38), rope.clamp(-3.3e38, 3.3e38)
    elif kind == "ties":
        values = torch.tensor(_E2M1_BOUNDS + (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))
        tops = torch.tensor([6.0, 5.0, 3.0])

        def tied(n: int) -> torch.Tensor:
            v = values[torch.randint(0, len(values), (t, n), generator=gen)]
            v = torch.where(torch.rand(t, n, generator=gen) < 0.5, -v, v)
            v = v.unflatten(-1, (-1, 16))
            v[..., 0] = tops[torch.randint(0, 3, v.shape[:-1], generator=gen)]  # the group amax
            return (v * torch.exp2(torch.randint(-30, 30, (*v.shape[:-1], 1), generator=gen).float())).flatten(-2)

        lat, rope = tied(512), tied(64)
    lat, rope = lat.to(torch.bfloat16), rope.to(torch.bfloat16)
    if kind == "bf16":
        return lat.float(), rope.float()
    return lat, rope


@needs_cuda
@pytest.mark.parametrize("kind", SGLANG_KINDS)
@pytest.mark.parametrize("fmt", TIES_AWAY_FORMATS)
def test_ties_away_writer_bytes_identical_to_codec(fmt, kind):
    """Writer bytes == codec bytes for SGLang's rounding and scale rule; each edge is checked to be reached."""
    spec = get_format(fmt)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{fmt}/{kind}".encode()))
    lat, rope = _sglang_inputs(kind, 300, gen)
    rec, kept = _kernel_bytes_equal_codec(spec, lat, rope, gen, kind)
    scales = torch.cat([rec[:, c.scale.offset : c.scale.end] for c in (spec.latent, spec.rope)], 1).int()
    codes = torch.stack((rec[:, :288] & 0xF, rec[:, :288] >> 4), -1)
    floor_byte = 127 + math.ceil(math.log2(spec.latent.scale_floor))  # 2^-33 >= 1e-10
    if kind == "zero":
        assert bool((scales == floor_byte).all()) and bool((codes == 0).all())
    if kind == "tiny":
        assert bool((scales == floor_byte).any()) and bool((codes == 8).any())
    if kind == "huge":
        assert int(scales.max()) >= 127 + 120
        assert bool((codes[:, 3, 0] == 8).all()) and bool((codes[:, 3, 1] == 0).all())  # values 6 and 7
    if kind == "ties":  # the groups' values divided by their scale sit on the bounds: ties are exercised
        x = torch.cat([lat, rope], 1).float()[kept]
        s = torch.exp2(scales.float() - 127).repeat_interleave(16, 1)
        assert bool(torch.isin((x / s).abs(), torch.tensor(_E2M1_BOUNDS)).float().mean() > 0.2)


@needs_cuda
@pytest.mark.parametrize("fmt", REFERENCE_ONLY + [ODD_GROUP.name])
def test_formats_outside_the_kernels_fall_back_to_the_reference(fmt):
    """auto picks the torch reference (bytes = codec), an explicit kernel request is a clear error."""
    from mla_eval.attention import dispatch
    from mla_eval.errors import UserError

    spec = ODD_GROUP if fmt == ODD_GROUP.name else get_format(fmt)
    assert not _has_kernel(spec)
    gen = torch.Generator().manual_seed(3)
    lat, rope = _inputs("random", 32, gen)
    slots = torch.arange(32)
    cache = torch.zeros(1, BLOCK, spec.record_bytes, dtype=torch.uint8, device="cuda")
    dispatch.write_cache(spec, lat.cuda(), rope.cuda(), slots.cuda(), cache, backend="auto")
    assert torch.equal(cache.cpu().view(BLOCK, -1)[:32], encode(spec, lat.float(), rope.float()))
    with pytest.raises(UserError, match="outside the kernels' scope"):
        dispatch.write_cache(spec, lat.cuda(), rope.cuda(), slots.cuda(), cache, backend="kernel")


@needs_cuda
def test_writer_takes_float32_input():
    from mla_eval.attention import dispatch

    spec = get_format("nvfp4_fp8rope")
    gen = torch.Generator().manual_seed(1)
    lat, rope = torch.randn(64, 512, generator=gen), torch.randn(64, 64, generator=gen)
    cache = torch.zeros(1, BLOCK, spec.record_bytes, dtype=torch.uint8, device="cuda")
    dispatch.write_cache(spec, lat.cuda(), rope.cuda(), torch.arange(64).cuda(), cache, outer_scale=0.1, backend="kernel")
    assert torch.equal(cache.cpu().view(64, -1), encode(spec, lat, rope, outer_scale=0.1))


# ---------------------------------------------------------------------------------- attention
def _random_cache(spec, blocks, gen, outer_scale=None):
    """Every slot holds fresh random latent/rope (written by the reference codec)."""
    t = blocks * BLOCK
    lat = torch.randn(t, 512, generator=gen).to(torch.bfloat16)
    rope = torch.randn(t, 64, generator=gen).to(torch.bfloat16)
    cache = torch.zeros(blocks, BLOCK, spec.record_bytes, dtype=torch.uint8)
    reference.write_cache(spec, lat, rope, torch.arange(t), cache, outer_scale=outer_scale)
    return cache.cuda()


def _bound(spec, q, cache, slots, scale, outer_scale):
    """The bf16 error bound of the module docstring, from the actual data."""
    flat = cache.view(-1, spec.record_bytes)
    lat, rope = decode(spec, flat, outer_scale=outer_scale)
    k = torch.cat([lat, rope], -1)
    exact = bool(torch.equal(k, k.to(torch.bfloat16).float()))
    vmax = float(lat.abs().max())
    if exact:
        return 1.5 * vmax * U_BF16 + 1e-5
    qa = q.float().abs()
    ka = k.abs()
    worst = 0.0
    for i in range(q.shape[0]):
        s = slots[i][slots[i] >= 0]
        if len(s):
            worst = max(worst, float((qa[i] @ ka[s.long()].T).max()))
    delta = U_BF16 * scale * worst
    return 1.5 * vmax * (2 * U_BF16 + math.expm1(2 * delta)) + 1e-5


def _check(out, lse, ref_out, ref_lse, bound, label):
    assert not torch.isnan(out).any(), f"{label}: NaN in out (unwritten or 0/0)"
    assert not torch.isnan(lse).any(), f"{label}: NaN in lse"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"{label}: -inf rows differ"
    empty = torch.isneginf(ref_lse)
    assert torch.all(out[empty] == 0), f"{label}: rows without keys must be 0"
    err = float((out - ref_out).abs().max())
    a, b = out.flatten().double(), ref_out.flatten().double()
    cos = float(a @ b / (a.norm() * b.norm()).clamp_min(1e-300)) if float(b.norm()) > 0 else 1.0
    assert cos >= 0.9999, f"{label}: cosine {cos}"
    assert err <= bound, f"{label}: max abs error {err} > bound {bound}"
    fin = ~empty
    lerr = float((lse[fin] - ref_lse[fin]).abs().max()) if bool(fin.any()) else 0.0
    assert lerr <= 0.05, f"{label}: lse error {lerr}"
    print(f"{label}: cos={cos:.7f} max_abs={err:.3e} bound={bound:.3e} lse_err={lerr:.2e}")


def _run(spec, q, cache, scale, *, sink=None, outer_scale=None, num_splits=None, tile=None, tuning=None, **lists):
    from mla_eval_kernels.cute import launch as kernel

    n, h = q.shape[:2]
    out = torch.full((n, h, 512), float("nan"), device="cuda")
    lse = torch.full((n, h), float("nan"), device="cuda")
    kernel.mla_attention(
        plan_for(spec), q, cache, softmax_scale=scale, sink=sink, outer_scale=outer_scale,
        block_table=lists.get("block_table"), seq_lens=lists.get("seq_lens"), indices=lists.get("indices"),
        num_splits=num_splits, out=out, lse=lse, workspace_fill=float("nan"), tile=tile,
        tuning=tuning,
    )
    torch.cuda.synchronize()
    return out, lse


def _dense_lists(gen, lengths, blocks):
    rows = [torch.randperm(blocks, generator=gen)[: -(-max(lengths) // BLOCK)] for _ in lengths]
    table = torch.stack(rows).to(torch.int32)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    slots = reference.dense_slots(table, seq_lens, BLOCK)
    return table, seq_lens, slots


def _sparse_lists(gen, n, topk, num_slots):
    idx = torch.randint(0, num_slots, (n, topk), generator=gen, dtype=torch.int32)
    idx[0, topk // 3 :] = -1  # -1 padded top-k
    idx[1, :] = -1  # all invalid
    idx[2, ::5] = num_slots + 3  # out of range
    idx[3, 1:] = -1  # single valid key
    valid = (idx >= 0) & (idx < num_slots)
    return idx, torch.where(valid, idx, -1)


# every format at h=16; every head count (8..128) on nvfp4; the other M=64 tiles (bf16 copies its
# records straight into a double-buffered K tile, fp8_ds_mla uses 32-slot tiles there)
CASES = [(f, 16) for f in FORMATS] + [("nvfp4", h) for h in (8, 32, 64, 128)] + [("bf16", 128), ("fp8_ds_mla", 128)]
CASES += [(f, 64) for f in ENGINE_FORMATS + TIES_AWAY_FORMATS]  # the 4 x 2 warp tile over 4-byte record chunks
# both kernel generations on every case (v2 at h <= 16: the narrow tile where two CTAs fit an SM,
# `attention_tuning.launch_choice`); v2 also on the 8-warp h <= 16 tile, and on the narrow tile with
# two tiles in flight for every format (whether or not it is the default there)
VERSION_CASES = (
    [(f, h, v) for f, h in CASES for v in attention_tuning.VERSIONS]
    + [(f, 16, "v2-wide") for f in FORMATS]
    + [(f, 16, "v2-narrow") for f in FORMATS]
)


@needs_cuda
@pytest.mark.parametrize("mode", ["dense", "sparse"])
@pytest.mark.parametrize("fmt,heads,version", VERSION_CASES)
def test_attention_matches_reference(fmt, heads, mode, version, monkeypatch):
    monkeypatch.setenv(attention_tuning.ENV, version.split("-")[0])  # v1: the fallback kernel, v2: issue 14's
    tile = tuning = None
    if version == "v2-narrow":
        tile = attention_tuning.NARROW_TILE
        tuning = dataclasses.replace(
            attention_tuning.default_tuning(plan_for(get_format(fmt)), tile, "v2"), prefetch=attention_tuning.NARROW_PREFETCH
        )
    elif version == "v2-wide":
        tile = (16, 1, 8, 64)
        tuning = attention_tuning.default_tuning(plan_for(get_format(fmt)), tile, "v2")
    spec = get_format(fmt)
    gen = torch.Generator().manual_seed(zlib.crc32(f'{fmt}/{heads}/{mode}'.encode()))
    blocks = 24
    s_l = 0.05 if spec.outer_scale is not None else None
    cache = _random_cache(spec, blocks, gen, outer_scale=s_l)
    scale = 576**-0.5
    sink = torch.randn(heads, generator=gen).cuda() if mode == "sparse" else None  # sink on / off
    if mode == "dense":
        lengths = [1, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 17, 1000]
        table, seq_lens, slots = _dense_lists(gen, lengths, blocks)
        lists = dict(block_table=table.cuda(), seq_lens=seq_lens.cuda())
    else:
        idx, slots = _sparse_lists(gen, 6, 300, blocks * BLOCK)
        lists = dict(indices=idx.cuda())
    q = torch.randn(len(slots), heads, 576, generator=gen).to(torch.bfloat16).cuda()
    ref_out, ref_lse = reference.mla_attention(spec, q, cache, softmax_scale=scale, sink=sink, outer_scale=s_l, **lists)
    bound = _bound(spec, q.cpu(), cache.cpu(), slots, scale, s_l)
    # the split-KV heuristic (partials + combine); nvfp4 and the engine formats also with one CTA per query
    for splits in ((1, None) if fmt == "nvfp4" or fmt in ENGINE_FORMATS + TIES_AWAY_FORMATS else (None,)):
        out, lse = _run(spec, q, cache, scale, sink=sink, outer_scale=s_l, num_splits=splits, tile=tile, tuning=tuning, **lists)
        _check(out, lse, ref_out, ref_lse, bound, f"{fmt} h={heads} {mode} splits={splits} {version}")


@needs_cuda
def test_attention_all_invalid_with_and_without_sink():
    spec = get_format("nvfp4")
    cache = _random_cache(spec, 2, torch.Generator().manual_seed(0))
    q = torch.randn(3, 16, 576).to(torch.bfloat16).cuda()
    for sink in (None, torch.full((16,), 2.0, device="cuda")):
        for splits in (1, 3):
            out, lse = _run(
                spec, q, cache, 0.1, sink=sink, num_splits=splits, indices=torch.full((3, 200), -1, dtype=torch.int32).cuda()
            )
            assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    zero = torch.zeros(3, dtype=torch.int32).cuda()
    out, lse = _run(spec, q, cache, 0.1, block_table=torch.zeros(3, 1, dtype=torch.int32).cuda(), seq_lens=zero)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


# ---------------------------------------------------------------------------------- compile keys
@needs_cuda
def test_scale_mode_or_s_l_change_never_reuses_a_kernel():
    """A kernel compiled for one scale setting must never serve another (the s_l = 1.0 bug)."""
    from mla_eval.attention import dispatch
    from mla_eval_kernels.cute import cache_writer

    gen = torch.Generator().manual_seed(7)
    lat, rope = _inputs("random", 64, gen)
    slots = torch.arange(64)
    keys_before = set(compile_cache.keys())
    results = {}
    for fmt, s_l in [("nvfp4", None), ("nvfp4", 1.0), ("nvfp4", 0.02), ("nvfp4", 3.0),
                     ("fp8_ds_mla", None), ("fp8_ds_mla_pow2", None), ("nvfp4_fp8rope", None), ("nvfp4_fp8rope_st", None),
                     ("nvfp4_fp8_ds_mla", None), ("trtllm_nvfp4_dsa", None), ("sglang_fp4_e2m1", None)]:
        spec = get_format(fmt)
        cache = torch.zeros(1, BLOCK, spec.record_bytes, dtype=torch.uint8, device="cuda")
        dispatch.write_cache(spec, lat.cuda(), rope.cuda(), slots.cuda(), cache, outer_scale=s_l, backend="kernel")
        got = cache.cpu().view(64, -1)
        assert torch.equal(got, encode(spec, lat, rope, outer_scale=s_l)), f"{fmt} s_l={s_l}"
        results[(fmt, s_l)] = got
    assert not torch.equal(results[("nvfp4", 1.0)], results[("nvfp4", 0.02)])
    assert not torch.equal(results[("fp8_ds_mla", None)], results[("fp8_ds_mla_pow2", None)])
    dev = torch.device("cuda")
    k = {name: cache_writer.compile_key(plan_for(get_format(name)), torch.bfloat16, o, dev)
         for name, o in [("nvfp4", False), ("fp8_ds_mla", False), ("fp8_ds_mla_pow2", False), ("nvfp4_fp8_ds_mla", False),
                         ("trtllm_nvfp4_dsa", False), ("sglang_fp4_e2m1", False)]}
    assert len(set(k.values())) == 6
    assert cache_writer.compile_key(plan_for(get_format("nvfp4")), torch.bfloat16, True, dev) != k["nvfp4"]
    new = set(compile_cache.keys()) - keys_before
    assert all(key in compile_cache.keys() for key in k.values())
    assert len(new) <= 9  # one writer per (format, outer on/off) at most, never one per s_l value

    # attention: outer scale on/off and two s_l values over the same records
    spec = get_format("nvfp4")
    cache = _random_cache(spec, 4, gen)
    idx = torch.randint(0, 4 * BLOCK, (4, 128), generator=gen, dtype=torch.int32).cuda()
    q = torch.randn(4, 16, 576, generator=gen).to(torch.bfloat16).cuda()
    for s_l in (None, 1.0, 0.02, 7.5):
        out, lse = _run(spec, q, cache, 0.05, outer_scale=s_l, num_splits=1, indices=idx)
        ref_out, ref_lse = reference.mla_attention(spec, q, cache, softmax_scale=0.05, indices=idx, outer_scale=s_l)
        _check(out, lse, ref_out, ref_lse, 1e9, f"nvfp4 s_l={s_l}")
        rel = float((out - ref_out).abs().max() / ref_out.abs().max())
        assert rel < 0.02, f"s_l={s_l}: relative error {rel} (stale specialisation?)"


# ---------------------------------------------------------------------------------- long launches
@needs_cuda
@pytest.mark.parametrize("version", attention_tuning.VERSIONS)
def test_more_queries_than_a_grid_dimension_of_65535(version, monkeypatch):
    """131,077 queries (prefill-as-decode, 2 heads): the first kernel put queries in grid z (limit
    65535) and a 64K kld window failed to launch (issue 17). Every row is written (NaN poison), rows
    on both sides of 65535 / 65536 / 131072 match the reference, with and without KV splits."""
    monkeypatch.setenv(attention_tuning.ENV, version)
    spec = get_format("nvfp4")
    gen = torch.Generator().manual_seed(17)
    blocks = 4
    cache = _random_cache(spec, blocks, gen)
    n, h = 131072 + 5, 2
    lengths = torch.arange(n, dtype=torch.int32) % (blocks * BLOCK) + 1  # 1..256 keys, wrapping
    table = torch.randperm(blocks, generator=gen).to(torch.int32).repeat(n, 1)
    q = torch.randn(n, h, 576, generator=gen).to(torch.bfloat16).cuda()
    picks = torch.tensor([0, 1, 255, 256, 65534, 65535, 65536, 65537, 131071, 131072, n - 1])
    picks = torch.cat([picks, torch.randint(0, n, (21,), generator=gen)])
    ref_out, ref_lse = reference.mla_attention(
        spec, q[picks.cuda()], cache, softmax_scale=0.07, block_table=table[picks].cuda(), seq_lens=lengths[picks].cuda()
    )
    slots = reference.dense_slots(table[picks], lengths[picks], BLOCK)
    bound = _bound(spec, q[picks.cuda()].cpu(), cache.cpu(), slots, 0.07, None)
    for splits in (1, 2):
        out, lse = _run(spec, q, cache, 0.07, num_splits=splits, block_table=table.cuda(), seq_lens=lengths.cuda())
        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"splits={splits}: unwritten rows"
        _check(out[picks.cuda()], lse[picks.cuda()], ref_out, ref_lse, bound, f"n={n} splits={splits} {version}")


@needs_cuda
def test_writer_past_a_grid_dimension_of_65535():
    """262,147 tokens (65,537 CTAs of 4 warps): sampled records are the codec's bytes."""
    from mla_eval.attention import dispatch

    spec = get_format("nvfp4")
    gen = torch.Generator().manual_seed(18)
    t = 4 * 65536 + 3
    lat, rope = _inputs("random", t, gen)
    cache = torch.zeros(-(-t // BLOCK), BLOCK, spec.record_bytes, dtype=torch.uint8, device="cuda")
    slots = torch.randperm(t, generator=gen)
    dispatch.write_cache(spec, lat.cuda(), rope.cuda(), slots.cuda(), cache, backend="kernel")
    picks = torch.cat([torch.tensor([0, 1, 65535 * 4, 65536 * 4, t - 1]), torch.randint(0, t, (59,), generator=gen)])
    got = cache.view(-1, spec.record_bytes)[slots[picks].cuda()].cpu()
    assert torch.equal(got, encode(spec, lat[picks], rope[picks]))
