"""Our own DSA indexer top-k (mla_eval.model.indexer) vs the installed transformers' stock indexer."""

import pytest
import torch
from tiny_models import preset_model

from mla_eval.model.indexer import indexer_topk


def _indexer_inputs(model, seq, seed):
    """The hidden states, q residual and rope of layer 0's attention for a random window."""
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, seq, model.config.hidden_size, generator=g)
    pos = torch.arange(seq).unsqueeze(0)
    cos_sin = model.model.rotary_emb(hidden, pos)
    q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden))
    return attn, hidden, q_resid, cos_sin, pos


@pytest.mark.parametrize("preset", ["deepseek-v3.2", "glm-5"])
def test_owned_topk_selects_the_stock_indexers_keys(preset):
    """Preset indexer geometry (64 x 128 / 32 x 128 heads, rope on the first 64 dims, half-split vs
    interleaved), top-k 48 over 96 keys so late queries really choose. Compared as index sets per
    query over visible keys (the order of equal scores is not defined)."""
    seq, k = 96, 48
    model = preset_model(preset, layers=1, index_topk=k)
    attn, hidden, q_resid, cos_sin, pos = _indexer_inputs(model, seq, seed=1)
    mask = torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1).unsqueeze(0)  # the eager causal mask
    with torch.no_grad():
        stock = attn.indexer(hidden, q_resid, cos_sin, mask, pos)  # positional: the keyword after it was renamed
        ours = indexer_topk(attn.indexer, model.config.model_type, hidden, q_resid, cos_sin, k)
    assert ours.shape == stock.shape == (1, seq, k) and ours.dtype == torch.int32
    for t in range(seq):
        visible = lambda idx: sorted(i for i in idx.tolist() if i <= t)  # noqa: E731
        assert visible(ours[0, t]) == visible(stock[0, t]), f"query {t}"
    assert len(visible(ours[0, seq - 1])) == k  # the last query saw 96 keys and kept 48


def test_rope_variant_matters():
    """The two architectures rotate differently: swapping the variant changes the selection, so the
    equality above really checks which rotation each architecture uses."""
    seq, k = 96, 24
    model = preset_model("glm-5", layers=1, index_topk=k)
    attn, hidden, q_resid, cos_sin, _ = _indexer_inputs(model, seq, seed=2)
    with torch.no_grad():
        glm = indexer_topk(attn.indexer, "glm_moe_dsa", hidden, q_resid, cos_sin, k)
        half = indexer_topk(attn.indexer, "deepseek_v32", hidden, q_resid, cos_sin, k)
    assert not torch.equal(glm.sort(-1).values, half.sort(-1).values)


def test_score_blocks_do_not_change_the_selection(monkeypatch):
    import mla_eval.model.indexer as ix

    model = preset_model("deepseek-v3.2", layers=1, index_topk=16)
    attn, hidden, q_resid, cos_sin, _ = _indexer_inputs(model, 40, seed=3)
    with torch.no_grad():
        whole = ix.indexer_topk(attn.indexer, "deepseek_v32", hidden, q_resid, cos_sin, 16)
        monkeypatch.setattr(ix, "_SCORE_BLOCK_BYTES", 4 * 64 * 40 * 7)  # 7 query rows per block
        blocked = ix.indexer_topk(attn.indexer, "deepseek_v32", hidden, q_resid, cos_sin, 16)
    assert torch.equal(whole, blocked)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["deepseek-v3.2", "glm-5.2"])
def test_owned_topk_at_the_published_top_k(preset):
    """The published top-k (2048) over 2100 keys: queries past 2048 really drop keys, and the
    selection equals the stock indexer's (compared on the last 52 queries, the ones that choose)."""
    seq = 2100
    model = preset_model(preset, layers=1)
    assert model.config.index_topk == 2048
    attn, hidden, q_resid, cos_sin, pos = _indexer_inputs(model, seq, seed=4)
    mask = torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1).unsqueeze(0)
    with torch.no_grad():
        stock = attn.indexer(hidden, q_resid, cos_sin, mask, pos)
        ours = indexer_topk(attn.indexer, model.config.model_type, hidden, q_resid, cos_sin, 2048)
    for t in range(2048, seq):
        got, want = ours[0, t].sort().values, stock[0, t].sort().values
        assert torch.equal(got, want), f"query {t}"
        assert int((got <= t).sum()) == 2048 < t + 1
