"""Torch codecs for every format, driven only by its `FormatSpec`.

`encode(fmt, latent[..., 512], rope[..., 64], outer_scale=None) -> uint8 [..., record_bytes]`
`decode(fmt, records[..., record_bytes], outer_scale=None) -> (latent, rope)` in float32.

Vectorised and device agnostic: the same code runs on CPU and CUDA tensors. The arithmetic is the
one spelled out in `spec.py`; these functions are the bit-exact reference the GPU writers are
tested against. Divisions are always tensor / tensor so that no backend replaces them with a
multiplication by a rounded reciprocal (PyTorch's CUDA division by a scalar does that).
"""

from __future__ import annotations

import torch

from mla_eval.errors import NonFiniteInputError, UserError
from mla_eval.formats import approx, ggml
from mla_eval.formats import numerics as nx
from mla_eval.formats.registry import get_format
from mla_eval.formats.spec import (
    TOKEN_SCALE_DENOMINATOR,
    FormatSpec,
    ScaleApply,
    ScaleOrder,
    ScaleRule,
    TokenScaleRule,
    VectorCoding,
)

OuterScaleArg = float | torch.Tensor | None


def _div(a: torch.Tensor, b: float) -> torch.Tensor:
    """IEEE float32 a / b (b broadcast as a tensor, never as a scalar)."""
    return a / torch.full_like(a, b)


def _floor(a: torch.Tensor, floor: float) -> torch.Tensor:
    """max(a, float32(floor)): the floor rounded to float32 first, as the GPU writers hold it."""
    return torch.maximum(a, torch.full_like(a, floor))


def _recip(s: torch.Tensor) -> torch.Tensor:
    """Correctly rounded 1 / s; 0 where s == 0 (an all-zero NVFP4 block)."""
    r = torch.ones_like(s) / s
    return torch.where(s == 0, torch.zeros_like(r), r)


