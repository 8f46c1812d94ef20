"""Randomly initialised models with a preset's exact attention geometry: dry runs at production shapes.

A spec string names one, anywhere `--model` takes a checkpoint:

    random:<preset>[:layers=N][:seed=S][:hidden=H][:topk=K]

<preset> is a name of `mla_eval.model_presets` (deepseek-v3, deepseek-v3.2, kimi-k2, glm-5, glm-5.2, deepseek-v4;
deepseek-v4's model is `model.deepseek_v4`'s, with a few small experts in place of its MoE).
The attention geometry (heads, q_lora, nope/rope/v dims, kv_lora 512, the indexer's heads, dims,
top-k and its per-layer full/shared schedule, rope theta and yarn factors) is the preset's; the rest
is small: N decoder layers (default 3) with a dense MLP of SMALL_MLP units, no MTP layer (transformers
builds none), the vocabulary of the embedded tokenizer. `hidden=H` replaces hidden_size (the only
attention number one may change; it keeps CPU tests fast); `topk=K` replaces a DSA preset's
index_topk (so short CPU windows already select sparsely). Both are recorded in the model's name.
Same spec, same device -> same weights: they are drawn after seeding with S (default 0), inside a
forked RNG state, so the global generator is left as it was.
Nothing is written to disk. The weights are noise: fit for plumbing, timing and memory, not quality.
"""

from __future__ import annotations

import dataclasses

import torch

from mla_eval.errors import UserError
from mla_eval.model.adapter import stock_attention
from mla_eval.model_presets import V4_MODEL_TYPE, ModelPreset, get_preset, preset_names

