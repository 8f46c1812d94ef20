"""The model adapter: our owned attention forward vs the stock transformers forward (CPU)."""

import inspect

import pytest
import torch
from tiny_models import preset_model, tiny_model
from transformers import DynamicCache

from mla_eval.errors import UserError
from mla_eval.formats import get_format
from mla_eval.model.adapter import MlaAdapter, check_supported
from mla_eval.model.session import CacheSession


def _bf16(x):
    return x.bfloat16().float()


class Bf16Cache(DynamicCache):
    """The stock model with a bf16 latent cache: what format bf16 must reproduce.

    transformers 5.24+ caches (c_kv, rotated k_pe) of every MLA model; 5.17 caches them for dense
    MLA but the expanded per-head (K, V) for the DSA models, where K's last 64 values are the rotated
    k_pe. c_kv itself is rounded by `_round_latent` (a hook on kv_a_layernorm), so each version
    rounds exactly the two things our bf16 format stores."""

    def update(self, k, v, layer_idx, *args, **kwargs):
        if k.shape[-1] == 512:  # latent cache: (c_kv, k_pe)
            return super().update(_bf16(k), _bf16(v), layer_idx, *args, **kwargs)
        k = torch.cat([k[..., :-64], _bf16(k[..., -64:])], dim=-1)
        return super().update(k, v, layer_idx, *args, **kwargs)


def _stock_bf16_logits(model, ids):
    hooks = [layer.self_attn.kv_a_layernorm.register_forward_hook(lambda m, i, out: _bf16(out)) for layer in model.model.layers]
    try:
        # the cache keyword was renamed in 5.24 (past_key_values -> cache)
        key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        return model(ids, **{key: Bf16Cache(config=model.config)}, use_cache=True).logits
    finally:
        for h in hooks:
            h.remove()


def _ours(model, adapter, fmt, ids, **kw):
    s = CacheSession(get_format(fmt), adapter.num_layers, ids.shape[0], ids.shape[1], "cpu", **kw)
    with adapter.session(s):
        return model(ids).logits


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2", "deepseek_v32", "glm_moe_dsa"])
def test_bf16_format_equals_stock_model_with_bf16_cache(model_type):
    model = tiny_model(model_type)
    ids = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        stock = _stock_bf16_logits(model, ids)
        adapter = MlaAdapter(model)
        ours = _ours(model, adapter, "bf16", ids)
        # without a session the stock forward runs untouched
        assert torch.equal(model(ids).logits, model(ids).logits)
    tol = 2e-4 if model_type == "glm_moe_dsa" else 1e-4
    assert (ours - stock).abs().max().item() <= tol


