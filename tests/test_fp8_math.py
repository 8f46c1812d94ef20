"""FP8 weight math on the CPU (mla_eval.model.fp8_math, fp8_linear): the engines' activation quantisation against
independent ports of their kernels (numpy float32, our own e4m3 rounding), the block-scaled product against float64,
the FP8 modules a checkpoint loads into (codes and scales kept as stored), and `--weight-math` resolution."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_checkpoint import TOKENIZER, small_config

from mla_eval.errors import UserError
from mla_eval.model import fp8_math
from mla_eval.model.checkpoint_writer import write_random_checkpoint
from mla_eval.model.fp8_linear import FP8_LOG, Fp8Experts, Fp8Linear, resolve_weight_math
from mla_eval.model.weight_formats import read_weight_format

F32 = np.float32


def e4m3_rne(y: np.ndarray) -> np.ndarray:
    """Round float32 values (|y| <= 448) to the nearest float8_e4m3fn value, ties to even, as numpy float64
    (3 mantissa bits; exponents -6..8; subnormals below 2**-6 in steps of 2**-9)."""
    y = y.astype(np.float64)
    mag = np.abs(y)
    exp = np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    exp = np.clip(exp, -6, 8)
    quantum = np.exp2(exp - 3)
    return np.sign(y) * np.round(mag / quantum) * quantum  # np.round: half to even


def sglang_port(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sgl-kernel per_token_group_quant_8bit_kernel (Hopper: ROUND_SCALE false): local_absmax starts at 1e-10,
    scale_inv = amax * (1.0f / 448), scale = 448 / amax, q = satfinite_rn(x * scale)."""
    g = x.astype(F32).reshape(x.shape[0], -1, 128)
    amax = np.maximum(F32(1e-10), np.abs(g).max(-1)).astype(F32)
    scale_inv = (amax * (F32(1.0) / F32(448.0))).astype(F32)
    scale = (F32(448.0) / amax).astype(F32)
    y = (g * scale[..., None]).astype(F32)
    return e4m3_rne(np.clip(y, -448, 448)).reshape(x.shape), scale_inv


def vllm_port(x: np.ndarray, ue8m0: bool) -> tuple[np.ndarray, np.ndarray]:
    """vllm per_token_group_quant_8bit_kernel: y_s = absmax / 448 (absmax from eps), optionally
    exp2(ceil(log2(max(|y_s|, 1e-10)))), q = rn(clamp(x / y_s, -448, 448))."""
    g = x.astype(F32).reshape(x.shape[0], -1, 128)
    amax = np.maximum(F32(1e-10), np.abs(g).max(-1)).astype(F32)
    y_s = (amax / F32(448.0)).astype(F32)
    if ue8m0:
        y_s = np.exp2(np.ceil(np.log2(np.maximum(np.abs(y_s), F32(1e-10))))).astype(F32)
    y = np.clip((g / y_s[..., None]).astype(F32), -448, 448)
    return e4m3_rne(y).reshape(x.shape), y_s


def _inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 384, generator=g) * torch.logspace(-3, 3, 9).unsqueeze(1)  # many magnitudes
    x[2, :128] = 0.0  # an all-zero group: amax is the 1e-10 floor
    x[3, 5] = 1e4  # one large value in a group
    return x.to(torch.bfloat16)  # the engines quantise bf16 activations


@pytest.mark.parametrize("rule", ["sglang", "vllm"])
def test_activation_quantisation_equals_the_engine_kernel_bit_for_bit(rule):
    x = _inputs()
    codes, scales = fp8_math.quantise_activations(x, fp8_math.ACT_RULES[rule])
    want_codes, want_scales = sglang_port(x.float().numpy()) if rule == "sglang" else vllm_port(x.float().numpy(), True)
    assert np.array_equal(scales.numpy(), want_scales)
    assert np.array_equal(codes.float().numpy().astype(np.float64), want_codes)
    if rule == "vllm":  # power-of-two scales: exact exponents only
        assert np.all(np.frexp(scales.numpy())[0] == 0.5)


def test_the_rules_differ_where_the_engines_differ():
    """SGLang multiplies by 448/amax and stores amax/448 rounded; vLLM divides by its power-of-two scale: the codes
    of some groups differ (so naming the engine matters)."""
    x = _inputs()
    a, _ = fp8_math.quantise_activations(x, fp8_math.SGLANG)
    b, _ = fp8_math.quantise_activations(x, fp8_math.VLLM)
    assert not torch.equal(a.float(), b.float())


def test_an_activation_width_not_a_multiple_of_128_is_refused():
    with pytest.raises(ValueError, match="groups of 128"):
        fp8_math.quantise_activations(torch.ones(2, 100))


