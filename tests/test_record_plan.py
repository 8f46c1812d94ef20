"""The kernel plan reads the spec: for every registered format, the plan agrees with the spec field
for field, or the format is refused with `UnsupportedFormat` and a reason. Pure CPU (no cutlass)."""

import dataclasses

import pytest
from format_fixtures import ODD_GROUP

from mla_eval.formats import Field, ScaleRule, VectorCoding, all_formats
from mla_eval.formats import spec as spec_mod
from mla_eval_kernels.plan import record_plan as rp


def _check_coding(plan: rp.CodingPlan, coding: VectorCoding) -> None:
    assert plan.dim == coding.dim and plan.elem == coding.elem
    assert plan.data_offset == coding.data.offset
    assert plan.rule == coding.scale_rule.value and plan.group == coding.group and plan.qmax == coding.qmax
    assert plan.apply == coding.apply.value and plan.scale_floor == coding.scale_floor
    assert plan.scale_order == coding.scale_order.value
    if coding.scale is None:
        assert (plan.scale_dtype, plan.scale_offset) == ("", -1)
    else:
        assert (plan.scale_dtype, plan.scale_offset) == (coding.scale.dtype, coding.scale.offset)
        assert plan.n_groups * (2 if plan.residual else 1) == coding.scale.count  # residual: [s1, s2] per group

@pytest.mark.parametrize("spec", all_formats(), ids=lambda s: s.name)
def test_plan_agrees_with_spec_or_is_refused_with_a_reason(spec):
    try:
        plan = rp.plan_for(spec)
    except rp.UnsupportedFormat as exc:
        assert str(exc), "a refusal must say why"
        return
    assert plan.name == spec.name and plan.record_bytes == spec.record_bytes
    _check_coding(plan.latent, spec.latent)
    _check_coding(plan.rope, spec.rope)
    assert plan.token_scale_offset == (spec.token_scale.offset if spec.token_scale else -1)
    assert plan.pads == tuple((f.offset, f.nbytes) for f in spec.pads)
    assert plan.outer_allowed == (spec.outer_scale is not None)
    assert plan.outer_bf16 == bool(spec.outer_scale is not None and spec.outer_scale.bf16_result)
    assert plan.reader_e4m3 == spec.reader_e4m3
    for cp, c in ((plan.latent, spec.latent), (plan.rope, spec.rope)):
        gs = c.global_scale
        assert (cp.global_quant, cp.global_dequant) == ((gs.quant, gs.dequant) if gs is not None else (None, None))
        assert cp.zero_scale_saturates == c.zero_scale_saturates and cp.residual == c.residual
        assert cp.elem_rounding == c.elem_rounding

def test_rule_names_are_the_spec_rules():
    assert rp.KNOWN_RULES == tuple(r.value for r in ScaleRule)
    assert rp.RULE_AMAX_FP32 == ScaleRule.AMAX_FP32.value and rp.RULE_OCP_E8M0 == ScaleRule.OCP_E8M0.value
    assert rp.LATENT_DIM == spec_mod.LATENT_DIM and rp.ROPE_DIM == spec_mod.ROPE_DIM

def test_engine_arithmetic_reaches_the_plan():
    """fp8_ds_mla divides with a FLT_MIN floor (vLLM), the pow2 variant floors at 1e-4 (FlashMLA)."""
    by_name = {s.name: s for s in all_formats()}
    vllm, flashmla = rp.plan_for(by_name["fp8_ds_mla"]), rp.plan_for(by_name["fp8_ds_mla_pow2"])
    assert vllm.latent.apply == rp.APPLY_DIV and vllm.latent.scale_floor == spec_mod.FLT_MIN
    assert flashmla.latent.apply == rp.APPLY_DIV and flashmla.latent.scale_floor == 1e-4
    assert vllm != flashmla  # different compile keys

def test_a_spec_outside_the_kernels_is_refused_with_its_reason():
    with pytest.raises(rp.UnsupportedFormat, match="latent group 8 is not a multiple of 16"):
        rp.plan_for(ODD_GROUP)


