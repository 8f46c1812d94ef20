"""The registry: lookups, user-registered formats, and spec validation."""

import pytest
import torch

from mla_eval.errors import UnknownFormatError
from mla_eval.formats import (
    Field,
    FormatSpec,
    ScaleRule,
    VectorCoding,
    all_formats,
    decode,
    encode,
    format_names,
    get_format,
    parse_format_list,
    register_format,
    unregister_format,
)


def test_builtin_names_in_order():
    assert format_names()[:12] == [
        "bf16", "fp8_ds_mla", "fp8_ds_mla_pow2", "nvfp4", "nvfp4_fp8rope", "nvfp4_fp8rope_st", "nvfp4_fp8_ds_mla",
        "sglang_fp4_e2m1", "trtllm_nvfp4_dsa", "trtllm_nvfp4_dsa_r64", "mxfp4", "fp8_e4m3",
    ]


def test_unknown_format_message_lists_choices():
    with pytest.raises(UnknownFormatError, match="unknown cache format 'nvfp5'; choose one of: bf16"):
        get_format("nvfp5")


def test_parse_format_list():
    assert [s.name for s in parse_format_list("nvfp4, fp8_ds_mla,nvfp4")] == ["nvfp4", "fp8_ds_mla"]
    assert len(parse_format_list(None)) == len(all_formats())
    with pytest.raises(UnknownFormatError):
        parse_format_list(" , ")


def test_user_format_registration_round_trip():
    spec = FormatSpec(
        name="user_fp8_g64",
        title="user fp8 g64",
        description="E4M3 latent with a scale per 64 values, bf16 rope",
        source="test",
        record_bytes=672,
        latent=VectorCoding(
            512, "e4m3", Field("latent", 0, "e4m3", 512), ScaleRule.AMAX_FP32, 64, Field("latent_scale", 512, "fp32", 8)
        ),
        rope=VectorCoding(64, "bf16", Field("rope", 544, "bf16", 64), ScaleRule.NONE, 64),
    )
    register_format(spec)
    try:
        assert get_format("user_fp8_g64") is spec
        with pytest.raises(ValueError, match="already registered"):
            register_format(spec)
        lat, rope = torch.randn(4, 512), torch.randn(4, 64).bfloat16().float()
        r = encode("user_fp8_g64", lat, rope)
        assert r.shape == (4, 672)
        latd, roped = decode("user_fp8_g64", r)
        assert torch.equal(roped, rope) and (latd - lat).norm() / lat.norm() < 0.05
    finally:
        unregister_format("user_fp8_g64")
    with pytest.raises(UnknownFormatError):
        get_format("user_fp8_g64")
    with pytest.raises(ValueError, match="built-in"):
        unregister_format("nvfp4")


@pytest.mark.parametrize(
    "record_bytes, rope_offset, match",
    [
        (672, 560, "hole or overlap"),  # hole between 544 and 560
        (672, 540, "hole or overlap"),  # overlaps the scales
        (688, 544, "fields end at byte 672"),
    ],
)
def test_invalid_layouts_are_rejected(record_bytes, rope_offset, match):
    with pytest.raises(ValueError, match=match):
        FormatSpec(
            name="bad",
            title="bad",
            description="",
            source="",
            record_bytes=record_bytes,
            latent=VectorCoding(
                512, "e4m3", Field("latent", 0, "e4m3", 512), ScaleRule.AMAX_FP32, 64, Field("latent_scale", 512, "fp32", 8)
            ),
            rope=VectorCoding(64, "bf16", Field("rope", rope_offset, "bf16", 64), ScaleRule.NONE, 64),
        )


def test_unaligned_record_rejected():
    with pytest.raises(ValueError, match="16-byte aligned"):
        FormatSpec(
            name="bad",
            title="bad",
            description="",
            source="",
            record_bytes=580,
            latent=VectorCoding(512, "e4m3", Field("latent", 0, "e4m3", 512), ScaleRule.TENSOR, 512),
            rope=VectorCoding(64, "e4m3", Field("rope", 512, "e4m3", 64), ScaleRule.TENSOR, 64),
            pads=(Field("pad", 576, "pad", 4),),
        )