def _block_weight(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(n, k, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(*fp8_math.block_grid(n, k), generator=g) * 1e-3 + 1e-4
    return codes, scales


@pytest.mark.parametrize("n,k", [(256, 384), (200, 256), (576, 128)])  # a partial last block row, kv_a's 576 rows
def test_block_matmul_equals_float64_of_the_same_operands(n, k):
    x = _inputs()[:, :k].float()
    xq, xs = fp8_math.quantise_activations(x)
    wq, ws = _block_weight(n, k, seed=n)
    got = fp8_math.block_fp8_matmul(xq, xs, wq, ws, torch.float32)
    x64 = xq.double() * xs.double().repeat_interleave(128, 1)
    w64 = fp8_math.dequantise_blocks(wq, ws, torch.float64)
    want = x64 @ w64.t()
    rel = float((got.double() - want).norm() / want.norm())
    assert rel < 1e-6, rel  # fp32 accumulation only
    chunked = fp8_math.block_fp8_matmul(xq, xs, wq, ws, torch.float32, rows_per_chunk=2)  # the products' blocking moves
    assert float((chunked.double() - want).norm() / want.norm()) < 1e-6  # only the fp32 order inside a K-group


def test_grouped_experts_reference_equals_a_per_pair_loop():
    """The routed experts (sorted by expert, two block products, SiLU(gate) * up) against one (token, expert) pair at
    a time through the same arithmetic written out: equal up to the bf16 rounding order of the top-k sum."""
    e, h, i, t, k = 3, 256, 128, 11, 2
    g = torch.Generator().manual_seed(5)
    w13, s13 = _block_weight(2 * i * e, h, 1)
    w13, s13 = w13.view(e, 2 * i, h), s13.view(e, 2, -1)
    w2, s2 = _block_weight(h * e, i, 2)
    w2, s2 = w2.view(e, h, i), s2.view(e, 2, 1)
    x = (torch.randn(t, h, generator=g) * 3).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=g)
    got = fp8_math.grouped_experts_reference(x, idx, wts, w13, s13, w2, s2, i)
    want = torch.zeros(t, h, dtype=torch.float64)
    for tok in range(t):
        for j in range(k):
            ex = int(idx[tok, j])
            gate = fp8_math.fp8_linear_reference(x[tok: tok + 1], w13[ex, :i], s13[ex, :1])
            up = fp8_math.fp8_linear_reference(x[tok: tok + 1], w13[ex, i:], s13[ex, 1:])
            down = fp8_math.fp8_linear_reference(torch.nn.functional.silu(gate) * up, w2[ex], s2[ex])
            want[tok] += float(wts[tok, j]) * down[0].double()
    rel = float((got.double() - want).norm() / want.norm())
    assert rel < 5e-3, rel


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("fp8") / "c", small_config("deepseek_v32", vocab=12288),
                                   "fp8-block", tokenizer_from=TOKENIZER).path


def test_fp8_weight_math_keeps_the_stored_bytes_and_computes_like_the_dequantised_model(fp8_checkpoint):
    from safetensors import safe_open

    from mla_eval.model.loader import load_model

    fp8 = load_model(fp8_checkpoint, device="cpu", dtype="bfloat16", weight_math="fp8")
    deq = load_model(fp8_checkpoint, device="cpu", dtype="bfloat16", weight_math="dequant")
    layer = fp8.model.model.layers[1]
    assert isinstance(layer.self_attn.q_a_proj, Fp8Linear) and isinstance(layer.mlp.experts, Fp8Experts)
    assert layer.self_attn.kv_b_proj.weight.dtype == torch.bfloat16  # read as a matrix by the absorbed attention
    index = json.loads((fp8_checkpoint / "model.safetensors.index.json").read_text())["weight_map"]

    def stored(name):
        with safe_open(str(fp8_checkpoint / index[name]), "pt") as f:
            return f.get_tensor(name)

    base = "model.layers.1.self_attn.q_a_proj.weight"
    assert torch.equal(layer.self_attn.q_a_proj.weight.view(torch.uint8), stored(base).view(torch.uint8))
    assert torch.equal(layer.self_attn.q_a_proj.weight_scale_inv, stored(base + "_scale_inv"))
    up = "model.layers.1.mlp.experts.2.up_proj.weight"
    i = layer.mlp.experts.intermediate_dim
    assert torch.equal(layer.mlp.experts.gate_up_proj[2, i:].view(torch.uint8), stored(up).view(torch.uint8))
    assert torch.equal(layer.mlp.experts.gate_up_proj_scale_inv[2, 1:], stored(up + "_scale_inv"))
    # the same function: each FP8 Linear within FP8 activation rounding of its dequantised twin
    x = torch.randn(5, layer.self_attn.q_a_proj.in_features).to(torch.bfloat16)
    FP8_LOG.reset()
    with torch.no_grad():
        a, b = layer.self_attn.q_a_proj(x).float(), deq.model.model.layers[1].self_attn.q_a_proj(x).float()
    assert float((a - b).norm() / b.norm()) < 0.06
    assert FP8_LOG.as_dict() == {"torch": 1}
    record = fp8.compute()
    assert record["weight_math"]["math"] == "fp8" and record["experts"]["implementation"] == "fp8-grouped"
    # half the bytes held per layer (codes + fp32 block scales against bf16)
    from mla_eval.model.run_plan import WeightInventory

    moe = 1
    held = {name: WeightInventory.of_model(lm.model, name).layer_bytes[moe] for name, lm in (("f", fp8), ("d", deq))}
    assert held["f"] < 0.6 * held["d"], held


def test_weight_math_resolution(fp8_checkpoint, tmp_path):
    fmt = read_weight_format(fp8_checkpoint, json.loads((fp8_checkpoint / "config.json").read_text()))
    assert resolve_weight_math("auto", fmt)[0] == "fp8"
    assert resolve_weight_math("dequant", fmt)[0] == "dequant"
    assert resolve_weight_math("auto", None) == ("dequant", "auto: weights stored in the run's precision (nothing to quantise)")
    with pytest.raises(UserError, match="--weight-math fp8 computes FP8 128x128 block weights as stored; this model has "
                                        "bf16 weights"):
        resolve_weight_math("fp8", None)
    with pytest.raises(UserError, match="--weight-math 'fp4': choose one of auto, dequant, fp8"):
        resolve_weight_math("fp4", fmt)
    ct = write_random_checkpoint(tmp_path / "ct", small_config("deepseek_v3"), "ct-nvfp4").path
    fmt = read_weight_format(ct, json.loads((ct / "config.json").read_text()))
    math, why = resolve_weight_math("auto", fmt)
    assert math == "dequant" and "does not model" in why
