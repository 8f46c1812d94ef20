"""What product code calls: CUDA tensors go to the CuTe DSL kernels, everything else to the torch
reference (same signatures; the writer's bytes are identical, attention agrees within bf16 error).

    write_cache(spec, latent [T,512], rope [T,64], slot_mapping [T] int64, cache, outer_scale=None)
    mla_attention_dense(spec, q [N,H,576] bf16, cache, block_table=[N,B] int32, seq_lens=[N] int32,
                        softmax_scale=..., sink=None, outer_scale=None) -> (out [N,H,512], lse [N,H])
    mla_attention_sparse(spec, q, cache, indices=[N,topk] int32, softmax_scale=..., ...)

Slot lists and the math are documented in `mla_eval.attention.reference`. `backend` picks the path:
"auto" (kernel for CUDA tensors when `nvidia-cutlass-dsl` is installed, the GPU's architecture is
one the kernels were compiled and tested for (`mla_eval_kernels.plan.device_limits.TESTED_ARCHS`) and
the format is within the kernels' scope, else reference), "kernel" (UserError naming why, if the
kernel cannot run) or "reference".
A call's "auto" defers to the enclosing `with use_backend(name) as log:` scope (the library's
evaluations open one from their settings), then to the MLA_EVAL_BACKEND variable; `log.paths`
records which path served each format, for the result's provenance.
`kernel_status(spec, device)` says which path "auto" takes, and why; `preflight(backend, devices)`
raises the "kernel" error before any work (commands call it before loading a model). `cutlass` is
imported only when a kernel actually runs.

Fallbacks are said out loud, once: when "auto" sends CUDA work to the torch reference (no CuTe DSL,
an untested GPU architecture, a format or dtype outside the kernels' scope), the library does not
print; it records one line per (device, reason) in `log.fallbacks` (result documents carry it in
`environment.attention.fallbacks`) and emits that line once as a `KernelFallbackWarning` through
`warnings.warn` (once per `use_backend` scope; once per process outside any scope). The CLI shows
it as one `warning: ...` line on stderr. CPU tensors and an explicit "reference" are choices, not
fallbacks: they are logged in `paths` and never warned about.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import warnings
from collections.abc import Iterable, Iterator

import torch

from mla_eval.attention import reference
from mla_eval.attention.reference import LATENT_DIM, QK_DIM
from mla_eval.attention.semantics import AttentionMath, get_math, quantize_q
from mla_eval.errors import UserError
from mla_eval.formats import get_format
from mla_eval.formats.codec import check_finite as require_finite
from mla_eval.formats.codec import outer_scale_tensor

_WRITER_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

BACKENDS = ("auto", "kernel", "reference")
BACKEND_ENV = "MLA_EVAL_BACKEND"


class KernelFallbackWarning(UserWarning):
    """CUDA attention under "auto" ran on the torch reference instead of the CuTe kernels."""


@dataclasses.dataclass
class PathLog:
    """Which attention path served each (operation, format, device) inside one `use_backend` scope.

    `paths` maps "write|attend <format> on <device>" -> "kernel" or "reference (why)"; `fallbacks`
    holds one line per (device, reason) where "auto" could not use the kernels on a CUDA device.
    Result documents carry both as their provenance (what computed the number). `source` names
    where the backend came from ("--backend", MLA_EVAL_BACKEND or "default"), for error messages.
    `generations` maps each kernel-served "attend <format> on <device>" to the attention kernel
    generations its launches ran, each with why ("v3 (default: ...)", "v2 (<v3_blocker reason>)").
    """

    backend: str
    source: str = "--backend"
    paths: dict[str, str] = dataclasses.field(default_factory=dict)
    fallbacks: list[str] = dataclasses.field(default_factory=list)
    generations: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def record(self, op: str, spec_name: str, device: torch.device, path: str) -> None:
        self.paths.setdefault(f"{op} {spec_name} on {device}", path)

    def record_generation(self, spec_name: str, device: torch.device, generation: str, why: str) -> None:
        seen = self.generations.setdefault(f"attend {spec_name} on {device}", [])
        if f"{generation} ({why})" not in seen:
            seen.append(f"{generation} ({why})")

    def devices(self) -> list[str]:
        """The devices the logged calls ran on ('cpu', 'cuda:0', ...), sorted."""
        return sorted({key.rsplit(" on ", 1)[1] for key in self.paths})

    def as_dict(self) -> dict:
        """The log as result documents record it (environment.attention): `kernel_version` is what
        MLA_EVAL_ATTENTION_KERNEL forced, or "default" (the per-format policy); `kernel_generations`
        what each attention path's launches actually ran."""
        generation = kernel_generation() if any(p == "kernel" for p in self.paths.values()) else None
        return {
            "backend": self.backend, "backend_from": self.source,
            **({"kernel_version": generation} if generation else {}),
            **({"kernel_generations": {k: list(v) for k, v in self.generations.items()}} if self.generations else {}),
            "paths": dict(self.paths), "fallbacks": list(self.fallbacks),
        }


