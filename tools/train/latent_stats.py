"""Per-layer statistics of the cached MLA latent of a model: `python -m tools.train.latent_stats`.

Runs the model (bf16 by default) over windows of a text and hooks every layer's
`self_attn.kv_a_layernorm`, whose output is the cached latent c_kv [tokens, kv_lora_rank]. Prints,
per layer: max |c_kv|, its 99.9th percentile, RMS, the fraction of the 128-value blocks whose amax
exceeds half the layer max, and the per-layer outer scale s_l = max|c_kv| / (6 * 448) of
`nvfp4_ds_mla_outer_scale_v1`; then the spread across layers (max / min of max |c_kv|). Also the
pre-RoPE k_pe max |.| (the last qk_rope_head_dim outputs of `kv_a_proj_with_mqa`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def collect(model, ids: torch.Tensor, ctx: int, windows: int) -> list[dict]:
    """Latent statistics per layer over up to `windows` non-overlapping windows of ctx tokens."""
    layers = model.model.layers
    rope = model.config.qk_rope_head_dim
    acc = [{"max": 0.0, "sq": 0.0, "n": 0, "samples": [], "pe_max": 0.0, "blocks_hi": []} for _ in layers]
    hooks = []
    for i, layer in enumerate(layers):
        def ckv_hook(_m, _inp, out, i=i):
            x = out.detach().float().reshape(-1, out.shape[-1]).abs()
            a = acc[i]
            a["max"] = max(a["max"], x.max().item())
            a["sq"] += x.pow(2).sum().item()
            a["n"] += x.numel()
            a["samples"].append(x.flatten()[torch.randint(0, x.numel(), (200_000,), device=x.device)].cpu())
            a["blocks_hi"].append(x.view(x.shape[0], -1, 128).amax(-1).flatten().cpu())

        def pe_hook(_m, _inp, out, i=i):
            acc[i]["pe_max"] = max(acc[i]["pe_max"], out[..., -rope:].detach().float().abs().max().item())

        hooks.append(layer.self_attn.kv_a_layernorm.register_forward_hook(ckv_hook))
        hooks.append(layer.self_attn.kv_a_proj_with_mqa.register_forward_hook(pe_hook))
    device = next(model.parameters()).device
    with torch.no_grad():
        for w in range(windows):
            chunk = ids[w * ctx : (w + 1) * ctx]
            if chunk.numel() < 16:
                break
            model(input_ids=chunk.unsqueeze(0).to(device), use_cache=False)
    for h in hooks:
        h.remove()
    out = []
    for i, a in enumerate(acc):
        s = torch.cat(a["samples"])
        blocks = torch.cat(a["blocks_hi"])
        out.append(
            {
                "layer": i,
                "max_abs_ckv": a["max"],
                "p99_9_abs_ckv": torch.quantile(s, 0.999).item(),
                "rms_ckv": (a["sq"] / a["n"]) ** 0.5,
                "blocks_over_half_max": (blocks > 0.5 * a["max"]).float().mean().item(),
                "outer_scale_s_l": a["max"] / (6 * 448),
                "max_abs_k_pe_pre_rope": a["pe_max"],
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mla_eval.model_home import default_model_path

    default_text = Path(__file__).resolve().parents[2].parent / "shared/data/wikitext-2/wiki.test.raw"
    p = argparse.ArgumentParser(prog="python -m tools.train.latent_stats", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--text", default=str(default_text), help="UTF-8 text file (default: wikitext-2 test if present)")
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--json", default=None, help="also write the table as JSON here")
    args = p.parse_args(argv)
    if not Path(args.text).exists():
        print(f"error: text file {args.text} not found; pass --text FILE", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(device).eval()
    ids = torch.tensor(tok(Path(args.text).read_text(encoding="utf-8"), add_special_tokens=False).input_ids)
    rows = collect(model, ids, args.ctx, args.windows)
    print(f"model {args.model} ({args.dtype}), {min(len(ids), args.ctx * args.windows)} tokens of {args.text}")
    print(f"{'layer':>5} {'max|c_kv|':>10} {'p99.9':>8} {'rms':>7} {'blk>max/2':>9} {'s_l':>10} {'max|k_pe|':>9}")
    for r in rows:
        print(
            f"{r['layer']:>5} {r['max_abs_ckv']:>10.3f} {r['p99_9_abs_ckv']:>8.3f} {r['rms_ckv']:>7.3f} "
            f"{r['blocks_over_half_max']:>9.4f} {r['outer_scale_s_l']:>10.3e} {r['max_abs_k_pe_pre_rope']:>9.3f}"
        )
    mx = [r["max_abs_ckv"] for r in rows]
    spread = max(mx) / min(mx)
    print(f"spread of max|c_kv| across layers: {min(mx):.3f} .. {max(mx):.3f} (x{spread:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "text": args.text, "ctx": args.ctx,
                                               "windows": args.windows, "dtype": args.dtype, "layers": rows,
                                               "spread_max_over_min": spread}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
