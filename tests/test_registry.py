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
    assert format_names()[:8] == [
        "bf16", "fp8_ds_mla", "fp8_ds_mla_pow2", "nvfp4", "nvfp4_fp8rope", "nvfp4_fp8rope_st", "mxfp4", "fp8_e4m3",
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
        latent=VectorCoding(512, "e4m3", Field("latent", 0, "e4m3", 512), ScaleRule.AMAX_FP32, 64, Field("latent_scale", 512, "fp32", 8)),
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
            latent=VectorCoding(512, "e4m3", Field("latent", 0, "e4m3", 512), ScaleRule.AMAX_FP32, 64, Field("latent_scale", 512, "fp32", 8)),
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
