"""Codec tests: exact bytes at every field offset (hand-derived), scale rules, edge cases, bounds."""

import struct
import zlib

import pytest
import torch

from mla_eval.errors import NonFiniteInputError, UserError
from mla_eval.formats import all_formats, decode, encode, get_format


def zeros():
    return torch.zeros(512), torch.zeros(64)


def f32_bytes(x: float) -> list[int]:
    return list(struct.pack("<f", x))


def bf16_bytes(x: float) -> list[int]:
    return list(struct.pack("<f", x)[2:])  # exact for bf16-representable x


def test_record_bytes_and_offsets_match_design():
    want = {
        "bf16": (1152, {"latent": (0, 1024), "rope": (1024, 1152)}),
        "fp8_ds_mla": (656, {"latent": (0, 512), "latent_scale": (512, 528), "rope": (528, 656)}),
        "fp8_ds_mla_pow2": (656, {"latent": (0, 512), "latent_scale": (512, 528), "rope": (528, 656)}),
        "nvfp4": (432, {"latent": (0, 256), "latent_scale": (256, 288), "pad": (288, 304), "rope": (304, 432)}),
        "nvfp4_fp8rope": (
            368,
            {"latent": (0, 256), "latent_scale": (256, 288), "rope_scale": (288, 292), "pad": (292, 304), "rope": (304, 368)},
        ),
        "nvfp4_fp8rope_st": (
            368,
            {
                "latent": (0, 256),
                "latent_scale": (256, 288),
                "rope_scale": (288, 292),
                "token_scale": (292, 296),
                "pad": (296, 304),
                "rope": (304, 368),
            },
        ),
        "mxfp4": (416, {"latent": (0, 256), "latent_scale": (256, 272), "pad": (272, 288), "rope": (288, 416)}),
        "fp8_e4m3": (576, {"latent": (0, 512), "rope": (512, 576)}),
    }
    for name, (nbytes, fields) in want.items():
        spec = get_format(name)
        assert spec.record_bytes == nbytes
        assert {f.name: (f.offset, f.end) for f in spec.fields} == fields, name
        assert spec.record_bytes % 16 == 0


def test_bf16_bytes():
    lat, rope = zeros()
    lat[0], lat[511], rope[0], rope[63] = 1.0, -2.0, 0.5, 3.0
    r = encode("bf16", lat, rope)
    assert r[0:2].tolist() == bf16_bytes(1.0)
    assert r[1022:1024].tolist() == bf16_bytes(-2.0)
    assert r[1024:1026].tolist() == bf16_bytes(0.5)
    assert r[1150:1152].tolist() == bf16_bytes(3.0)


def test_fp8_ds_mla_bytes_raw_scale():
    lat, rope = zeros()
    lat[0] = 448.0  # group 0: amax 448 -> scale 1.0 -> 448 -> 0x7E
    lat[1] = -1.0  # -> 0xB8
    lat[128] = 3.0  # group 1: amax 3 -> scale 3/448 (fp32) ; 3 * (1/s) ~ 448 -> 0x7E
    rope[1] = 1.5
    r = encode("fp8_ds_mla", lat, rope)
    assert r[0].item() == 0x7E and r[1].item() == 0xB8 and r[128].item() == 0x7E
    assert r[512:516].tolist() == f32_bytes(1.0)
    s1 = torch.tensor(3.0) / torch.tensor(448.0)
    assert r[516:520].tolist() == list(struct.pack("<f", s1.item()))
    # all-zero groups store FLT_MIN (never a zero scale): 2^-126 = 0x00800000
    assert r[520:524].tolist() == [0, 0, 0x80, 0] and r[524:528].tolist() == [0, 0, 0x80, 0]
    assert r[530:532].tolist() == bf16_bytes(1.5)


