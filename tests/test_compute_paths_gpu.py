"""KLD rows do not depend on how the weights compute (GPU, bf16): each cache format's KLD against its own reference
is the same within noise whether the experts run eager or grouped, and whether FP8 checkpoint weights are dequantised
or computed in FP8 -- every row of a run shares the weights, so the comparison a user reads is unchanged.

One dense (DeepSeek-V3) and one DSA (GLM-5) FP8-block checkpoint written at a small width (hidden 1024, 16 experts of
512, 4 layers), random tokens. Run by `python -m tools.device fp8` (DeepGEMM required) and by the `tests` step."""

from __future__ import annotations

import json

import pytest
import torch

from mla_eval.cli import main
from mla_eval.model.checkpoint_writer import write_random_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOKENIZER = "mla_eval/default_model"
FORMATS = "fp8_ds_mla,nvfp4"


def _config(model_type: str):
    import transformers as tf

    kw = dict(vocab_size=12288, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
              v_head_dim=128, max_position_embeddings=4096, n_routed_experts=16, num_experts_per_tok=4, n_group=1,
              topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=512, tie_word_embeddings=False)
    if model_type == "deepseek_v3":
        return tf.DeepseekV3Config(**kw)
    return tf.GlmMoeDsaConfig(**kw, index_topk=256, index_head_dim=128, index_n_heads=4,
                              indexer_types=["full", "shared", "full", "shared"])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from pathlib import Path

    root = tmp_path_factory.mktemp("paths")
    text = root / "t.txt"
    g = torch.Generator().manual_seed(0)
    text.write_text(" ".join(f"word{int(i)}" for i in torch.randint(0, 3000, (6000,), generator=g)))
    return {t: write_random_checkpoint(root / t, _config(t), "fp8-block", tokenizer_from=Path(TOKENIZER), device="cuda").path
            for t in ("deepseek_v3", "glm_moe_dsa")}, text


def _kld(folder, text, tmp_path, *extra):
    out = tmp_path / f"k{len(list(tmp_path.iterdir()))}.json"
    code = main(["kld", "--model", str(folder), "--text", str(text), "--formats", FORMATS, "--scales", "none",
                 "--ctx", "1024", "--stride", "512", "--max-tokens", "6144", "--device", "cuda", "--out", str(out),
                 *extra])
    assert code == 0
    return json.loads(out.read_text())


def _within_noise(runs, base_name):
    """Every run's row of every format against `base_name`'s: within 3 standard errors (or 5 %); the table printed."""
    base = runs[base_name]["formats"]
    for name, doc in runs.items():
        print(name, {f: (round(r["kld_mean"], 6), round(r["kld_se"], 6), round(r["ppl_ref"], 3))
                     for f, r in doc["formats"].items()})
    for name, doc in runs.items():
        for fmt, row in doc["formats"].items():
            a, b = row["kld_mean"], base[fmt]["kld_mean"]
            noise = 3 * (row["kld_se"] ** 2 + base[fmt]["kld_se"] ** 2) ** 0.5
            assert abs(a - b) <= max(noise, 0.05 * b), (name, fmt, a, b, noise)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm_moe_dsa"])
def test_kld_rows_are_unchanged_between_expert_paths(checkpoints, model_type, tmp_path):
    folders, text = checkpoints
    runs = {
        "eager+dequant": _kld(folders[model_type], text, tmp_path, "--experts", "eager", "--weight-math", "dequant"),
        "grouped+dequant": _kld(folders[model_type], text, tmp_path, "--experts", "grouped_mm", "--weight-math", "dequant"),
    }
    assert runs["eager+dequant"]["model"]["experts"]["implementation"] == "eager"
    assert runs["grouped+dequant"]["model"]["experts"]["implementation"] == "grouped_mm"
    _within_noise(runs, "eager+dequant")


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm_moe_dsa"])
def test_kld_rows_are_unchanged_between_weight_maths(checkpoints, model_type, tmp_path):
    """The issue's claim at bf16 on a GPU. On a CPU in float32 FP8 activation rounding adds a KLD floor that small-error
    formats feel (tests/test_compute_paths.py says why); here the dequantised run rounds to bf16 as well."""
    folders, text = checkpoints
    runs = {
        "grouped+dequant": _kld(folders[model_type], text, tmp_path, "--experts", "grouped_mm", "--weight-math", "dequant"),
        "fp8": _kld(folders[model_type], text, tmp_path, "--weight-math", "fp8"),
    }
    assert runs["fp8"]["model"]["weight_math"]["math"] == "fp8"
    assert runs["fp8"]["execution"]["fp8_gemm_calls"].get("deepgemm-grouped", 0) > 0
    _within_noise(runs, "grouped+dequant")
