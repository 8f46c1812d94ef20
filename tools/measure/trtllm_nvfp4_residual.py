"""Measure what the codec's rcp.rn stand-ins change in TensorRT-LLM's NVFP4 DSA records (`trtllm_nvfp4_dsa`).

TensorRT-LLM's writer (cvt_warp_fp16_to_fp4 at SFScaleVal = S, see the spec's engine note) scales each
16-value group by rcp.approx.ftz(s * rcp.approx.ftz(S)), s the decoded E4M3 block scale. S (26.88 at the
engine's default amax 100) and the product are arbitrary float32 values, so the CPU codec takes both
reciprocals with rcp.rn. This script computes the engine's arithmetic on the GPU with the real instruction
(triton inline PTX, as kernels/measure_rcp_approx.py) and compares the records byte for byte with the
codec, over bf16 inputs (normal, heavy-tailed, model-like scale). It also writes the instruction's results
for the 1 + 126 inputs the default S needs (rcp.approx(S) and rcp.approx(e * rcp.approx(S)) for every
positive E4M3 e): with those committed to the reciprocal table the codec could be exact at the default.

    python -m tools.measure.trtllm_nvfp4_residual [--tokens 200000] [--out residual.json]

The E2M1 conversion is our numerics' (sm_90 has no cvt to e2m1x2): the comparison isolates the reciprocals.
"""

from __future__ import annotations

import argparse
import json

import torch

from mla_eval.atomic_io import write_json_atomic
from mla_eval.formats import encode, get_format
from mla_eval.formats import numerics as nx
from tools.measure.rcp_approx import _kernel, bits

FORMAT = "trtllm_nvfp4_dsa"


def engine_records(x: torch.Tensor, quant: float, run) -> torch.Tensor:
    """[n, 576] float32 (bf16 values) -> [n, 324]: the engine's recipe with the GPU's rcp.approx."""
    n = x.shape[0]
    g = x.view(n, 36, 16)
    vec_max = g.abs().amax(-1)
    s_scale = torch.full((1,), quant, dtype=torch.float32, device=x.device)
    r6 = run(torch.full((1,), 6.0, dtype=torch.float32, device=x.device))
    sf = s_scale * (vec_max * r6)
    sf_bits = nx.e4m3_encode(sf)
    prod = (nx.e4m3_decode(sf_bits) * run(s_scale)).contiguous()
    out_scale = torch.where(vec_max != 0, run(prod), torch.zeros_like(prod))  # rcp.approx(0) = +inf
    v = g * out_scale.unsqueeze(-1)
    v = torch.where(torch.isnan(v), torch.full_like(v, 6.0), v)  # cvt .satfinite: NaN -> +MAX_NORM
    codes = nx.e2m1_pack(nx.e2m1_encode(v.reshape(n, 576)))
    return torch.cat([codes, sf_bits], dim=-1)


def measure(kind: str, tokens: int, run, gen: torch.Generator) -> dict:
    x = torch.randn(tokens, 576, device="cuda", generator=gen)
    if kind == "heavy":
        x = x * torch.exp(2.0 * torch.randn(tokens, 576, device="cuda", generator=gen))
    if kind == "model_scale":  # a post-norm latent of O(1) plus a rope up to ~10 (DeepSeek-V3-like ranges)
        x[:, 512:] *= 10.0
    x = x.bfloat16().float()
    gs = get_format(FORMAT).latent.global_scale
    a = engine_records(x, gs.quant, run)
    b = encode(FORMAT, x[:, :512], x[:, 512:])
    diff = a != b
    return {
        "kind": kind,
        "tokens": tokens,
        "byte_mismatch_rate": float(diff.float().mean()),
        "scale_byte_mismatch_rate": float(diff[:, 288:].float().mean()),
        "record_mismatch_rate": float(diff.any(-1).float().mean()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--out")
    args = ap.parse_args()
    run = _kernel()
    gen = torch.Generator(device="cuda").manual_seed(0)
    gs = get_format(FORMAT).latent.global_scale
    s = torch.full((1,), gs.quant, dtype=torch.float32, device="cuda")
    r_s = run(s)
    codes = torch.arange(1, 0x7F, dtype=torch.uint8, device="cuda")
    prods = (nx.e4m3_decode(codes) * r_s).contiguous()
    doc = {
        "instruction": "rcp.approx.ftz.f32",
        "format": FORMAT,
        "device": torch.cuda.get_device_name(0),
        "global_scale": {"amax": gs.amax, "quant": gs.quant, "dequant": gs.dequant},
        "rcp_approx_of_quant_equals_rcp_rn": bool(r_s.item() == (1.0 / s).item()),
        "table_inputs": bits(torch.cat([s, prods])),
        "table_outputs": bits(torch.cat([r_s, run(prods)])),
        "results": [measure(kind, args.tokens, run, gen) for kind in ("normal", "heavy", "model_scale")],
    }
    exact = (1.0 / torch.cat([s, prods]).double()).float()
    doc["table_differs_from_correctly_rounded"] = int((torch.cat([r_s, run(prods)]) != exact).sum())
    print(json.dumps({k: v for k, v in doc.items() if not k.startswith("table_")}, indent=1))
    print("table entries differing from rcp.rn:", doc["table_differs_from_correctly_rounded"], "of", len(doc["table_inputs"]))
    if args.out:
        write_json_atomic(args.out, doc)


if __name__ == "__main__":
    main()
