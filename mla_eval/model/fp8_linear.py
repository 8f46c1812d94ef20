"""`--weight-math`: FP8 block-quantised weights kept as stored and computed in FP8 (as the engines serve them), or
dequantised once to the run dtype.

`resolve_weight_math(asked, format)` decides, once per run, from the checkpoint's weight format:

- `dequant`: every quantised weight dequantised to the run dtype when its layer is materialised (what mla-eval always
  did; exact: mla_eval.model.weight_formats).
- `fp8`: a DeepSeek-style FP8 checkpoint's 128x128 block-scaled weights stay e4m3 with their scales (half the bytes of
  bf16 on the device and half the bytes per streamed layer's copy) and every such Linear computes as SGLang and vLLM do
  (mla_eval.model.fp8_math: activations quantised per token in 1x128 groups, block-scaled FP8 GEMM, fp32 accumulation).
  `convert(model, checkpoint)` swaps the modules of a model built on the meta device before its weights are read:
  each FP8 `nn.Linear` becomes an `Fp8Linear`, each MoE layer's routed experts an `Fp8Experts`. `kv_b_proj` stays
  dequantised: our absorbed attention reads it as a matrix (W_UK, W_UV), as vLLM's MLA does after loading
  (`get_and_maybe_dequant_weights`), so the cache formats under test see the same up-projection in both maths.
- `auto` (the default): what the engines do with the checkpoint: `fp8` for FP8 block weights (vLLM's
  W8A8BlockFp8LinearOp / SGLang's Fp8LinearMethod with DeepGEMM), else `dequant` (bf16 weights have nothing to
  quantise; NVFP4 and per-channel FP8 run kernels this tool does not model, said in the reason).

On a Hopper GPU with DeepGEMM importable (mla_eval.model.deepgemm) the products run there; elsewhere the torch
reference computes the same arithmetic (slow on a GPU, said once as a warning). `FP8_LOG` counts which backend served
each call; results record it.
"""

from __future__ import annotations

import collections
import re
import warnings
from typing import Any

import torch

from mla_eval.errors import UserError
from mla_eval.model import deepgemm, fp8_math
from mla_eval.model.fp8_math import GROUP, SGLANG, ActQuantRule

WEIGHT_MATHS = ("auto", "dequant", "fp8")
WEIGHT_MATH_HELP = (
    "How quantised checkpoint weights compute: 'fp8' keeps FP8 block weights as stored and runs FP8 GEMMs with "
    "activations quantised per token in 1x128 groups (as SGLang/vLLM serve them; half the bytes to hold and stream), "
    "'dequant' dequantises every weight once to the run dtype, 'auto' does what the engines do for the checkpoint "
    "(fp8 for DeepSeek-style FP8 block weights, else dequant). Recorded in results."
)
_KEEP_DEQUANTISED = ("kv_b_proj",)  # read as a matrix by our absorbed attention (see the module docstring)
_EXPERT = re.compile(r"^(?P<experts>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$")


def check_weight_math(asked: str) -> str:
    if asked not in WEIGHT_MATHS:
        raise UserError(f"--weight-math {asked!r}: choose one of {', '.join(WEIGHT_MATHS)}")
    return asked


def resolve_weight_math(asked: str, fmt) -> tuple[str, str]:
    """(dequant | fp8, why) for a checkpoint of weight format `fmt` (mla_eval.model.weight_formats.WeightFormat; None
    for a model that never went through the checkpoint reader)."""
    check_weight_math(asked)
    method = getattr(fmt, "method", "none")
    fp8_block = method == "fp8" and tuple(fmt.block_size or (GROUP, GROUP)) == (GROUP, GROUP)
    if asked == "fp8":
        if not fp8_block:
            what = "bf16 weights" if method == "none" else f"{method} weights"
            raise UserError(f"--weight-math fp8 computes FP8 128x128 block weights as stored; this model has {what}: "
                            "use --weight-math dequant (or auto)")
        return "fp8", "asked (--weight-math fp8)"
    if asked == "dequant":
        return "dequant", "asked (--weight-math dequant)"
    if fp8_block:
        return "fp8", "auto: FP8 128x128 block weights, which SGLang and vLLM compute with block FP8 GEMMs"
    if method == "none":
        return "dequant", "auto: weights stored in the run's precision (nothing to quantise)"
    return "dequant", (f"auto: {method} weights are dequantised to the run dtype (an engine runs them through kernels "
                       "this tool does not model)")


