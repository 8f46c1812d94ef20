"""Per-layer error statistics: on DSA models the reference reads the same top-k keys as the model."""

import torch
from tiny_models import preset_model

from mla_eval.evals.layer_stats import LayerStats, exact_attention
from mla_eval.formats import get_format
from mla_eval.model.adapter import MlaAdapter
from mla_eval.model.session import CacheSession


def test_topk_over_every_visible_key_is_dense_attention():
    g = torch.Generator().manual_seed(0)
    b, t, h, s = 2, 5, 3, 9
    q, lat, rope = torch.randn(b, t, h, 576, generator=g), torch.randn(b, s, 512, generator=g), torch.randn(b, s, 64, generator=g)
    dense = exact_attention(q, lat, rope, 0.05)
    # every position 0..s-1 listed (future ones included, as an indexer's top-k can be), plus -1 padding
    everything = torch.cat([torch.arange(s).expand(b, t, s), torch.full((b, t, 2), -1)], -1)
    assert torch.allclose(exact_attention(q, lat, rope, 0.05, topk=everything), dense, atol=1e-6)
    one = torch.full((b, t, 1), 2)  # only position 2: the output is exactly its latent
    assert torch.allclose(exact_attention(q, lat, rope, 0.05, topk=one), lat[:, 2:3, None, :].expand(b, t, h, 512))


def _stats(model, fmt, ids, dense_reference=False):
    adapter = MlaAdapter(model)
    stats = LayerStats(adapter.num_layers)
    observe = stats.observers(get_format(fmt))[0]

    def observer(ev):
        if dense_reference:
            ev.topk = None  # what the statistics did before: dense attention as the reference
        observe(ev)

    s = CacheSession(get_format(fmt), adapter.num_layers, 1, ids.shape[1], "cpu", observers=(observer,), keep_exact=True)
    with torch.no_grad(), adapter.session(s):
        model(ids)
    assert adapter.sparse_read_counts()[0] < adapter.sparse_read_counts()[1]
    return stats.summary()


def test_dsa_layer_error_is_the_formats_alone():
    """bf16 on a DSA model with ctx 80 > top-k 16: against the same top-k keys the error is bf16
    rounding (tiny); against dense attention it would be dominated by what the indexer left out."""
    model = preset_model("glm-5", layers=1, index_topk=16)
    ids = torch.randint(0, 320, (1, 80), generator=torch.Generator().manual_seed(1))
    same_keys = _stats(model, "bf16", ids)
    dense = _stats(model, "bf16", ids, dense_reference=True)
    nvfp4 = _stats(model, "nvfp4", ids)
    for row, d, n in zip(same_keys, dense, nvfp4):
        assert row["attn_rel_l2"] < 0.01 < d["attn_rel_l2"]
        assert row["attn_rel_l2"] < n["attn_rel_l2"] < d["attn_rel_l2"]