def test_fp8_ds_mla_pow2_scale_rounds_up_to_power_of_two():
    lat, rope = zeros()
    lat[0] = 448.0  # amax/448 = 1 -> already a power of two -> 1
    lat[128] = 449.0  # amax/448 just above 1 -> 2
    lat[256] = 100.0  # 100/448 = 0.223 -> 0.25
    r = encode("fp8_ds_mla_pow2", lat, rope)
    assert r[512:516].tolist() == f32_bytes(1.0)
    assert r[516:520].tolist() == f32_bytes(2.0)
    assert r[520:524].tolist() == f32_bytes(0.25)
    assert r[128].item() == 0x76  # 449 / 2 = 224.5 -> 224 = 2^7 * 1.75 -> e=14, m=6 -> 0x76
    assert r[256].item() == 0x7C  # 100 * 4 = 400 = 2^8 * 1.5625: tie of 1.5 (m=4) / 1.625 (m=5) -> m=4, e=15


def test_nvfp4_bytes():
    lat, rope = zeros()
    lat[0], lat[1] = 6.0, -3.0  # block 0: amax 6 -> scale e4m3(1.0) = 0x38 ; codes 7 and 0xD
    lat[2], lat[3] = 0.75, 0.25  # ties: 0.75 -> 1.0 (code 2), 0.25 -> 0 (code 0)
    lat[16] = 12.0  # block 1: amax 12 -> scale 2.0 = 0x40 ; 12/2 = 6 -> code 7
    lat[17] = 5.0  # 5/2 = 2.5 -> tie -> 2 (code 4)
    rope[0] = 1.0
    r = encode("nvfp4", lat, rope)
    assert r[0].item() == 0xD7  # element 0 low nibble, element 1 high nibble
    assert r[1].item() == 0x02
    assert r[8].item() == 0x47
    assert r[256].item() == 0x38 and r[257].item() == 0x40
    assert r[258:288].tolist() == [0] * 30  # all-zero blocks: scale 0
    assert r[288:304].tolist() == [0] * 16  # padding
    assert r[304:306].tolist() == bf16_bytes(1.0)
    latd, roped = decode("nvfp4", r)
    assert latd[:4].tolist() == [6.0, -3.0, 1.0, 0.0]
    assert latd[16:18].tolist() == [12.0, 4.0]
    assert roped[0].item() == 1.0


def test_nvfp4_block_scale_saturates_and_subnormal_scales():
    lat, rope = zeros()
    lat[0] = 6 * 448.0 * 2  # amax/6 = 896 -> E4M3 saturates to 448 (0x7E); 5376/448 = 12 -> code 7 (6)
    lat[16] = 6 * 2.0**-9  # amax/6 = 2^-9: smallest E4M3 subnormal (0x01); value/scale = 6 -> code 7
    lat[32] = 3 * 2.0**-9  # amax/6 = 2^-10: tie between 0 and 2^-9 -> scale 0 -> block all zero
    r = encode("nvfp4", lat, rope)
    assert r[256].item() == 0x7E and (r[0] & 0xF).item() == 7
    assert r[257].item() == 0x01 and (r[8] & 0xF).item() == 7
    assert r[258].item() == 0x00 and (r[16] & 0xF).item() == 0
    latd, _ = decode("nvfp4", r)
    assert latd[0].item() == 6 * 448.0 and latd[16].item() == 6 * 2.0**-9 and latd[32].item() == 0.0
    assert torch.isfinite(latd).all()


def test_nvfp4_negative_zero_and_zero_block():
    lat, rope = zeros()
    lat[5] = -0.0
    r = encode("nvfp4", lat, rope)
    assert (r[2] >> 4).item() == 0x8  # element 5 = high nibble of byte 2, sign kept
    latd, _ = decode("nvfp4", r)
    assert torch.signbit(latd[5]) and latd[5].item() == 0.0


def test_nvfp4_fp8rope_bytes():
    lat, rope = zeros()
    rope[0], rope[1] = 448.0, -224.0  # amax 448 -> scale 1.0
    r = encode("nvfp4_fp8rope", lat, rope)
    assert r[288:292].tolist() == f32_bytes(1.0)
    assert r[292:304].tolist() == [0] * 12
    assert r[304].item() == 0x7E and r[305].item() == 0xF6  # -224 = -(2^7 * 1.75): e=14, m=6
    assert decode("nvfp4_fp8rope", r)[1][:2].tolist() == [448.0, -224.0]


