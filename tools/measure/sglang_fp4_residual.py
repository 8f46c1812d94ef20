"""Compare SGLang's compiled KVFP4 quantiser on the GPU with our `sglang_fp4_e2m1` codec, byte for byte.

SGLang's `KVFP4QuantizeUtil.batched_quantize` (sgl-project/sglang @ 0e6b6cf0ac71,
python/sglang/srt/layers/quantization/kvfp4_tensor.py) is `@torch.compile`d: on a GPU its division by 6
and its log2 run as Triton code, whose float32 division and log2 need not be correctly rounded. Our codec
computes them exactly. This script re-states the engine function (the same statements, compiled the
same way) on bf16 inputs on the GPU and reports how many scale bytes and data bytes differ from the codec.

    python -m tools.measure.sglang_fp4_residual [--tokens 200000] [--out residual.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from mla_eval.atomic_io import write_json_atomic
from mla_eval.formats import encode

E2M1_MAX = 6.0


def _engine():
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5], dtype=torch.float32, device="cuda")

    @torch.compile
    def batched_quantize(tensor: torch.Tensor):
        b, m, n = tensor.shape
        reshaped = tensor.view(b, m * n // 16, 16)
        block_max = reshaped.abs().max(dim=-1, keepdim=True).values
        scale_exp = torch.ceil(torch.log2(torch.clamp(block_max / E2M1_MAX, min=1e-10)))
        scale_factors = (scale_exp + 127).squeeze(-1).to(torch.uint8)
        scaled = reshaped / torch.exp2(scale_exp)
        sign_bits = (scaled < 0).to(torch.uint8) << 3
        magnitude_bits = torch.sum(scaled.abs().unsqueeze(-1) >= bounds, dim=-1)
        fp4_vals = sign_bits + magnitude_bits.to(torch.uint8)
        fp4_reshaped = fp4_vals.view(b, m, n)
        packed = (fp4_reshaped[..., 1::2] << 4) + fp4_reshaped[..., 0::2]
        return packed, scale_factors

    return batched_quantize


def _inputs(kind: str, tokens: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(tokens, 576, generator=gen)
    if kind == "heavy":
        x = x * torch.exp(2.0 * torch.randn(tokens, 576, generator=gen))
    if kind == "pow2_blocks":  # block maxima 1.5 * 2^k, where amax / 6 is exactly a power of two
        x = x.clamp(-1.4, 1.4)
        x[:, ::16] = 1.5 * torch.exp2(torch.randint(-20, 20, (tokens, 36), generator=gen).float())
    return x.bfloat16()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--out")
    args = ap.parse_args()
    run = _engine()
    gen = torch.Generator().manual_seed(0)
    results = []
    for kind in ("normal", "heavy", "pow2_blocks"):
        x = _inputs(kind, args.tokens, gen)
        packed, scales = run(x.cuda().view(args.tokens, 1, 576))
        engine = torch.cat([packed.view(args.tokens, 288), scales.view(args.tokens, 36)], dim=-1).cpu()
        ours = encode("sglang_fp4_e2m1", x[:, :512].float(), x[:, 512:].float())
        diff = engine != ours
        results.append({
            "kind": kind,
            "tokens": args.tokens,
            "data_byte_mismatch_rate": float(diff[:, :288].float().mean()),
            "scale_byte_mismatch_rate": float(diff[:, 288:].float().mean()),
            "record_mismatch_rate": float(diff.any(-1).float().mean()),
        })
    doc = {"format": "sglang_fp4_e2m1", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "results": results}
    print(json.dumps(doc, indent=1))
    if args.out:
        write_json_atomic(args.out, doc)


if __name__ == "__main__":
    main()
