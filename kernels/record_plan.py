"""What the GPU kernels need to know about a cache format, as hashable compile-time constants.

A `RecordPlan` is derived from a `mla_eval.formats.FormatSpec` and nothing else: byte offsets,
dimensions, rule names and constants are read from the spec module, never restated here. It is a
frozen dataclass so that it can sit in a compile-cache key: two formats that differ in any offset,
element type, group size, scale dtype, scale rule, order or arithmetic give different plans, hence
different compiled kernels.

Pure Python (no `cutlass` import; `mla_eval.formats.spec` only): CPU code paths, the dispatcher
and the CPU test that plan and spec agree (tests/test_record_plan.py) may import it freely.

Kernel constraints checked here (a spec outside them is served by the torch reference):
- the record is a whole number of 16-byte chunks and every field starts on a 4-byte boundary
  (the writer stores 32-bit words; the attention kernel copies records with 16-byte loads);
- latent groups hold a multiple of 16 values (one writer lane owns 16 consecutive values);
- the rope has one scale for all 64 values, or none;
- no engine global scale, no saturating zero scales, no residual coding, no E4M3 reader copy (TensorRT-LLM's
  NVFP4 DSA arithmetic, `trtllm_nvfp4_dsa*`): refused by name, so that a kernel never ignores them silently.
"""

from __future__ import annotations

import dataclasses

from mla_eval.formats.spec import (  # pure Python: no torch or cutlass needed at this level
    FLT_MIN,
    LATENT_DIM,
    ROPE_DIM,
    ScaleApply,
    ScaleOrder,
    ScaleRule,
)

# The spec's rule strings, under the names the kernels branch on (one definition: spec.ScaleRule).
RULE_NONE = ScaleRule.NONE.value
RULE_TENSOR = ScaleRule.TENSOR.value
RULE_AMAX_FP32 = ScaleRule.AMAX_FP32.value
RULE_AMAX_FP32_POW2 = ScaleRule.AMAX_FP32_POW2.value
RULE_AMAX_E4M3 = ScaleRule.AMAX_E4M3.value
RULE_AMAX_E4M3_UP = ScaleRule.AMAX_E4M3_UP.value
RULE_AMAX_E4M3_RCP6 = ScaleRule.AMAX_E4M3_RCP6.value
RULE_AMAX_FP32_MUL = ScaleRule.AMAX_FP32_MUL.value
RULE_OCP_E8M0 = ScaleRule.OCP_E8M0.value
KNOWN_RULES = tuple(r.value for r in ScaleRule)
APPLY_MUL_RCP = ScaleApply.MUL_RCP.value
APPLY_DIV = ScaleApply.DIV.value
APPLY_MUL_RCP_APPROX = ScaleApply.MUL_RCP_APPROX.value
ORDER_LINEAR = ScaleOrder.LINEAR.value
ORDER_8X4 = ScaleOrder.TRANSPOSE_8X4.value  # group s's scale at entry 8*(s&3) + (s>>2)

class UnsupportedFormat(ValueError):
    """The spec is valid but outside what the CuTe kernels implement (dispatch falls back)."""


@dataclasses.dataclass(frozen=True)
class CodingPlan:
    """One vector (latent or rope): elements at `data_offset`, scales at `scale_offset`."""

    dim: int
    elem: str  # "bf16" | "e4m3" | "e2m1"
    data_offset: int
    rule: str  # one of KNOWN_RULES
    group: int
    qmax: float
    scale_dtype: str  # "" (no stored scale) | "fp32" | "e4m3" | "e8m0"
    scale_offset: int  # -1 when no stored scale
    apply: str = APPLY_MUL_RCP  # ScaleApply value: multiply by rcp.rn(s) or div.rn by s
    scale_floor: float = FLT_MIN  # floor of amax / qmax for the fp32 rules and AMAX_E4M3_UP
    scale_order: str = ORDER_LINEAR  # ScaleOrder value: where group s's scale sits
    zero_scale_clears: bool = False  # a zero scale stores +0 codes for the whole group

    @property
    def n_groups(self) -> int:
        return self.dim // self.group