_scope: contextvars.ContextVar[PathLog | None] = contextvars.ContextVar("mla_eval_backend", default=None)
_unscoped_fallbacks: set[str] = set()  # fallback lines already warned about outside any scope


def check_backend(name: str, source: str = "--backend") -> str:
    """Validate a backend name (one-line UserError naming where the bad value came from)."""
    if name not in BACKENDS:
        raise UserError(f"{source} {name!r} is not a backend; choose one of {', '.join(BACKENDS)}")
    return name


def default_backend() -> str:
    """The backend when none is given: MLA_EVAL_BACKEND if set (validated), else auto."""
    return check_backend(os.environ.get(BACKEND_ENV, "auto") or "auto", source=BACKEND_ENV)


def _resolve(name: str | None) -> tuple[str, str]:
    """(backend, where it came from): `name` ("--backend"), else MLA_EVAL_BACKEND, else "default"."""
    if name is not None:
        return check_backend(name), "--backend"
    return default_backend(), BACKEND_ENV if os.environ.get(BACKEND_ENV) else "default"


@contextlib.contextmanager
def use_backend(name: str | None = None) -> Iterator[PathLog]:
    """Route every dispatch call inside the block through `name` (None: `default_backend()`).

    Yields the PathLog that records which path each call took. Nested scopes restore the outer one.
    """
    log = PathLog(*_resolve(name))
    if _scope.get() is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):  # an outermost scope is one run: its results report its own peak
            torch.cuda.reset_peak_memory_stats(i)
    token = _scope.set(log)
    try:
        yield log
    finally:
        _scope.reset(token)


@functools.lru_cache(maxsize=None)
def _cutlass_importable() -> str | None:
    try:
        import cutlass  # noqa: F401, PLC0415 - GPU-only dependency, imported on first use

        import mla_eval_kernels.cute.cache_writer  # noqa: F401, PLC0415
    except ImportError as exc:
        return f"CuTe DSL kernels unavailable ({exc}); install nvidia-cutlass-dsl"
    return None


def _device_reason(device: torch.device) -> str | None:
    """Why the CuTe kernels cannot run on `device` at all (any format), or None when they can."""
    if device.type != "cuda":
        return f"{device.type} tensors: the kernels need a CUDA GPU"
    why = _kernels_package_reason()
    if why is not None:
        return why
    from mla_eval_kernels.plan.device_limits import untested_arch_reason  # noqa: PLC0415 - torch only

    return untested_arch_reason(device) or _cutlass_importable()


@functools.lru_cache(maxsize=None)
def _kernels_package_reason() -> str | None:
    """Why the kernels package is missing, or None. It ships with mla-eval (kernels/ installs as
    mla_eval_kernels); a source tree run without installing has no such package, and that must be a
    stated fallback, not a traceback."""
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec("mla_eval_kernels") is None:
        return "the mla_eval_kernels package is not importable (install mla-eval: pip install -e .)"
    return None