def test_permuted_scales_and_bumped_rule_reach_the_plan():
    plan = rp.plan_for(next(s for s in all_formats() if s.name == "nvfp4_fp8_ds_mla"))
    assert plan.latent.scale_order == rp.ORDER_8X4 and plan.latent.rule == rp.RULE_AMAX_E4M3_UP
    assert plan.latent.scale_floor == 2.0**-9 and plan.latent.scale_offset == 320
    assert (plan.rope.elem, plan.rope.rule, plan.rope.data_offset) == ("e4m3", rp.RULE_TENSOR, 256)


def test_every_kernel_format_has_its_own_plan_hence_its_own_compiled_kernels():
    """Plans sit in the compile keys: two formats must never share one (the s_l = 1.0 reuse bug). The name
    is left out of the comparison, so two formats differing only in arithmetic must still differ."""
    plans = {}
    for spec in all_formats():
        try:
            plans[spec.name] = dataclasses.replace(rp.plan_for(spec), name="")
        except rp.UnsupportedFormat:
            continue
    assert len(set(plans.values())) == len(plans) >= 9


def test_engine_outer_scale_order_reaches_the_plan():
    """nvfp4 / nvfp4_fp8rope round the s_l-scaled latent to bf16 (the vLLM fork scales in torch on bf16);
    fp8_e4m3 scales in float32: the writer must know which, and the compile key must differ."""
    by_name = {s.name: s for s in all_formats()}
    assert rp.plan_for(by_name["nvfp4"]).outer_bf16 and rp.plan_for(by_name["nvfp4_fp8rope"]).outer_bf16
    assert not rp.plan_for(by_name["fp8_e4m3"]).outer_bf16
    flipped = dataclasses.replace(
        by_name["nvfp4"], outer_scale=dataclasses.replace(by_name["nvfp4"].outer_scale, bf16_result=False)
    )
    assert rp.plan_for(flipped) != rp.plan_for(by_name["nvfp4"])


def test_trtllm_engine_arithmetic_reaches_the_plan():
    """trtllm_nvfp4_dsa's engine arithmetic (global scale, saturating zero scales, E4M3 read-back) and r64's
    residual rope are in the plan, read from the spec, so each of them changes the compile key; a residual
    latent has no kernel and is refused by name, as SGLang's ties-away E2M1 is, rather than ignored."""
    by_name = {s.name: s for s in all_formats()}
    spec = by_name["trtllm_nvfp4_dsa"]
    plan = rp.plan_for(spec)
    gs = spec.latent.global_scale
    for c in (plan.latent, plan.rope):
        assert (c.global_quant, c.global_dequant) == (gs.quant, gs.dequant) and c.zero_scale_saturates
        assert (c.elem, c.rule, c.apply, c.group, c.scale_dtype) == (
            "e2m1", rp.RULE_AMAX_E4M3_RCP6, rp.APPLY_MUL_RCP_APPROX, 16, "e4m3")
    assert plan.reader_e4m3 and plan.record_bytes == 324
    assert (plan.rope.data_offset, plan.rope.scale_offset, plan.latent.scale_offset) == (256, 320, 288)
    other_amax = dataclasses.replace(gs, amax=448.0)
    variants = [
        dataclasses.replace(spec, name="v", latent=dataclasses.replace(spec.latent, global_scale=other_amax),
                            rope=dataclasses.replace(spec.rope, global_scale=other_amax)),
        dataclasses.replace(spec, name="v", latent=dataclasses.replace(spec.latent, zero_scale_saturates=False)),
        dataclasses.replace(spec, name="v", reader_e4m3=False),
    ]
    base = dataclasses.replace(plan, name="v")
    keys = {base} | {rp.plan_for(v) for v in variants}
    assert len(keys) == 4  # every engine rule is its own compiled kernel
    r64_spec = by_name["trtllm_nvfp4_dsa_r64"]
    r64 = rp.plan_for(r64_spec)
    assert r64.rope.residual and not r64.latent.residual and r64.reader_e4m3 and r64.record_bytes == 360
    assert (r64.rope.data_offset, r64.rope.scale_offset, r64.latent.scale_offset) == (256, 352, 320)
    assert r64.rope.scale_floor == r64_spec.rope.scale_floor == 2.0**-9 and r64.rope.global_quant == gs.quant
    assert not r64.rope.zero_scale_saturates and r64.latent.zero_scale_saturates
    assert dataclasses.replace(r64, name="") != dataclasses.replace(plan, name="")
    residual_latent = dataclasses.replace(
        r64_spec, name="v", latent=dataclasses.replace(r64_spec.rope, dim=512, data=Field("latent", 0, "e2m1", 1024),
                                                       scale=Field("latent_scale", 512, "e4m3", 64)),
        rope=dataclasses.replace(r64_spec.rope, data=Field("rope", 576, "e2m1", 128), scale=Field("rope_scale", 640, "e4m3", 8)),
        record_bytes=648, buffers=())
    with pytest.raises(rp.UnsupportedFormat, match="residual E2M1 latent"):
        rp.plan_for(residual_latent)