PREFIX = "random:"
DEFAULT_LAYERS = 3
SMALL_MLP = 1024  # dense MLP width of every layer (the MoE of the real models is not what we measure)
_ATTENTION_FIELDS = ("hidden_size", "num_attention_heads", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim", "kv_lora_rank", "max_position_embeddings")
_INDEXER_FIELDS = ("index_topk", "index_n_heads", "index_head_dim")
_LOW = {"layers": 1, "seed": 0, "hidden": 64, "topk": 1}  # smallest value of each spec key
# preset model_type -> the transformers class family that builds it (Kimi-K2 is DeepSeek-V3 code)
_FAMILY = {"deepseek_v3": "DeepseekV3", "kimi_k2": "DeepseekV3", "deepseek_v32": "DeepseekV32", "glm_moe_dsa": "GlmMoeDsa"}


@dataclasses.dataclass(frozen=True)
class RandomSpec:
    preset: ModelPreset
    layers: int = DEFAULT_LAYERS
    seed: int = 0
    hidden: int | None = None
    topk: int | None = None

    @property
    def name(self) -> str:
        extra = (f":hidden={self.hidden}" if self.hidden else "") + (f":topk={self.topk}" if self.topk else "")
        return f"{PREFIX}{self.preset.name}:layers={self.layers}:seed={self.seed}{extra}"

    @property
    def label(self) -> str:
        return f"random weights with the {self.preset.name} attention geometry: for plumbing, timing and memory, not quality"


def is_random_spec(model) -> bool:
    return isinstance(model, str) and model.strip().lower().startswith(PREFIX)


def parse_random_spec(text: str) -> RandomSpec:
    """Parse `random:<preset>[:layers=N][:seed=S][:hidden=H][:topk=K]`; UserError naming what is wrong."""
    parts = text.strip()[len(PREFIX):].split(":")
    name = parts[0].strip().lower()
    if name not in preset_names():
        raise UserError(f"--model {text!r}: no preset {name!r}; random models exist for: {', '.join(preset_names())}")
    values: dict[str, int] = {}
    for part in parts[1:]:
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep or key not in _LOW:
            raise UserError(f"--model {text!r}: {part!r} is not layers=N, seed=S, hidden=H or topk=K")
        if key in values:
            raise UserError(f"--model {text!r}: {key} given twice")
        try:
            value = int(raw.strip())
        except ValueError:
            raise UserError(f"--model {text!r}: {key} must be an integer, got {raw!r}") from None
        low = _LOW[key]
        if value < low:
            raise UserError(f"--model {text!r}: {key} must be >= {low}, got {value}")
        values[key] = value
    preset = get_preset(name)
    if "topk" in values and "index_topk" not in preset.config:
        raise UserError(f"--model {text!r}: topk applies to DSA presets only; {name} has no indexer")
    return RandomSpec(preset, layers=values.get("layers", DEFAULT_LAYERS), seed=values.get("seed", 0),
                      hidden=values.get("hidden"), topk=values.get("topk"))


def random_config(spec: RandomSpec, vocab_size: int):
    """The transformers config of `spec`: the preset's attention geometry, small everything else."""
    import transformers

    cfg = spec.preset.config
    if cfg["model_type"] == V4_MODEL_TYPE:
        return _v4_config(spec, vocab_size)
    kw = {f: cfg[f] for f in _ATTENTION_FIELDS}
    if spec.hidden:
        kw["hidden_size"] = spec.hidden
    rope = {"rope_type": "default", "rope_theta": float(cfg["rope_theta"])}
    if cfg.get("rope_scaling"):
        scaling = dict(cfg["rope_scaling"])
        rope = {**rope, "rope_type": scaling.pop("type"), **{k: float(v) for k, v in scaling.items()}}
    kw.update(
        rope_parameters=rope,
        num_hidden_layers=spec.layers,
        num_key_value_heads=cfg["num_attention_heads"],
        vocab_size=vocab_size,
        intermediate_size=SMALL_MLP,
        first_k_dense_replace=spec.layers,  # every layer dense: a small MLP, no experts
        tie_word_embeddings=False,
    )
    if "index_topk" in cfg:
        kw.update({f: cfg[f] for f in _INDEXER_FIELDS})
        if spec.topk:
            kw["index_topk"] = spec.topk
    if cfg["model_type"] == "glm_moe_dsa":
        kinds = cfg.get("indexer_types") or ["full"] * cfg["num_hidden_layers"]
        kw["indexer_types"] = list(kinds[: spec.layers])  # the first N layers of the published schedule
        kw["mlp_layer_types"] = ["dense"] * spec.layers
    family = _FAMILY[cfg["model_type"]]
    config = getattr(transformers, f"{family}Config")(**kw)
    config._attn_implementation = stock_attention(cfg["model_type"])  # as a loaded checkpoint of the family
    return config, getattr(transformers, f"{family}ForCausalLM")


# DeepSeek-V4: every layer is MoE (no dense MLP to shrink to), so a random V4 model keeps a few small experts: the
# published first three layers hash-routed, the rest top-k routed (transformers' mlp_layer_types)
V4_SMALL_EXPERTS = 4
V4_EXPERTS_PER_TOKEN = 2
V4_HASH_LAYERS = 3  # DeepSeek-V4-Flash config.json num_hash_layers
_V4_ATTENTION_FIELDS = ("hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                        "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "max_position_embeddings",
                        "rope_theta", "compress_rope_theta", "hc_mult", "hc_sinkhorn_iters")


def _v4_config(spec: RandomSpec, vocab_size: int):
    """A DeepseekV4Config of the preset's attention geometry (the first N layers of its published layer schedule),
    small experts, the embedded tokenizer's vocabulary."""
    import transformers

    cfg = spec.preset.config
    missing = [f for f in _V4_ATTENTION_FIELDS if f not in cfg]
    if missing:
        raise UserError(f"random:{spec.preset.name}: the preset does not carry {', '.join(missing)} (not read from the "
                        "model's own config), so no random model of its geometry can be built")
    geometry = spec.preset.geometry()
    kw = {f: cfg[f] for f in _V4_ATTENTION_FIELDS}
    if spec.hidden:
        kw["hidden_size"] = spec.hidden
    if spec.topk:
        kw["index_topk"] = spec.topk
    scaling = dict(cfg["rope_scaling"])
    kw.update(
        num_hidden_layers=spec.layers,
        num_key_value_heads=1,
        partial_rotary_factor=cfg["qk_rope_head_dim"] / cfg["head_dim"],
        layer_types=list(geometry.layer_types[: spec.layers]),
        compress_rates=dict(geometry.compress_rates),
        rope_parameters={"rope_type": scaling.pop("type"), **{k: float(v) for k, v in scaling.items()}},
        vocab_size=vocab_size,
        n_routed_experts=V4_SMALL_EXPERTS,
        num_experts_per_tok=V4_EXPERTS_PER_TOKEN,
        n_shared_experts=1,
        moe_intermediate_size=SMALL_MLP,
        mlp_layer_types=["hash_moe" if i < V4_HASH_LAYERS else "moe" for i in range(spec.layers)],
        tie_word_embeddings=False,
    )
    config = transformers.DeepseekV4Config(**kw)
    config._attn_implementation = "eager"  # the only implementation transformers ships for V4 (its sinks)
    return config, transformers.DeepseekV4ForCausalLM


def build_random_model(spec: RandomSpec, vocab_size: int, device: torch.device, dtype: torch.dtype):
    """Initialise the model directly on `device` in `dtype` (no CPU copy, no file), seeded by spec.seed."""
    config, cls = random_config(spec, vocab_size)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(spec.seed)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = cls(config)
        finally:
            torch.set_default_dtype(default)
    return model.eval()


def build_random_skeleton(spec: RandomSpec, vocab_size: int, dtype: torch.dtype):
    """The model of `spec` with every parameter on the meta device (nothing allocated, nothing drawn) and real
    buffers (the rotary tables): what a dry run plans from, as a checkpoint's skeleton (`checkpoint.empty_model`)."""
    from mla_eval.model.checkpoint import empty_model

    config, _ = random_config(spec, vocab_size)
    return empty_model(config, dtype, config._attn_implementation)