def kernel_status(spec, device: torch.device | str) -> tuple[bool, str]:
    """(True, 'kernel') if the CuTe kernels serve this format on this device, else (False, why)."""
    device = torch.device(device)
    if device.type != "cuda" or _kernels_package_reason() is not None:
        return False, _device_reason(device)
    from mla_eval_kernels.plan.record_plan import UnsupportedFormat, plan_for  # noqa: PLC0415

    spec = get_format(spec)
    name = spec.name
    try:
        plan_for(spec)
    except UnsupportedFormat as exc:
        return False, f"format {name} is outside the kernels' scope: {exc}"
    why = _device_reason(device)
    return (False, why) if why is not None else (True, "kernel")


def _kernel_error(source: str, why: str) -> UserError:
    asked = f"{BACKEND_ENV}=kernel" if source == BACKEND_ENV else f"{source} kernel"
    return UserError(f"{asked}, but the CuTe kernels cannot run here: {why}; use auto or reference")


def kernel_generation() -> str | None:
    """The CuTe attention kernel generation MLA_EVAL_ATTENTION_KERNEL forces, "default" when it is unset
    (`tuning.generation_for` picks per launch), or None where the kernels package is missing;
    a value that names no generation is a one-line UserError."""
    if _kernels_package_reason() is not None:
        return None
    from mla_eval_kernels.plan.tuning import ENV, VERSIONS, forced_generation  # noqa: PLC0415 - pure Python

    try:
        return forced_generation() or "default"
    except ValueError:
        raise UserError(f"{ENV}={os.environ.get(ENV)!r} names no kernel generation; use one of {', '.join(VERSIONS)} "
                        "or unset it (the per-format default)") from None


def preflight(backend: str | None, devices: Iterable[torch.device | str]) -> str:
    """Before any work: the backend a run will use (None: `default_backend()`), validated; with
    "kernel", a one-line UserError when a device cannot run the kernels (a CPU, an untested GPU
    architecture, no CuTe DSL). Formats are checked per call (`kernel_status`). A kernel generation
    chosen by MLA_EVAL_ATTENTION_KERNEL is validated here (results record the generation:
    environment.attention.kernel_version)."""
    kernel_generation()
    backend, source = _resolve(backend)
    if backend == "kernel":
        for device in devices:
            why = _device_reason(torch.device(device))
            if why is not None:
                raise _kernel_error(source, why)
    return backend


def _fallback(scope: PathLog | None, device: torch.device, why: str) -> None:
    """Say once (per scope, or per process outside a scope) that CUDA work runs on the reference."""
    line = f"attention on {device} runs on the torch reference, not the CuTe kernels: {why}"
    seen = scope.fallbacks if scope is not None else _unscoped_fallbacks
    if line in seen:
        return
    if scope is not None:
        scope.fallbacks.append(line)
    else:
        _unscoped_fallbacks.add(line)
    warnings.warn(line, KernelFallbackWarning, stacklevel=4)


def _use_kernel(spec, device: torch.device, backend: str, op: str = "attend", blocker: str | None = None) -> bool:
    """Whether this call runs the CuTe kernel. An explicit `backend` argument wins; "auto" defers
    to the enclosing `use_backend` scope, then to MLA_EVAL_BACKEND. `blocker`: why this call's
    arguments (not the device or format) keep it off the kernel, if they do."""
    scope = _scope.get()
    source = "--backend"
    if backend == "auto":
        backend, source = (scope.backend, scope.source) if scope is not None else _resolve(None)
    check_backend(backend, source="backend")
    if backend == "reference":
        ok, why = False, "asked for"
    else:
        ok, why = kernel_status(spec, device)
        if ok and blocker is not None:
            ok, why = False, blocker
        if not ok and backend == "kernel":
            raise _kernel_error(source, why)
        if not ok and device.type == "cuda":
            _fallback(scope, device, why)
    if scope is not None:
        scope.record(op, get_format(spec).name, device, "kernel" if ok else f"reference ({why})")
    return ok