def _user_spec(name: str, aliases: tuple[str, ...] = ()) -> FormatSpec:
    return FormatSpec(
        name=name,
        title=name,
        description="E4M3 latent with a scale per 64 values, bf16 rope",
        source="test",
        record_bytes=672,
        latent=VectorCoding(
            512, "e4m3", Field("latent", 0, "e4m3", 512), ScaleRule.AMAX_FP32, 64, Field("latent_scale", 512, "fp32", 8)
        ),
        rope=VectorCoding(64, "bf16", Field("rope", 544, "bf16", 64), ScaleRule.NONE, 64),
        aliases=aliases,
    )


def test_old_names_select_the_format_with_a_note():
    from mla_eval.formats import alias_note

    spec = register_format(_user_spec("user_new_name", aliases=("user_old_name",)))
    try:
        assert get_format("user_old_name") is spec
        assert [s.name for s in parse_format_list("user_old_name,user_new_name")] == ["user_new_name"]
        assert "alias of 'user_new_name'" in alias_note("user_old_name")
        assert alias_note("user_new_name") is None
        with pytest.raises(ValueError, match="already taken"):
            register_format(_user_spec("user_other", aliases=("user_old_name",)))
        with pytest.raises(ValueError, match="already taken"):
            register_format(_user_spec("user_third", aliases=("nvfp4",)))
    finally:
        unregister_format("user_new_name")
    with pytest.raises(UnknownFormatError):
        get_format("user_old_name")


def test_builtin_names_and_aliases_never_collide():
    names = [s.name for s in all_formats()] + [a for s in all_formats() for a in s.aliases]
    assert len(names) == len(set(names))


def test_every_engine_defined_format_has_an_engine_facing_alias_selecting_only_it():
    """'<engine>:<its name>' selects exactly our format, and results record our name."""
    from mla_eval.evals.variants import parse_variants
    from mla_eval.formats import alias_note

    engine_specs = [s for s in all_formats() if s.engine is not None]
    assert {s.name for s in engine_specs} >= {"fp8_ds_mla", "fp8_ds_mla_pow2", "nvfp4", "nvfp4_fp8rope", "nvfp4_fp8_ds_mla"}
    for spec in engine_specs:
        engine_aliases = [a for a in spec.aliases if ":" in a]
        assert engine_aliases, f"{spec.name} has no engine-facing alias"
        for alias in engine_aliases:
            assert get_format(alias) is spec
            assert f"results record {spec.name!r}" in alias_note(alias)
            assert sum(get_format(a) is spec for s in all_formats() for a in s.aliases if a == alias) == 1
    assert get_format("vllm-fork:nvfp4_ds_mla").record_bytes == 432
    assert get_format("vllm-fork:nvfp4_ds_mla:KV_FP8_ROPE=1").record_bytes == 368
    assert [v.name for v in parse_variants("vllm-fork:nvfp4_ds_mla+s_l,sglang:fp4_e2m1")] == ["nvfp4+s_l", "sglang_fp4_e2m1"]


def test_an_engine_name_shared_by_several_records_is_refused_naming_the_choices():
    with pytest.raises(UnknownFormatError) as exc:
        get_format("nvfp4_ds_mla")
    msg = str(exc.value)
    assert "ambiguous" in msg and "nvfp4 (432 B" in msg and "nvfp4_fp8rope (368 B" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="already taken"):
        register_format(_user_spec("nvfp4_ds_mla"))


def test_record_width_lookup():
    from mla_eval.errors import UserError
    from mla_eval.formats import format_for_record_bytes

    assert format_for_record_bytes(352).name == "nvfp4_fp8_ds_mla"
    assert format_for_record_bytes(1152).name == "bf16"
    with pytest.raises(UserError, match="records of 432 B, shared by nvfp4, llamacpp_q5_1; name the format"):
        format_for_record_bytes(432)  # the vLLM fork's NVFP4 row and llama.cpp's q5_1 K row
    with pytest.raises(UserError, match=r"records of 500 B, which matches no cache format \(bf16=1152") as exc:
        format_for_record_bytes(500)
    assert "\n" not in str(exc.value)
    with pytest.raises(UserError, match="shared by fp8_ds_mla, fp8_ds_mla_pow2; name the format"):
        format_for_record_bytes(656)
    with pytest.raises(UserError, match="records of 324 B, shared by sglang_fp4_e2m1, trtllm_nvfp4_dsa, llamacpp_q4_0; "):
        format_for_record_bytes(324)


