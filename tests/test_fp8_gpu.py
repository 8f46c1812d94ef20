"""FP8 weight math on a Hopper GPU: DeepGEMM's kernels (the optional sgl-deep-gemm wheel) against the torch
reference of the same arithmetic (mla_eval.model.fp8_math), dense and grouped, and the FP8 modules using them.

Without deep_gemm installed the kernel tests skip, unless MLA_EVAL_FP8_GEMM=deepgemm asks for it (then they fail,
saying why it could not load): the device step sets it (`python -m tools.device fp8`)."""

from __future__ import annotations

import os

import pytest
import torch

from mla_eval.model import deepgemm, fp8_math
from mla_eval.model.fp8_linear import FP8_LOG, Fp8Experts, Fp8Linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def dg():
    ok, why = deepgemm.available()
    if not ok and os.environ.get(deepgemm.BACKEND_ENV) != "deepgemm":
        pytest.skip(f"DeepGEMM not usable here ({why}); set {deepgemm.BACKEND_ENV}=deepgemm to require it")
    return deepgemm.require()


def _weight(n, k, seed, experts=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (n, k) if experts is None else (experts, n, k)
    codes = (torch.randn(*shape, generator=g, device="cuda") * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = fp8_math.block_grid(n, k)
    scales = torch.rand(*(grid if experts is None else (experts, *grid)), generator=g, device="cuda") * 1e-3 + 1e-4
    return codes, scales


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("m,n,k", [(1, 2048, 7168), (333, 1536, 7168), (4096, 7168, 2048)])
def test_deepgemm_dense_equals_the_reference(dg, m, n, k):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = fp8_math.quantise_activations(x)
    wq, ws = _weight(n, k, seed=m)
    got = deepgemm.gemm(xq, xs, wq, ws)
    want = fp8_math.block_fp8_matmul(xq, xs, wq, ws, torch.bfloat16)
    assert _rel(got, want) < 5e-3  # bf16 output rounding and the tensor core's order within a K-group


def test_deepgemm_grouped_experts_equal_the_reference(dg):
    """GLM-5 expert widths (hidden 6144, intermediate 2048), 16 experts, 700 tokens x top 4."""
    e, h, i, t, top = 16, 6144, 2048, 700, 4
    w13, s13 = _weight(2 * i, h, 1, experts=e)
    w2, s2 = _weight(h, i, 2, experts=e)
    experts = Fp8Experts(e, h, i, torch.nn.functional.silu, device="cuda")
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.gate_up_proj_scale_inv.copy_(s13)
        experts.down_proj.copy_(w2)
        experts.down_proj_scale_inv.copy_(s2)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(e, device="cuda")[:top] for _ in range(t)])
    wts = torch.rand(t, top, device="cuda")
    FP8_LOG.reset()
    got = experts(x, idx, wts)
    assert FP8_LOG.as_dict() == {"deepgemm-grouped": 1}
    want = fp8_math.grouped_experts_reference(x, idx, wts, w13, s13, w2, s2, i)
    assert _rel(got, want) < 2e-2  # plus the re-quantised intermediate, whose codes may flip on a last-bit difference


def test_fp8_linear_runs_deepgemm_on_the_gpu_576_rows_included(dg):
    """kv_a_proj_with_mqa's 576 rows are padded to the block grid for the kernel: the same numbers as the reference."""
    lin = Fp8Linear(7168, 576, device="cuda")
    wq, ws = _weight(576, 7168, 3)
    with torch.no_grad():
        lin.weight.copy_(wq)
        lin.weight_scale_inv.copy_(ws)
    x = torch.randn(2, 64, 7168, device="cuda", dtype=torch.bfloat16)
    FP8_LOG.reset()
    got = lin(x)
    assert FP8_LOG.as_dict() == {"deepgemm": 1}
    assert got.shape == (2, 64, 576)
    assert _rel(got, fp8_math.fp8_linear_reference(x, wq, ws)) < 5e-3