def test_two_level_token_scale():
    lat, rope = zeros()
    lat[0] = 2688.0  # token amax 2688 -> s_t = 1.0 ; block 0 amax 2688 -> 448 (0x7E) ; code 7
    lat[16] = 6.0  # block 1: 6 -> scale 1.0 (0x38), code 7
    r = encode("nvfp4_fp8rope_st", lat, rope)
    assert r[292:296].tolist() == f32_bytes(1.0)
    assert r[256].item() == 0x7E and r[257].item() == 0x38
    assert r[296:304].tolist() == [0] * 8
    lat2 = lat * 0.5  # s_t halves; all stored codes and block scales stay the same
    r2 = encode("nvfp4_fp8rope_st", lat2, rope)
    assert r2[292:296].tolist() == f32_bytes(0.5)
    assert torch.equal(r2[:292], r[:292])
    assert decode("nvfp4_fp8rope_st", r2)[0][:17:16].tolist() == [1344.0, 3.0]


def test_mxfp4_bytes_ocp_floor_rule():
    lat, rope = zeros()
    lat[0] = 6.0  # floor(log2 6) = 2 -> X = 2^0 -> E8M0 127 ; 6 -> code 7
    lat[32] = 7.0  # floor(log2 7) = 2 -> X = 1 ; 7 saturates to 6 (OCP rule clamps)
    lat[64] = 1.0  # floor(log2 1) = 0 -> X = 2^-2 -> code 125 ; 1/0.25 = 4 -> code 6
    r = encode("mxfp4", lat, rope)
    assert r[256:259].tolist() == [127, 127, 125]
    assert r[259:272].tolist() == [0] * 13  # zero blocks: 2^-127
    assert r[272:288].tolist() == [0] * 16
    assert (r[0] & 0xF).item() == 7 and (r[16] & 0xF).item() == 7 and (r[32] & 0xF).item() == 6
    latd, _ = decode("mxfp4", r)
    assert latd[0].item() == 6.0 and latd[32].item() == 6.0 and latd[64].item() == 1.0


def test_fp8_e4m3_per_tensor_scale():
    lat, rope = zeros()
    lat[0], rope[0] = 1.0, -448.0
    r = encode("fp8_e4m3", lat, rope)
    assert r[0].item() == 0x38 and r[512].item() == 0xFE
    r2 = encode("fp8_e4m3", lat, rope, outer_scale=2.0)  # stores values / 2, rope too
    assert r2[0].item() == 0x30 and r2[512].item() == 0xF6
    latd, roped = decode("fp8_e4m3", r2, outer_scale=2.0)
    assert latd[0].item() == 1.0 and roped[0].item() == -448.0


def test_outer_scale_is_applied_before_quantisation():
    torch.manual_seed(1)
    lat = (torch.randn(7, 512) * 40).bfloat16().float()  # the engine's latent is bf16
    rope = torch.randn(7, 64)
    s_l = 0.03125
    r = encode("nvfp4", lat, rope, outer_scale=s_l)
    assert torch.equal(r, encode("nvfp4", lat * (1 / s_l), rope))  # 1/s_l is exact here
    # the scaled latent is held in bf16 before quantisation (the vLLM fork scales its bf16 tensor in torch)
    lat32 = torch.randn(7, 512) * 40
    held = (lat32 * (1 / torch.tensor(0.37))).bfloat16().float()
    assert torch.equal(encode("nvfp4", lat32, rope, outer_scale=0.37), encode("nvfp4", held, rope))
    latd, _ = decode("nvfp4", r, outer_scale=s_l)
    latd0, _ = decode("nvfp4", r)
    assert torch.equal(latd, latd0 * s_l)
    # a per-token tensor of scales broadcasts over the leading dims
    per_tok = torch.full((7,), s_l)
    assert torch.equal(encode("nvfp4", lat, rope, outer_scale=per_tok), r)


def test_outer_scale_errors():
    lat, rope = zeros()
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(UserError, match="positive and finite"):
            encode("nvfp4", lat, rope, outer_scale=bad)
    with pytest.raises(UserError, match="takes no outer scale"):
        encode("fp8_ds_mla", lat, rope, outer_scale=1.0)


