"""GPU pass / fail checks of whole evaluations (they were Python inside the old device script; issue 39): each runs a
user's evaluation through the library on wikitext-2 (the `wikitext_path` fixture: the same tokens for every run
compared, unlike self-samples, which each backend draws with its own forward) and compares two computations that
must agree.

- v3 reproduces v2: the embedded model's KLD with every format v3 serves, each kernel generation forced.
- A mixed per-layer plan (several formats in one forward): kernels = torch reference, on a dense (DeepSeek-V3) and a
  DSA (GLM-5.2: the indexer's top-2048 lists through the sparse kernels, ctx 4096) random model.
"""

from __future__ import annotations

import pytest
import torch

from mla_eval import api

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# the kernels round P to bf16 and accumulate in another order than the float32 reference (docs/kernels.md): KLD
# agreement on the same tokens, relative (the embedded model's v2 / v3 agreed within 0.8 % on an H100, issue 39)
KLD_REL = 0.03
KLD_ABS = 1e-4
V3_FORMATS = "bf16,fp8_ds_mla,fp8_ds_mla_pow2,fp8_e4m3,nvfp4,nvfp4_fp8rope,nvfp4_fp8rope_st,nvfp4_fp8_ds_mla,mxfp4"


def _rows(result) -> dict[str, float]:
    return {name: row["kld_mean"] for name, row in result.to_document()["formats"].items()}


def _agree(a: dict, b: dict, rel: float, what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(a), sorted(b))
    bad = {k: (a[k], b[k]) for k in b if abs(a[k] - b[k]) > max(KLD_ABS, rel * b[k])}
    assert not bad, f"{what}: {bad}"


@pytest.mark.gpu
@pytest.mark.slow
@needs_cuda
def test_v3_reproduces_v2_on_the_embedded_model(wikitext_path, monkeypatch):
    """MLA_EVAL_ATTENTION_KERNEL=v2 vs v3 (decode and prefill launches alike), 16,384 wikitext-2 tokens, every format
    v3 serves: the same KLD per format within 1 %."""
    common = dict(text=wikitext_path, max_tokens=16384, formats=V3_FORMATS, layer_stats=False, prefill="absorbed",
                  device="cuda", backend="kernel")
    got = {}
    for gen in ("v2", "v3"):
        monkeypatch.setenv("MLA_EVAL_ATTENTION_KERNEL", gen)
        got[gen] = _rows(api.evaluate_kld(api.KldSettings(**common)))
    print({k: (got["v2"][k], got["v3"][k]) for k in got["v2"]})
    _agree(got["v3"], got["v2"], 0.01, "v3 vs v2")


def _mixed_plan(tmp_path, layers: int):
    from mla_eval.formats import get_format
    from mla_eval.formats.variant import Variant
    from mla_eval.layer_plan import LayerPlan

    cycle = [Variant(get_format("fp8_ds_mla")), Variant(get_format("nvfp4"), True), Variant(get_format("nvfp4_fp8_ds_mla")),
             Variant(get_format("nvfp4_fp8rope"))]
    variants = tuple(cycle[i % len(cycle)] for i in range(layers))
    scales = tuple(0.01 if v.spec.name == "nvfp4" else None for v in variants)
    path = tmp_path / "mixed.json"
    LayerPlan(variants, scales, model={"name": "random", "layers": layers}).save(path)
    return path


@pytest.mark.gpu
@pytest.mark.slow
@needs_cuda
@pytest.mark.parametrize("model", ["random:deepseek-v3:layers=4", "random:glm-5.2:layers=4"])
def test_a_mixed_layer_plan_through_the_kernels_equals_the_reference(model, wikitext_path, tmp_path):
    """`kld --formats nvfp4,plan:FILE` (fp8_ds_mla, nvfp4+s_l, nvfp4_fp8_ds_mla, nvfp4_fp8rope by layer) through the
    kernels and through the torch reference, on the same 8,192 tokens at ctx 4096: the same KLD per row within
    `KLD_REL`. On GLM-5.2 (DSA) the windows are longer than the indexer's top-k, so the sparse kernels serve them."""
    plan = _mixed_plan(tmp_path, 4)
    common = dict(model=model, text=wikitext_path, max_tokens=8192, ctx=4096, stride=2048, min_context=2048,
                  formats=f"nvfp4,plan:{plan}", layer_stats=False, prefill="absorbed", device="cuda")
    kern = _rows(api.evaluate_kld(api.KldSettings(**common, backend="kernel")))
    ref = _rows(api.evaluate_kld(api.KldSettings(**common, backend="reference")))
    print(model, {k: (kern[k], ref[k]) for k in ref})
    _agree(kern, ref, KLD_REL, f"{model} mixed plan, kernel vs reference")
