"""Tiny randomly initialised MLA models of each supported architecture (no weights on disk).

They have the production cache geometry (kv_lora_rank 512, rope 64) and everything else small,
so adapter tests run in seconds on a CPU.
"""

import torch

COMMON = dict(
    vocab_size=320,
    hidden_size=96,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
    max_position_embeddings=1024,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
)


def tiny_model(model_type: str, seed: int = 0, **over):
    import transformers as tf

    torch.manual_seed(seed)
    kw = dict(COMMON, **over)
    if model_type == "deepseek_v3":
        cfg = tf.DeepseekV3Config(q_lora_rank=None, first_k_dense_replace=1, **kw)
        cls = tf.DeepseekV3ForCausalLM
    elif model_type == "deepseek_v2":
        cfg = tf.DeepseekV2Config(q_lora_rank=None, first_k_dense_replace=1, **kw)
        cls = tf.DeepseekV2ForCausalLM
    elif model_type == "deepseek_v32":
        dsa = dict(q_lora_rank=48, first_k_dense_replace=1, index_topk=8, index_head_dim=96, index_n_heads=2)
        cfg = tf.DeepseekV32Config(**dsa, **kw)
        cls = tf.DeepseekV32ForCausalLM
    elif model_type == "glm_moe_dsa":
        dsa = dict(q_lora_rank=48, first_k_dense_replace=1, index_topk=8, index_head_dim=96, index_n_heads=2)
        cfg = tf.GlmMoeDsaConfig(**dsa, indexer_types=["full", "shared", "full"], **kw)
        cls = tf.GlmMoeDsaForCausalLM
    else:
        raise ValueError(model_type)
    cfg._attn_implementation = "eager"
    model = cls(cfg).eval()
    # random init leaves RMSNorm weights at 1 and tiny projections; scale the latent path up so
    # quantisation errors are visible above float noise
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.kv_a_layernorm.weight.mul_(3.0)
    return model


def tiny_checkpoint(folder, model_type: str = "deepseek_v3"):
    """Save a tiny model with the embedded model's tokenizer (vocab 12288) as a local checkpoint
    folder that `--model` accepts; returns the folder."""
    import shutil
    from pathlib import Path

    from transformers.utils import logging as hf_logging

    folder = Path(folder)
    # transformers >= 5.2x draws a "Writing model shards" bar on stderr; the tests read stderr
    hf_logging.disable_progress_bar()
    try:
        tiny_model(model_type, vocab_size=12288, max_position_embeddings=256).save_pretrained(folder)
    finally:
        hf_logging.enable_progress_bar()
    tokenizer_dir = Path(__file__).resolve().parents[1] / "mla_eval" / "default_model"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, folder / f)
    return folder


def preset_model(preset: str, layers: int = 2, hidden: int = 128, seed: int = 0, index_topk: int | None = None):
    """A random float32 CPU model with a preset's attention geometry (mla_eval.model.random_models),
    a small hidden size, and optionally a smaller indexer top-k so short windows already select."""
    from mla_eval.model.random_models import RandomSpec, build_random_model
    from mla_eval.model_presets import get_preset

    spec = RandomSpec(get_preset(preset), layers=layers, seed=seed, hidden=hidden, topk=index_topk)
    model = build_random_model(spec, 320, torch.device("cpu"), torch.float32)
    with torch.no_grad():  # as tiny_model: make the latent large enough for quantisation error to show
        for layer in model.model.layers:
            layer.self_attn.kv_a_layernorm.weight.mul_(3.0)
    return model
