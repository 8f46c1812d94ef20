"""Write a random-weight checkpoint at full DeepSeek-V3.2 (or GLM-5.2) geometry, shard by shard.

    python -m tools.write_checkpoint OUT --layers 7 [--format fp8-block] [--first-dense 3] [--seed 0]
                                         [--device auto] [--dry-run] [--preset glm-5.2] [--index-only]

--index-only writes no shard: config.json, the index and the tokenizer, the folder a user plans a run from before
downloading (`mla-eval kld --model OUT --dry-run`), e.g. all 78 layers of GLM-5.2.

The geometry is transformers' DeepseekV32Config defaults (DeepSeek-V3.2's config.json: hidden 7168,
128 heads, q_lora 1536, kv_lora 512, 256 routed experts of 2048 + 1 shared, 8 per token, the DSA indexer
with 64 heads of 128, top-k 2048, vocabulary 129280), with OUT's layer count: the first `--first-dense`
layers dense (MLP 18432), the rest MoE, as in the real model; no MTP layer. The weights are random and the
format's exact on-disk layout (mla_eval.model.checkpoint_writer): for fp8-block, float8_e4m3fn codes and
float32 128x128 `weight_scale_inv` grids, config.json quantization_config as DeepSeek ships it.
The embedded model's tokenizer is copied in (its ids are a subset of the 129280-token vocabulary), so
`mla-eval kld --model OUT` runs on it. Numbers from it are about time and memory, never quality.

Bytes (fp8-block; --dry-run prints them for any choice): a dense layer 0.598 GB, an MoE layer 11.526 GB,
embeddings + lm_head + norm 3.707 GB. On a 64 GiB (68.7 GB) disk that also holds the system and the
repository, 3 dense + 4 MoE layers (51.6 GB) fit; 3 + 5 (63.1 GB) only on an otherwise empty disk. The
tool refuses up front when the folder's disk cannot hold what it would write.
`--device auto` draws and quantises on the GPU when there is one (CPU: minutes per MoE layer).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


PRESETS = ("deepseek-v3.2", "glm-5.2")


def full_width_config(layers: int, first_dense: int, preset: str = "deepseek-v3.2"):
    """transformers' config of the preset at full width with `layers` decoder layers, the first `first_dense` dense."""
    import transformers

    if preset == "glm-5.2":
        from mla_eval.model_presets import get_preset

        # GLM-5.2: transformers' GlmMoeDsaConfig defaults (zai-org/GLM-5: hidden 6144, 64 heads, 256 experts of 2048)
        # with the preset's IndexShare schedule (mla_eval.model_presets, 21 full / 57 shared at 78 layers)
        full = get_preset("glm-5.2").config
        cfg = transformers.GlmMoeDsaConfig(num_hidden_layers=layers, first_k_dense_replace=min(first_dense, layers),
                                           tie_word_embeddings=False, indexer_types=full["indexer_types"][:layers],
                                           max_position_embeddings=full["max_position_embeddings"])
        if cfg.hidden_size != 6144 or cfg.n_routed_experts != 256:
            raise SystemExit("error: this transformers' GlmMoeDsaConfig defaults are not GLM-5's geometry")
        return cfg
    cfg = transformers.DeepseekV32Config(num_hidden_layers=layers, first_k_dense_replace=min(first_dense, layers),
                                         tie_word_embeddings=False)
    if cfg.hidden_size != 7168 or cfg.n_routed_experts != 256 or not cfg.index_n_heads:
        raise SystemExit("error: this transformers' DeepseekV32Config defaults are not DeepSeek-V3.2's geometry")
    return cfg


def main(argv: list[str] | None = None) -> int:
    import torch

    from mla_eval.errors import UserError
    from mla_eval.model.checkpoint_writer import FORMATS, estimate_layer_bytes, write_random_checkpoint

    p = argparse.ArgumentParser(prog="python -m tools.write_checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="a new (empty) folder")
    p.add_argument("--layers", type=int, required=True, help="decoder layers to write")
    p.add_argument("--first-dense", type=int, default=3, help="how many leading layers are dense (DeepSeek-V3.2: 3)")
    p.add_argument("--format", default="fp8-block", choices=FORMATS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="where weights are drawn and quantised: auto, cpu, cuda")
    p.add_argument("--dry-run", action="store_true", help="print the bytes per layer and write nothing")
    p.add_argument("--preset", default="deepseek-v3.2", choices=PRESETS, help="the geometry (default DeepSeek-V3.2)")
    p.add_argument("--index-only", action="store_true",
                   help="write config.json, the safetensors index and the tokenizer, no shard: a folder to plan from "
                   "(mla-eval kld --dry-run) as a user has it before the download")
    args = p.parse_args(argv)
    if args.layers < 1 or args.first_dense < 0:
        p.error("--layers must be >= 1 and --first-dense >= 0")
    cfg = full_width_config(args.layers, args.first_dense, args.preset)
    layers, rest = estimate_layer_bytes(cfg, args.format)
    for i, b in enumerate(layers):
        kind = "dense" if i < cfg.first_k_dense_replace else "MoE"
        print(f"layer {i:3d} ({kind:5s}): {b / 1e9:8.3f} GB")
    print(f"embeddings, lm_head, norm: {rest / 1e9:.3f} GB; total {(sum(layers) + rest) / 1e9:.2f} GB ({args.format})")
    if args.dry_run:
        return 0
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    try:
        written = write_random_checkpoint(args.out, cfg, args.format, seed=args.seed, device=device,
                                          tokenizer_from=ROOT / "mla_eval" / "default_model", progress=print,
                                          free_bytes_check=True, index_only=args.index_only)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    what = "wrote the index (no shard) of" if args.index_only else "wrote"
    print(f"{what} {written.path}: {written.total_bytes / 1e9:.2f} GB in {len(written.layer_bytes) + 1} shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
