"""KV-cache pool arithmetic, done the way vLLM sizes its block pool (pure functions, no CLI).

Per GPU (vllm-project/vllm, read at commit 001cabc1 unless noted):
1. KV budget. `vllm/v1/worker/utils.py::request_memory`: requested = ceil(total x
   gpu_memory_utilization); the worker then gives the KV cache requested minus the non-KV memory
   (weights, peak activations, non-torch memory, CUDA graphs), or exactly `kv_cache_memory_bytes`
   when that is set. Here the non-KV memory is weights/GPU + one `reserve` figure.
2. Bytes per token. Every cache layer is an `MLAAttentionSpec` with one KV head
   (`vllm/v1/kv_cache_interface.py::MLAAttentionSpec.real_page_size_bytes`: block_size x 656 for
   fp8_ds_mla, block_size x 576 x dtype size otherwise), i.e. block_size x the format's record
   bytes. The MLA latent is NOT split by tensor parallelism: every TP rank holds the full record
   for each of its tokens. A DSA indexer cache (`DeepseekV32IndexerCache`) is one more
   `MLAAttentionSpec` per indexed layer, 132 B per token.
3. One block pool. All these specs are `FullAttentionSpec`s with one block size, so
   `kv_cache_utils.py::get_kv_cache_groups` puts latent and indexer layers in ONE group
   (`UniformTypeKVCacheSpecs`, whose page size is the sum of the layers' page sizes) and
   `get_kv_cache_config_from_groups` sets num_blocks = available // that page size. Without an
   indexer all layers share one spec and `get_num_blocks` gives available // page // num_layers,
   the same integer. Either way: num_blocks = available // (block_size x bytes_per_token_all_layers).
   The indexer cache is therefore not a separate pool: a token's block holds its latent records
   and its indexer keys, and both run out together.
4. Pool tokens. `_report_kv_cache_config`: num_blocks x block_size, multiplied by the
   decode-context-parallel size (each DCP rank stores 1/dcp of every sequence). This is what
   vLLM allocates and logs as "GPU KV cache size". `vllm/v1/core/block_pool.py::BlockPool`
   keeps block 0 as its null block, so requests can be given (num_blocks - 1) blocks: that
   figure is the pool-limited single-request context reported here (vLLM's own startup check,
   `_check_enough_kv_cache_memory`, counts all blocks).
5. Concurrency. `get_max_concurrency_for_kv_cache_config`: num_blocks / blocks per request,
   with blocks per request = cdiv(cdiv(max_model_len, dcp), block_size)
   (`FullAttentionSpec.max_memory_usage_bytes`).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mla_eval.errors import UserError
from mla_eval.formats import FormatSpec, get_format, parse_format_list
from mla_eval.formats.v4 import V4_CONFIGS, RecordUse, V4CacheConfig, v4_config
from mla_eval.gpu_presets import get_gpu, gpu_names
from mla_eval.layer_plan import LayerPlan
from mla_eval.model_presets import (
    WEIGHT_DTYPE_BYTES,
    MlaCacheGeometry,
    V4CacheGeometry,
    WeightsInfo,
    get_preset,
    load_config,
    preset_names,
)
from mla_eval.protocol import ProgressCallback, no_progress, option, value_fits
from mla_eval.result_schemas import CAPACITY_SCHEMA

GIB = 1 << 30
REFERENCE_FORMAT = "fp8_ds_mla"  # the ratio column compares every format with this one
DEFAULT_RESERVE_GIB = 5.0  # peak activations + non-torch memory + CUDA graphs, per GPU (rough)
DEFAULT_PRESET = "deepseek-v3"  # what a bare `mla-eval capacity` shows
DEFAULT_GPU = "h200"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """How the model is spread. gpus = tp x dp; dcp splits each sequence's cache over dcp TP ranks."""

    gpus: int = 1
    tp: int = 1
    dcp: int = 1

    def __post_init__(self) -> None:
        for name in ("gpus", "tp", "dcp"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.gpus % self.tp:
            raise UserError(f"--gpus {self.gpus} is not a multiple of --tp {self.tp}; gpus = tp x data-parallel ranks")
        if self.tp % self.dcp:
            raise UserError(f"--dcp {self.dcp} must divide --tp {self.tp} (vLLM runs DCP inside the TP group)")

    @property
    def dp(self) -> int:
        """Engines (TP groups), each with its own block pool."""
        return self.gpus // self.tp


@dataclasses.dataclass(frozen=True)
class KvBudget:
    """Bytes per GPU available to the KV cache, and the arithmetic that gave them."""

    bytes_per_gpu: int
    source: str
    total_bytes_per_gpu: int | None = None
    gpu_memory_utilization: float | None = None
    requested_bytes_per_gpu: int | None = None
    weights_bytes_per_gpu: int | None = None
    reserve_bytes_per_gpu: int | None = None


def gib_to_bytes(value: float) -> int:
    return int(round(value * GIB))


def kv_budget_given(bytes_per_gpu: int, source: str) -> KvBudget:
    """The KV budget stated directly (vLLM's `kv_cache_memory_bytes`)."""
    if bytes_per_gpu <= 0:
        raise UserError(f"the KV memory per GPU must be positive, got {bytes_per_gpu} bytes")
    return KvBudget(bytes_per_gpu=bytes_per_gpu, source=source)


def kv_budget_from_memory(
    *,
    total_bytes_per_gpu: int,
    gpu_memory_utilization: float,
    weights_bytes_total: int,
    gpus: int,
    reserve_bytes_per_gpu: int,
) -> KvBudget:
    """available = ceil(total x util) - weights_total / gpus - reserve (all per GPU, bytes)."""
    if total_bytes_per_gpu <= 0:
        raise UserError(f"GPU memory must be positive, got {total_bytes_per_gpu / GIB:.3g} GiB")
    if not 0 < gpu_memory_utilization <= 1:
        raise UserError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    if weights_bytes_total <= 0:
        raise UserError(f"the weights size must be positive, got {weights_bytes_total / GIB:.3g} GiB")
    if reserve_bytes_per_gpu < 0:
        raise UserError(f"--reserve-gib must be >= 0, got {reserve_bytes_per_gpu / GIB:.3g}")
    requested = math.ceil(total_bytes_per_gpu * gpu_memory_utilization)
    weights_per_gpu = cdiv(weights_bytes_total, gpus)
    available = requested - weights_per_gpu - reserve_bytes_per_gpu
    if available <= 0:
        raise UserError(
            f"weights ({weights_per_gpu / GIB:.2f} GiB per GPU) + reserve ({reserve_bytes_per_gpu / GIB:.2f} GiB) "
            f"do not fit in {requested / GIB:.2f} GiB (= {total_bytes_per_gpu / GIB:.2f} GiB x {gpu_memory_utilization}); "
            "use more GPUs (--gpus/--tp), smaller weights, or give --kv-memory-gib"
        )
    return KvBudget(
        bytes_per_gpu=available,
        source="derived",
        total_bytes_per_gpu=total_bytes_per_gpu,
        gpu_memory_utilization=gpu_memory_utilization,
        requested_bytes_per_gpu=requested,
        weights_bytes_per_gpu=weights_per_gpu,
        reserve_bytes_per_gpu=reserve_bytes_per_gpu,
    )


def latent_bytes_per_token(spec: FormatSpec, geometry: MlaCacheGeometry, include_mtp: bool = True) -> int:
    """Latent cache bytes per token summed over the cache layers (one GPU holds all of them)."""
    return spec.record_bytes * geometry.cache_layers(include_mtp)


def bytes_per_token(spec: FormatSpec, geometry: MlaCacheGeometry, include_mtp: bool = True) -> int:
    """Latent records of every cache layer + indexer keys of every indexed layer, per token."""
    return latent_bytes_per_token(spec, geometry, include_mtp) + geometry.indexer_bytes_per_token(include_mtp)


def num_blocks(available_bytes: int, block_size: int, token_bytes: int) -> int:
    """vLLM's integer block count for one GPU: available // (block_size x bytes per token)."""
    if block_size < 1:
        raise UserError(f"--block-size must be >= 1, got {block_size}")
    return max(available_bytes // (block_size * token_bytes), 0)


def pool_tokens(blocks: int, block_size: int, dcp: int = 1) -> int:
    """Physical tokens in one engine's pool: blocks x block_size x DCP size."""
    return blocks * block_size * dcp


def schedulable_tokens(blocks: int, block_size: int, dcp: int = 1) -> int:
    """Tokens requests can hold: every block but vLLM's null block."""
    return max(blocks - 1, 0) * block_size * dcp


def blocks_per_request(max_model_len: int, block_size: int, dcp: int = 1) -> int:
    """Blocks one request of max_model_len tokens takes on each GPU (each DCP rank holds 1/dcp)."""
    return cdiv(cdiv(max_model_len, dcp), block_size)


def max_concurrency(blocks: int, max_model_len: int, block_size: int, dcp: int = 1) -> float:
    """vLLM's 'Maximum concurrency for N tokens per request': blocks / blocks per request."""
    return blocks / blocks_per_request(max_model_len, block_size, dcp)


@dataclasses.dataclass(frozen=True)
class FormatCapacity:
    """The capacity figures of one cache format for one model and GPU setup (one engine)."""

    name: str
    title: str
    bytes_per_token_per_layer: int
    latent_bytes_per_token: int
    indexer_bytes_per_token: int
    bytes_per_token: int
    block_bytes: int
    num_blocks: int
    pool_tokens: int
    schedulable_tokens: int
    pool_tokens_all_engines: int
    max_context_pool: int
    max_context_model: int | None
    max_context: int
    max_context_limited_by: str
    max_model_len: int | None
    max_concurrency: float | None
    full_length_requests: int | None
    ratio_vs_fp8_ds_mla: float | None
    # a per-layer plan's row: each cache layer's record bytes (bytes_per_token_per_layer is then the widest)
    layer_record_bytes: tuple[int, ...] | None = None
    # a DeepSeek-V4 row: the bytes of each kind of entry (v4_capacity); None for an MLA row
    entries: dict | None = None

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        if self.layer_record_bytes is None:
            del out["layer_record_bytes"]
        else:
            out["layer_record_bytes"] = list(self.layer_record_bytes)
        if self.entries is None:
            del out["entries"]
        return out


def format_capacity(
    spec: FormatSpec,
    geometry: MlaCacheGeometry,
    budget: KvBudget,
    parallel: Parallelism,
    *,
    block_size: int = 64,
    include_mtp: bool = True,
    max_model_len: int | None = None,
) -> FormatCapacity:
    """Every figure for one format. max_model_len defaults to the model's max_position_embeddings."""
    return layers_capacity(spec.name, spec.title, (spec.record_bytes,) * geometry.cache_layers(include_mtp), geometry,
                           budget, parallel, block_size=block_size, include_mtp=include_mtp,
                           max_model_len=max_model_len, per_layer=False)


def plan_layer_bytes(layer_bytes: Sequence[int], geometry: MlaCacheGeometry, include_mtp: bool = True) -> tuple[int, ...]:
    """A plan's record bytes per cache layer: one per main layer (its length must be the model's), and the MTP
    layers, when counted, at the plan's widest record (a plan covers the main layers; an MTP layer's cache gets no
    cheaper than the worst case without a plan for it)."""
    if len(layer_bytes) != geometry.num_hidden_layers:
        raise UserError(f"the plan has {len(layer_bytes)} layers but {geometry.name} has {geometry.num_hidden_layers}; "
                        "give the plan's own model (--config) or make a plan for this one")
    return tuple(layer_bytes) + (max(layer_bytes),) * geometry.mtp_layers(include_mtp)


def layers_capacity(
    name: str,
    title: str,
    layer_bytes: Sequence[int],
    geometry: MlaCacheGeometry,
    budget: KvBudget,
    parallel: Parallelism,
    *,
    block_size: int = 64,
    include_mtp: bool = True,
    max_model_len: int | None = None,
    per_layer: bool = True,
) -> FormatCapacity:
    """Every figure for a cache whose layers may hold different records (`layer_bytes`, one per cache layer): a
    token's bytes are the sum over the layers, and one block of every layer runs out together (vLLM's one block
    pool: num_blocks = available // (block_size x bytes per token), whatever each layer's page size)."""
    if max_model_len is not None and max_model_len < 1:
        raise UserError(f"--max-model-len must be >= 1, got {max_model_len}")
    latent = sum(layer_bytes)
    indexer = geometry.indexer_bytes_per_token(include_mtp)
    token_bytes = latent + indexer
    blocks = num_blocks(budget.bytes_per_gpu, block_size, token_bytes)
    pool = pool_tokens(blocks, block_size, parallel.dcp)
    usable = schedulable_tokens(blocks, block_size, parallel.dcp)

    reference = get_format(REFERENCE_FORMAT)
    ref_bytes = bytes_per_token(reference, geometry, include_mtp)
    ref_pool = pool_tokens(num_blocks(budget.bytes_per_gpu, block_size, ref_bytes), block_size, parallel.dcp)

    model_len = geometry.max_position_embeddings
    length = max_model_len if max_model_len is not None else model_len
    if model_len is not None and usable >= model_len:
        max_context, limited_by = model_len, "model"
    else:
        max_context, limited_by = usable, "pool"
    concurrency = None if length is None else max_concurrency(blocks, length, block_size, parallel.dcp)
    return FormatCapacity(
        name=name,
        title=title,
        bytes_per_token_per_layer=max(layer_bytes),
        latent_bytes_per_token=latent,
        indexer_bytes_per_token=indexer,
        bytes_per_token=token_bytes,
        block_bytes=block_size * token_bytes,
        num_blocks=blocks,
        pool_tokens=pool,
        schedulable_tokens=usable,
        pool_tokens_all_engines=pool * parallel.dp,
        max_context_pool=usable,
        max_context_model=model_len,
        max_context=max_context,
        max_context_limited_by=limited_by,
        max_model_len=length,
        max_concurrency=concurrency,
        full_length_requests=None if concurrency is None else int(concurrency),
        ratio_vs_fp8_ds_mla=pool / ref_pool if ref_pool else None,
        layer_record_bytes=tuple(layer_bytes) if per_layer else None,
    )


def capacity_table(
    specs: Iterable[FormatSpec],
    geometry: MlaCacheGeometry,
    budget: KvBudget,
    parallel: Parallelism,
    *,
    block_size: int = 64,
    include_mtp: bool = True,
    max_model_len: int | None = None,
) -> list[FormatCapacity]:
    """`format_capacity` for each spec, in the order given."""
    return [
        format_capacity(
            spec, geometry, budget, parallel, block_size=block_size, include_mtp=include_mtp, max_model_len=max_model_len
        )
        for spec in specs
    ]


# --- DeepSeek-V4: three kinds of entries per layer (mla_eval.formats.v4) ---------------------------
#
# vLLM's DeepSeek-V4 cache, read at vllm-project/vllm@03dc56495617 (vllm/v1/attention/backends/mla/sparse_swa.py) and
# @b3ae0bbf2895 (vllm/models/deepseek_v41/attention.py): one head per entry and one KV head, so (as for MLA) every TP
# rank holds each of its tokens' entries whole. Per layer:
# - sliding-window entries: a per-request window of `sliding_window` (128) tokens in blocks of 64 tokens
#   (DeepseekV4SWACache.block_size); a request holds cdiv(window - 1, 64) + 1 such blocks whatever its length;
# - compressed entries: block_size / rate entries per block of block_size tokens (rate 4 or 128), each page rounded up
#   to the record's page alignment (576 B for the 584 B record, 512 B for V4.1's: `alignment` in the specs);
# - indexer keys (compressed-sparse layers): block_size / 4 keys of 132 B per block.
# The compressor's running state (float32, a few windows per request) and vLLM's per-step scratch, which its startup
# check also counts against max_num_batched_tokens, are not modelled.
V4_BLOCK_SIZE = 256  # vLLM's preferred block size for DeepSeek-V4 (DeepseekSparseSWABackend.get_preferred_block_size)
V4_SWA_BLOCK = 64  # tokens per sliding-window block (DeepseekV4SWACache: the compressed page of 256 // 4 entries)
# vLLM's page alignment per record (sparse_swa.py: 576 for fp8_ds_mla's UE8M0 layout; deepseek_v41: "512 satisfies"
# the V4.1 records); 0: none (bf16, the fork's 432 B record: none read)
V4_PAGE_ALIGN = {"dsv4_fp8_ds_mla": 576, "dsv41_mxfp8": 512, "dsv41_nvfp4": 512}
V4_REFERENCE = "dsv4_fp8_ds_mla"


def _page(use: RecordUse, entries: int) -> int:
    """Bytes of one page of `entries` records, rounded up to the engine's page alignment."""
    raw = entries * use.spec.record_bytes
    align = V4_PAGE_ALIGN.get(use.spec.name, 0)
    return cdiv(raw, align) * align if align else raw


def v4_entry_bytes(config: V4CacheConfig, geometry: V4CacheGeometry, block_size: int,
                   include_mtp: bool = True) -> dict:
    """Bytes per kind of entry: per block of `block_size` tokens (compressed entries, indexer keys) and per request
    (the sliding window), with the layers of each kind."""
    if block_size % max(rate for _, rate in geometry.compress_rates):
        raise UserError(f"--block-size {block_size}: DeepSeek-V4's compressed caches hold whole entries per block, so a "
                        f"block must be a multiple of {max(r for _, r in geometry.compress_rates)} tokens (vLLM uses "
                        f"{V4_BLOCK_SIZE})")
    csa, hca = "compressed_sparse_attention", "heavily_compressed_attention"
    n_csa, n_hca = geometry.layers_of(csa, include_mtp), geometry.layers_of(hca, include_mtp)
    n_all = geometry.cache_layers(include_mtp)
    per_block = {
        "compressed_csa": n_csa * _page(config.compressed, block_size // geometry.rate(csa)),
        "compressed_hca": n_hca * _page(config.compressed, block_size // geometry.rate(hca)),
        "indexer": n_csa * (block_size // geometry.rate(csa)) * config.indexer_bytes,
    }
    window_blocks = cdiv(geometry.sliding_window - 1, V4_SWA_BLOCK) + 1
    return {
        "config": config.name,
        "records": {"sliding": config.sliding.spec.name, "compressed": config.compressed.spec.name,
                    "indexer": config.indexer_record},
        "record_bytes": {"sliding": config.sliding.spec.record_bytes, "compressed": config.compressed.spec.record_bytes,
                         "indexer": config.indexer_bytes},
        "layers": {"sliding": n_all, "compressed_csa": n_csa, "compressed_hca": n_hca, "indexer": n_csa},
        "compress_rates": dict(geometry.compress_rates),
        "block_size": block_size,
        "bytes_per_block": per_block,
        "bytes_per_token": {k: v / block_size for k, v in per_block.items()},
        "sliding_window": geometry.sliding_window,
        "sliding_blocks_per_request": window_blocks,
        "sliding_bytes_per_request": n_all * _page(config.sliding, window_blocks * V4_SWA_BLOCK),
    }


def v4_capacity(config: V4CacheConfig, geometry: V4CacheGeometry, budget: KvBudget, parallel: Parallelism, *,
                block_size: int = V4_BLOCK_SIZE, include_mtp: bool = True, max_model_len: int | None = None
                ) -> FormatCapacity:
    """One V4 configuration's figures. Blocks are what the compressed entries and indexer keys of `block_size` tokens
    take; the pool for a single request is what the budget holds after one request's sliding window."""
    if max_model_len is not None and max_model_len < 1:
        raise UserError(f"--max-model-len must be >= 1, got {max_model_len}")
    entries = v4_entry_bytes(config, geometry, block_size, include_mtp)
    block_bytes = sum(entries["bytes_per_block"].values())
    window = entries["sliding_bytes_per_request"]

    def blocks_for(token_block_bytes: int, window_bytes: int) -> int:
        return max((budget.bytes_per_gpu - window_bytes) // token_block_bytes, 0)

    blocks = blocks_for(block_bytes, window)
    pool = pool_tokens(blocks, block_size, parallel.dcp)
    usable = schedulable_tokens(blocks, block_size, parallel.dcp)
    ref = v4_entry_bytes(v4_config(V4_REFERENCE), geometry, block_size, include_mtp)
    ref_pool = pool_tokens(blocks_for(sum(ref["bytes_per_block"].values()), ref["sliding_bytes_per_request"]),
                           block_size, parallel.dcp)
    model_len = geometry.max_position_embeddings
    length = max_model_len if max_model_len is not None else model_len
    max_context, limited_by = (model_len, "model") if model_len is not None and usable >= model_len else (usable, "pool")
    concurrency = None
    if length is not None:  # every request: its window and the blocks of its compressed entries
        per_request = window + blocks_per_request(length, block_size, parallel.dcp) * block_bytes
        concurrency = budget.bytes_per_gpu / per_request
    compressed = entries["bytes_per_block"]["compressed_csa"] + entries["bytes_per_block"]["compressed_hca"]
    return FormatCapacity(
        name=config.name,
        title=config.title,
        bytes_per_token_per_layer=config.compressed.spec.record_bytes,
        latent_bytes_per_token=cdiv(compressed, block_size),
        indexer_bytes_per_token=cdiv(entries["bytes_per_block"]["indexer"], block_size),
        bytes_per_token=cdiv(block_bytes, block_size),
        block_bytes=block_bytes,
        num_blocks=blocks,
        pool_tokens=pool,
        schedulable_tokens=usable,
        pool_tokens_all_engines=pool * parallel.dp,
        max_context_pool=usable,
        max_context_model=model_len,
        max_context=max_context,
        max_context_limited_by=limited_by,
        max_model_len=length,
        max_concurrency=concurrency,
        full_length_requests=None if concurrency is None else int(concurrency),
        ratio_vs_fp8_ds_mla=pool / ref_pool if ref_pool else None,
        entries=entries,
    )


def v4_configs(names: str | None) -> list[V4CacheConfig]:
    """The V4 configurations named in a --formats list (None: all of them); an MLA format name is refused."""
    if not names:
        return list(V4_CONFIGS)
    out = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        config = v4_config(name)
        if config is None:
            raise UserError(f"--formats {name!r}: DeepSeek-V4 caches other records than the MLA formats; choose among "
                            f"its configurations: {', '.join(c.name for c in V4_CONFIGS)} (see `mla-eval formats`)")
        if config not in out:
            out.append(config)
    return out


# --- the capacity evaluation as one call: settings in, a result (and its JSON document) out -------


@dataclasses.dataclass(frozen=True)
class CapacitySettings:
    """One capacity question. Field names are the `mla-eval capacity` long options (and a recipe's
    [capacity] keys) with `_` for `-`; None means that option's default. Sizes in GiB are 2^30 bytes.

    Model: `preset` or `config` (a config.json or checkpoint folder); neither = DEFAULT_PRESET.
    Budget: `kv_memory_gib` / `kv_cache_memory_bytes` given directly, or derived from the GPU
    (`gpu` preset or `gpu_mem_gib`), `gpu_memory_utilization`, the weights and `reserve_gib`.
    """

    preset: str | None = option(
        None, "--preset", "-p",
        help=f"Built-in model: {', '.join(preset_names())} (default {DEFAULT_PRESET}). See --list-presets for sources.",
    )
    config: Path | None = option(
        None, "--config", "-c", path="read", help="A Hugging Face config.json, or a checkpoint directory holding one "
        "(its model.safetensors.index.json then gives the weights size).",
    )
    gpu: str | None = option(
        None, "--gpu", "-g", help=f"GPU preset: {', '.join(gpu_names())} (default {DEFAULT_GPU}). "
        "Uses the total memory CUDA reports, not the datasheet figure.",
    )
    gpu_mem_gib: float | None = option(
        None, "--gpu-mem-gib", help="Total memory per GPU in GiB (2^30 B); overrides --gpu."
    )
    tp: int = option(8, "--tp", help="Tensor-parallel size. The MLA latent is replicated on every TP rank.")
    gpus: int | None = option(
        None, "--gpus", help="GPUs the weights are spread over (default: --tp). Extra GPUs beyond --tp are "
        "data-parallel engines, each with its own pool (pipeline parallelism is not modelled).",
    )
    dcp: int = option(
        1, "--dcp", help="Decode-context-parallel size (divides --tp): each rank stores 1/dcp of every sequence, so the "
        "pool holds dcp x more tokens.",
    )
    gpu_memory_utilization: float = option(
        0.9, "--gpu-memory-utilization",
        help="Fraction of each GPU's memory vLLM may use (vLLM's --gpu-memory-utilization).",
    )
    block_size: int | None = option(  # None: 64, or V4_BLOCK_SIZE for DeepSeek-V4
        None, "--block-size", help=f"Tokens per KV block (vLLM block_size; default 64 as FlashMLA, {V4_BLOCK_SIZE} for "
        "DeepSeek-V4, whose compressed caches fill whole entries per block).",
    )
    weights_gib: float | None = option(
        None, "--weights-gib", help="Total weights of the whole model in GiB, split evenly over --gpus. "
        "Default: the checkpoint's safetensors index (with --config DIR) or parameters x dtype (presets).",
    )
    weights_dtype: str | None = option(
        None, "--weights-dtype", help=f"Weights dtype for a preset's parameter count: {', '.join(WEIGHT_DTYPE_BYTES)} "
        "(nvfp4 = 4.5 bits incl. block scales). Default: the preset's checkpoint dtype.",
    )
    reserve_gib: float = option(
        DEFAULT_RESERVE_GIB, "--reserve-gib", help="Per-GPU GiB kept for peak activations, non-torch memory and CUDA "
        "graphs (a rough default; use the KV size vLLM logs via --kv-memory-gib for an exact match).",
    )
    kv_memory_gib: float | None = option(
        None, "--kv-memory-gib", help="KV-cache memory per GPU in GiB, given directly (skips GPU, weights, reserve)."
    )
    kv_cache_memory_bytes: int | None = option(
        None, "--kv-cache-memory-bytes", help="KV-cache memory per GPU in bytes, as vLLM's --kv-cache-memory-bytes."
    )
    mtp: bool = option(
        True, "--mtp/--no-mtp", help="Count MTP/next-n layers (num_nextn_predict_layers), which have caches when "
        "MTP speculative decoding runs (default on).",
    )
    max_model_len: int | None = option(
        None, "--max-model-len", help="Tokens per request for the concurrency column (default: the model's "
        "max_position_embeddings).",
    )
    formats: str | None = option(  # comma-separated names; None = every registered format
        None, "--formats", "-f", help="Comma-separated cache formats (default: all registered; with --plan: the "
        "plan's own formats and fp8_ds_mla; DeepSeek-V4: its cache configurations, see `mla-eval formats`)."
    )
    plan: Path | None = option(
        None, "--plan", path="read", help="A per-layer plan (`mla-eval plan`): one more row, its layers' records summed "
        "per token (MTP layers, when counted, at the plan's widest record).",
    )

    @classmethod
    def from_options(cls, options: Mapping[str, Any], where: str = "capacity") -> CapacitySettings:
        """Settings from a mapping of option names (`-` or `_` alike), e.g. a recipe's [capacity]
        table; an unknown key is a one-line UserError naming the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {str(k).replace("-", "_"): v for k, v in options.items()}
        unknown = sorted(k for k in values if k not in known)
        if unknown:
            raise UserError(f"{where}: unknown capacity option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if isinstance(values.get("formats"), (list, tuple)):
            values["formats"] = ",".join(str(f) for f in values["formats"])
        hints = typing.get_type_hints(cls)
        for key, value in values.items():  # a recipe's `tp = "eight"` is named here, not met as a TypeError later
            if not value_fits(hints[key], value):
                raise UserError(f"{where}: {key} = {value!r} has the wrong type (expected {hints[key]})")
        for key in ("config", "plan"):
            if values.get(key) is not None:
                values[key] = Path(values[key])
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class CapacityResult:
    """The resolved model, budget and setup, and one row per format; `to_document()` is the
    versioned `mla-eval.capacity/1` JSON document."""

    settings: CapacitySettings
    geometry: MlaCacheGeometry | V4CacheGeometry
    weights: WeightsInfo | None
    budget: KvBudget
    parallel: Parallelism
    gpu_label: str | None
    rows: tuple[FormatCapacity, ...]
    notes: tuple[str, ...]

    @property
    def max_model_len(self) -> int | None:
        s = self.settings
        return s.max_model_len if s.max_model_len is not None else self.geometry.max_position_embeddings

    @property
    def block_size(self) -> int:
        """The block size in effect: the one given, else 64 (V4_BLOCK_SIZE for DeepSeek-V4)."""
        return resolved_block_size(self.settings, self.geometry)

    def to_document(self) -> dict:
        geometry, include_mtp = self.geometry, self.settings.mtp
        if isinstance(geometry, V4CacheGeometry):
            return self._v4_document()
        indexer = geometry.indexer
        derived = self.budget.source == "derived"
        budget, parallel, weights = self.budget, self.parallel, self.weights
        model = {
            "name": geometry.name,
            "source": geometry.source,
            "model_type": geometry.model_type,
            "num_hidden_layers": geometry.num_hidden_layers,
            "num_nextn_predict_layers": geometry.num_nextn_predict_layers,
            "include_mtp": include_mtp,
            "cache_layers": geometry.cache_layers(include_mtp),
            "kv_lora_rank": geometry.kv_lora_rank,
            "qk_rope_head_dim": geometry.qk_rope_head_dim,
            "max_position_embeddings": geometry.max_position_embeddings,
            "indexer": None
            if indexer is None
            else {
                "index_head_dim": indexer.head_dim,
                "bytes_per_token_per_layer": indexer.bytes_per_token,
                "indexed_layers": geometry.indexed_layers(include_mtp),
                "full_main_layers": indexer.full_main_layers,
                "shared_main_layers": indexer.shared_main_layers,
                "mtp_layers": geometry.mtp_layers(include_mtp),
                "rule": indexer.rule,
            },
        }
        setup = {
            "gpu": self.gpu_label,
            "gpu_memory_bytes": budget.total_bytes_per_gpu,
            "gpus": parallel.gpus,
            "tp": parallel.tp,
            "dcp": parallel.dcp,
            "data_parallel_engines": parallel.dp,
            "gpu_memory_utilization": budget.gpu_memory_utilization,
            "block_size": self.block_size,
            "weights_bytes_total": weights.bytes if (weights and derived) else None,
            "weights_source": weights.source if (weights and derived) else None,
            "weights_bytes_per_gpu": budget.weights_bytes_per_gpu,
            "reserve_bytes_per_gpu": budget.reserve_bytes_per_gpu,
            "requested_bytes_per_gpu": budget.requested_bytes_per_gpu,
            "kv_budget_bytes_per_gpu": budget.bytes_per_gpu,
            "kv_budget_source": budget.source,
            "max_model_len": self.max_model_len,
        }
        formats = [r.as_dict() for r in self.rows]
        return {"schema": CAPACITY_SCHEMA, "model": model, "setup": setup, "formats": formats, "notes": list(self.notes)}

    def _setup(self) -> dict:
        budget, parallel, weights = self.budget, self.parallel, self.weights
        derived = budget.source == "derived"
        return {
            "gpu": self.gpu_label, "gpu_memory_bytes": budget.total_bytes_per_gpu, "gpus": parallel.gpus,
            "tp": parallel.tp, "dcp": parallel.dcp, "data_parallel_engines": parallel.dp,
            "gpu_memory_utilization": budget.gpu_memory_utilization, "block_size": self.block_size,
            "weights_bytes_total": weights.bytes if (weights and derived) else None,
            "weights_source": weights.source if (weights and derived) else None,
            "weights_bytes_per_gpu": budget.weights_bytes_per_gpu, "reserve_bytes_per_gpu": budget.reserve_bytes_per_gpu,
            "requested_bytes_per_gpu": budget.requested_bytes_per_gpu, "kv_budget_bytes_per_gpu": budget.bytes_per_gpu,
            "kv_budget_source": budget.source, "max_model_len": self.max_model_len,
        }

    def _v4_document(self) -> dict:
        """The same document for DeepSeek-V4: `kv_lora_rank` is what a record holds without rope (448); the indexer's
        bytes per token per layer are its 132 B key over its compress rate (33); `model.deepseek_v4` and each row's
        `entries` give every kind of entry."""
        g, mtp = self.geometry, self.settings.mtp
        csa = "compressed_sparse_attention"
        indexed = g.layers_of(csa, mtp)
        key = self.rows[0].entries["record_bytes"]["indexer"] if self.rows else 132
        model = {
            "name": g.name, "source": g.source, "model_type": g.model_type, "num_hidden_layers": g.num_hidden_layers,
            "num_nextn_predict_layers": g.num_nextn_predict_layers, "include_mtp": mtp, "cache_layers": g.cache_layers(mtp),
            "kv_lora_rank": g.kv_lora_rank, "qk_rope_head_dim": g.qk_rope_head_dim,
            "max_position_embeddings": g.max_position_embeddings,
            "indexer": {"index_head_dim": g.index_head_dim, "bytes_per_token_per_layer": key // g.rate(csa),
                        "indexed_layers": indexed, "full_main_layers": g.layers_of(csa, False), "shared_main_layers": 0,
                        "mtp_layers": indexed - g.layers_of(csa, False),
                        "rule": f"compressed-sparse layers: one {key} B key per {g.rate(csa)} tokens"},
            "deepseek_v4": {"head_dim": g.head_dim, "sliding_window": g.sliding_window,
                            "compress_rates": dict(g.compress_rates),
                            "layers": {t: g.layers_of(t, mtp) for t in ("sliding_attention", csa,
                                                                          "heavily_compressed_attention")}},
        }
        return {"schema": CAPACITY_SCHEMA, "model": model, "setup": self._setup(),
                "formats": [r.as_dict() for r in self.rows], "notes": list(self.notes)}


def resolved_block_size(s: CapacitySettings, geometry) -> int:
    if s.block_size is not None:
        return s.block_size
    return V4_BLOCK_SIZE if isinstance(geometry, V4CacheGeometry) else 64


def evaluate_capacity(settings: CapacitySettings, progress: ProgressCallback = no_progress) -> CapacityResult:
    """Resolve the model, the parallel setup and the per-GPU KV budget, and size every format's pool.
    Every bad setting is a one-line UserError naming the option. `progress` is the evaluation
    protocol's (mla_eval.evaluation); this arithmetic takes no time worth reporting."""
    s = settings
    if s.block_size is not None and s.block_size < 1:
        raise UserError(f"--block-size must be >= 1, got {s.block_size}")
    if s.max_model_len is not None and s.max_model_len < 1:
        raise UserError(f"--max-model-len must be >= 1, got {s.max_model_len}")
    if s.tp < 1:  # before --gpus, whose default is --tp: the error must name what the user gave
        raise UserError(f"--tp must be >= 1, got {s.tp}")
    geometry, weights, notes = _resolve_model(s)
    if s.weights_gib is not None:
        if not 0 < s.weights_gib < math.inf:
            raise UserError(f"--weights-gib must be positive, got {s.weights_gib}")
        weights = WeightsInfo(bytes=gib_to_bytes(s.weights_gib), source="--weights-gib")
    parallel = Parallelism(gpus=s.gpus if s.gpus is not None else s.tp, tp=s.tp, dcp=s.dcp)
    block_size = resolved_block_size(s, geometry)
    if isinstance(geometry, V4CacheGeometry):
        return _v4_result(s, geometry, weights, parallel, block_size, notes)
    plan = None if s.plan is None else LayerPlan.load(s.plan)
    default = None if plan is None else list(dict.fromkeys([REFERENCE_FORMAT, *(sp.name for sp in plan.specs)]))
    specs = parse_format_list(s.formats, default)
    for spec in specs:
        if spec.geometry.name != "mla":
            raise UserError(f"--formats {spec.name!r} is a DeepSeek-V4 record; {geometry.name} caches 512 + 64 MLA records")
    plan_bytes = None if plan is None else plan_layer_bytes([sp.record_bytes for sp in plan.specs], geometry, s.mtp)
    gpu_label, budget = _resolve_budget(s, weights, parallel, geometry)
    rows = capacity_table(
        specs, geometry, budget, parallel, block_size=block_size, include_mtp=s.mtp, max_model_len=s.max_model_len
    )
    if plan is not None:
        rows.append(layers_capacity(plan.label, f"per-layer plan: {plan.summary()}", plan_bytes, geometry, budget,
                                    parallel, block_size=block_size, include_mtp=s.mtp, max_model_len=s.max_model_len))
        if geometry.mtp_layers(s.mtp):
            notes.append(f"{plan.label}: the {geometry.mtp_layers(s.mtp)} MTP layer(s) are sized at the plan's widest "
                         f"record ({max(plan_bytes)} B); --no-mtp leaves them out")
    notes += list(geometry.notes)
    if any(r.num_blocks == 0 for r in rows):
        notes.append("a format with 0 blocks does not fit one block in the KV budget (vLLM would refuse to start)")
    short = [r.name for r in rows if r.max_concurrency is not None and 0 < r.max_concurrency < 1]
    if short:
        notes.append(
            f"{', '.join(short)}: the pool holds less than one request of {rows[0].max_model_len:,} tokens; vLLM refuses "
            "to start with that --max-model-len and names the largest that fits (about the pool size)"
        )
    return CapacityResult(s, geometry, weights, budget, parallel, gpu_label, tuple(rows), tuple(notes))


def _v4_result(s: CapacitySettings, geometry: V4CacheGeometry, weights: WeightsInfo | None, parallel: Parallelism,
               block_size: int, notes: list[str]) -> CapacityResult:
    if s.plan is not None:
        raise UserError("--plan holds a per-layer plan of MLA formats; DeepSeek-V4 takes its cache configurations")
    configs = v4_configs(s.formats)
    gpu_label, budget = _resolve_budget(s, weights, parallel, geometry)
    rows = [v4_capacity(c, geometry, budget, parallel, block_size=block_size, include_mtp=s.mtp,
                        max_model_len=s.max_model_len) for c in configs]
    window = rows[0].entries
    notes = notes + list(geometry.notes) + [
        f"DeepSeek-V4: B/tok model = compressed entries (1 per {window['compress_rates']['compressed_sparse_attention']} "
        f"/ {window['compress_rates']['heavily_compressed_attention']} tokens) + indexer keys, over every layer; each "
        f"request also holds its sliding window ({window['sliding_window']} tokens in {window['sliding_blocks_per_request']} "
        f"blocks of {V4_SWA_BLOCK}, every layer), which max context and concurrency count; ratio vs {V4_REFERENCE}",
        "not modelled: the compressors' float32 running state and vLLM's per-step scratch, which its startup check counts "
        "against max_num_batched_tokens (an engine's log therefore reports more memory per request)",
    ]
    if any(r.num_blocks == 0 for r in rows):
        notes.append("a configuration with 0 blocks does not fit one request's window and one block in the KV budget")
    return CapacityResult(s, geometry, weights, budget, parallel, gpu_label, tuple(rows), tuple(notes))


def _resolve_model(s: CapacitySettings) -> tuple[MlaCacheGeometry | V4CacheGeometry, WeightsInfo | None, list[str]]:
    if s.preset and s.config:
        raise UserError("give either --preset or --config, not both")
    if s.config is None:
        name = s.preset or DEFAULT_PRESET
        chosen = get_preset(name)
        notes = [] if s.preset else [f"no --preset or --config given: showing {name} (presets: {', '.join(preset_names())})"]
        return chosen.geometry(), chosen.weights(s.weights_dtype), notes
    if s.weights_dtype is not None:
        raise UserError("--weights-dtype needs a parameter count, which only presets carry; give --weights-gib instead")
    geometry, weights = load_config(s.config)
    return geometry, weights, []


def _positive_gib(option: str, value: float) -> int:
    if not 0 < value < math.inf:
        raise UserError(f"{option} must be positive, got {value}")
    return gib_to_bytes(value)


def _resolve_budget(
    s: CapacitySettings, weights: WeightsInfo | None, parallel: Parallelism, geometry: MlaCacheGeometry
) -> tuple[str | None, KvBudget]:
    """The per-GPU KV budget and the GPU's label (None when the budget is given directly)."""
    if s.kv_memory_gib is not None and s.kv_cache_memory_bytes is not None:
        raise UserError("give either --kv-memory-gib or --kv-cache-memory-bytes, not both")
    if s.kv_cache_memory_bytes is not None:
        return None, kv_budget_given(s.kv_cache_memory_bytes, "--kv-cache-memory-bytes")
    if s.kv_memory_gib is not None:
        return None, kv_budget_given(_positive_gib("--kv-memory-gib", s.kv_memory_gib), "--kv-memory-gib")

    if s.gpu_mem_gib is not None:
        total, label = _positive_gib("--gpu-mem-gib", s.gpu_mem_gib), f"custom GPU ({s.gpu_mem_gib:g} GiB)"
    else:
        preset = get_gpu(s.gpu or DEFAULT_GPU)
        total, label = preset.memory_bytes, preset.title + ("" if preset.verified else " [unverified memory figure]")
    if weights is None:
        raise UserError(
            f"cannot tell the weights size of {geometry.name}: pass --weights-gib (whole checkpoint), "
            "point --config at a checkpoint directory with model.safetensors.index.json, or give --kv-memory-gib"
        )
    if not 0 <= s.reserve_gib < math.inf:
        raise UserError(f"--reserve-gib must be >= 0, got {s.reserve_gib}")
    budget = kv_budget_from_memory(
        total_bytes_per_gpu=total,
        gpu_memory_utilization=s.gpu_memory_utilization,
        weights_bytes_total=weights.bytes,
        gpus=parallel.gpus,
        reserve_bytes_per_gpu=gib_to_bytes(s.reserve_gib),
    )
    return label, budget
