"""Measure what the GPU's approximate reciprocal `rcp.approx.ftz.f32` returns, for a table of inputs.

Engines' NVFP4 writers (the b12x / local-inference-lab vLLM `nvfp4_ds_mla` writer) compute block
scales as `amax * rcp.approx.ftz(6)` and codes as `x * rcp.approx.ftz(decoded E4M3 scale)`. The
instruction is not correctly rounded, so the CPU codec cannot reproduce it from IEEE arithmetic;
but its inputs there come from a small set (every positive finite E4M3 value, the constants 6 and
448), so the exact outputs can be measured once on the GPU, committed, and looked up on the CPU.

    python -m tools.measure.rcp_approx --out table.json [--random 1000000]

Needs CUDA and triton (inline PTX through `tl.inline_asm_elementwise`). Also reports, for
information, how often the instruction differs from the correctly rounded 1/x on random fp32
inputs (the residual for arbitrary, non-tabulable inputs).
"""

from __future__ import annotations

import argparse
import json

import torch

from mla_eval.atomic_io import write_json_atomic


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rcp_approx(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m, other=1.0)
        y = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
        tl.store(y_ptr + offs, y, mask=m)

    def run(x: torch.Tensor) -> torch.Tensor:
        y = torch.full_like(x, float("nan"))  # poisoned: every output must be written
        block = 1024
        rcp_approx[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), BLOCK=block)
        torch.cuda.synchronize()
        return y

    return run


def table_inputs() -> torch.Tensor:
    """Every positive finite E4M3 value, 6, 448, and every normal power of two, as float32."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = codes[torch.isfinite(codes) & (codes > 0)]
    pow2 = torch.tensor([2.0**e for e in range(-126, 128)], dtype=torch.float32)
    extra = torch.tensor([6.0, 448.0], dtype=torch.float32)
    return torch.unique(torch.cat([e4m3, extra, pow2]))  # sorted


def bits(t: torch.Tensor) -> list[int]:
    return [int(v) for v in t.float().cpu().contiguous().view(torch.int32).tolist()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--random", type=int, default=1_000_000, help="random fp32 inputs for the residual figure")
    args = ap.parse_args()
    run = _kernel()
    x = table_inputs().cuda()
    y = run(x)
    assert bool(torch.isfinite(y).all()), "kernel left outputs unwritten"
    exact = (1.0 / x.double()).float()
    differs = (y != exact)
    gen = torch.Generator(device="cuda").manual_seed(0)
    # random normal-range fp32: uniform exponent in [-60, 60], uniform mantissa
    r = torch.ldexp(1.0 + torch.rand(args.random, device="cuda", generator=gen),
                    torch.randint(-60, 61, (args.random,), device="cuda", generator=gen).float())
    ry = run(r)
    r_exact = (1.0 / r.double()).float()
    doc = {
        "instruction": "rcp.approx.ftz.f32",
        "measured_by": "kernels/measure_rcp_approx.py (triton inline PTX)",
        "device": torch.cuda.get_device_name(0),
        "capability": "sm_%d%d" % torch.cuda.get_device_capability(0),
        "torch": torch.__version__,
        "note": "inputs/outputs are float32 bit patterns (int32); inputs: every positive finite E4M3 value, 6, 448, "
                "every normal power of two",
        "inputs": bits(x),
        "outputs": bits(y),
        "differs_from_correctly_rounded": int(differs.sum()),
        "random_fp32_inputs": args.random,
        "random_fp32_differs_from_correctly_rounded": int((ry != r_exact).sum()),
        "random_fp32_max_ulp_error": int((ry.view(torch.int32).long() - r_exact.view(torch.int32).long()).abs().max()),
    }
    print(json.dumps({k: v for k, v in doc.items() if k not in ("inputs", "outputs")}, indent=1))
    six = x.tolist().index(6.0)
    print("rcp.approx(6) =", y[six].item(), "correctly rounded:", exact[six].item())
    write_json_atomic(args.out, doc)


if __name__ == "__main__":
    main()
