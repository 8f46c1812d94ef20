"""FP8 weights computed in FP8, as SGLang and vLLM serve block-quantised checkpoints: the arithmetic of record.

A DeepSeek-style FP8 checkpoint stores each Linear weight as float8_e4m3fn codes W_q [N, K] with one float32 scale
per 128 x 128 block (`weight_scale_inv` [ceil(N/128), ceil(K/128)]; mla_eval.model.weight_formats). The engines keep
those bytes as stored and quantise the activations on the fly, per token in groups of 128 along K ("1x128"), then
run a block-scaled FP8 GEMM (DeepGEMM's `fp8_gemm_nt` / `m_grouped_fp8_gemm_nt_contiguous` on Hopper):

    X_q[m, k], s_x[m, g]     per token m and K-group g (k // 128), by the engine's rule below
    P_g[m, n] = sum_{k in g} fp32(X_q[m, k]) * fp32(W_q[n, k])      (fp32 accumulation inside one K-group)
    Y[m, n]   = sum_g P_g[m, n] * (s_x[m, g] * s_w[n // 128, g])    (the scales applied per K-group, in fp32)
    out       = Y rounded to the activation dtype (bf16)

DeepGEMM's Hopper kernel promotes each 128-deep K-group's tensor-core partial sum to fp32 CUDA-core registers and
adds it there multiplied by the product of the two scales (deepseek-ai/DeepGEMM README, "FP8 ... promotion" and
`sm90_fp8_gemm_1d2d.cuh`, `final_accum += scale_a * scale_b * accum`); `block_fp8_matmul` below is exactly that,
with torch's fp32 matmul for P_g (the tensor core's partial sum differs from it only in the order it adds the
exact e4m3 x e4m3 products). It runs anywhere; it is what the GPU kernel is tested against (tests/test_fp8_gpu.py).

Activation quantisation: one engine rule each (`ActQuantRule`), on Hopper:

- SGLang (`sgl_per_token_group_quant_fp8`, sgl-project/sglang sgl-kernel/csrc/gemm/per_token_group_quant_8bit.cu,
  commit 00568d901494b258992378a66983d5486e587722): amax = max(1e-10, max |x|) in fp32; stored scale
  s = amax * fp32(1/448); codes = e4m3_satfinite_rn(x * (448 / amax)) (a multiply by an fp32 quotient, not a division
  by s). Scales are plain fp32 on Hopper: `DEEPGEMM_SCALE_UE8M0 = DEEPGEMM_BLACKWELL`
  (python/sglang/srt/layers/deep_gemm_wrapper/configurer.py). This is `SGLANG` (the default rule).
- vLLM (`per_token_group_quant_fp8` -> `per_token_group_quant_8bit_kernel`, vllm-project/vllm
  csrc/quantization/fp8/per_token_group_quant.cu, commit 0ba022c2905baad57de4ca3ec1b2b02525dfa857): amax as SGLang;
  s = amax / 448; with UE8M0 scales s = exp2(ceil(log2(max(s, 1e-10)))); codes = e4m3_rn(clamp(x / s, -448, 448)).
  vLLM uses UE8M0 (power-of-two) scales with DeepGEMM on Hopper as well by default (`DeepGemmQuantScaleFMT`
  FLOAT32_CEIL_UE8M0, VLLM_USE_DEEP_GEMM_E8M0=1: vllm/utils/deep_gemm.py and vllm/envs.py); it then also re-quantises
  weights whose block scales are not powers of two (`requant_weight_ue8m0_inplace`), which this module does not model:
  `VLLM` is offered for checkpoints whose weight scales are powers of two already (DeepSeek-V3.2's `scale_fmt: ue8m0`),
  and `check_pow2_weight_scales` refuses the others.

The K of an activation must be a multiple of 128 (both engines assert it); so must N for the fused GPU kernel
(a partial last block row of W is fine for this reference).
"""

from __future__ import annotations

import dataclasses

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
GROUP = 128  # activation group (1 x 128) and weight block (128 x 128) of every engine we model
_EPS = 1e-10  # both engines' floor under a group's amax


