"""What the GPU kernels need to know about a cache format, as hashable compile-time constants.

A `RecordPlan` is derived from a `mla_eval.formats.FormatSpec` and nothing else: byte offsets,
dimensions, rule names and constants are read from the spec module, never restated here. It is a
frozen dataclass so that it can sit in a compile-cache key: two formats that differ in any offset,
element type, group size, scale dtype, scale rule, order or arithmetic give different plans, hence
different compiled kernels.

Pure Python (no `cutlass` import; `mla_eval.formats.spec` only): CPU code paths, the dispatcher
and the CPU test that plan and spec agree (tests/test_record_plan.py) may import it freely.

Kernel constraints checked here (a spec outside them is served by the torch reference):
- the record is a whole number of 4-byte words and every field starts on a 4-byte boundary (the writer
  stores 32-bit words; the attention kernel copies records in 16-, 8- or 4-byte cp.async chunks, the
  largest that divides the record);
- latent groups hold a multiple of 16 values (one writer lane owns 16 consecutive values);
- the rope has one fp32 scale for all 64 values, none, or (E2M1 rope) one E4M3 or E8M0 scale per 16 values;
- SGLang's KVFP4 arithmetic (`sglang_fp4_e2m1`): the E2M1 rounding (`elem_rounding`: RNE, or ties away from
  zero) and the E8M0 ceiling rule (`rule` = RULE_E8M0_CEIL) are plan fields, so part of every compile key;
- TensorRT-LLM's NVFP4 DSA arithmetic (`trtllm_nvfp4_dsa`): the engine global scale (`global_quant` for the
  writer, `global_dequant` for the reader), saturating zero scales and the reader's E4M3 copy (`reader_e4m3`)
  are plan fields (so part of every compile key), and so is the residual E2M1 rope (`residual`,
  `trtllm_nvfp4_dsa_r64`); a residual latent is refused by name, so that a kernel never ignores it silently.
"""

from __future__ import annotations

import dataclasses
import functools

from mla_eval.formats.spec import (  # pure Python: no torch or cutlass needed at this level
    FLT_MIN,
    LATENT_DIM,
    ROPE_DIM,
    ScaleApply,
    ScaleOrder,
    ScaleRule,
    TokenScaleRule,
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
RULE_E8M0_CEIL = ScaleRule.E8M0_CEIL.value
KNOWN_RULES = tuple(r.value for r in ScaleRule)
APPLY_MUL_RCP = ScaleApply.MUL_RCP.value
APPLY_DIV = ScaleApply.DIV.value
APPLY_MUL_RCP_APPROX = ScaleApply.MUL_RCP_APPROX.value
ORDER_LINEAR = ScaleOrder.LINEAR.value
ORDER_8X4 = ScaleOrder.TRANSPOSE_8X4.value  # group s's scale at entry 8*(s&3) + (s>>2)
ROUND_RNE = "rne"  # spec.VectorCoding.elem_rounding: cvt's round to nearest even
ROUND_TIES_AWAY = "ties_away"  # SGLang: the E2M1 code counts the bounds |x| reaches (>=), sign for x < 0 only

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
    # TensorRT-LLM's NVFP4 recipe (spec.GlobalScale): the writer's SFScaleVal and the reader's dequant factor,
    # float32 values read from the spec; None without a global scale
    global_quant: float | None = None
    global_dequant: float | None = None
    zero_scale_saturates: bool = False  # s = 0 < amax: codes +-6, +6 for zeros (spec step 4)
    residual: bool = False  # a second E2M1 pass over each group's residual (spec step 5)
    elem_rounding: str = ROUND_RNE  # ROUND_RNE | ROUND_TIES_AWAY (E2M1 codes only)

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
    reader_e4m3: bool = False  # the decoded values are rounded to E4M3 last (the engine's attention reads that copy)

    @property
    def record_words(self) -> int:
        return self.record_bytes // 4


def _coding(c) -> CodingPlan:
    rule = c.scale_rule.value
    if c.elem not in ("bf16", "e4m3", "e2m1"):
        raise UnsupportedFormat(f"element type {c.elem!r} has no kernel")
    if rule == ScaleRule.AMAX_E4M3_DIV6G.value:
        raise UnsupportedFormat("SGLang's DSA NVFP4 rule (amax / (6 g) scales, midpoint codes) has no kernel")
    if rule in (ScaleRule.UE8M0_CEIL.value, ScaleRule.AMAX_E4M3_CLAMP6.value):
        raise UnsupportedFormat(f"DeepSeek-V4's scale rule {rule!r} has no kernel")
    if c.elem_rounding not in (ROUND_RNE, ROUND_TIES_AWAY) or (c.elem_rounding == ROUND_TIES_AWAY and c.elem != "e2m1"):
        raise UnsupportedFormat(f"{c.elem} rounding {c.elem_rounding!r} has no kernel (ties away is an E2M1 rule)")
    if rule not in KNOWN_RULES:
        raise UnsupportedFormat(f"scale rule {rule!r} has no kernel")
    if rule == RULE_E8M0_CEIL and (c.scale is None or c.scale.dtype != "e8m0"):
        raise UnsupportedFormat(f"scale rule {rule!r} is implemented for E8M0 scales only")
    if rule == RULE_E8M0_CEIL and not c.scale_floor >= FLT_MIN:  # the writer reads ceil(log2 t) from a normal t's bits
        raise UnsupportedFormat(f"scale rule {rule!r} is implemented for a floor of at least FLT_MIN")
    scale, gs = c.scale, c.global_scale
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
        global_quant=gs.quant if gs is not None else None,
        global_dequant=gs.dequant if gs is not None else None,
        zero_scale_saturates=bool(c.zero_scale_saturates),
        residual=bool(c.residual),
        elem_rounding=c.elem_rounding,
    )


