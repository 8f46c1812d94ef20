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
from collections.abc import Iterable

from mla_eval.errors import UserError
from mla_eval.formats import FormatSpec, get_format
from mla_eval.model_presets import MlaCacheGeometry

GIB = 1 << 30
REFERENCE_FORMAT = "fp8_ds_mla"  # the ratio column compares every format with this one
DEFAULT_RESERVE_GIB = 5.0  # peak activations + non-torch memory + CUDA graphs, per GPU (rough)


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

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


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
    if max_model_len is not None and max_model_len < 1:
        raise UserError(f"--max-model-len must be >= 1, got {max_model_len}")
    latent = latent_bytes_per_token(spec, geometry, include_mtp)
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
        name=spec.name,
        title=spec.title,
        bytes_per_token_per_layer=spec.record_bytes,
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