def reference_only(op: str, spec, device: torch.device | str, why: str) -> None:
    """A call only the torch reference serves, whatever the format (`why`: e.g. a model whose attention the kernels do
    not implement): recorded in the scope like a fallback, said once on a CUDA device; --backend kernel is refused."""
    device = torch.device(device)
    scope = _scope.get()
    backend, source = (scope.backend, scope.source) if scope is not None else _resolve(None)
    if backend == "kernel":
        raise _kernel_error(source, why)
    if device.type == "cuda" and backend != "reference":
        _fallback(scope, device, why)
    if scope is not None:
        scope.record(op, get_format(spec).name, device, f"reference ({why})")


def _outer_scale_value(spec, outer_scale) -> float | None:
    """The codec's validation of s_l, then the one float32 value the kernels take per call."""
    s = outer_scale_tensor(spec, outer_scale, torch.device("cpu"))
    if s is None:
        return None
    if s.numel() != 1:
        raise UserError(f"the kernels take one outer scale per layer, got {s.numel()} values")
    return float(s.reshape(()))  # exactly the float32 value the codec uses


def write_cache(
    spec,
    latent: torch.Tensor,
    rope: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache: torch.Tensor,
    outer_scale=None,
    layer: int | None = None,
    *,
    backend: str = "auto",
    check_finite: bool = True,
) -> None:
    """Encode T tokens into `cache` at `slot_mapping` (distinct slots; < 0 skipped), in place."""
    spec = get_format(spec)
    if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[2] != spec.record_bytes or not cache.is_contiguous():
        raise UserError(f"cache must be a contiguous uint8 [num_blocks, block_size, {spec.record_bytes}] tensor")
    if latent.shape[-1:] != (512,) or rope.shape[-1:] != (64,) or latent.shape[:-1] != rope.shape[:-1]:
        raise UserError(f"latent [T, 512] and rope [T, 64] expected, got {tuple(latent.shape)} and {tuple(rope.shape)}")
    blocker = None
    if latent.dtype not in _WRITER_DTYPES:
        blocker = f"the kernel writer takes bf16, fp16 or fp32 latents, not {latent.dtype}"
    if not _use_kernel(spec, cache.device, backend, op="write", blocker=blocker):
        reference.write_cache(spec, latent, rope, slot_mapping, cache, outer_scale=outer_scale, layer=layer)
        return
    s_l = _outer_scale_value(spec, outer_scale)
    # The kernels cannot raise: check here (one device sync for both tensors), and on a failure
    # let the codec's check name the first bad value.
    if check_finite and not bool(torch.isfinite(latent).all() & torch.isfinite(rope).all()):
        require_finite(latent.float(), "latent", layer)
        require_finite(rope.float(), "rope", layer)
    from mla_eval_kernels.cute import cache_writer  # noqa: PLC0415 - CUDA-only import
    from mla_eval_kernels.plan.record_plan import plan_for  # noqa: PLC0415

    rope = rope.to(latent.dtype)
    cache_writer.write_cache(
        plan_for(spec),
        latent.reshape(-1, 512).contiguous(),
        rope.reshape(-1, 64).contiguous(),
        slot_mapping.reshape(-1).to(device=cache.device, dtype=torch.int64).contiguous(),
        cache,
        s_l,
    )


