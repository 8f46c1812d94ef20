"""Measure what the codec's rcp.rn stand-in for rcp.approx.ftz changes in b12x's fp8 rope codes.

b12x's 368 B writer (nvfp4_fp8rope) stores rope codes cvt.rn.satfinite.e4m3(v * rcp.approx.ftz(s)) with
s = amax(rope) * f32(1/448): an arbitrary float32, so the reciprocal cannot be tabulated. The codec (and
our writer) use rcp.rn there. This script runs both on the GPU over bf16 rope vectors (normal and
heavy-tailed) and reports the fraction of rope codes and of records that differ.

    python -m tools.measure.rope_rcp_residual [--tokens 1000000] [--out residual.json]

Needs CUDA and triton (inline PTX, as kernels/measure_rcp_approx.py).
"""

from __future__ import annotations

import argparse
import json

import torch

from mla_eval.atomic_io import write_json_atomic
from tools.measure.rcp_approx import _kernel


def rope_codes(rope: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    q = (rope * inv.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where((inv == 0).unsqueeze(-1), torch.zeros_like(q), q)


def measure(kind: str, tokens: int, run, gen: torch.Generator) -> dict:
    rope = torch.randn(tokens, 64, device="cuda", generator=gen)
    if kind == "heavy":
        rope = rope * torch.exp(2.0 * torch.randn(tokens, 64, device="cuda", generator=gen))
    rope = rope.bfloat16().float()
    scale = rope.abs().amax(-1) * torch.tensor(1.0 / 448.0, dtype=torch.float32, device="cuda")
    nz = scale != 0
    inv_rn = torch.where(nz, 1.0 / scale, torch.zeros_like(scale))
    inv_approx = torch.where(nz, run(scale.contiguous()), torch.zeros_like(scale))
    a, b = rope_codes(rope, inv_approx), rope_codes(rope, inv_rn)
    return {
        "kind": kind,
        "tokens": tokens,
        "reciprocal_differs": float((inv_rn != inv_approx).float().mean()),
        "code_mismatch_rate": float((a != b).float().mean()),
        "record_mismatch_rate": float((a != b).any(-1).float().mean()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--out")
    args = ap.parse_args()
    run = _kernel()
    gen = torch.Generator(device="cuda").manual_seed(0)
    doc = {
        "instruction": "rcp.approx.ftz.f32",
        "format": "nvfp4_fp8rope",
        "device": torch.cuda.get_device_name(0),
        "results": [measure(kind, args.tokens, run, gen) for kind in ("normal", "heavy")],
    }
    print(json.dumps(doc, indent=1))
    if args.out:
        write_json_atomic(args.out, doc)


if __name__ == "__main__":
    main()
