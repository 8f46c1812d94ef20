"""A model whose MLA cache is not the 512 + 64 record is refused by the formats module's one check
(`mla_eval.formats.check_model_dims`), the same line from every entry point, before any weight is read."""

import json

import pytest

from mla_eval.errors import UserError
from mla_eval.model.adapter import check_supported
from mla_eval.model.loader import load_model
from mla_eval.model_presets import geometry_from_config


def _checkpoint(tmp_path, **fields):
    from tiny_models import COMMON

    cfg = {**COMMON, "model_type": "deepseek_v3", **fields}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # weights that cannot be read: the refusal must come before any attempt to load them
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    return tmp_path


def test_other_latent_width_is_refused_before_weights(tmp_path):
    with pytest.raises(UserError, match="caches 256 \\+ 64 values per token.*defined for 512 latent \\+ 64 rope") as exc:
        load_model(_checkpoint(tmp_path, kv_lora_rank=256), device="cpu")
    assert "\n" not in str(exc.value) and str(tmp_path) in str(exc.value)


def test_a_448_plus_64_cache_is_named_as_deepseek_v4_everywhere(tmp_path):
    with pytest.raises(UserError, match="a DeepSeek-V4 cache"):
        load_model(_checkpoint(tmp_path, kv_lora_rank=448), device="cpu")
    with pytest.raises(UserError, match="a DeepSeek-V4 cache"):
        geometry_from_config({"model_type": "deepseek_v3", "num_hidden_layers": 4, "kv_lora_rank": 448, "qk_rope_head_dim": 64},
                             name="cfg.json", source="test")
    cfg = type("Config", (), {"model_type": "deepseek_v3", "kv_lora_rank": 448, "qk_rope_head_dim": 64,
                              "qk_nope_head_dim": 128, "v_head_dim": 128})()
    with pytest.raises(UserError, match="a DeepSeek-V4 cache"):
        check_supported(cfg)


def test_the_same_message_from_capacity_and_the_adapter():
    bad = {"model_type": "deepseek_v3", "num_hidden_layers": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 32}
    with pytest.raises(UserError) as from_capacity:
        geometry_from_config(bad, name="cfg.json", source="test")
    cfg = type("Config", (), {**bad, "qk_nope_head_dim": 128, "v_head_dim": 128})()
    with pytest.raises(UserError) as from_adapter:
        check_supported(cfg)
    tail = "values per token (kv_lora_rank 512, qk_rope_head_dim 32); every cache format is defined for"
    assert tail in str(from_capacity.value) and tail in str(from_adapter.value)
