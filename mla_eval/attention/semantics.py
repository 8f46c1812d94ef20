"""Attention semantics (which keys a query reads from the quantised cache) and attention math
(which precision the attention computes in): the one definition of both, and the engine presets.

Semantics
---------
- ``cache``: every query reads every key, its own included, from the quantised cache: what a
  decode step sees. The default, and the protocol of the published vLLM-fork figures.
- ``engine:C``: what a serving engine computes for a prompt with chunked prefill of C tokens.
  The prompt runs as consecutive forwards of C tokens; inside the chunk [s, e) a query reads the
  keys of earlier chunks (positions < s) from the quantised cache and the keys of its own chunk
  from the freshly computed latents, rounded to bf16 (the engine's activation dtype). Decode steps
  read only the cache. This is how vLLM's dense-MLA prefill runs: the context already in the cache
  is gathered in context chunks, dequantised and attended (non-causal "context run"), the new
  tokens attend causally over their own fresh K/V ("main run"), and the partial results are merged
  by their log-sum-exp (vllm-project/vllm vllm/model_executor/layers/attention/mla_attention.py
  @90b0a26e: `MLACommonImpl.forward` writes the cache, then `_forward_prefill`; the metadata
  builder plans the main and context runs; vllm/v1/attention/backends/mla/common.py @37fa5c09,
  "Chunked Prefill" in its header).
  With a bf16 cache the fresh keys are bit-identical to the stored ones, so engine and cache
  semantics agree; with one chunk covering the window no query reads the cache at all.
- DSA models (deepseek_v32, glm_moe_dsa): the sparse prefill backends read every selected entry
  from the quantised cache, the chunk's own included (vLLM's FlashMLA sparse backend either runs
  the fp8 decode kernel over the cache for prefill tokens, or upconverts the selected cache entries
  to bf16 for its bf16 prefill kernel: vllm-project/vllm
  vllm/v1/attention/backends/mla/flashmla_sparse.py @60191e18, header comment). So on a DSA model
  engine semantics equal cache semantics, and the evaluation says so.

Engine presets (chunk sizes an engine uses by default; both depend on the GPU, H200 values here)
- ``vllm``: 8192 = `max_num_batched_tokens` of `vllm serve` (UsageContext.OPENAI_API_SERVER) on a
  GPU with >= 70 GiB that is not an A100 (H100, H200); 2048 on smaller GPUs. V1 always chunks.
  vllm-project/vllm vllm/engine/arg_utils.py @99d7eb5d, EngineArgs batch defaults.
- ``vllm-offline``: 16384 = the same default for the offline `LLM` class on such a GPU (8192 below).
- ``sglang``: 8192 = `chunked_prefill_size` for 90 GiB <= GPU memory < 160 GiB ("H20, H200");
  8192 on an H100, 16384 on B200/MI300, 2048-4096 on small GPUs. sgl-project/sglang
  python/sglang/srt/server_args.py, `_handle_gpu_memory_settings`.
A chunk is the engine's per-step token budget; a single request prefilling alone gets all of it.

Math
----
- ``bf16``: the absorbed attention in float32 over the dequantised keys (our bf16-MMA kernels).
- ``fp8-q``: Q quantised to E4M3 before QK^T with a static per-tensor scale, as vLLM's MLA decode
  does for an fp8 KV cache (vllm/model_executor/layers/attention/mla_attention.py @90b0a26e,
  `MLACommonImpl.forward`: `_decode_concat_quant_fp8_op(decode_ql_nope, decode_q_pe, layer._q_scale)`,
  i.e. the absorbed [q_nope W_UK, q_pe] in one E4M3 tensor; the attention layer's `_q_scale` is
  1.0 unless the checkpoint or --calculate-kv-scales sets one): codes = E4M3(q / q_scale) (round to nearest
  even, saturating at +-448), scores = (codes . K) * softmax_scale * q_scale. Every E4M3 value is
  exact in bf16, so the bf16-MMA kernel fed the codes computes exactly these products (fp32
  accumulation; only the summation order differs from the reference).
- ``fp8-qp``: fp8-q, and P = exp(s - rowmax) quantised to E4M3 (unit scale, vLLM's `_prob_scale`
  default) before P.V; the softmax denominator keeps the float32 P. Torch reference only: the
  CuTe kernels would need a change, so `--backend kernel` with it is refused.
In every math the reference of a KLD run keeps bf16 math: the figure measures what the math adds.
"""