@dataclasses.dataclass(frozen=True)
class RecordPlan:
    name: str
    record_bytes: int
    latent: CodingPlan
    rope: CodingPlan
    token_scale_offset: int  # -1: no per-token scale s_t
    pads: tuple[tuple[int, int], ...]  # (offset, nbytes) of zero padding
    outer_allowed: bool  # the format takes a per-layer s_l
    outer_required: bool
    outer_on_rope: bool
    outer_bf16: bool = False  # the latent scaled by s_l is rounded to bf16 before quantisation (engine order)

    @property
    def record_words(self) -> int:
        return self.record_bytes // 4


def _coding(c) -> CodingPlan:
    rule = c.scale_rule.value
    if rule not in KNOWN_RULES:
        raise UnsupportedFormat(f"scale rule {rule!r} has no kernel")
    if c.elem not in ("bf16", "e4m3", "e2m1"):
        raise UnsupportedFormat(f"element type {c.elem!r} has no kernel")
    if c.global_scale is not None or c.zero_scale_saturates or c.residual:
        raise UnsupportedFormat("an engine global scale (SFScaleVal), saturating zero scales and residual codings have no kernel")
    scale = c.scale
    return CodingPlan(
        dim=c.dim,
        elem=c.elem,
        data_offset=c.data.offset,
        rule=rule,
        group=c.group,
        qmax=float(c.qmax),
        scale_dtype=scale.dtype if scale is not None else "",
        scale_offset=scale.offset if scale is not None else -1,
        apply=c.apply.value,
        scale_floor=float(c.scale_floor),
        scale_order=c.scale_order.value,
        zero_scale_clears=bool(c.zero_scale_clears),
    )


def plan_for(spec) -> RecordPlan:
    """The kernel plan of a `FormatSpec`; raises `UnsupportedFormat` outside the kernels' scope."""
    if spec.reader_e4m3:
        raise UnsupportedFormat("the engine's E4M3 read-back copy has no kernel")
    latent, rope = _coding(spec.latent), _coding(spec.rope)
    outer = spec.outer_scale
    plan = RecordPlan(
        name=spec.name,
        record_bytes=spec.record_bytes,
        latent=latent,
        rope=rope,
        token_scale_offset=spec.token_scale.offset if spec.token_scale is not None else -1,
        pads=tuple((f.offset, f.nbytes) for f in spec.pads),
        outer_allowed=outer is not None,
        outer_required=bool(outer is not None and outer.required),
        outer_on_rope=bool(outer is not None and outer.applies_to_rope),
        outer_bf16=bool(outer is not None and outer.bf16_result),
    )
    _check_kernel_scope(plan)
    return plan


def _check_kernel_scope(p: RecordPlan) -> None:
    if p.latent.dim != LATENT_DIM or p.rope.dim != ROPE_DIM:
        raise UnsupportedFormat("kernels are built for a 512-d latent and a 64-d rope")
    if p.record_bytes % 16:
        raise UnsupportedFormat(f"record of {p.record_bytes} B is not a multiple of 16 B")
    offsets = [p.latent.data_offset, p.rope.data_offset, p.token_scale_offset]
    offsets += [c.scale_offset for c in (p.latent, p.rope)]
    offsets += [o for o, _ in p.pads]
    if any(o >= 0 and o % 4 for o in offsets) or any(n % 4 for _, n in p.pads):
        raise UnsupportedFormat("every field must start on a 4-byte boundary")
    lat = p.latent
    if lat.group % 16 or lat.group > LATENT_DIM:
        raise UnsupportedFormat(f"latent group {lat.group} is not a multiple of 16")
    if lat.scale_dtype in ("e4m3", "e8m0") and lat.n_groups % 4:
        raise UnsupportedFormat("byte-sized latent scales must come in multiples of 4")
    if lat.scale_order == ORDER_8X4 and (lat.group != 16 or lat.scale_dtype == "fp32"):
        raise UnsupportedFormat("the 8x4 scale transpose is implemented for 32 byte-sized scales of 16 values")
    rope = p.rope
    if rope.elem == "e2m1":
        raise UnsupportedFormat("e2m1 rope has no kernel")
    if rope.scale_dtype and (rope.group != ROPE_DIM or rope.scale_dtype != "fp32"):
        raise UnsupportedFormat("the rope may have one fp32 scale for all 64 values, or none")
