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
