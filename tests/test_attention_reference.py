"""CPU tests of the torch reference (writer + MLA attention over the paged cache) and of dispatch.

The oracle is a naive float64 attention written from the definition, one query at a time, over
the records decoded by the codec.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from mla_eval.attention import dispatch, reference
from mla_eval.errors import UserError
from mla_eval.formats import decode, encode, get_format

BLOCK = 16


def _fill_cache(spec, num_blocks, gen, outer_scale=None):
    """A cache whose every slot holds the encoding of fresh random latent/rope."""
    t = num_blocks * BLOCK
    latent = torch.randn(t, 512, generator=gen).to(torch.bfloat16)
    rope = torch.randn(t, 64, generator=gen).to(torch.bfloat16)
    cache = torch.zeros(num_blocks, BLOCK, spec.record_bytes, dtype=torch.uint8)
    reference.write_cache(spec, latent, rope, torch.randperm(t, generator=gen), cache, outer_scale=outer_scale)
    return cache


def _naive(spec, q, cache, slot_lists, scale, sink=None, outer_scale=None):
    """float64 attention from the definition; slot_lists[n] = python list of valid slot ids."""
    n, h, _ = q.shape
    out = torch.zeros(n, h, 512, dtype=torch.float64)
    lse = torch.full((n, h), -math.inf, dtype=torch.float64)
    flat = cache.view(-1, spec.record_bytes)
    for i, slots in enumerate(slot_lists):
        if not slots:
            continue
        lat, rope = decode(spec, flat[torch.tensor(slots)], outer_scale=outer_scale)
        k = torch.cat([lat, rope], -1).double()
        s = q[i].double() @ k.T * scale  # [H, L]
        m = s.max(dim=1, keepdim=True).values
        e = torch.exp(s - m)
        denom = e.sum(1, keepdim=True)
        lse[i] = (m + torch.log(denom)).squeeze(1)
        if sink is not None:
            denom = denom + torch.exp(sink.double().view(h, 1) - m)
        out[i] = (e @ lat.double()) / denom
    return out, lse


def _dense_case(gen, n, lengths, num_blocks, blocks_per_seq):
    """Block tables (shuffled blocks, one row per query) and seq_lens for the given lengths."""
    rows = [torch.randperm(num_blocks, generator=gen)[:blocks_per_seq] for _ in range(n)]
    table = torch.stack(rows).to(torch.int32)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    lists = [[int(table[i, j // BLOCK]) * BLOCK + j % BLOCK for j in range(lengths[i])] for i in range(n)]
    return table, seq_lens, lists


def _close(out, lse, ref_out, ref_lse):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-5, atol=2e-5)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla", "nvfp4", "nvfp4_fp8rope_st", "mxfp4", "fp8_e4m3"])
@pytest.mark.parametrize("heads", [8, 16, 128])
def test_dense_matches_float64(fmt, heads):
    gen = torch.Generator().manual_seed(zlib.crc32(f'{fmt}/{heads}'.encode()))
    spec = get_format(fmt)
    cache = _fill_cache(spec, 12, gen)
    lengths = [1, BLOCK - 1, BLOCK + 1, 3 * BLOCK, 2 * BLOCK + 5]  # single token, not multiples of the block
    table, seq_lens, lists = _dense_case(gen, len(lengths), lengths, 12, 3)
    q = torch.randn(len(lengths), heads, 576, generator=gen).to(torch.bfloat16)
    scale = 576**-0.5
    out, lse = reference.mla_attention(spec, q, cache, softmax_scale=scale, block_table=table, seq_lens=seq_lens)
    _close(out, lse, *_naive(spec, q, cache, lists, scale))


@pytest.mark.parametrize("with_sink", [False, True])
def test_sparse_padding_out_of_range_and_duplicates(with_sink):
    gen = torch.Generator().manual_seed(3)
    spec = get_format("nvfp4")
    cache = _fill_cache(spec, 8, gen)
    num_slots = 8 * BLOCK
    idx = torch.randint(0, num_slots, (5, 40), generator=gen, dtype=torch.int32)
    idx[0, 30:] = -1  # padded top-k
    idx[1, ::3] = num_slots + 7  # out of range: invalid
    idx[2, 1] = idx[2, 0]  # duplicate: counted twice
    idx[3, :] = -1  # all invalid
    idx[4, 1:] = -1  # a single valid key
    lists = [[int(s) for s in row if 0 <= int(s) < num_slots] for row in idx]
    q = torch.randn(5, 16, 576, generator=gen).to(torch.bfloat16)
    sink = torch.randn(16, generator=gen) if with_sink else None
    out, lse = reference.mla_attention(spec, q, cache, softmax_scale=0.07, indices=idx, sink=sink)
    _close(out, lse, *_naive(spec, q, cache, lists, 0.07, sink=sink))
    assert torch.all(out[3] == 0) and torch.all(lse[3] == -math.inf)


@pytest.mark.parametrize("with_sink", [False, True])
def test_all_invalid_and_empty_rows_give_zeros_and_neg_inf(with_sink):
    spec = get_format("fp8_ds_mla")
    cache = torch.zeros(2, BLOCK, spec.record_bytes, dtype=torch.uint8)
    q = torch.randn(3, 8, 576).to(torch.bfloat16)
    sink = torch.full((8,), 3.0) if with_sink else None
    out, lse = reference.mla_attention(spec, q, cache, softmax_scale=0.1, indices=torch.full((3, 8), -1), sink=sink)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)
    table = torch.zeros(3, 1, dtype=torch.int32)
    out, lse = reference.mla_attention(
        spec, q, cache, softmax_scale=0.1, block_table=table, seq_lens=torch.tensor([0, 1, 0], dtype=torch.int32), sink=sink
    )
    assert torch.all(out[[0, 2]] == 0) and torch.all(lse[[0, 2]] == -math.inf)
    assert torch.isfinite(lse[1]).all() and not torch.isnan(out).any()


def test_sink_only_changes_the_denominator():
    gen = torch.Generator().manual_seed(5)
    spec = get_format("bf16")
    cache = _fill_cache(spec, 4, gen)
    idx = torch.randint(0, 4 * BLOCK, (2, 20), generator=gen)
    q = torch.randn(2, 8, 576, generator=gen).to(torch.bfloat16)
    sink = torch.randn(8, generator=gen)
    o0, l0 = reference.mla_attention(spec, q, cache, softmax_scale=0.05, indices=idx)
    o1, l1 = reference.mla_attention(spec, q, cache, softmax_scale=0.05, indices=idx, sink=sink)
    torch.testing.assert_close(l0, l1)  # the lse is over keys only
    factor = 1.0 / (1.0 + torch.exp(sink.view(1, 8) - l0))  # sum_j e^s / (sum_j e^s + e^sink)
    torch.testing.assert_close(o1, o0 * factor.unsqueeze(-1), rtol=1e-5, atol=1e-6)


def test_outer_scale_is_applied_on_read():
    gen = torch.Generator().manual_seed(9)
    spec = get_format("nvfp4")
    cache = _fill_cache(spec, 4, gen, outer_scale=0.01)
    idx = torch.arange(4 * BLOCK).view(2, -1)
    q = torch.randn(2, 8, 576, generator=gen).to(torch.bfloat16)
    lists = [row.tolist() for row in idx]
    out, lse = reference.mla_attention(spec, q, cache, softmax_scale=0.04, indices=idx, outer_scale=0.01)
    _close(out, lse, *_naive(spec, q, cache, lists, 0.04, outer_scale=0.01))


def test_dense_slots_follow_the_block_table():
    table = torch.tensor([[3, 0, 2], [1, 1, 1]], dtype=torch.int32)
    slots = reference.dense_slots(table, torch.tensor([BLOCK + 2, 1], dtype=torch.int32), BLOCK)
    assert slots.shape == (2, BLOCK + 2)
    assert slots[0, :BLOCK].tolist() == list(range(3 * BLOCK, 4 * BLOCK))
    assert slots[0, BLOCK:].tolist() == [0, 1]
    assert slots[1].tolist() == [BLOCK] + [-1] * (BLOCK + 1)


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_fp8rope_st", "fp8_ds_mla_pow2", "mxfp4", "fp8_e4m3", "bf16"])
def test_reference_writer_scatters_codec_bytes(fmt):
    gen = torch.Generator().manual_seed(11)
    spec = get_format(fmt)
    latent = torch.randn(10, 512, generator=gen).to(torch.bfloat16)
    rope = torch.randn(10, 64, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([5, -1, 0, 17, -3, 9, 31, 2, 30, 1])
    cache = torch.full((2, BLOCK, spec.record_bytes), 0xAB, dtype=torch.uint8)
    reference.write_cache(spec, latent, rope, slots, cache)
    flat = cache.view(-1, spec.record_bytes)
    expect = encode(spec, latent, rope)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], expect[t])
    untouched = sorted(set(range(2 * BLOCK)) - {s for s in slots.tolist() if s >= 0})
    assert torch.all(flat[untouched] == 0xAB)


def test_dispatch_uses_the_reference_on_cpu():
    gen = torch.Generator().manual_seed(13)
    spec = get_format("nvfp4")
    cache = _fill_cache(spec, 4, gen)
    q = torch.randn(3, 8, 576, generator=gen).to(torch.bfloat16)
    table, seq_lens, _ = _dense_case(gen, 3, [5, 20, 33], 4, 3)
    got = dispatch.mla_attention_dense(spec, q, cache, block_table=table, seq_lens=seq_lens, softmax_scale=0.1)
    want = reference.mla_attention(spec, q, cache, softmax_scale=0.1, block_table=table, seq_lens=seq_lens)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert dispatch.kernel_status(spec, "cpu")[0] is False
    with pytest.raises(UserError, match="--backend kernel"):
        dispatch.mla_attention_sparse(
            spec, q, cache, indices=torch.zeros(3, 4, dtype=torch.int32), softmax_scale=0.1, backend="kernel"
        )
    with dispatch.use_backend("reference") as log:
        dispatch.mla_attention_dense(spec, q, cache, block_table=table, seq_lens=seq_lens, softmax_scale=0.1)
    assert log.backend == "reference" and log.paths == {"attend nvfp4 on cpu": "reference (asked for)"}
    with pytest.raises(UserError, match="not a backend"):
        with dispatch.use_backend("bogus"):
            pass