def test_global_scale_rules_are_validated():
    """A global scale belongs to the NVIDIA recipe (AMAX_E4M3_RCP6 with rcp.approx); saturation excludes clearing."""
    import dataclasses

    from mla_eval.formats import GlobalScale, ScaleApply
    from mla_eval.formats.spec import ScaleOrder

    spec = get_format("trtllm_nvfp4_dsa")
    with pytest.raises(ValueError, match="global scale is defined for the AMAX_E4M3_RCP6 rule"):
        dataclasses.replace(spec, name="bad_gs", latent=dataclasses.replace(spec.latent, apply=ScaleApply.MUL_RCP))
    with pytest.raises(ValueError, match="must be positive and finite"):
        dataclasses.replace(spec, name="bad_amax", latent=dataclasses.replace(spec.latent, global_scale=GlobalScale(amax=0.0)))
    with pytest.raises(ValueError, match="zero_scale_saturates is defined"):
        dataclasses.replace(spec, name="bad_sat", rope=dataclasses.replace(spec.rope, zero_scale_clears=True))
    r64 = get_format("trtllm_nvfp4_dsa_r64")
    with pytest.raises(ValueError, match="residual coding is defined for e2m1 groups of 16"):
        dataclasses.replace(r64, name="bad_res", rope=dataclasses.replace(r64.rope, scale_order=ScaleOrder.TRANSPOSE_8X4))
    with pytest.raises(ValueError, match="holds 128 codes, not 64"):  # two codes per value only with the residual pass
        dataclasses.replace(r64, name="bad_res_data", rope=dataclasses.replace(r64.rope, residual=False))
    other = dataclasses.replace(spec, name="trtllm_amax_448", aliases=(),
                                latent=dataclasses.replace(spec.latent, global_scale=GlobalScale(amax=448.0)),
                                rope=dataclasses.replace(spec.rope, global_scale=GlobalScale(amax=448.0)))
    x = torch.randn(8, 576).bfloat16().float() * 40
    assert not torch.equal(encode(other, x[:, :512], x[:, 512:]), encode(spec, x[:, :512], x[:, 512:]))


def test_model_dims_check_names_deepseek_v4():
    from mla_eval.errors import UserError
    from mla_eval.formats import check_model_dims

    check_model_dims(512, 64)
    with pytest.raises(UserError, match="448 \\+ 64 values per token \\(a DeepSeek-V4 cache\\).*not supported"):
        check_model_dims(448, 64, "deepseek-ai/DeepSeek-V4")
    with pytest.raises(UserError, match="caches 256 \\+ 32 values"):
        check_model_dims(256, 32)


def test_split_buffers_must_cover_the_record_in_order():
    from mla_eval.formats import get_format

    spec = get_format("sglang_fp4_e2m1")
    assert spec.record_bytes == 324 and spec.buffers == (("kv_buffer", 0, 288), ("kv_scale_buffer", 288, 324))
    import dataclasses

    with pytest.raises(ValueError, match="buffers must split the record"):
        dataclasses.replace(spec, name="bad_buffers", buffers=(("a", 0, 200), ("b", 288, 324)))


def test_reading_records_with_the_wrong_spec_is_one_line():
    from mla_eval.errors import UserError

    records = encode("nvfp4_fp8_ds_mla", torch.randn(2, 512), torch.randn(2, 64))  # 352 B, permuted scales
    for wrong in ("nvfp4", "nvfp4_fp8rope", "fp8_ds_mla"):
        with pytest.raises(UserError, match=r"records must be uint8 \[\.\.\., \d+\], got torch.uint8 \(2, 352\)") as exc:
            decode(wrong, records)
        assert "\n" not in str(exc.value)