def test_nan_and_inf_are_reported_with_position():
    lat = torch.zeros(3, 4, 512)
    rope = torch.zeros(3, 4, 64)
    lat[1, 2, 17] = float("nan")
    with pytest.raises(NonFiniteInputError, match=r"latent is nan at layer 5, index \(1, 2, 17\)"):
        encode("nvfp4", lat, rope, layer=5)
    lat[1, 2, 17] = 0
    rope[2, 0, 3] = float("-inf")
    with pytest.raises(NonFiniteInputError, match=r"rope is -inf at index \(2, 0, 3\)"):
        encode("fp8_ds_mla", lat, rope)


def test_shape_and_dtype_errors():
    with pytest.raises(UserError, match="expected 512"):
        encode("nvfp4", torch.zeros(4, 500), torch.zeros(4, 64))
    with pytest.raises(UserError, match="leading dims"):
        encode("nvfp4", torch.zeros(4, 512), torch.zeros(3, 64))
    with pytest.raises(UserError, match="records must be uint8"):
        decode("nvfp4", torch.zeros(4, 368, dtype=torch.uint8))


def _data(kind: str, gen: torch.Generator, n: int = 256):
    if kind == "normal":
        lat = torch.randn(n, 512, generator=gen)
        rope = torch.randn(n, 64, generator=gen)
    else:  # heavy-tailed: Student-t with 2 degrees of freedom, plus a few huge outliers
        t = torch.distributions.StudentT(2.0)
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
        lat = t.sample((n, 512)) * 3
        rope = t.sample((n, 64))
        lat[::17, ::31] *= 1000
    return lat.bfloat16().float(), rope.bfloat16().float()


@pytest.mark.parametrize("kind", ["normal", "heavy"])
@pytest.mark.parametrize("name", [s.name for s in all_formats()])
def test_round_trip_error_bounds(name, kind):
    """Per-element error bounds that follow from the element and scale types.

    Formats with an outer scale get the calibrated s_l = amax / denominator (what `calibrate`
    computes); the bounds are then stated on the scaled values v = x / s_l.
    """
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}-{kind}".encode()))
    lat, rope = _data(kind, gen)
    spec = get_format(name)
    s_l = None
    if spec.outer_scale is not None:
        amax = torch.cat([lat.flatten(), rope.flatten()] if spec.outer_scale.applies_to_rope else [lat.flatten()])
        s_l = amax.abs().max().item() / spec.outer_scale.denominator
    latd, roped = decode(spec, encode(spec, lat, rope, outer_scale=s_l), outer_scale=s_l)
    for coding, x, xd in ((spec.latent, lat, latd), (spec.rope, rope, roped)):
        scaled = s_l is not None and (coding is spec.latent or spec.outer_scale.applies_to_rope)
        unit = s_l if scaled else 1.0
        v, err = x / unit, (xd - x).abs() / unit
        slack = 1e-5 * v.abs() + 1e-30  # the scaling by s_l itself rounds
        g = v.abs().reshape(x.shape[0], -1, coding.group).amax(-1, keepdim=True)
        gmax = g.expand(-1, -1, coding.group).reshape(x.shape)
        if coding.ggml:
            _check_ggml_bounds(coding.elem, v, err, gmax, slack)
            continue
        if coding.elem == "bf16":
            assert torch.equal(xd, x)  # inputs are bf16 already: lossless
        elif coding.elem == "e4m3" and coding.scale_rule.value == "tensor":
            # no group scale: relative 2^-4 in the normal range, 2^-10 absolute in the subnormals
            assert (err <= v.abs() * 2**-4 + 2**-10 + slack).all()
        elif coding.elem == "e4m3":
            # scale maps amax to 448 (pow2: to [224, 448]); E4M3 half-ulp is 2^-4 relative,
            # subnormals (below 2^-6 * s) have absolute spacing 2^-9 * s
            s = gmax / 448 * (2 if "pow2" in coding.scale_rule.value else 1)
            assert (err <= v.abs() * 2**-4 + s * 2**-10 * 1.0001 + slack).all(), err.max()
        else:  # e2m1 with an E4M3 or E8M0 group scale
            # E4M3 scale: s within 2^-4 of amax/6; spacing at the top of E2M1 is 2 s -> error <= s,
            # plus saturation of at most (6 (1+2^-4) - 6) s: err <= amax/4. E8M0: s in (amax/8,
            # amax/4], values up to 8 s saturate to 6 s -> err <= 2 s <= amax/2.
            # Without an outer scale, values beyond 6 * 448 also clip (the E4M3 scale saturates at 448);
            # with an engine global scale S at 6 * 448 / S (TensorRT-LLM: its amax setting, 100 by default).
            clip = 6 * 448 * (coding.global_scale.dequant if coding.global_scale is not None else 1.0)
            bound = gmax * (0.25 if coding.scale_rule.value.startswith("e4m3") else 0.5)
            if coding.scale_rule.value.startswith("e4m3"):
                bound = bound + (v.abs() - clip).clamp_min(0)
            if spec.reader_e4m3:  # the engine reads an E4M3 copy: half an ulp more, 2^-10 absolute in subnormals
                bound = bound + (v.abs() + bound) * 2**-4 + 2**-10
            assert (err <= bound + slack).all(), (err - bound).max()
        # groups that clip (an E2M1 format without an outer scale, amax above the clip level) are bounded above
        clip = 6 * 448 * (coding.global_scale.dequant if coding.global_scale is not None else 1.0)
        keep = gmax <= clip if (coding.elem == "e2m1" and not scaled) else torch.ones_like(gmax, dtype=torch.bool)
        rel = (err[keep].norm() / v[keep].norm()).item()
        assert rel < {"bf16": 1e-6, "e4m3": 0.05, "e2m1": 0.2}[coding.elem], rel