@dataclasses.dataclass(frozen=True)
class ActQuantRule:
    """How an engine quantises one token's 128-value group of activations to e4m3 (see the module docstring)."""

    name: str
    pow2: bool  # scales rounded up to a power of two (UE8M0 values kept in fp32)
    multiply: bool  # codes = x * (448 / amax) (SGLang) rather than x / s (vLLM)
    source: str


SGLANG = ActQuantRule("sglang", pow2=False, multiply=True,
                      source="sgl-kernel per_token_group_quant_8bit.cu @00568d90 (Hopper: fp32 scales)")
VLLM = ActQuantRule("vllm", pow2=True, multiply=False,
                    source="vllm csrc/quantization/fp8/per_token_group_quant.cu @0ba022c2 (DeepGEMM on Hopper: "
                    "UE8M0 scales)")
ACT_RULES = {r.name: r for r in (SGLANG, VLLM)}


def _ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """ceil(log2(x)) of positive normal fp32 values, from their bits (DeepEP's fast_log2_ceil, which SGLang uses)."""
    bits = x.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    return exponent - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e as fp32 for integer e in [-126, 127] (built from the exponent bits, exact)."""
    return ((e + 127).to(torch.int32) << 23).view(torch.float32)


def quantise_activations(x: torch.Tensor, rule: ActQuantRule = SGLANG) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 1x128 quantisation of `x` [..., K] (K a multiple of 128): (codes e4m3 [..., K], scales fp32
    [..., K/128]) such that x ~ codes * scale, by the engine `rule`."""
    k = x.shape[-1]
    if k % GROUP:
        raise ValueError(f"activations of width {k}: the engines quantise in groups of {GROUP} (K must divide)")
    xf = x.float().reshape(*x.shape[:-1], k // GROUP, GROUP)
    amax = xf.abs().amax(-1).clamp_min(_EPS)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    fp8_max = one * FP8_MAX
    if rule.multiply:  # SGLang: separate fp32 multiplier and stored scale
        if rule.pow2:
            e = _ceil_log2(amax * (one / fp8_max))
            scale, mult = _pow2(e), _pow2(-e)
        else:
            scale, mult = amax * (one / fp8_max), fp8_max / amax
        y = xf * mult.unsqueeze(-1)
    else:  # vLLM: divide by the stored scale
        scale = amax / fp8_max
        if rule.pow2:
            scale = torch.exp2(torch.ceil(torch.log2(scale.abs().clamp_min(_EPS))))
        y = xf / scale.unsqueeze(-1)
    codes = y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.reshape(x.shape), scale


def block_grid(n: int, k: int) -> tuple[int, int]:
    return -(-n // GROUP), -(-k // GROUP)


@torch.no_grad()
def block_fp8_matmul(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                     out_dtype: torch.dtype = torch.bfloat16, rows_per_chunk: int = 4096) -> torch.Tensor:
    """Y = X W^T with X = (xq [M, K] e4m3, xs [M, K/128] fp32) and W = (wq [N, K] e4m3, ws [ceil(N/128), K/128] fp32),
    the module docstring's arithmetic: per K-group an fp32 partial product, scaled by s_x * s_w and summed in fp32.
    Rows are processed `rows_per_chunk` at a time (bounds the [groups, rows, N] partials)."""
    m, k = xq.shape
    n = wq.shape[0]
    groups = k // GROUP
    if k % GROUP or xs.shape != (m, groups) or ws.shape != block_grid(n, k) or wq.shape[1] != k:
        raise ValueError(f"block FP8 shapes: x {tuple(xq.shape)} / {tuple(xs.shape)}, w {tuple(wq.shape)} / "
                         f"{tuple(ws.shape)}")
    w = wq.float().reshape(n, groups, GROUP).permute(1, 2, 0)  # [G, 128, N]
    sw = ws.float().repeat_interleave(GROUP, 0)[:n].t()  # [G, N]: each row's block scale
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    step = max(1, min(m, rows_per_chunk))
    with _ieee_fp32():
        for r in range(0, m, step):
            x = xq[r: r + step].float().reshape(-1, groups, GROUP).transpose(0, 1)  # [G, rows, 128]
            partial = torch.bmm(x, w)  # [G, rows, N], fp32 within each K-group
            scale = xs[r: r + step].float().t().unsqueeze(-1) * sw.unsqueeze(1)  # [G, rows, N]: s_x * s_w
            acc = torch.zeros(x.shape[1], n, dtype=torch.float32, device=xq.device)
            for g in range(groups):  # the promotion order: group after group
                acc += partial[g] * scale[g]
            out[r: r + step] = acc.to(out_dtype)
    return out


class _ieee_fp32:
    """fp32 matrix products in full fp32 (no TF32) while the reference runs; the setting is restored after."""

    def __enter__(self):
        self._saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        return self

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self._saved


def fp8_linear_reference(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, rule: ActQuantRule = SGLANG) -> torch.Tensor:
    """A block-FP8 Linear: `x` [..., K] quantised per token (rule), times the stored weight; [..., N] in x's dtype."""
    xq, xs = quantise_activations(x.reshape(-1, x.shape[-1]), rule)
    y = block_fp8_matmul(xq, xs, wq, ws, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], wq.shape[0])


def dequantise_blocks(wq: torch.Tensor, ws: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W = fp32(codes) * block scale, in `dtype` (the dequantised weight the bf16 path computes with)."""
    n, k = wq.shape[-2:]
    s = ws.float().repeat_interleave(GROUP, -2)[..., :n, :].repeat_interleave(GROUP, -1)[..., :k]
    return (wq.float() * s).to(dtype)


def check_pow2_weight_scales(ws: torch.Tensor, what: str) -> None:
    """vLLM's rule keeps stored weights only where their block scales are powers of two (else it re-quantises them,
    not modelled here): a ValueError naming the first weight that is not."""
    bits = ws.float().contiguous().view(torch.int32)
    if bool(((bits & 0x7FFFFF) != 0).any()):
        raise ValueError(f"{what} has block scales that are not powers of two: vLLM re-quantises such weights to UE8M0 "
                         "scales before its FP8 GEMM, which mla-eval does not model; use the sglang rule")


@torch.no_grad()
def grouped_experts_reference(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                              w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                              intermediate: int, rule: ActQuantRule = SGLANG) -> torch.Tensor:
    """Routed experts in FP8, the engines' way: `hidden` [T, H] quantised once per token, per expert the gate and
    up products (w13 [E, 2I', H] codes with s13 [E, 2 * ceil(I/128), H/128]: gate's block rows, then up's), SiLU(gate)
    * up in the activation dtype (two roundings, as transformers and SGLang's act_and_mul compute it), that product
    quantised per token, the down product (w2 [E, H, I], s2 [E, H/128, ceil(I/128)]), and the top-k weighted sum in
    fp32, rounded once to hidden's dtype. [T, H]."""
    t, h = hidden.shape
    k = top_k_index.shape[-1]
    xq, xs = quantise_activations(hidden, rule)
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = order // k
    out = torch.zeros(t * k, h, dtype=torch.float32, device=hidden.device)
    ib = -(-intermediate // GROUP)
    experts = flat[order]
    bounds = torch.searchsorted(experts, torch.arange(w13.shape[0] + 1, device=experts.device)).tolist()
    for e in range(w13.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        r = rows[lo:hi]
        gate = block_fp8_matmul(xq[r], xs[r], w13[e, :intermediate], s13[e, :ib], hidden.dtype)
        up = block_fp8_matmul(xq[r], xs[r], w13[e, intermediate:], s13[e, ib:], hidden.dtype)
        act = torch.nn.functional.silu(gate) * up
        aq, as_ = quantise_activations(act, rule)
        out[order[lo:hi]] = block_fp8_matmul(aq, as_, w2[e], s2[e], hidden.dtype).float()
    weighted = out.view(t, k, h) * top_k_weights.float().unsqueeze(-1)
    return weighted.sum(1).to(hidden.dtype)