class _Fp8Log:
    """Calls of the FP8 products per backend, and the fallbacks said (one warning each)."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self._said: set[str] = set()

    def served(self, backend: str, device: torch.device, why: str = "") -> None:
        self.calls[backend] += 1
        if backend == "torch" and device.type == "cuda" and why not in self._said:
            self._said.add(why)
            warnings.warn(f"FP8 weight math on the GPU through the torch reference ({why}): correct but slow; "
                          "install sgl-deep-gemm for DeepGEMM's kernels", stacklevel=3)

    def as_dict(self) -> dict[str, int]:
        return dict(self.calls)

    def reset(self) -> None:
        self.calls.clear()


FP8_LOG = _Fp8Log()


def fp8_calls() -> dict[str, int]:
    """FP8 products per backend since the run's execution opened (mla_eval.model.strategy resets the count)."""
    return FP8_LOG.as_dict()


def _backend(device: torch.device, n: int, k: int) -> tuple[str, str]:
    if device.type != "cuda":
        return "torch", ""
    if not deepgemm.supports(n, k):
        return "torch", f"a weight {k} wide is not whole 128-column blocks"
    if deepgemm.asked_backend() == "deepgemm":
        deepgemm.require()
        return "deepgemm", ""
    ok, why = deepgemm.available()
    return ("deepgemm", "") if ok else ("torch", why)


def fp8_gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """One block-FP8 product (fp8_math.block_fp8_matmul's arithmetic) on the best backend here."""
    backend, why = _backend(xq.device, wq.shape[0], wq.shape[1])
    FP8_LOG.served(backend, xq.device, why)
    if backend == "deepgemm":
        return deepgemm.gemm(xq, xs, wq, ws, out_dtype)
    return fp8_math.block_fp8_matmul(xq, xs, wq, ws, out_dtype)