@functools.lru_cache(maxsize=None)
def plan_for(spec) -> RecordPlan:
    """The kernel plan of a `FormatSpec` (made once per spec); raises `UnsupportedFormat` outside the kernels' scope."""
    if (spec.latent.dim, spec.rope.dim) != (LATENT_DIM, ROPE_DIM):
        raise UnsupportedFormat(f"the kernels are built for the {LATENT_DIM} + {ROPE_DIM} MLA record; {spec.name} holds "
                                f"{spec.latent.dim} + {spec.rope.dim} values ({spec.geometry.models})")
    if spec.token_scale_rule is not TokenScaleRule.DIV_FLOORED:
        raise UnsupportedFormat("b12x's per-token scale (rcp(s_t) folded into each group's factor) has no kernel")
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
        reader_e4m3=bool(spec.reader_e4m3),
    )
    _check_kernel_scope(plan)
    return plan


def record_chunk(record_bytes: int) -> int:
    """Bytes per cp.async of a record in the attention kernel: the largest of 16, 8, 4 that divides it (the
    records of a tile sit back to back, so each starts at a multiple of it in global and shared memory)."""
    return next(c for c in (16, 8, 4) if record_bytes % c == 0)


def _check_kernel_scope(p: RecordPlan) -> None:
    if p.latent.dim != LATENT_DIM or p.rope.dim != ROPE_DIM:
        raise UnsupportedFormat("kernels are built for a 512-d latent and a 64-d rope")
    if p.record_bytes % 4:
        raise UnsupportedFormat(f"record of {p.record_bytes} B is not a multiple of 4 B")
    offsets = [p.latent.data_offset, p.rope.data_offset, p.token_scale_offset]
    offsets += [c.scale_offset for c in (p.latent, p.rope)]
    offsets += [o for o, _ in p.pads]
    if any(o >= 0 and o % 4 for o in offsets) or any(n % 4 for _, n in p.pads):
        raise UnsupportedFormat("every field must start on a 4-byte boundary")
    lat = p.latent
    if lat.residual:
        raise UnsupportedFormat("a residual E2M1 latent has no kernel (the residual coding is implemented for the rope)")
    if lat.group % 16 or lat.group > LATENT_DIM:
        raise UnsupportedFormat(f"latent group {lat.group} is not a multiple of 16")
    if lat.scale_dtype in ("e4m3", "e8m0") and lat.n_groups % 4:
        raise UnsupportedFormat("byte-sized latent scales must come in multiples of 4")
    if lat.scale_order == ORDER_8X4 and (lat.group != 16 or lat.scale_dtype == "fp32"):
        raise UnsupportedFormat("the 8x4 scale transpose is implemented for 32 byte-sized scales of 16 values")
    rope = p.rope
    e2m1_rope = (rope.elem == "e2m1" and rope.group == 16 and rope.scale_dtype in ("e4m3", "e8m0")
                 and rope.scale_order == ORDER_LINEAR)
    if rope.elem == "e2m1" and not e2m1_rope:
        raise UnsupportedFormat("an E2M1 rope needs one linear E4M3 or E8M0 scale per 16 values")
    if rope.residual and rope.scale_dtype != "e4m3":
        raise UnsupportedFormat("the residual E2M1 rope is implemented with E4M3 scales only")
    if rope.scale_dtype and not e2m1_rope and (rope.group != ROPE_DIM or rope.scale_dtype != "fp32"):
        raise UnsupportedFormat("the rope may have one fp32 scale for all 64 values, none, or E4M3 / E8M0 per 16 (E2M1)")
    if e2m1_rope and p.outer_on_rope:
        raise UnsupportedFormat("an outer scale on an E2M1 rope has no kernel")
