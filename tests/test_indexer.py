"""Our own DSA indexer top-k (mla_eval.model.indexer) vs the installed transformers' stock indexer."""

import functools

import pytest
import torch
from tiny_models import preset_model

from mla_eval.model.indexer import SCORE_BLOCK_BYTES, index_score_blocks, indexer_topk


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


def _ties_window(model, seq, period=5, batch=1, seed=3):
    """Hidden rows repeating with `period` and an identity rotation (cos 1, sin 0): keys t and t + period are the
    same vector, so every query's scores tie in groups (exactly: the same products summed in the same order)."""
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(batch, period, model.config.hidden_size, generator=g)
    hidden = base.repeat(1, -(-seq // period), 1)[:, :seq]
    rope = model.config.qk_rope_head_dim
    cos_sin = (torch.ones(batch, seq, rope), torch.zeros(batch, seq, rope))
    return attn, hidden, attn.q_a_layernorm(attn.q_a_proj(hidden)), cos_sin


def _topk(attn, model_type, hidden, q_resid, cos_sin, k, block_bytes):
    with torch.no_grad():
        return indexer_topk(attn.indexer, model_type, hidden, q_resid, cos_sin, k, block_bytes=block_bytes)


UNCHUNKED = 1 << 62  # one block: the whole [B, S, H, S] score tensor at once


@functools.lru_cache(maxsize=None)
def _one_layer(preset):
    """One model per preset for the chunking tests (the top-k is passed to the indexer, not read from the config)."""
    return preset_model(preset, layers=1, index_topk=16)


@pytest.mark.parametrize("preset", ["deepseek-v3.2", "glm-5"])
@pytest.mark.parametrize("case", ["random", "ties", "fewer_than_k"])
def test_chunked_topk_equals_unchunked_bit_for_bit(preset, case):
    """Query-row chunks of 1, 3 and 7 rows (batch 2: the block bound counts the batch) select exactly the indices,
    in exactly the order, of one whole-window block: at the preset's indexer geometry (64 or 32 heads x 128), with
    scores that tie across the top-k boundary, and with top-k above the window (every row sees fewer than k keys,
    so its tail is future positions whose masked scores all tie at -inf)."""
    seq, k = 60, 16
    model = _one_layer(preset)
    mt, heads = model.config.model_type, model.config.index_n_heads
    if case == "ties":
        attn, hidden, q_resid, cos_sin = _ties_window(model, seq, batch=2)
        with torch.no_grad():
            (_, _, scores), = index_score_blocks(attn.indexer, mt, hidden, q_resid, cos_sin, UNCHUNKED)
        top = scores.sort(-1, descending=True).values
        assert (top[..., k - 1] == top[..., k])[:, k:].float().mean() > 0.5  # most choosing rows tie at the boundary
    else:
        attn, hidden, q_resid, cos_sin, _ = _indexer_inputs(model, seq, seed=3)
        hidden = torch.cat([hidden, hidden.flip(1)])  # batch 2
        q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden))
        cos_sin = tuple(x.expand(2, -1, -1) for x in cos_sin)
    if case == "fewer_than_k":
        k = 2048  # the published top-k, above the 60-key window: k = 60, rows pad with future positions
    whole = _topk(attn, mt, hidden, q_resid, cos_sin, k, UNCHUNKED)
    assert whole.shape == (2, seq, min(k, seq))
    for rows in (1, 3, 7):
        blocked = _topk(attn, mt, hidden, q_resid, cos_sin, k, 4 * 2 * heads * seq * rows)
        assert torch.equal(whole, blocked), f"{rows} rows per block"
    if case != "fewer_than_k":  # late rows really choose: at least one visible key left out
        assert int((whole[0, -1] <= seq - 1).sum()) == k < seq


def test_block_bytes_bound_the_score_block():
    """The default bound keeps a score block within SCORE_BLOCK_BYTES whatever the batch: rows shrink with it."""
    attn, hidden, q_resid, cos_sin = _ties_window(_one_layer("deepseek-v3.2"), 40, batch=2)
    budget = 4 * 2 * 64 * 40 * 7  # 7 rows of batch 2
    with torch.no_grad():
        sizes = [s1 - s0 for s0, s1, _ in index_score_blocks(attn.indexer, "deepseek_v32", hidden, q_resid, cos_sin,
                                                             budget)]
    assert sizes == [7] * 5 + [5]
    assert SCORE_BLOCK_BYTES <= 1 << 28


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