class Fp8Linear(torch.nn.Module):
    """A bias-free Linear whose weight stays as the checkpoint stores it: `weight` e4m3 [out, in] and
    `weight_scale_inv` fp32 [ceil(out/128), ceil(in/128)] (the checkpoint's own names, so the reader fills them)."""

    def __init__(self, in_features: int, out_features: int, rule: ActQuantRule = SGLANG, device="meta") -> None:
        super().__init__()
        self.in_features, self.out_features, self.rule = in_features, out_features, rule
        self.weight_math = "fp8"
        nb, kb = fp8_math.block_grid(out_features, in_features)
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
                                         requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(torch.empty(nb, kb, dtype=torch.float32, device=device),
                                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        xq, xs = fp8_math.quantise_activations(flat, self.rule)
        y = fp8_gemm(xq, xs, self.weight, self.weight_scale_inv, x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 128x128, rule={self.rule.name}"


class Fp8Experts(torch.nn.Module):
    """A MoE layer's routed experts with FP8 weights as stored, fused per expert as transformers fuses them:
    `gate_up_proj` e4m3 [E, 2I, H] (gate rows, then up rows) with `gate_up_proj_scale_inv` [E, 2 ceil(I/128),
    ceil(H/128)] (gate's block rows, then up's), `down_proj` [E, H, I] with `down_proj_scale_inv` [E, ceil(H/128),
    ceil(I/128)]. Called as transformers' experts are: (hidden [T, H], top_k_index [T, k], top_k_weights [T, k])."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act_fn, rule: ActQuantRule = SGLANG,
                 device="meta") -> None:
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden, intermediate
        self.act_fn, self.rule, self.weight_math = act_fn, rule, "fp8"
        ib, hb = -(-intermediate // GROUP), -(-hidden // GROUP)

        def param(*shape, dtype):
            return torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        e4m3 = torch.float8_e4m3fn
        self.gate_up_proj = param(num_experts, 2 * intermediate, hidden, dtype=e4m3)
        self.gate_up_proj_scale_inv = param(num_experts, 2 * ib, hb, dtype=torch.float32)
        self.down_proj = param(num_experts, hidden, intermediate, dtype=e4m3)
        self.down_proj_scale_inv = param(num_experts, hb, ib, dtype=torch.float32)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        i = self.intermediate_dim
        # the grouped kernel takes the fused gate/up rows whole: the intermediate width in whole blocks
        backend, why = (_backend(hidden.device, i, self.hidden_dim) if i % GROUP == 0 else
                        ("torch", f"an expert intermediate width of {i} is not whole 128-row blocks"))
        FP8_LOG.served(f"{backend}-grouped", hidden.device, why)
        if backend == "deepgemm":
            return self._deepgemm(hidden, top_k_index, top_k_weights)
        return fp8_math.grouped_experts_reference(hidden, top_k_index, top_k_weights, self.gate_up_proj,
                                                  self.gate_up_proj_scale_inv, self.down_proj, self.down_proj_scale_inv,
                                                  i, self.rule)

    def _deepgemm(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """The contiguous grouped layout: (token, expert) pairs sorted by expert, each expert's rows padded to the
        kernel's alignment (padding rows marked -1), two grouped FP8 products, then the weighted top-k sum."""
        t, h = hidden.shape
        k = top_k_index.shape[-1]
        align = deepgemm.alignment()
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        padded = (counts + align - 1) // align * align
        starts = torch.cumsum(padded, 0) - padded  # first padded row of each expert
        total = int(padded.sum())  # one host sync per MoE layer
        sorted_experts = flat[order]
        first_sorted = torch.cumsum(counts, 0) - counts
        dest = starts[sorted_experts] + (torch.arange(order.numel(), device=hidden.device) - first_sorted[sorted_experts])
        m_indices = torch.full((total,), -1, dtype=torch.int32, device=hidden.device)
        m_indices[dest] = sorted_experts.int()
        xq, xs = fp8_math.quantise_activations(hidden, self.rule)  # once per token, as the engines quantise
        aq, as_ = _scatter_rows(xq, xs, order // k, dest, total)
        gate_up = deepgemm.grouped_gemm(aq, as_, self.gate_up_proj, self.gate_up_proj_scale_inv, m_indices, hidden.dtype)
        gate, up = gate_up[dest].split(self.intermediate_dim, dim=-1)
        act = self.act_fn(gate) * up
        bq, bs = fp8_math.quantise_activations(act, self.rule)
        bq, bs = _scatter_rows(bq, bs, None, dest, total)
        down = deepgemm.grouped_gemm(bq, bs, self.down_proj, self.down_proj_scale_inv, m_indices, hidden.dtype)
        out = torch.empty(t * k, h, dtype=torch.float32, device=hidden.device)
        out[order] = down[dest].float()
        return (out.view(t, k, h) * top_k_weights.float().unsqueeze(-1)).sum(1).to(hidden.dtype)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"fp8 128x128, rule={self.rule.name}")


def _scatter_rows(q: torch.Tensor, s: torch.Tensor, rows: torch.Tensor | None, dest: torch.Tensor, total: int):
    """Rows `rows` of (codes, scales) (all rows when None) placed at rows `dest` of a zero-padded [total, ...] pair
    (padding rows: zero codes, unit scales). Codes move as bytes: indexing kernels need not know float8."""
    qb = q.view(torch.uint8)
    src_q, src_s = (qb, s) if rows is None else (qb[rows], s[rows])
    out_q = torch.zeros(total, q.shape[1], dtype=torch.uint8, device=q.device)
    out_s = torch.ones(total, s.shape[1], dtype=torch.float32, device=q.device)
    out_q[dest] = src_q
    out_s[dest] = src_s.float()
    return out_q.view(q.dtype), out_s


def convert(model: torch.nn.Module, quantised: dict, num_layers: int, rule: ActQuantRule = SGLANG) -> dict[str, Any]:
    """Swap, in a model whose parameters are on the meta device, every module the checkpoint stores as FP8 128x128
    blocks (`quantised`: weight name -> QuantisedWeight, from the reader) for its FP8 twin, except kv_b_proj; MTP
    layers (past `num_layers`, never built) are skipped. Returns what was converted (counts, for results)."""
    linears, experts = set(), collections.defaultdict(set)
    for q in quantised.values():
        if q.scheme != "fp8-block":
            continue
        m = re.search(r"layers\.(\d+)\.", q.base)
        if m and int(m.group(1)) >= num_layers:
            continue
        if q.base.rsplit(".", 1)[-1] in _KEEP_DEQUANTISED:
            continue
        e = _EXPERT.match(q.base)
        if e:
            experts[e.group("experts")].add((int(e.group("e")), e.group("proj")))
        else:
            linears.add(q.base)
    for base in sorted(linears):
        owner_name, _, leaf = base.rpartition(".")
        owner = model.get_submodule(owner_name)
        old = getattr(owner, leaf, None)
        if not isinstance(old, torch.nn.Linear) or old.bias is not None:
            raise UserError(f"{base}: the checkpoint stores FP8 weights for a module that is not a bias-free Linear "
                            f"({type(old).__name__}); use --weight-math dequant")
        setattr(owner, leaf, Fp8Linear(old.in_features, old.out_features, rule))
    for base, parts in sorted(experts.items()):
        owner_name, _, leaf = base.rpartition(".")
        owner = model.get_submodule(owner_name)
        old = getattr(owner, leaf)
        n = old.gate_up_proj.shape[0] if hasattr(old, "gate_up_proj") else 0
        if n == 0 or len(parts) != 3 * n:
            raise UserError(f"{base}: the checkpoint stores {len(parts)} FP8 expert weights for {3 * n} expert "
                            "projections; use --weight-math dequant")
        inter, hidden = old.down_proj.shape[2], old.down_proj.shape[1]
        setattr(owner, leaf, Fp8Experts(n, hidden, inter, old.act_fn, rule))
    return {"linears": len(linears), "experts_layers": len(experts), "kept_dequantised": list(_KEEP_DEQUANTISED),
            "rule": rule.name, "rule_source": rule.source}