def test_quantised_formats_change_logits_by_their_error():
    model = tiny_model("deepseek_v3")
    adapter = MlaAdapter(model)
    ids = torch.randint(0, 320, (1, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = _ours(model, adapter, "bf16", ids)
        d = {f: (_ours(model, adapter, f, ids) - ref).abs().max().item() for f in ("fp8_ds_mla", "nvfp4", "mxfp4")}
    assert 0 < d["fp8_ds_mla"] < d["nvfp4"]  # 8-bit error is below 4-bit error
    assert d["mxfp4"] > 0


def test_incremental_decode_matches_one_forward():
    model = tiny_model("deepseek_v3")
    adapter = MlaAdapter(model)
    ids = torch.randint(0, 320, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = _ours(model, adapter, "nvfp4", ids)
        s = CacheSession(get_format("nvfp4"), adapter.num_layers, 2, 30, "cpu")
        with adapter.session(s):
            parts = [model(ids[:, :20], position_ids=torch.arange(20).expand(2, -1)).logits]
            for t in range(20, 30):
                parts.append(model(ids[:, t : t + 1], position_ids=torch.full((2, 1), t)).logits)
    assert (torch.cat(parts, 1) - full).abs().max().item() < 1e-4


def test_unsupported_and_non_mla_configs():
    from transformers import LlamaConfig

    with pytest.raises(UserError, match="unsupported architecture 'llama'"):
        check_supported(LlamaConfig())
    model = tiny_model("deepseek_v3")
    model.config.kv_lora_rank = 256
    with pytest.raises(UserError, match="kv_lora_rank 512"):
        check_supported(model.config)


def test_session_capacity_is_enforced():
    model = tiny_model("deepseek_v3")
    adapter = MlaAdapter(model)
    ids = torch.randint(0, 320, (1, 20))
    s = CacheSession(get_format("bf16"), adapter.num_layers, 1, 16, "cpu")
    with adapter.session(s), pytest.raises(ValueError, match="holds 16 tokens"):
        model(ids)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2"])
def test_mha_prefill_bf16_equals_stock_model(model_type):
    model = tiny_model(model_type)
    ids = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        stock = _stock_bf16_logits(model, ids)
        ours = _ours(model, MlaAdapter(model), "bf16", ids, prefill="mha")
    assert (ours - stock).abs().max().item() <= 1e-4


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_ds_mla", "mxfp4"])
def test_mha_prefill_reads_the_quantised_cache_like_the_absorbed_path(fmt):
    """Same cache bytes, up-projection before vs after attention: equal up to fp32 rounding, and
    far from bf16 (so the mha path really reads the quantised latent, not the fresh one).

    One layer, so both paths quantise identical latents: deeper layers see inputs that differ in
    the last bit, and an fp8 tile's amax-derived scale can then round differently.
    """
    model = tiny_model("deepseek_v3", num_hidden_layers=1)
    adapter = MlaAdapter(model)
    ids = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        absorbed = _ours(model, adapter, fmt, ids)
        mha = _ours(model, adapter, fmt, ids, prefill="mha")
        bf16 = _ours(model, adapter, "bf16", ids, prefill="mha")
    gap = (absorbed - bf16).abs().max().item()
    assert (mha - absorbed).abs().max().item() < 1e-5 < gap / 100


def test_mha_prefill_then_absorbed_decode_matches_one_forward():
    model = tiny_model("deepseek_v3")
    adapter = MlaAdapter(model)
    ids = torch.randint(0, 320, (2, 30), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = _ours(model, adapter, "nvfp4", ids)
        s = CacheSession(get_format("nvfp4"), adapter.num_layers, 2, 30, "cpu", prefill="mha")
        with adapter.session(s):
            parts = [model(ids[:, :20], position_ids=torch.arange(20).expand(2, -1)).logits]
            for t in range(20, 30):
                parts.append(model(ids[:, t : t + 1], position_ids=torch.full((2, 1), t)).logits)
    assert (torch.cat(parts, 1) - full).abs().max().item() < 1e-4


def test_mha_prefill_leaves_dsa_models_sparse():
    model = tiny_model("deepseek_v32")
    adapter = MlaAdapter(model)
    ids = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(_ours(model, adapter, "nvfp4", ids), _ours(model, adapter, "nvfp4", ids, prefill="mha"))


def test_unknown_prefill_mode():
    with pytest.raises(ValueError, match="prefill mode 'flash'"):
        CacheSession(get_format("bf16"), 2, 1, 8, "cpu", prefill="flash")


# Preset attention geometry (heads, q_lora, nope/rope/v, indexer heads x dims, GLM-5.2's layer
# schedule), 2 layers, hidden 128. DSA models get top-k 64 over a 96-token window so late queries
# really select (the sparse path, not dense-by-another-name); the test asserts it did.
PRESETS = [("deepseek-v3", None), ("kimi-k2", None), ("deepseek-v3.2", 64), ("glm-5", 64), ("glm-5.2", 64)]


@pytest.mark.parametrize("preset,topk", PRESETS)
def test_preset_geometry_bf16_equals_stock(preset, topk):
    model = preset_model(preset, layers=2, index_topk=topk)
    ids = torch.randint(0, 320, (1, 96), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        stock = _stock_bf16_logits(model, ids)
        adapter = MlaAdapter(model)
        ours = _ours(model, adapter, "bf16", ids)
    assert (ours - stock).abs().max().item() <= 2e-4
    selected, causal = adapter.sparse_read_counts()
    if topk is None:
        assert (selected, causal) == (0, 0)
    else:
        assert 0 < selected < causal  # fewer keys read than causal attention would


def test_glm52_shared_layer_reuses_the_full_layers_topk():
    """GLM-5.2 layers 3..5 are 'shared': the adapter hands them the top-k of layer 2 (its own state,
    not the decoder layer's prev_topk_indices)."""
    model = preset_model("glm-5.2", layers=4, index_topk=16)
    assert model.config.indexer_types == ["full", "full", "full", "shared"]
    adapter = MlaAdapter(model)
    seen = {}
    orig = CacheSession.attend

    def spy(self, layer, q, scale, topk=None):
        seen[layer] = topk
        return orig(self, layer, q, scale, topk=topk)

    ids = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(9))
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(CacheSession, "attend", spy)
        _ours(model, adapter, "bf16", ids)
    assert torch.equal(seen[3], seen[2]) and not torch.equal(seen[2], seen[1])


def test_restore_puts_back_the_stock_forward():
    model = preset_model("deepseek-v3.2", layers=2, index_topk=16)
    ids = torch.randint(0, 320, (1, 24), generator=torch.Generator().manual_seed(10))
    cls_forward = type(model.model.layers[0].self_attn).forward
    with torch.no_grad():
        before = model(ids).logits
        with MlaAdapter(model) as adapter:
            assert all("forward" in m.__dict__ for m in adapter.modules)
            _ours(model, adapter, "nvfp4", ids)
        for layer in model.model.layers:
            attn = layer.self_attn
            assert "forward" not in attn.__dict__ and attn.forward.__func__ is cls_forward
            assert not [k for k in attn.__dict__ if k.startswith("_mla_eval")]
        assert torch.equal(model(ids).logits, before)
        adapter.restore()  # idempotent


def test_bad_configs_one_line():
    import transformers as tf

    with pytest.raises(UserError, match="DeepSeek-V4 checkpoints are not loaded yet: .* random:deepseek-v4"):
        check_supported(type("C", (), {"model_type": "deepseek_v4"})())
    cfg = tf.DeepseekV32Config()
    cfg.__dict__["index_topk"] = None  # past the config's own validation: as a hand-edited config would be
    with pytest.raises(UserError, match="no index_topk"):
        check_supported(cfg)