from __future__ import annotations

import dataclasses

import torch

from mla_eval.errors import UserError
from mla_eval.formats.numerics import e4m3_decode, e4m3_encode

SEMANTICS_KINDS = ("cache", "engine")


@dataclasses.dataclass(frozen=True)
class EnginePreset:
    name: str
    chunk: int
    engine: str
    source: str


PRESETS = {
    p.name: p
    for p in (
        EnginePreset(
            "vllm", 8192, "vLLM `vllm serve`, chunked prefill (V1 default), H100/H200-class GPU",
            "vllm-project/vllm vllm/engine/arg_utils.py @99d7eb5d: max_num_batched_tokens default "
            "(OPENAI_API_SERVER 8192 on >= 70 GiB non-A100 GPUs, 2048 otherwise)",
        ),
        EnginePreset(
            "vllm-offline", 16384, "vLLM offline `LLM` class, chunked prefill, H100/H200-class GPU",
            "vllm-project/vllm vllm/engine/arg_utils.py @99d7eb5d: max_num_batched_tokens default "
            "(LLM_CLASS 16384 on >= 70 GiB non-A100 GPUs, 8192 otherwise)",
        ),
        EnginePreset(
            "sglang", 8192, "SGLang server, chunked prefill, H200 (also H100/H20)",
            "sgl-project/sglang python/sglang/srt/server_args.py _handle_gpu_memory_settings: chunked_prefill_size "
            "8192 below 160 GiB of GPU memory (H20, H200), 16384 on B200/MI300",
        ),
    )
}

SEMANTICS_HELP = (
    "Which keys a query reads from the quantised cache: 'cache' (every key, its own included: what decode sees; "
    "default), 'engine:C' (chunked prefill of C tokens: earlier chunks through the cache, the own chunk from fresh bf16 "
    "latents, as vLLM/SGLang prefill dense MLA), or an engine preset: "
    + ", ".join(f"{p.name} (engine:{p.chunk})" for p in PRESETS.values())
    + ". "
    "Comma-separate several for one row each."
)


@dataclasses.dataclass(frozen=True)
class Semantics:
    """Resolved attention semantics: kind 'cache' or 'engine' (with its chunk), and the preset it came from."""

    kind: str = "cache"
    chunk: int | None = None
    preset: str | None = None

    @property
    def label(self) -> str:
        """The identity used in documents, table titles and gate names: 'cache' or 'engine:C'."""
        return "cache" if self.kind == "cache" else f"engine:{self.chunk}"

    @property
    def is_engine(self) -> bool:
        return self.kind == "engine"

    def as_dict(self) -> dict:
        out = {"semantics": self.label, "kind": self.kind, "chunk": self.chunk, "preset": self.preset}
        if self.preset is not None:
            out["preset_source"] = PRESETS[self.preset].source
        return out

    def forward_chunk(self, length: int, is_dsa: bool) -> int:
        """Tokens per forward of a `length`-token prompt: the chunk under engine semantics on a dense
        model, else the whole prompt. A DSA model's sparse prefill reads every selected key from the
        cache, so it runs like cache semantics, in one forward."""
        if self.is_engine and not is_dsa:
            return min(self.chunk, length)
        return length

    def check_positions(self, max_positions: int, option: str = "--semantics") -> None:
        """A chunk longer than the model's positions names no prefill an engine could run."""
        if self.is_engine and max_positions > 0 and self.chunk > max_positions:
            raise UserError(
                f"{option} {self.label}: chunk {self.chunk} is beyond the model's {max_positions} positions; "
                f"use a chunk of at most {max_positions}"
            )


CACHE = Semantics()


def parse_semantics(text: str, option: str = "--semantics") -> Semantics:
    """'cache', 'engine:512' or a preset name -> Semantics (one-line UserError otherwise)."""
    tok = str(text).strip().lower()
    if tok == "cache":
        return CACHE
    if tok in PRESETS:
        return Semantics("engine", PRESETS[tok].chunk, tok)
    kind, colon, num = tok.partition(":")
    if kind == "engine":
        if not colon:
            raise UserError(f"{option} engine needs a chunk size: engine:C, e.g. engine:2048 (or a preset: {', '.join(PRESETS)})")
        try:
            chunk = int(num)
        except ValueError:
            raise UserError(f"{option} {text!r}: the chunk must be a whole number of tokens, e.g. engine:2048") from None
        if chunk <= 0:
            raise UserError(f"{option} {text!r}: the chunk must be at least 1 token")
        return Semantics("engine", chunk)
    choices = ", ".join(["cache", "engine:C", *PRESETS])
    raise UserError(f"{option} {text!r} is not a semantics; choose one of {choices}")