def test_engine_names_follow_each_engine_and_version():
    """vLLM calls its 352 B record nvfp4_ds_mla (vllm/config/cache.py @ 002f10e0cfa1), as the fork calls its 432 B
    and 368 B records and vLLM its DeepSeek-V4.1 288 B one: the bare name is refused listing every candidate with
    its byte size, the '<engine>:<name>' aliases select one format each, and the retired spelling says why."""
    from mla_eval.formats.builtin import ENGINE_NAMES
    from mla_eval.formats.registry import ambiguous_engine_names

    assert get_format("vllm:nvfp4_ds_mla").name == "nvfp4_fp8_ds_mla"
    assert get_format("vllm:nvfp4_ds_mla").engine.flag.startswith("--kv-cache-dtype nvfp4_ds_mla ")
    with pytest.raises(UnknownFormatError) as exc:
        get_format("nvfp4_ds_mla")
    msg = str(exc.value)
    for piece in ("nvfp4_fp8_ds_mla (352 B", "dsv41_nvfp4 (288 B", "nvfp4 (432 B", "nvfp4_fp8rope (368 B",
                  "nvfp4_fp8rope_dyn (368 B", "304 B, not built in"):
        assert piece in msg, piece
    assert "\n" not in msg
    with pytest.raises(UnknownFormatError, match="vLLM calls the 352 B record nvfp4_ds_mla"):
        get_format("vllm:nvfp4_fp8_ds_mla")
    with pytest.raises(UnknownFormatError, match=r"sglang_fp4_e2m1 \(324 B.*sglang_nvfp4_dsa \(416 B"):
        get_format("fp4_e2m1")
    with pytest.raises(UnknownFormatError, match=r"'q8_0' is an engine's name: ours is llamacpp_q8_0, alias llama.cpp:q8_0"):
        get_format("q8_0")
    assert get_format("nvfp4").record_bytes == 432  # our own name wins over TensorRT-LLM's dtype name
    assert set(ambiguous_engine_names()) == {"nvfp4_ds_mla", "fp4_e2m1"}
    by_format = {e.format: e for e in ENGINE_NAMES if e.format is not None}
    assert set(by_format) <= set(format_names())
    for e in ENGINE_NAMES:
        if e.format is not None:
            assert get_format(e.format).record_bytes == e.record_bytes, e
        else:
            assert e.not_built_in, e


def test_round3_rules_are_validated():
    """ggml blocks fill their data field with whole blocks and no scale field; SGLang's DSA rule needs its g and
    midpoint codes (and only it has them); b12x's folded s_t needs a stored s_t and the recipe latent; the
    non-finite policy belongs to SGLang's DSA writer."""
    import dataclasses

    from mla_eval.formats import Field, ScaleRule
    from mla_eval.formats.spec import TokenScaleRule

    q8, dsa, dyn = get_format("llamacpp_q8_0"), get_format("sglang_nvfp4_dsa"), get_format("nvfp4_fp8rope_dyn")
    with pytest.raises(ValueError, match="stores 16 q8_0 blocks of 32"):
        dataclasses.replace(q8, latent=dataclasses.replace(q8.latent, group=16))
    with pytest.raises(ValueError, match="ggml block types go with scale rule"):
        dataclasses.replace(q8, latent=dataclasses.replace(q8.latent, scale_rule=ScaleRule.TENSOR))
    with pytest.raises(ValueError, match="SGLang's DSA rule"):
        dataclasses.replace(dsa, latent=dataclasses.replace(dsa.latent, elem_rounding="rne"))
    with pytest.raises(ValueError, match="SGLang's DSA rule"):
        dataclasses.replace(dsa, latent=dataclasses.replace(dsa.latent, global_scale=None))
    with pytest.raises(ValueError, match="SGLang's DSA rule"):
        nv = get_format("nvfp4")
        dataclasses.replace(nv, latent=dataclasses.replace(nv.latent, elem_rounding="midpoints"))
    with pytest.raises(ValueError, match="folded s_t"):
        dataclasses.replace(dyn, token_scale=None, pads=(Field("pad", 292, "pad", 12),))
    with pytest.raises(ValueError, match="non-finite policy"):
        dataclasses.replace(get_format("nvfp4"), nonfinite="nan_zero_inf_saturate")
    assert dyn.token_scale_rule is TokenScaleRule.MUL_FOLDED
    assert get_format("nvfp4_fp8rope_st").token_scale_rule is TokenScaleRule.DIV_FLOORED
