"""The default model's Hugging Face config, built from the recipe's [model] section.

A `DeepseekV3Config` with every layer dense (`first_k_dense_replace = num_hidden_layers`, so no
MoE module is built), no multi-token-prediction layer, the DeepSeek-V3 interleaved RoPE layout and
the production MLA cache geometry. Works on transformers 5.17 and 5.24.
"""

from __future__ import annotations

from transformers import DeepseekV3Config

EOS_ID = 0  # <|endoftext|>: the tokenizer's first special token (bos = eos)
PAD_ID = 1  # <|pad|>


def build_config(m: dict, *, yarn_factor: float | None = None) -> DeepseekV3Config:
    """Config from the recipe's [model] table; `yarn_factor` stretches RoPE beyond the trained
    length with YaRN (original_max_position_embeddings = the trained max_position_embeddings)."""
    layers = int(m["num_hidden_layers"])
    max_pos = int(m["max_position_embeddings"])
    rope: dict = {"rope_type": "default", "rope_theta": float(m["rope_theta"])}
    if yarn_factor:
        rope = {
            "rope_type": "yarn",
            "rope_theta": float(m["rope_theta"]),
            "factor": float(yarn_factor),
            "original_max_position_embeddings": max_pos,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
        max_pos = int(max_pos * yarn_factor)
    return DeepseekV3Config(
        vocab_size=int(m["vocab_size"]),
        hidden_size=int(m["hidden_size"]),
        intermediate_size=int(m["intermediate_size"]),
        moe_intermediate_size=int(m["intermediate_size"]),
        num_hidden_layers=layers,
        num_attention_heads=int(m["num_attention_heads"]),
        num_key_value_heads=int(m["num_attention_heads"]),
        q_lora_rank=int(m["q_lora_rank"]) or None,
        kv_lora_rank=int(m["kv_lora_rank"]),
        qk_rope_head_dim=int(m["qk_rope_head_dim"]),
        qk_nope_head_dim=int(m["qk_nope_head_dim"]),
        v_head_dim=int(m["v_head_dim"]),
        first_k_dense_replace=layers,  # all layers dense: DeepseekV3DecoderLayer builds an MLP
        n_routed_experts=1,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=1,
        num_mtp_layers=0,
        max_position_embeddings=max_pos,
        rope_parameters=rope,
        rope_interleave=True,
        tie_word_embeddings=bool(m["tie_word_embeddings"]),
        rms_norm_eps=float(m["rms_norm_eps"]),
        initializer_range=float(m["initializer_range"]),
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attention_bias=False,
        attention_dropout=0.0,
        hidden_act="silu",
    )