def test_sglang_fp4_e2m1_reaches_the_plan_with_its_rounding_and_scale_rule():
    """SGLang's KVFP4 record on the kernels: ties-away E2M1 and the E8M0 ceiling rule (dividing, floor 1e-10) are
    plan fields, both vectors E2M1 with one E8M0 byte per 16; flipping either rule gives another compile key."""
    spec = next(s for s in all_formats() if s.name == "sglang_fp4_e2m1")
    plan = rp.plan_for(spec)
    for c, vec in ((plan.latent, spec.latent), (plan.rope, spec.rope)):
        assert (c.elem, c.rule, c.scale_dtype, c.group) == ("e2m1", rp.RULE_E8M0_CEIL, "e8m0", 16)
        assert c.elem_rounding == rp.ROUND_TIES_AWAY == vec.elem_rounding and c.apply == rp.APPLY_DIV
        assert c.scale_floor == vec.scale_floor == 1e-10 and c.scale_order == rp.ORDER_LINEAR
    assert (plan.latent.data_offset, plan.latent.scale_offset, plan.rope.data_offset, plan.rope.scale_offset) == (
        0, 288, 256, 320)
    assert (plan.record_bytes, plan.token_scale_offset, plan.pads, plan.outer_allowed) == (324, -1, (), False)
    rne = dataclasses.replace(spec, name="v", latent=dataclasses.replace(spec.latent, elem_rounding="rne"),
                              rope=dataclasses.replace(spec.rope, elem_rounding="rne"))
    ocp = dataclasses.replace(spec, name="v", latent=dataclasses.replace(spec.latent, scale_rule=ScaleRule.OCP_E8M0,
                                                                 apply=spec_mod.ScaleApply.MUL_RCP))
    keys = {dataclasses.replace(plan, name="v"), rp.plan_for(rne), rp.plan_for(ocp)}
    assert len(keys) == 3


def test_the_e8m0_ceiling_rule_without_an_e8m0_scale_and_ties_away_outside_e2m1_are_refused():
    spec = next(s for s in all_formats() if s.name == "sglang_fp4_e2m1")
    fp32 = dataclasses.replace(spec.latent, scale=Field("s", 288, "fp32", 32))  # the vector alone (no record layout)
    with pytest.raises(rp.UnsupportedFormat, match="E8M0 scales only"):
        rp._coding(fp32)
    with pytest.raises(rp.UnsupportedFormat, match="floor of at least FLT_MIN"):
        rp._coding(dataclasses.replace(spec.latent, scale_floor=1e-40))
    e4m3_rounded = dataclasses.replace(spec.latent, elem="e4m3", data=Field("latent", 0, "e4m3", 512))
    with pytest.raises(rp.UnsupportedFormat, match="ties away is an E2M1 rule"):
        rp._coding(e4m3_rounded)
