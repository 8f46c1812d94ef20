"""The model adapter: our owned attention forward vs the stock transformers forward (CPU)."""

import pytest
import torch
from transformers import DynamicCache

from mla_eval.errors import UserError
from mla_eval.formats import get_format
from mla_eval.model.adapter import MlaAdapter, check_supported
from mla_eval.model.session import CacheSession
from tiny_models import tiny_model


class Bf16Cache(DynamicCache):
    """The stock model with a bf16 latent cache: what format bf16 must reproduce."""

    def update(self, k, v, layer_idx, *args, **kwargs):
        return super().update(k.bfloat16().float(), v.bfloat16().float(), layer_idx, *args, **kwargs)


def _ours(model, adapter, fmt, ids, **kw):
    s = CacheSession(get_format(fmt), adapter.num_layers, ids.shape[0], ids.shape[1], "cpu", **kw)
    with adapter.session(s):
        return model(ids).logits


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2", "deepseek_v32", "glm_moe_dsa"])
def test_bf16_format_equals_stock_model_with_bf16_cache(model_type):
    model = tiny_model(model_type)
    ids = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        stock = model(ids, past_key_values=Bf16Cache(config=model.config), use_cache=True).logits
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
        stock = model(ids, past_key_values=Bf16Cache(config=model.config), use_cache=True).logits
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