def _as_f32(x: torch.Tensor, what: str, dim: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor")
    if x.shape[-1:] != (dim,):
        raise UserError(f"{what} has last dimension {tuple(x.shape)[-1:]}, expected {dim}")
    if not x.is_floating_point():
        raise UserError(f"{what} must be a floating-point tensor, got {x.dtype}")
    return x.to(torch.float32)


def check_finite(x: torch.Tensor, what: str, layer: int | None) -> None:
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        value = float(x[index])
        where = f"layer {layer}, " if layer is not None else ""
        raise NonFiniteInputError(
            f"{what} is {value} at {where}index {index} (leading dims = token position); "
            "cache formats need finite values: check the model's activations (overflow?) or the input text"
        )


def outer_scale_tensor(spec: FormatSpec, outer_scale: OuterScaleArg, device: torch.device) -> torch.Tensor | None:
    """Validate the per-layer scale for `spec`; as a float32 tensor (broadcast over the leading
    dims), or None. The one place the outer-scale rules are checked (GPU dispatch calls it too)."""
    rule = spec.outer_scale
    if outer_scale is None:
        if rule is not None and rule.required:
            raise UserError(f"format {spec.name} needs a per-layer outer scale; pass --scales FILE (see `mla-eval calibrate`)")
        return None
    if rule is None:
        raise UserError(f"format {spec.name} takes no outer scale s_l; use one of the nvfp4 / fp8_e4m3 formats for --scales")
    s = torch.as_tensor(outer_scale, dtype=torch.float32, device=device)
    if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
        raise UserError(f"outer scale for {spec.name} must be positive and finite, got {s.flatten()[:4].tolist()}")
    return s.unsqueeze(-1) if s.dim() else s


def _amax_rcp6(amax: torch.Tensor) -> torch.Tensor:
    """amax * rcp.approx.ftz(6): NVIDIA's NVFP4 block-scale step (the measured rcp.approx(6), see approx.py)."""
    return amax * torch.full_like(amax, approx.rcp_approx_of(nx.E2M1_MAX))


def _group_scale(coding: VectorCoding, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scales for groups g [..., n_groups, group]: (decoded scale, reciprocal, stored bytes)."""
    amax = g.abs().amax(dim=-1)
    rule = coding.scale_rule
    if rule is ScaleRule.AMAX_FP32:
        s = _floor(_div(amax, coding.qmax), coding.scale_floor)
        return s, _recip(s), nx.f32_to_bytes(s)
    if rule is ScaleRule.AMAX_FP32_POW2:
        s0 = _floor(_div(amax, coding.qmax), coding.scale_floor)
        mant, exp = torch.frexp(s0)  # s0 = mant * 2^exp, mant in [0.5, 1)
        exp = torch.where(mant == 0.5, exp - 1, exp)  # already a power of two: keep it
        s = torch.ldexp(torch.ones_like(s0), exp)
        return s, _recip(s), nx.f32_to_bytes(s)
    if rule is ScaleRule.AMAX_E4M3:
        bits = nx.e4m3_encode(_div(amax, nx.E2M1_MAX))
        s = nx.e4m3_decode(bits)
        return s, _recip(s), bits
    if rule is ScaleRule.AMAX_E4M3_RCP6:
        sf = _amax_rcp6(amax)
        if coding.global_scale is not None:  # SFScaleVal * (vecMax * rcp6): the inner product rounds first
            sf = sf * torch.full_like(sf, coding.global_scale.quant)
        bits = nx.e4m3_encode(sf)
        s = nx.e4m3_decode(bits)
        return s, _recip(s), bits
    if rule is ScaleRule.AMAX_FP32_MUL:
        s = amax * torch.full_like(amax, 1.0 / coding.qmax)  # the double 1/qmax rounded to f32 once
        return s, _recip(s), nx.f32_to_bytes(s)
    if rule is ScaleRule.AMAX_E4M3_UP:
        want = _floor(_div(amax, nx.E2M1_MAX), coding.scale_floor)
        bits = nx.e4m3_encode(want)
        bits = bits + ((nx.e4m3_decode(bits) < want) & (bits < nx.E4M3_MAX_CODE)).to(torch.uint8)
        s = nx.e4m3_decode(bits)
        return s, _recip(s), bits
    if rule is ScaleRule.E8M0_CEIL:
        t = _floor(_div(amax, nx.E2M1_MAX), coding.scale_floor)
        mant, exp = torch.frexp(t)  # t = mant * 2^exp, mant in [0.5, 1): ceil(log2 t) = exp - (mant == 0.5)
        exp = torch.where(mant == 0.5, exp - 1, exp).clamp(-127, 127)
        one = torch.ones_like(amax)
        return torch.ldexp(one, exp), torch.ldexp(one, -exp), (exp + 127).to(torch.uint8)
    if rule is ScaleRule.UE8M0_CEIL:  # the floor bounds amax, then one f32 division by qmax (448)
        t = _div(_floor(amax, coding.scale_floor), coding.qmax)
        mant, exp = torch.frexp(t)  # ceil(log2 t) = exp - (mant == 0.5), exact for every finite t > 0
        exp = torch.where(mant == 0.5, exp - 1, exp)
        one = torch.ones_like(amax)
        return torch.ldexp(one, exp), torch.ldexp(one, -exp), (exp + 127).clamp(0, 255).to(torch.uint8)
    if rule is ScaleRule.AMAX_E4M3_CLAMP6:  # amax * f32(1/6) clamped to [floor, 448], then E4M3 (RN)
        sf = torch.clamp(amax * torch.full_like(amax, 1.0 / nx.E2M1_MAX), min=coding.scale_floor, max=nx.E4M3_MAX)
        bits = nx.e4m3_encode(sf)
        s = nx.e4m3_decode(bits)
        return s, _recip(s), bits
    if rule is ScaleRule.OCP_E8M0:
        exp = torch.where(amax > 0, nx.e8m0_floor_log2(torch.where(amax > 0, amax, 1.0)) - 2, -127)
        exp = exp.clamp(-127, 127)
        one = torch.ones_like(amax)
        return torch.ldexp(one, exp), torch.ldexp(one, -exp), (exp + 127).to(torch.uint8)
    raise AssertionError(f"no group scale for rule {rule}")


_LUTS: dict[torch.device, torch.Tensor] = {}


def _rcp_approx_lut(device: torch.device) -> torch.Tensor:
    if device not in _LUTS:
        _LUTS[device] = approx.rcp_approx_e4m3_lut().to(device)
    return _LUTS[device]


def _inverse(positions: tuple[int, ...]) -> list[int]:
    """inv[p] = the group whose scale sits at entry p."""
    inv = [0] * len(positions)
    for group, p in enumerate(positions):
        inv[p] = group
    return inv


def _encode_elems(elem: str, v: torch.Tensor, rounding: str = "rne") -> torch.Tensor:
    if elem == "e2m1" and rounding == "ties_away":
        return nx.e2m1_pack(nx.e2m1_encode_ties_away(v))
    if elem == "bf16":
        return nx.bf16_encode(v)
    if elem == "e4m3":
        return nx.e4m3_encode(v)
    if elem == "e2m1":
        return nx.e2m1_pack(nx.e2m1_encode(v))
    raise AssertionError(elem)


def _decode_elems(elem: str, raw: torch.Tensor) -> torch.Tensor:
    if elem == "bf16":
        return nx.bf16_decode(raw)
    if elem == "e4m3":
        return nx.e4m3_decode(raw)
    if elem == "e2m1":
        return nx.e2m1_decode(nx.e2m1_unpack(raw))
    raise AssertionError(elem)


def _e4m3_rcp6_floored(coding: VectorCoding, v: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Residual coding's group scale (spec step 5) of v [..., n, 16]: (bits, decoded s, rcp.approx(s) from the table)."""
    amax = v.abs().amax(dim=-1)
    sf = _floor(_amax_rcp6(amax), coding.scale_floor)
    bits = nx.e4m3_encode(sf)
    return bits, nx.e4m3_decode(bits), _rcp_approx_lut(device)[bits.long()]


def _encode_residual(coding: VectorCoding, x: torch.Tensor, out: torch.Tensor) -> None:
    """Spec step 5: main E2M1 codes and scale, then the same on the residual; [q1 | q2] bytes per group."""
    v = x.reshape(*x.shape[:-1], coding.dim // coding.group, coding.group)
    if coding.global_scale is not None:  # the residual writer scales the values, not the block scale
        v = v * torch.full_like(v, coding.global_scale.quant)
    bits1, s1, r1 = _e4m3_rcp6_floored(coding, v, x.device)
    q1 = nx.e2m1_encode(v * r1.unsqueeze(-1))
    residual = v - nx.e2m1_decode(q1) * s1.unsqueeze(-1)  # q1 * s1 is exact: one rounding, as the engine's fma
    bits2, _, r2 = _e4m3_rcp6_floored(coding, residual, x.device)
    q2 = nx.e2m1_encode(residual * r2.unsqueeze(-1))
    data = torch.stack([nx.e2m1_pack(q1), nx.e2m1_pack(q2)], dim=-2)  # [..., n, 2, 8]: main then residual codes
    out[..., coding.data.offset : coding.data.end] = data.flatten(-3)
    out[..., coding.scale.offset : coding.scale.end] = torch.stack([bits1, bits2], dim=-1).flatten(-2)


def _decode_residual(coding: VectorCoding, records: torch.Tensor) -> torch.Tensor:
    """fma(q2, s2 * D, q1 * (s1 * D)) per value; float64 holds q2 * (s2 * D) + f32(q1 * (s1 * D)) exactly."""
    n = coding.dim // coding.group
    data = records[..., coding.data.offset : coding.data.end].unflatten(-1, (n, 2, coding.group // 2))
    scales = nx.e4m3_decode(records[..., coding.scale.offset : coding.scale.end].unflatten(-1, (n, 2)))
    if coding.global_scale is not None:
        scales = scales * torch.full_like(scales, coding.global_scale.dequant)
    q1 = nx.e2m1_decode(nx.e2m1_unpack(data[..., 0, :]))
    q2 = nx.e2m1_decode(nx.e2m1_unpack(data[..., 1, :]))
    main = q1 * scales[..., 0:1]
    fused = main.double() + q2.double() * scales[..., 1:2].double()
    return fused.float().flatten(-2)


# SGLang's DSA NVFP4 midpoints (spec step 6): (k, strict) per E2M1 boundary; strict where the upper code is odd
_DSA_MIDPOINTS = ((0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False), (5.0, True))


def _encode_sglang_dsa(coding: VectorCoding, x: torch.Tensor, out: torch.Tensor) -> None:
    """Spec step 6: clamp to +-f32(2688 g), e4m3(clamp(amax / f32(6 g), 0, 448)), codes by f32 midpoints."""
    g_val = coding.global_scale.dequant
    g = x.reshape(*x.shape[:-1], coding.dim // coding.group, coding.group)
    bound = torch.full_like(g, nx.E2M1_MAX * nx.E4M3_MAX) * g_val  # the engine's 6.0 * 448.0 * g, one f32 product
    g = torch.maximum(torch.minimum(g, bound), -bound)
    amax = g.abs().amax(dim=-1)
    s = (amax / (torch.full_like(amax, nx.E2M1_MAX) * g_val)).clamp(0.0, nx.E4M3_MAX)
    bits = nx.e4m3_encode(s)
    denom = (nx.e4m3_decode(bits) * g_val).unsqueeze(-1)
    a = g.abs()
    code = sum(((a > denom * k) if strict else (a >= denom * k)).to(torch.uint8) for k, strict in _DSA_MIDPOINTS)
    code = code | (torch.signbit(g).to(torch.uint8) << 3)
    code = torch.where(denom > 0, code, torch.zeros_like(code))
    out[..., coding.data.offset : coding.data.end] = nx.e2m1_pack(code.reshape(x.shape))
    out[..., coding.scale.offset : coding.scale.end] = bits


def _encode_vector(coding: VectorCoding, x: torch.Tensor, out: torch.Tensor) -> None:
    if coding.residual:
        _encode_residual(coding, x, out)
        return
    if coding.ggml:
        out[..., coding.data.offset : coding.data.end] = ggml.encode(coding.elem, x)
        return
    if coding.scale_rule is ScaleRule.AMAX_E4M3_DIV6G:
        _encode_sglang_dsa(coding, x, out)
        return
    if coding.scale is not None:
        g = x.reshape(*x.shape[:-1], coding.dim // coding.group, coding.group)
        s, r, stored = _group_scale(coding, g)
        if coding.apply is ScaleApply.MUL_RCP_APPROX and coding.scale.dtype == "e4m3":
            if coding.global_scale is None:
                r = _rcp_approx_lut(g.device)[stored.long()]  # exact H200 results; 0 for a zero scale
            else:  # rcp.approx(s * rcp.approx(S)) of arbitrary fp32 values: rcp.rn stands in (spec.py, step 4)
                r = _recip(s * _recip(torch.full_like(s, coding.global_scale.quant)))
        original = g
        if coding.apply is ScaleApply.DIV:
            g = g / s.unsqueeze(-1).expand_as(g)
        else:
            g = g * r.unsqueeze(-1)
        if coding.zero_scale_clears:
            g = torch.where((s == 0).unsqueeze(-1), torch.zeros_like(g), g)
        if coding.zero_scale_saturates:  # factor +inf: +-inf saturates to +-6, 0 * inf = NaN becomes +6
            six = torch.full_like(g, nx.E2M1_MAX)
            hit = ((s == 0) & (original.abs().amax(dim=-1) > 0)).unsqueeze(-1)
            g = torch.where(hit, torch.where(original == 0, six, torch.copysign(six, original)), g)
        x = g.reshape(x.shape)
        stored = stored.reshape(*x.shape[:-1], -1)
        if coding.scale_order is not ScaleOrder.LINEAR:  # stored[..., s] goes to entry positions[s]
            width = stored.shape[-1] // g.shape[-2]
            stored = stored.unflatten(-1, (-1, width))[..., _inverse(coding.scale_positions), :].flatten(-2)
        out[..., coding.scale.offset : coding.scale.end] = stored
    out[..., coding.data.offset : coding.data.end] = _encode_elems(coding.elem, x, coding.elem_rounding)


def _decode_vector(coding: VectorCoding, records: torch.Tensor) -> torch.Tensor:
    if coding.residual:
        return _decode_residual(coding, records)
    if coding.ggml:
        return ggml.decode(coding.elem, records[..., coding.data.offset : coding.data.end])
    q = _decode_elems(coding.elem, records[..., coding.data.offset : coding.data.end])
    if coding.scale is None:
        return q
    raw = records[..., coding.scale.offset : coding.scale.end]
    if coding.scale_order is not ScaleOrder.LINEAR:  # entry positions[s] holds group s
        width = raw.shape[-1] // (coding.dim // coding.group)
        raw = raw.unflatten(-1, (-1, width))[..., list(coding.scale_positions), :].flatten(-2)
    if coding.scale.dtype == "fp32":
        s = nx.f32_from_bytes(raw)
    elif coding.scale.dtype == "e4m3":
        s = nx.e4m3_decode(raw)
    else:  # e8m0
        s = torch.ldexp(torch.ones(raw.shape, dtype=torch.float32, device=raw.device), raw.to(torch.int32) - 127)
    g = q.reshape(*q.shape[:-1], coding.dim // coding.group, coding.group)
    if coding.scale_rule is ScaleRule.AMAX_E4M3_DIV6G:  # SGLang's DSA reader: (q * s) * g
        return (g * s.unsqueeze(-1) * coding.global_scale.dequant).reshape(q.shape)
    if coding.global_scale is not None:  # the engine's reader: q * (s * D), its fp32 dequant scale first
        s = s * torch.full_like(s, coding.global_scale.dequant)
    return (g * s.unsqueeze(-1)).reshape(q.shape)


def _encode_folded_token_scale(spec: FormatSpec, latent: torch.Tensor, out: torch.Tensor) -> None:
    """Spec step 8, b12x's per-token scale: s_t = amax * f32(1/2688); group scale e4m3((amax_g * r_t) * rcp6);
    codes cvt(x * (rcp(s) * r_t)), r_t = 1/s_t (rcp.rn for the engine's rcp.approx.ftz: not tabulable);
    everything 0 for an all-zero token (r_t = 0 then, so every scale is 0 and every group cleared)."""
    coding = spec.latent
    amax = latent.abs().amax(dim=-1, keepdim=True)
    s_t = amax * torch.full_like(amax, 1.0 / TOKEN_SCALE_DENOMINATOR)  # the double 1/2688 rounded to f32 once
    out[..., spec.token_scale.offset : spec.token_scale.end] = nx.f32_to_bytes(s_t)
    r_t = _recip(s_t).unsqueeze(-1)  # [..., 1, 1] against [..., groups, 16]
    g = latent.reshape(*latent.shape[:-1], coding.dim // coding.group, coding.group)
    sf = _amax_rcp6(g.abs().amax(dim=-1) * r_t.squeeze(-1))  # (amax_g * r_t) * rcp6: the inner product first
    bits = nx.e4m3_encode(sf)
    factor = (_rcp_approx_lut(latent.device)[bits.long()] * r_t.squeeze(-1)).unsqueeze(-1)
    v = torch.where((nx.e4m3_decode(bits) == 0).unsqueeze(-1), torch.zeros_like(g), g * factor)
    out[..., coding.data.offset : coding.data.end] = nx.e2m1_pack(nx.e2m1_encode(v.reshape(latent.shape)))
    out[..., coding.scale.offset : coding.scale.end] = bits


def encode(
    fmt: str | FormatSpec,
    latent: torch.Tensor,
    rope: torch.Tensor,
    *,
    outer_scale: OuterScaleArg = None,
    layer: int | None = None,
    engine_nonfinite: bool = False,
) -> torch.Tensor:
    """Encode latent [..., 512] and rotated rope [..., 64] into uint8 records [..., record_bytes].

    `outer_scale`: the per-layer s_l (a float, or a tensor broadcastable to the leading dims) for
    formats that take one; `layer` only labels error messages. NaN / inf are refused, unless
    `engine_nonfinite` asks for the policy of a format whose engine defines one (`FormatSpec.nonfinite`).
    """
    spec = get_format(fmt)
    latent = _as_f32(latent, "latent", spec.latent.dim)
    rope = _as_f32(rope, "rope", spec.rope.dim)
    if latent.shape[:-1] != rope.shape[:-1]:
        raise UserError(f"latent {tuple(latent.shape)} and rope {tuple(rope.shape)} disagree on the leading dims")
    if engine_nonfinite and spec.nonfinite is None:
        raise UserError(f"format {spec.name} has no engine policy for NaN / inf inputs; pass finite values")
    if engine_nonfinite:  # "nan_zero_inf_saturate": the latent's +-inf meet the writer's clamp (spec step 6)
        bf16_max = torch.finfo(torch.bfloat16).max
        latent = torch.nan_to_num(latent, nan=0.0, posinf=float("inf"), neginf=float("-inf"))
        rope = torch.nan_to_num(rope, nan=0.0, posinf=bf16_max, neginf=-bf16_max)
    else:
        check_finite(latent, "latent", layer)
        check_finite(rope, "rope", layer)
    out = torch.zeros(*latent.shape[:-1], spec.record_bytes, dtype=torch.uint8, device=latent.device)

    s_l = outer_scale_tensor(spec, outer_scale, latent.device)
    if s_l is not None:
        r_l = _recip(s_l)
        latent = latent * r_l
        if spec.outer_scale.applies_to_rope:
            rope = rope * r_l
        if spec.outer_scale.bf16_result:  # the engine's writer reads the scaled latent as bf16 (RNE)
            latent = latent.to(torch.bfloat16).to(torch.float32)
    if spec.token_scale is not None and spec.token_scale_rule is TokenScaleRule.MUL_FOLDED:
        _encode_folded_token_scale(spec, latent, out)
    elif spec.token_scale is not None:
        amax = latent.abs().amax(dim=-1, keepdim=True)
        s_t = torch.clamp_min(_div(amax, TOKEN_SCALE_DENOMINATOR), nx.FLT_MIN)
        latent = latent * _recip(s_t)
        out[..., spec.token_scale.offset : spec.token_scale.end] = nx.f32_to_bytes(s_t)
        _encode_vector(spec.latent, latent, out)
    else:
        _encode_vector(spec.latent, latent, out)
    _encode_vector(spec.rope, rope, out)
    return out


def decode(
    fmt: str | FormatSpec, records: torch.Tensor, *, outer_scale: OuterScaleArg = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode uint8 records [..., record_bytes] into float32 (latent [..., 512], rope [..., 64]).

    Products are taken in the order ((q * group scale) * s_t) * s_l, each rounded to float32.
    """
    spec = get_format(fmt)
    if records.dtype != torch.uint8 or records.shape[-1:] != (spec.record_bytes,):
        raise UserError(
            f"{spec.name} records must be uint8 [..., {spec.record_bytes}], got {records.dtype} {tuple(records.shape)}"
        )
    latent = _decode_vector(spec.latent, records)
    rope = _decode_vector(spec.rope, records)
    if spec.reader_e4m3:  # what the engine's attention reads: an E4M3 copy (no s_t / s_l with this flag)
        latent, rope = (nx.e4m3_decode(nx.e4m3_encode(v)) for v in (latent, rope))
    if spec.token_scale is not None:
        latent = latent * nx.f32_from_bytes(records[..., spec.token_scale.offset : spec.token_scale.end])
    s_l = outer_scale_tensor(spec, outer_scale, records.device)
    if s_l is not None:
        latent = latent * s_l
        if spec.outer_scale.applies_to_rope:
            rope = rope * s_l
    return latent, rope