def parse_semantics_list(text: str | list | tuple, option: str = "--semantics") -> list[Semantics]:
    """A comma list (or a list) of semantics, distinct, in order."""
    tokens = text.split(",") if isinstance(text, str) else [str(t) for t in text]
    out: list[Semantics] = []
    for tok in (t for t in tokens if t.strip()):
        s = parse_semantics(tok, option)
        if all(o.label != s.label for o in out):
            out.append(s)
    if not out:
        raise UserError(f"{option} is empty; give e.g. cache or engine:2048")
    return out


@dataclasses.dataclass(frozen=True)
class AttentionMath:
    """How the attention computes: Q (and P) to E4M3 or not; `q_scale` is the static per-tensor Q scale."""

    name: str
    q_fp8: bool
    p_fp8: bool
    q_scale: float = 1.0
    description: str = ""

    @property
    def kernel_blocker(self) -> str | None:
        """Why the CuTe kernels cannot compute this math (None: they can)."""
        if self.p_fp8:
            return f"math {self.name} rounds P to E4M3 before P.V, which the CuTe kernels do not do (torch reference only)"
        return None


MATHS = {
    m.name: m
    for m in (
        AttentionMath("bf16", False, False, description="float32 softmax over the dequantised keys (bf16-MMA kernels)"),
        AttentionMath("fp8-q", True, False, description="Q to E4M3 (static per-tensor scale 1.0, vLLM) before QK^T"),
        AttentionMath("fp8-qp", True, True, description="fp8-q, and P to E4M3 (unit scale) before P.V; reference only"),
    )
}
BF16 = MATHS["bf16"]
MATH_HELP = (
    "Attention math: bf16 (default), fp8-q (Q to E4M3 with vLLM's static per-tensor scale before QK^T), "
    "fp8-qp (also P to E4M3 before P.V; torch reference only). Comma-separate several for one row each."
)


def get_math(name: str | AttentionMath, option: str = "--math") -> AttentionMath:
    if isinstance(name, AttentionMath):
        return name
    m = MATHS.get(str(name).strip().lower())
    if m is None:
        raise UserError(f"{option} {name!r} is not an attention math; choose one of {', '.join(MATHS)}")
    return m


def parse_math_list(text: str | list | tuple, option: str = "--math") -> list[AttentionMath]:
    tokens = text.split(",") if isinstance(text, str) else [str(t) for t in text]
    out: list[AttentionMath] = []
    for tok in (t for t in tokens if t.strip()):
        m = get_math(tok, option)
        if m not in out:
            out.append(m)
    if not out:
        raise UserError(f"{option} is empty; give e.g. bf16 or fp8-q")
    return out


def quantize_q(q: torch.Tensor, math: AttentionMath) -> tuple[torch.Tensor, float]:
    """(float32 E4M3 codes of q / q_scale, q_scale): the Q an fp8 attention multiplies, and the
    factor that goes into the softmax scale. q unchanged (as float32) for a math without fp8 Q."""
    q = q.to(torch.float32)
    if not math.q_fp8:
        return q, 1.0
    # a Python float, not a tensor: no host-to-device copy, so a decode step stays CUDA-graph capturable
    scale = float(torch.tensor(math.q_scale, dtype=torch.float32))  # the float32 value an engine holds
    return e4m3_decode(e4m3_encode(q / scale)), scale


def quantize_p(p: torch.Tensor) -> torch.Tensor:
    """P (float32, in [0, 1]) rounded to E4M3 with unit scale, as float32."""
    return e4m3_decode(e4m3_encode(p.to(torch.float32)))


def row_label(fmt: str, semantics: Semantics | str, math: AttentionMath | str) -> str:
    """The key of a (format, semantics, math) row: the bare format name for cache + bf16 (so every
    earlier document and baseline keeps its names), else 'fmt (engine:512, fp8-q)'."""
    sem = semantics.label if isinstance(semantics, Semantics) else str(semantics)
    name = math.name if isinstance(math, AttentionMath) else str(math)
    if sem == "cache" and name == "bf16":
        return fmt
    return f"{fmt} ({sem}, {name})"
