"""load_model: random preset models, bad input (one-line UserError), no process-wide side effects."""

import json
import os

import pytest
import torch

from mla_eval.errors import UserError
from mla_eval.model.loader import MODEL_HELP, load_model, resolve_device
from mla_eval.model.random_models import parse_random_spec
from mla_eval.model_presets import preset_names


@pytest.mark.parametrize(
    "spec,match",
    [
        ("random:glm-9", "no preset 'glm-9'; random models exist for: deepseek-v3, deepseek-v3.2, kimi-k2, glm-5, glm-5.2"),
        ("random:glm-5.2:layers=0", "layers must be >= 1, got 0"),
        ("random:glm-5.2:layers=x", "layers must be an integer, got 'x'"),
        ("random:glm-5.2:seed=-1", "seed must be >= 0"),
        ("random:glm-5.2:depth=3", "'depth=3' is not layers=N, seed=S, hidden=H or topk=K"),
        ("random:kimi-k2:topk=8", "topk applies to DSA presets only; kimi-k2 has no indexer"),
        ("random:glm-5:topk=0", "topk must be >= 1"),
        ("random:glm-5.2:layers=2:layers=3", "layers given twice"),
        ("random:glm-5.2:hidden=8", "hidden must be >= 64"),
    ],
)
def test_bad_random_specs(spec, match):
    with pytest.raises(UserError, match=match):
        parse_random_spec(spec)


def test_random_spec_defaults_and_help():
    spec = parse_random_spec("random:GLM-5.2")
    assert (spec.preset.name, spec.layers, spec.seed, spec.hidden) == ("glm-5.2", 3, 0, None)
    assert spec.name == "random:glm-5.2:layers=3:seed=0"
    assert all(name in MODEL_HELP for name in preset_names()) and "random:<preset>" in MODEL_HELP


def test_random_model_is_labelled_seeded_and_leaves_no_global_state():
    from transformers.utils import logging as hf_logging

    env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    verbosity = hf_logging.get_verbosity()
    rng = torch.get_rng_state()
    a = load_model("random:deepseek-v3.2:layers=1:seed=3:hidden=128", device="cpu")
    b = load_model("random:deepseek-v3.2:layers=1:seed=3:hidden=128", device="cpu")
    c = load_model("random:deepseek-v3.2:layers=1:seed=4:hidden=128", device="cpu")
    assert {k: os.environ.get(k) for k in env} == env and hf_logging.get_verbosity() == verbosity
    assert torch.equal(torch.get_rng_state(), rng)  # the seed did not touch the global generator
    assert a.is_random and not a.is_default
    assert a.label == "random weights with the deepseek-v3.2 attention geometry: for plumbing, timing and memory, not quality"
    assert a.name == str(a.path) == "random:deepseek-v3.2:layers=1:seed=3:hidden=128"
    sa, sb, sc = (m.model.state_dict() for m in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.self_attn.q_b_proj.weight"], sc["model.layers.0.self_attn.q_b_proj.weight"])
    cfg = a.model.config  # the preset's attention geometry, the hidden size overridden
    got = (cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim,
           cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.rope_parameters["factor"])
    assert got == (128, 128, 1536, 128, 128, 64, 128, 2048, 40.0)
    assert a.model.model.layers[0].self_attn.q_b_proj.weight.dtype == torch.float32  # auto on CPU


def test_default_model_load_restores_env(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")  # a user's own setting survives
    lm = load_model(None, device="cpu")
    assert lm.label == "the embedded default model" and not lm.is_random
    assert "HF_HUB_OFFLINE" not in os.environ and os.environ["TRANSFORMERS_OFFLINE"] == "0"


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "gpu", "cpu:0", ""])
def test_bad_devices(device):
    with pytest.raises(UserError, match="give one of auto, cpu, cuda, cuda:N"):
        resolve_device(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu():
    with pytest.raises(UserError, match="no CUDA GPU is visible"):
        resolve_device("cuda:1")


def _config_dir(tmp_path, **fields):
    from tiny_models import COMMON

    cfg = {**COMMON, **fields}
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return tmp_path


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"model_type": "llama", "kv_lora_rank": None}, "unsupported architecture 'llama'"),
        ({"model_type": "deepseek_v3", "kv_lora_rank": None}, "no kv_lora_rank \\(model_type 'deepseek_v3'\\)"),
        ({"model_type": "qwen3_moe"}, "unsupported architecture 'qwen3_moe'"),
        ({"model_type": "deepseek_v32", "index_topk": 8, "index_n_heads": 2},
         "DSA model \\(deepseek_v32\\) without index_head_dim"),
        ({"model_type": "glm_moe_dsa"}, "without index_topk, index_n_heads, index_head_dim"),
        ({"model_type": "deepseek_v4"}, "DeepSeek-V4 checkpoints are not loaded yet"),
    ],
)
def test_bad_configs(tmp_path, fields, match):
    with pytest.raises(UserError, match=match):
        load_model(_config_dir(tmp_path, **fields), device="cpu")


def test_random_model_refuses_device_map():
    with pytest.raises(UserError, match="random model is built on --device"):
        load_model("random:glm-5", device="cpu", device_map="auto")


def test_random_models_get_the_stock_attention_of_their_family():
    """A random:<preset> model runs the attention a loaded checkpoint of its family gets (the stock forward the
    benchmarks compare with): SDPA, eager only for the DSA families whose indexer needs the materialised mask.
    The first DeepSeek-V3 kld-window benchmark compared with an eager stock forward (211 ms vs SDPA 67.5)."""
    from mla_eval.model.random_models import random_config

    for preset, want in (("deepseek-v3", "sdpa"), ("kimi-k2", "sdpa"), ("deepseek-v3.2", "eager"), ("glm-5.2", "eager")):
        config, _ = random_config(parse_random_spec(f"random:{preset}:layers=1"), 1000)
        assert config._attn_implementation == want, preset
