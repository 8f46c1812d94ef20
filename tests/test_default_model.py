"""The shipped default model loads offline, runs a finite forward pass and retrieves a pass key."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mla_eval.model_home import default_model_path  # noqa: E402

MODEL = default_model_path()
pytestmark = pytest.mark.skipif(
    not (MODEL / "model.safetensors").exists(), reason="default model weights not present"
)

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it later.\n"
)


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    return model, tok


def test_shipped_files_and_geometry():
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(MODEL)
    assert cfg.model_type == "deepseek_v3"
    assert cfg.kv_lora_rank == 512 and cfg.qk_rope_head_dim == 64
    assert cfg.rope_interleave
    assert cfg.first_k_dense_replace == cfg.num_hidden_layers  # all layers dense
    assert (MODEL / "model.safetensors").stat().st_size <= 48_000_000
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (MODEL / name).exists(), name


def test_forward_shape_and_finite(model_and_tokenizer):
    model, tok = model_and_tokenizer
    ids = tok("The history of the city begins in the Roman period, when", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_latent_cache_width(model_and_tokenizer):
    model, _ = model_and_tokenizer
    attn = model.model.layers[0].self_attn
    assert attn.kv_a_proj_with_mqa.out_features == 512 + 64
    assert attn.kv_a_layernorm.weight.shape == (512,)


@pytest.mark.parametrize("key", ["71432", "390817"])
def test_greedy_passkey(model_and_tokenizer, key):
    model, tok = model_and_tokenizer
    filler = " ".join([FILLER] * 8)
    prompt = (
        f"{INTRO}{filler} The pass key is {key}. Remember it. {key} is the pass key. {filler}"
        "\nWhat is the pass key? The pass key is"
    )
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(key) + 2, do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
    text = tok.decode(out[0, ids.shape[1]:])
    assert text.strip().startswith(key), text
