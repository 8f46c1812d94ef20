"""The routed experts' implementation is chosen by name for every MoE class we load (mla_eval.model.experts), and
transformers' grouped path computes what its eager loop computes (within the rounding order of the dtype)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from mla_eval.errors import UserError
from mla_eval.model.experts import check_experts, describe, experts_modules, select_experts


def _kimi_k2():
    """Kimi-K2 runs DeepSeek-V3's classes with its own routing: one group, many experts, one dense layer."""
    return tiny_model("deepseek_v3", n_routed_experts=12, num_experts_per_tok=4, routed_scaling_factor=2.827)


MODELS = {
    "deepseek_v3": lambda: tiny_model("deepseek_v3"),
    "kimi_k2": _kimi_k2,
    "deepseek_v32": lambda: tiny_model("deepseek_v32"),
    "glm_moe_dsa": lambda: tiny_model("glm_moe_dsa"),
}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_grouped_equals_eager_per_class(name, dtype, tol, monkeypatch):
    """One MoE block of each class, the same input through both paths: equal within the dtype's rounding, and the
    grouped path really ran grouped products (counted) while eager ran none."""
    model = MODELS[name]().to(dtype)
    block = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    x = torch.randn(3, 40, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    calls = []
    real = torch.nn.functional.grouped_mm

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(torch.nn.functional, "grouped_mm", counted)
    out = {}
    for path in ("eager", "grouped_mm"):
        calls.clear()
        record = select_experts(model, path)
        assert record["implementation"] == path and record["moe_layers"] == 2
        with torch.no_grad():
            out[path] = block(x).float()
        assert (len(calls) > 0) == (path == "grouped_mm"), (path, len(calls))
    rel = float((out["eager"] - out["grouped_mm"]).norm() / out["eager"].norm())
    assert rel <= tol, rel


def test_every_loaded_model_records_its_experts_path():
    from mla_eval.model.loader import load_model

    lm = load_model("random:deepseek-v3:layers=1:hidden=64", device="cpu")  # dense random layers: no experts
    assert lm.compute()["experts"] is None
    model = tiny_model("glm_moe_dsa")
    select_experts(model, "eager")
    assert describe(model) == {"implementation": "eager", "moe_layers": 2, "classes": ["GlmMoeDsaExperts"]}
    assert len(experts_modules(model)) == 2


def test_an_unknown_path_is_one_line():
    with pytest.raises(UserError, match=r"--experts 'sonic': choose one of grouped_mm, eager"):
        check_experts("sonic")
