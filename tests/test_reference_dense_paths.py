"""The reference's shared-row dense path equals its general per-query path."""

import pytest
import torch

from mla_eval.attention import reference
from mla_eval.formats import encode, get_format


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "fp8_ds_mla"])
@pytest.mark.parametrize("sink", [False, True])
def test_shared_rows_equal_one_query_at_a_time(fmt, sink):
    g = torch.Generator().manual_seed(7)
    spec = get_format(fmt)
    bs, nblocks, h = 16, 6, 8
    cache = torch.zeros(nblocks, bs, spec.record_bytes, dtype=torch.uint8)
    lat, rope = torch.randn(nblocks * bs, 512, generator=g), torch.randn(nblocks * bs, 64, generator=g)
    cache.view(-1, spec.record_bytes)[:] = encode(spec, lat, rope)
    # two sequences (blocks 0-2 and 3-5), causal lengths, one empty row
    table = torch.tensor([[0, 1, 2]] * 5 + [[3, 4, 5]] * 4, dtype=torch.int32)
    lens = torch.tensor([1, 7, 16, 33, 48, 0, 5, 20, 41], dtype=torch.int32)
    q = torch.randn(9, h, 576, generator=g)
    s = torch.randn(h, generator=g) if sink else None
    out, lse = reference.mla_attention(spec, q, cache, softmax_scale=0.05, block_table=table, seq_lens=lens, sink=s)
    # Same math, different matmul batching: float32 reassociation leaves ~1e-6 absolute noise on
    # O(1) outputs (seen: 1.2e-6), so the bound is a few ulps of the summed values, not 1e-6.
    for i in range(9):
        o1, l1 = reference.mla_attention(
            spec, q[i : i + 1], cache, softmax_scale=0.05, block_table=table[i : i + 1], seq_lens=lens[i : i + 1], sink=s
        )
        torch.testing.assert_close(out[i : i + 1], o1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[i : i + 1], l1, rtol=1e-5, atol=1e-5)
    assert torch.isinf(lse[5]).all() and (out[5] == 0).all()


def test_dispatch_takes_the_codecs_outer_scale_rules():
    """The kernel path validates s_l with the codec's one rule set, then passes one float32."""
    from mla_eval.attention.dispatch import _outer_scale_value
    from mla_eval.errors import UserError

    nvfp4, fp8 = get_format("nvfp4"), get_format("fp8_ds_mla")
    assert _outer_scale_value(nvfp4, None) is None
    assert _outer_scale_value(nvfp4, 0.1) == float(torch.tensor(0.1, dtype=torch.float32))
    for bad, match in (
        (-1.0, "positive and finite"), (float("nan"), "positive and finite"), (torch.tensor([0.1, 0.2]), "one outer scale")
    ):
        with pytest.raises(UserError, match=match):
            _outer_scale_value(nvfp4, bad)
    with pytest.raises(UserError, match="takes no outer scale"):
        _outer_scale_value(fp8, 1.0)