def mla_attention(
    spec,
    q: torch.Tensor,
    cache: torch.Tensor,
    *,
    softmax_scale: float,
    block_table: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    outer_scale=None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    backend: str = "auto",
    math: str | AttentionMath = "bf16",
    queries_per_seq: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [N, H, 512] float32 and lse [N, H] float32; dense (block_table + seq_lens) or sparse (indices).

    `queries_per_seq`: how many of the N queries read each sequence's keys (1: a decode step; T: the
    prefill-as-decode path); it picks the kernel generation (`tuning.generation_for`, through the cached
    `mla_eval_kernels.plan.launch.launch_plan`).
    `max_seq_len` (dense) spares the kernel path a device sync to find the longest list;
    `num_splits` overrides the split-KV heuristic (kernel path only). `math` is the attention math
    (`mla_eval.attention.semantics.MATHS`): fp8 Q is quantised here, once, for both paths -- the
    E4M3 codes are exact in bf16, so the kernel fed the codes with the Q scale folded into the
    softmax scale computes the same products as the reference; P in E4M3 is reference-only.
    """
    spec = get_format(spec)
    math = get_math(math, option="math")
    if (indices is None) == (block_table is None or seq_lens is None):
        raise ValueError("give either block_table and seq_lens (dense) or indices (sparse)")
    if q.dim() != 3 or q.shape[2] != QK_DIM:
        raise UserError(f"q must be [N, H, {QK_DIM}], got {tuple(q.shape)}")
    if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[2] != spec.record_bytes:
        raise UserError(f"cache must be uint8 [num_blocks, block_size, {spec.record_bytes}]")
    if sink is not None and sink.shape != (q.shape[1],):
        raise UserError(f"sink must be [H] = [{q.shape[1]}], got {tuple(sink.shape)}")
    q, softmax_scale = _q_for_math(q, softmax_scale, math)
    if not _use_kernel(spec, cache.device, backend, blocker=math.kernel_blocker):
        return reference.mla_attention(
            spec, q, cache, softmax_scale=softmax_scale, block_table=block_table, seq_lens=seq_lens,
            indices=indices, sink=sink, outer_scale=outer_scale, p_fp8=math.p_fp8,
        )
    from mla_eval_kernels.cute import launch  # noqa: PLC0415 - CUDA-only import
    from mla_eval_kernels.plan.device_limits import device_facts  # noqa: PLC0415
    from mla_eval_kernels.plan.launch import launch_plan  # noqa: PLC0415
    from mla_eval_kernels.plan.record_plan import plan_for  # noqa: PLC0415

    s_l = _outer_scale_value(spec, outer_scale)
    dev = cache.device
    plan = plan_for(spec)
    chosen = launch_plan(
        plan, sparse=indices is not None, heads=q.shape[1], facts=device_facts(dev), queries_per_seq=queries_per_seq
    )
    scope = _scope.get()
    if scope is not None:
        scope.record_generation(spec.name, dev, chosen.generation, chosen.why)
    i32 = functools.partial(torch.as_tensor, dtype=torch.int32, device=dev)
    return launch.run(
        chosen,
        plan,
        q.to(device=dev, dtype=torch.bfloat16).contiguous(),
        cache.contiguous(),
        softmax_scale=float(softmax_scale),
        block_table=None if block_table is None else i32(block_table).contiguous(),
        seq_lens=None if seq_lens is None else i32(seq_lens).contiguous(),
        indices=None if indices is None else i32(indices).contiguous(),
        sink=None if sink is None else sink.to(device=dev, dtype=torch.float32).contiguous(),
        outer_scale=s_l,
        max_seq_len=max_seq_len,
        num_splits=num_splits,
    )


def mla_attention_dense(spec, q, cache, block_table, seq_lens, softmax_scale, sink=None, outer_scale=None, **kw):
    """Dense causal lists: query n sees keys 0..seq_lens[n]-1 through its block_table row."""
    return mla_attention(
        spec, q, cache, softmax_scale=softmax_scale, block_table=block_table, seq_lens=seq_lens,
        sink=sink, outer_scale=outer_scale, **kw,
    )


def mla_attention_sparse(spec, q, cache, indices, softmax_scale, sink=None, outer_scale=None, **kw):
    """Sparse top-k lists: indices [N, topk] of global slot ids, -1 (or out of range) invalid."""
    return mla_attention(
        spec, q, cache, softmax_scale=softmax_scale, indices=indices, sink=sink, outer_scale=outer_scale, **kw
    )


def mla_attention_chunk(
    spec,
    q: torch.Tensor,
    cache: torch.Tensor,
    *,
    softmax_scale: float,
    block_table: torch.Tensor,
    prefix_len: int,
    chunk_keys: torch.Tensor,
    outer_scale=None,
    backend: str = "auto",
    math: str | AttentionMath = "bf16",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Engine chunked-prefill attention: q [B * T, H, 576] of each sequence's current chunk (positions
    prefix_len .. prefix_len + T - 1) over the cache's positions < prefix_len and the chunk's fresh
    keys `chunk_keys` [B, T, 576] (causal within the chunk). See `reference.mla_attention_chunk`.

    Kernel path: the prefix through the format's kernel (every query reads prefix_len keys) and the
    chunk through the bf16 kernel over a scratch bf16 paged cache holding the fresh keys (the bf16
    format stores bf16 values exactly), merged by their log-sum-exp as vLLM's `merge_attn_states`
    does. Same math as the reference up to float32 summation order.
    """
    spec = get_format(spec)
    math = get_math(math, option="math")
    b, t = chunk_keys.shape[:2]
    if q.dim() != 3 or q.shape[2] != QK_DIM or q.shape[0] != b * t:
        raise UserError(f"q must be [B * T = {b * t}, H, {QK_DIM}], got {tuple(q.shape)}")
    q, softmax_scale = _q_for_math(q, softmax_scale, math)
    if not _use_kernel(spec, cache.device, backend, blocker=math.kernel_blocker):
        return reference.mla_attention_chunk(
            spec, q, cache, softmax_scale=softmax_scale, block_table=block_table, prefix_len=prefix_len,
            chunk_keys=chunk_keys, outer_scale=outer_scale, p_fp8=math.p_fp8,
        )
    dev = cache.device
    bf16 = get_format("bf16")
    block = cache.shape[1]
    blocks = -(-t // block)
    scratch = torch.zeros(b * blocks, block, bf16.record_bytes, dtype=torch.uint8, device=dev)
    table = torch.arange(b * blocks, dtype=torch.int32, device=dev).view(b, blocks)
    pos = torch.arange(t, device=dev)
    slots = (table[:, pos // block].long() * block + pos % block).reshape(-1)
    keys = chunk_keys.reshape(b * t, QK_DIM)
    write_cache(bf16, keys[:, :LATENT_DIM], keys[:, LATENT_DIM:], slots, scratch, backend="kernel")
    out, lse = mla_attention(
        bf16, q, scratch, softmax_scale=softmax_scale, block_table=table.repeat_interleave(t, 0),
        seq_lens=(pos + 1).repeat(b).to(torch.int32), max_seq_len=t, backend="kernel", queries_per_seq=t,
    )
    if prefix_len == 0:
        return out, lse
    out_p, lse_p = mla_attention(
        spec, q, cache, softmax_scale=softmax_scale, block_table=block_table.repeat_interleave(t, 0),
        seq_lens=torch.full((b * t,), prefix_len, dtype=torch.int32, device=dev), outer_scale=outer_scale,
        max_seq_len=prefix_len, backend="kernel", queries_per_seq=t,
    )
    return merge_states(out_p, lse_p, out, lse)


def _q_for_math(q: torch.Tensor, softmax_scale: float, math: AttentionMath) -> tuple[torch.Tensor, float]:
    """The query and softmax scale an attention math feeds both paths: with fp8 Q, the E4M3 codes (exact in
    bf16) and the Q scale folded into the softmax scale, so the kernel's bf16 MMA computes the fp8 products."""
    if not math.q_fp8:
        return q, softmax_scale
    q, q_scale = quantize_q(q, math)
    return q, float(softmax_scale) * q_scale


def merge_states(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint key sets -> the attention over their union (log-sum-exp
    weights; a part with lse = -inf has no keys and weight 0)."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = wa + wb
    out = (out_a * wa.unsqueeze(-1) + out_b * wb.unsqueeze(-1)) / torch.where(total > 0, total, 1.0).unsqueeze(-1)
    return out, m + torch.log(total)
