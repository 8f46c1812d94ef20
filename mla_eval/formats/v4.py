"""DeepSeek-V4's cache records, and the engine configurations that write them to its three kinds of entries.

DeepSeek-V4 (transformers `deepseek_v4`) caches one 512-d head per entry and reads it as key and value alike:
448 values without rope, then 64 rotated (`spec.DSV4_GEOMETRY`). Each layer caches up to three kinds of entries:

- sliding-window entries: the raw head of each of the last `sliding_window` (128) tokens, every layer;
- compressed entries: one head per `compress_rate` tokens (4 in compressed-sparse-attention layers, 128 in
  heavily-compressed ones), pooled by the layer's compressor, the whole history kept;
- indexer keys: in compressed-sparse layers, the lightning indexer's own compressed keys (index_head_dim 128 per 4
  tokens) that choose each query's top-k compressed entries.

Which record each engine writes to which entry, read at the commits below (every record's bytes are the engine's,
tested against independent ports in tests/test_engine_ports_v4.py):

- vLLM, DeepSeek-V4 (`--kv-cache-dtype fp8` / `fp8_ds_mla`): the 584 B record for sliding-window and compressed
  entries alike; indexer keys FP8 in 132 B. SGLang's DeepSeekV4SingleKVPool writes the same bytes (SWA, C4 and C128
  pools; its indexer pool 132 B).
- vLLM, DeepSeek-V4.1 on SM100 (PR 56893): the 528 B MXFP8 record for both kinds; with `nvfp4_ds_mla` (the 288 B
  record, PR 56935 / 57344) the compressed entries are NVFP4 and the sliding-window ones stay MXFP8.
- the local-inference-lab vLLM fork, PR 632 (VLLM_DSV4_NVFP4_DIRECT_WRITE): its 432 B `nvfp4_ds_mla` record (the
  built-in `nvfp4` format, the same writer) over the whole head -- all 512 values NVFP4, the 64 rotated ones also
  copied as bf16 -- for sliding-window and compressed entries (its staging `producer`s "swa" and "compressor").

Every engine keeps the compressor's not-yet-closed windows (its running state) in float32: not a cache record.
The indexer keys are scored exact here (their FP8 / MXFP4 engine records count in `capacity` only).

The CuTe kernels are built for the 512 + 64 MLA record (`record_plan.plan_for` refuses these by geometry); the torch
reference serves them.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from mla_eval.formats.builtin import BUILTIN_FORMATS, VLLM_FORK_NVFP4
from mla_eval.formats.spec import (
    DSV4_GEOMETRY,
    DSV4_NOPE_DIM,
    DSV4_ROPE_DIM,
    Engine,
    EngineName,
    Field,
    FormatSpec,
    ScaleApply,
    ScaleRule,
    VectorCoding,
)

NOPE, ROPE = DSV4_NOPE_DIM, DSV4_ROPE_DIM
HEAD_DIM = NOPE + ROPE  # 512: what one entry holds, read as key and value
ENTRY_KINDS = ("sliding", "compressed_csa", "compressed_hca")  # the cache entries a record may be written to
V4_AMAX_FLOOR = 1e-4  # fmaxf(amax, 1e-4f) in every V4 UE8M0 writer read (vLLM CUDA and Triton, SGLang)
V41_NVFP4_FLOOR = 2.0**-9  # tl.clamp(amax * (1/6), 0.001953125, 448): the smallest E4M3 subnormal

# ------------------------------------------------------------------------------------------- engines
# vLLM's sliding-window writer of the 584 B record, read at this commit: per 64-value block of the 448, absmax over
# the bf16-rounded values, fmaxf(absmax, 1e-4f), exponent = ceilf(log2f(absmax / 448.0f)) (a division), codes
# __nv_cvt_float_to_fp8(clamp(x * exp2f(-exponent), +-448), SATFINITE, E4M3); scale byte clamp(exponent + 127,
# 0, 255); byte 7 of the scale row 0; the rotated rope stored bf16. Per block of `block_size` tokens the 576 B data
# rows come first and the 8 B scale rows after them all (one logical record, two regions: `buffers`).
VLLM_DSV4_SWA = Engine(
    name="vLLM",
    repository="vllm-project/vllm",
    path="csrc/fused_deepseek_v4_qnorm_rope_kv_insert_kernel.cu",
    symbol="fusedDeepseekV4QNormRopeKVRopeQuantInsertKernel (fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert)",
    commit="057dcc0c2b547a54af75d3d6c77506b76cf79ef5",
    flag="--kv-cache-dtype fp8 / fp8_ds_mla (DeepSeek-V4)",
    note="the compressed entries' writer (Triton, vllm-project/vllm@1bd28daa03df "
    "vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py _rope_quant_insert_kernel) multiplies by "
    "f32(1/448) instead of dividing: the same power of two for every input tested (tests/test_engine_ports_v4.py); "
    "log2f / tl.log2 and the division are taken exactly here (the CUDA ones are within an ulp, and a quotient of a bf16 "
    "amax is a power of two or 0.6 % away from one); on gfx950 the Triton writer caps the scale byte at 254",
)
# SGLang's writer of the same record, read at this commit: per warp 64 values, scale_raw = fmaxf(1e-4f, absmax) /
# 448 (kFP8E4M3Max), cast_to_ue8m0 = biased exponent + (mantissa != 0) (the ceiling of log2, exactly), codes
# pack_fp8(x * 2^-e) (clamp +-448, cvt.rn.satfinite), bf16 rope; the pad byte is never written (the pool is zeroed).
SGLANG_DSV4 = Engine(
    name="SGLang",
    repository="sgl-project/sglang",
    path="python/sglang/jit_kernel/csrc/deepseek_v4/store.cuh",
    symbol="fused_store_flashmla_cache (DeepSeekV4SingleKVPool, mem_cache/deepseekv4_memory_pool.py @ 02e29cb18ae1)",
    commit="0efea6f4c6dd0807125d517a766952d20529107c",
    flag="--kv-cache-dtype fp8_e4m3 (DeepSeek-V4 pools SWA / C4 / C128, 584 B per token)",
    note="cast_to_ue8m0 reads the ceiling of log2 from the float's bits: exact",
)
# vLLM's DeepSeek-V4.1 MXFP8 record (PR 56893), read at this commit: all 512 values (rope included, rotated in
# float32 and not rounded to bf16 by the compressed writer) in 16 groups of 32, amax = max(max|x|, 1e-4), exponent =
# ceil(log2(amax * (1/448))), codes (x * 2^-e clamped to +-448).to(float8e4nv); 16 scale bytes clamp(e + 127, 0, 255).
VLLM_DSV41_MXFP8 = Engine(
    name="vLLM",
    repository="vllm-project/vllm",
    path="vllm/models/deepseek_v41/common/ops/cache_utils.py",
    symbol="_quantize_and_insert_k_mxfp8_kernel (sliding window); fused_compress_quant_cache.py "
    "_rope_quant_insert_mxfp8_kernel @ 1bd28daa03df (compressed)",
    commit="b3ae0bbf2895fd8a1e82dc0f690b334335f1f91d",
    flag="--kv-cache-dtype fp8 (DeepSeek-V4.1 on SM100, _use_v41_mxfp8_kv_record)",
    note="multiplies by f32(1/448): the same power of two as the division for every input tested; the Triton log2 "
    "is taken exactly here",
)
# vLLM's DeepSeek-V4.1 NVFP4 compressed record, read at this commit: the 512 values (rope rotated in float32) in 32
# groups of 16, scale = e4m3_rn(clamp(amax * (1/6), 2^-9, 448)), codes cvt.rn.satfinite.e2m1x2(div_rn(x, scale))
# (even element in the low nibble); [0,256) codes, [256,288) the scales in group order.
VLLM_DSV41_NVFP4 = Engine(
    name="vLLM",
    repository="vllm-project/vllm",
    path="vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py",
    symbol="_rope_quant_insert_nvfp4_kernel (rope_quant_insert, 288 B compressed records)",
    commit="1bd28daa03df01a6b5955124cca638cbed474ee6",
    flag="--kv-cache-dtype nvfp4_ds_mla (DeepSeek-V4.1: NVFP4 compressed entries, MXFP8 sliding window)",
    note="its reader (cache_utils.py @ b3ae0bbf2895 _dequantize_and_gather_k_nvfp4_kernel) returns code * scale",
)
# The local-inference-lab fork's DeepSeek-V4 NVFP4 writer (PR 632), read at this commit: the 512 values of the head,
# the 64 rotated in float32 and rounded to bf16, go through the fork's `cvt_warp_fp16_to_fp4` at SFScaleVal 1.0 (the
# built-in nvfp4 record's recipe, vllm-project/vllm@bde90062eb90 nvfp4_utils.cuh; the fork's copy was not re-read at
# this commit) into [0,256) codes and [256,288) scales; [288,304) zero; the 64 rotated values again as bf16 at 304.
FORK_DSV4_NVFP4 = dataclasses.replace(
    VLLM_FORK_NVFP4,
    repository="local-inference-lab/vllm",
    path="csrc/libtorch_stable/nvfp4_kv_cache_kernels.cu",
    symbol="fused_deepseek_v4_qnorm_rope_nvfp4_mla_kernel (PR 632, VLLM_DSV4_NVFP4_DIRECT_WRITE)",
    commit="42d67f7630d8b5c4652b31d2292d4fad1ad56f34",
    flag="--kv-cache-dtype nvfp4_ds_mla with VLLM_DSV4_NVFP4_DIRECT_WRITE=1 (DeepSeek-V4)",
    note="the reader (b12x PR 304, 'avoids duplicate native NVFP4 RoPE output') is taken to read the rope from the bf16 "
    "copy and the 448 from the NVFP4 codes: from its description, its code not read at a commit",
)

# ------------------------------------------------------------------------------------------- records (448 + 64)


def _ue8m0(dim: int, name: str, offset: int, group: int, scale_offset: int) -> VectorCoding:
    return VectorCoding(dim, "e4m3", Field(name, offset, "e4m3", dim), ScaleRule.UE8M0_CEIL, group,
                        Field(f"{name}_scale", scale_offset, "e8m0", dim // group), scale_floor=V4_AMAX_FLOOR)


def _v41_nvfp4(dim: int, name: str, offset: int, scale_offset: int) -> VectorCoding:
    return VectorCoding(dim, "e2m1", Field(name, offset, "e2m1", dim), ScaleRule.AMAX_E4M3_CLAMP6, 16,
                        Field(f"{name}_scale", scale_offset, "e4m3", dim // 16), apply=ScaleApply.DIV,
                        scale_floor=V41_NVFP4_FLOOR)


DSV4_BF16 = FormatSpec(
    name="dsv4_bf16",
    title="bf16 (DeepSeek-V4, 1024 B)",
    description="Uncompressed DeepSeek-V4 head: 448 bf16 values without rope, then the 64 rotated ones in bf16.",
    source="DeepSeek-V4 bf16 cache (vLLM's full-cache bf16 layout: head_size 512 in the model dtype)",
    record_bytes=1024,
    latent=VectorCoding(NOPE, "bf16", Field("latent", 0, "bf16", NOPE), ScaleRule.NONE, NOPE),
    rope=VectorCoding(ROPE, "bf16", Field("rope", 2 * NOPE, "bf16", ROPE), ScaleRule.NONE, ROPE),
)
DSV4_FP8_DS_MLA = FormatSpec(
    name="dsv4_fp8_ds_mla",
    title="fp8_ds_mla (DeepSeek-V4, 584 B)",
    description="448 E4M3 values in 7 groups of 64, each with a UE8M0 scale 2^ceil(log2(max(amax, 1e-4) / 448)); "
    "the 64 rotated values in bf16; data and scale rows in two regions of a block.",
    source="vLLM fp8_ds_mla for DeepSeek-V4 (vllm/v1/attention/backends/mla/sparse_swa.py: 448 NoPE + 128 B RoPE + "
    "8 B scales = 584 B) and SGLang DeepSeekV4SingleKVPool (448, 64)",
    record_bytes=584,
    latent=_ue8m0(NOPE, "latent", 0, 64, 576),
    rope=VectorCoding(ROPE, "bf16", Field("rope", NOPE, "bf16", ROPE), ScaleRule.NONE, ROPE),
    pads=(Field("pad", 583, "pad", 1),),
    align=8,
    engine=VLLM_DSV4_SWA,
    aliases=("vllm:fp8_ds_mla:deepseek_v4", "sglang:fp8_e4m3:deepseek_v4"),
    buffers=(("token_data", 0, 576), ("scales", 576, 584)),
)
DSV41_MXFP8 = FormatSpec(
    name="dsv41_mxfp8",
    title="MXFP8 (DeepSeek-V4.1, 528 B)",
    description="All 512 values E4M3 (rope included) in 16 groups of 32, each with a UE8M0 scale "
    "2^ceil(log2(max(amax, 1e-4) / 448)); data and scale rows in two regions of a block.",
    source="vLLM PR 56893: DeepSeek-V4.1 stores the whole KV in MXFP8 (FlashMLA ModelType::V41), 528 B per token",
    record_bytes=528,
    latent=_ue8m0(NOPE, "latent", 0, 32, 512),
    rope=_ue8m0(ROPE, "rope", NOPE, 32, 512 + NOPE // 32),
    engine=VLLM_DSV41_MXFP8,
    aliases=("vllm:fp8_ds_mla:deepseek_v4.1",),
    buffers=(("token_data", 0, 512), ("scales", 512, 528)),
)
DSV41_NVFP4 = FormatSpec(
    name="dsv41_nvfp4",
    title="NVFP4 compressed (DeepSeek-V4.1, 288 B)",
    description="All 512 values E2M1 (rope included) in 32 groups of 16, each with an E4M3 scale "
    "e4m3(clamp(amax * f32(1/6), 2^-9, 448)), codes x / scale; written to compressed entries only.",
    source="vLLM PR 56935 / 57344: DeepSeek-V4.1 NVFP4 compressed KV (FlashMLA ModelType::V41_FP4), 288 B per token",
    record_bytes=288,
    latent=_v41_nvfp4(NOPE, "latent", 0, 256),
    rope=_v41_nvfp4(ROPE, "rope", NOPE // 2, 256 + NOPE // 16),
    engine=VLLM_DSV41_NVFP4,
    aliases=("vllm:nvfp4_ds_mla:deepseek_v4.1",),
    buffers=(("token_data", 0, 256), ("scales", 256, 288)),
)

# The V4 records of this geometry, in the order `mla-eval formats` lists them (the 432 B record is the built-in nvfp4).
DSV4_FORMATS: tuple[FormatSpec, ...] = (DSV4_BF16, DSV4_FP8_DS_MLA, DSV41_MXFP8, DSV41_NVFP4)
assert all(spec.geometry is DSV4_GEOMETRY for spec in DSV4_FORMATS)

# ------------------------------------------------------------------------------------------- what goes where

# How a record holds a V4 head: "split" (its latent = the 448, its rope = the 64 rotated values), or "whole_head"
# (its 512-value latent = the whole head, its rope = the 64 rotated values again; read back as the latent's first 448
# and the rope copy -- the fork's 432 B record)
Binding = Literal["split", "whole_head"]


@dataclasses.dataclass(frozen=True)
class RecordUse:
    """A record written to one kind of entry, and how the head goes in."""

    spec: FormatSpec
    binding: Binding = "split"

    def __post_init__(self) -> None:
        dims = (self.spec.latent.dim, self.spec.rope.dim)
        want = (NOPE, ROPE) if self.binding == "split" else (HEAD_DIM, ROPE)
        if dims != want:
            raise ValueError(f"{self.spec.name}: a {self.binding!r} V4 record holds {want[0]} + {want[1]} values, not {dims}")


@dataclasses.dataclass(frozen=True)
class V4CacheConfig:
    """One engine configuration of a DeepSeek-V4 cache: the record of each kind of entry. Its `name` is what
    --formats takes for a V4 model (a result row records it)."""

    name: str
    title: str
    sliding: RecordUse
    compressed: RecordUse  # compressed-sparse (rate 4) and heavily-compressed (rate 128) entries alike
    indexer_bytes: int  # what the engine stores per indexer key (capacity; the keys are scored exact here)
    indexer_record: str  # the engine's indexer-key record, in words
    source: str

    def record(self, kind: str) -> RecordUse:
        if kind not in ENTRY_KINDS:
            raise ValueError(f"entry kind {kind!r}: one of {', '.join(ENTRY_KINDS)}")
        return self.sliding if kind == "sliding" else self.compressed

    @property
    def specs(self) -> tuple[FormatSpec, ...]:
        return tuple(dict.fromkeys(u.spec for u in (self.sliding, self.compressed)))


# vLLM's DeepseekV4IndexerCache / SGLang's DeepSeekV4IndexerPool: 128 FP8 key values + one fp32 scale
INDEXER_FP8 = (132, "FP8 E4M3 x128 + fp32 scale (vLLM DeepseekV4IndexerCache, SGLang DeepSeekV4IndexerPool)")


def _config(name: str, title: str, sliding: RecordUse, compressed: RecordUse, source: str) -> V4CacheConfig:
    return V4CacheConfig(name, title, sliding, compressed, *INDEXER_FP8, source)


_MXFP8 = RecordUse(DSV41_MXFP8)
V4_CONFIGS: tuple[V4CacheConfig, ...] = (
    _config("bf16", "bf16 reference", RecordUse(DSV4_BF16), RecordUse(DSV4_BF16),
            "the model's head rounded to bf16: the reference every V4 row is compared with"),
    _config(DSV4_FP8_DS_MLA.name, DSV4_FP8_DS_MLA.title, RecordUse(DSV4_FP8_DS_MLA), RecordUse(DSV4_FP8_DS_MLA),
            "vLLM --kv-cache-dtype fp8 on DeepSeek-V4 (sliding window: the fused CUDA writer; compressed: Triton); "
            "SGLang's three V4 pools"),
    _config(DSV41_MXFP8.name, DSV41_MXFP8.title, _MXFP8, _MXFP8, "vLLM PR 56893: DeepSeek-V4.1 on SM100"),
    _config(DSV41_NVFP4.name, "NVFP4 compressed, MXFP8 window (DeepSeek-V4.1)", _MXFP8, RecordUse(DSV41_NVFP4),
            "vLLM --kv-cache-dtype nvfp4_ds_mla on DeepSeek-V4.1: 'keeps the MXFP8 sliding-window record and stores "
            "the compressed cache as NVFP4' (vllm/models/deepseek_v41/attention.py)"),
)


# The fork's PR 632 writes the built-in 432 B nvfp4 record (its own writer, no outer scale) over the whole head.
_NVFP4 = next(spec for spec in BUILTIN_FORMATS if spec.name == "nvfp4")
_FORK = RecordUse(dataclasses.replace(_NVFP4, engine=FORK_DSV4_NVFP4, outer_scale=None), "whole_head")
V4_CONFIGS += (
    _config(_NVFP4.name, "nvfp4 over the whole head (vLLM fork PR 632, 432 B)", _FORK, _FORK,
            "local-inference-lab/vllm PR 632: native NVFP4 MLA cache writes for DeepSeek-V4 (its SWA and compressor "
            "producers)"),
)


def v4_config(name: str) -> V4CacheConfig | None:
    """The V4 cache configuration called `name` (None: no such configuration)."""
    return next((c for c in V4_CONFIGS if c.name == name), None)


# What engines call the V4 records, per version (listed with the other records' names by `mla-eval formats`).
V4_ENGINE_NAMES: tuple[EngineName, ...] = (
    EngineName("vLLM", "fp8_ds_mla", "DeepSeek-V4 (sparse_swa.py 584 B; the fused CUDA and Triton writers)", 584,
               DSV4_FP8_DS_MLA.name),
    EngineName("SGLang", "fp8_e4m3", "DeepSeek-V4 DeepSeekV4SingleKVPool (448, 64)", 584, DSV4_FP8_DS_MLA.name),
    EngineName("vLLM", "fp8_ds_mla", "PR 56893, DeepSeek-V4.1 on SM100 (MXFP8, 528 B)", 528, DSV41_MXFP8.name),
    EngineName("vLLM", "nvfp4_ds_mla", "PR 56935 / 57344, DeepSeek-V4.1 compressed entries (288 B)", 288,
               DSV41_NVFP4.name),
    EngineName("vLLM fork", "nvfp4_ds_mla", "local-inference-lab/vllm PR 632, DeepSeek-V4 (whole head NVFP4 + bf16 "
               "rope)", 432, "nvfp4"),
)

# V4 records known but not built, for `mla-eval formats` (each says why).
V4_NOT_BUILT: tuple[str, ...] = (
    "TensorRT-LLM NVFP4 cold-page compression of DeepSeek-V4's CSA cache (PRs 18783 / 19317: 448 NoPE NVFP4, rope "
    "and indexer lossless, pages of 128 / 256 tokens): a page-level codec whose kernel was not read at a commit",
    "SGLang MXFP4 DeepSeek-V4 cache on Hopper (PR 37138 / 32741, 368 B: 224 B E2M1 + 14 E8M0 + 2 pad + bf16 rope): "
    "writer not read at a commit",
    "SGLang SM120 NVFP4 sparse-MLA cache for DeepSeek-V4 (PR 38646, 384 B) and a 380 B NVFP4 layout: writers not read",
)


# ------------------------------------------------------------------------------------------- a head in, a head out


def encode_head(use: RecordUse, head, **kwargs):
    """Records [..., record_bytes] of V4 heads [..., 512] (448 without rope, then the 64 rotated values)."""
    from mla_eval.formats import codec  # the codec reads the registry, which imports this module

    if head.shape[-1] != HEAD_DIM:
        raise ValueError(f"a DeepSeek-V4 head has {HEAD_DIM} values, got {head.shape[-1]}")
    latent = head if use.binding == "whole_head" else head[..., :NOPE]
    return codec.encode(use.spec, latent, head[..., NOPE:], **kwargs)


def decode_head(use: RecordUse, records):
    """The float32 heads [..., 512] the engine's attention reads back from `records`."""
    import torch

    from mla_eval.formats import codec

    latent, rope = codec.decode(use.spec, records)
    return torch.cat([latent[..., :NOPE], rope], dim=-1)