def _check_ggml_bounds(kind: str, v: torch.Tensor, err: torch.Tensor, gmax: torch.Tensor, slack: torch.Tensor) -> None:
    """ggml blocks of 32: the code step d (q8_0 amax/127, q4_0 amax/8, q5_1 range/31 <= 2 amax/31) bounds the
    error by d/2 (q4_0: d, its -max side clips to 7 d), plus the fp16 rounding of d (2^-11 relative, 2^-25 in
    the subnormals) times the largest code and, for q5_1, of the fp16 minimum. A block whose scale passes fp16's
    65504 stores inf, as ggml does: those blocks are left out (llama.cpp's cache holds inf there too)."""
    step, steps, half = {"q8_0": (gmax / 127, 127, 0.5), "q4_0": (gmax / 8, 8, 1.0), "q5_1": (2 * gmax / 31, 31, 0.5)}[kind]
    keep = (step <= 65504) & (gmax <= 65504 if kind == "q5_1" else True)
    fp16 = steps * (step * 2**-11 + 2**-25) + (gmax * 2**-11 + 2**-25 if kind == "q5_1" else 0)
    assert (err[keep] <= (step * half + fp16 + slack)[keep] * 1.0001).all()
    rel = (err[keep].norm() / v[keep].norm()).item()
    assert rel < {"q8_0": 0.02, "q4_0": 0.2, "q5_1": 0.1}[kind], rel


def test_nvfp4_without_outer_scale_saturates_at_6_times_448():
    """Why s_l exists: without it a latent above 2688 clips (block scale saturates at 448)."""
    lat, rope = zeros()
    lat[0], lat[1] = 10000.0, 448.0
    latd, _ = decode("nvfp4", encode("nvfp4", lat, rope))
    assert latd[0].item() == 2688.0 and latd[1].item() == 448.0
    s_l = 10000.0 / 2688
    latd, _ = decode("nvfp4", encode("nvfp4", lat, rope, outer_scale=s_l), outer_scale=s_l)
    assert abs(latd[0].item() - 10000.0) < 1.0


def test_decode_is_exact_inverse_on_the_value_grid():
    """Values already on a format's grid encode and decode without change."""
    lat = torch.tensor([6.0, -4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0] * 64)
    rope = torch.linspace(-4, 4, 64).bfloat16().float()
    for name in ("nvfp4", "mxfp4"):
        assert torch.equal(decode(name, encode(name, lat, rope))[0], lat)


def test_encode_is_device_agnostic_and_batched():
    gen = torch.Generator().manual_seed(3)
    lat = torch.randn(2, 3, 512, generator=gen)
    rope = torch.randn(2, 3, 64, generator=gen)
    for spec in all_formats():
        batched = encode(spec, lat, rope)
        single = torch.stack([torch.stack([encode(spec, lat[i, j], rope[i, j]) for j in range(3)]) for i in range(2)])
        assert torch.equal(batched, single), spec.name
