"""One MoE block per preset geometry, every expert path side by side with the bf16 matmul ceiling of the same run.

For each distinct MoE geometry of the presets (mla_eval.model_presets: DeepSeek-V3/V3.2, Kimi-K2, GLM-5/5.2) a
transformers MoE block of its family (router, routed experts, shared experts; random weights, so every expert is
routed to about equally) runs `--tokens` tokens through each path:

- `eager`: transformers' own loop over the experts (mla_eval.model.experts);
- `grouped_mm`: transformers' grouped path (two grouped products over every expert at once);
- `fp8`: the block's weights quantised to 128x128 e4m3 blocks (as the checkpoints store them) and computed as the
  engines do (mla_eval.model.fp8_linear: activations per token in 1x128 groups, DeepGEMM's grouped FP8 GEMM); on a
  GPU only where DeepGEMM runs (the torch reference would time a reference, not a kernel: the row says why it is
  absent); on a CPU (--smoke) through the reference, to exercise the path.

and the ceiling: the block's matrix products as dense bf16 GEMMs of the same shapes (the routed tokens as one
[tokens x top_k, hidden] operand through one expert's projections, the shared experts, the router), timed in the same
run. Each row: seconds (median of --repeats after warm-ups, CUDA events), TFLOP/s of the block's useful FLOPs, the
share of the ceiling, and the output's relative difference to the eager path (bf16 rounding order; FP8 activation
quantisation). `--smoke`: a tiny geometry on the CPU, one repeat (tests/test_moe_bench.py runs it).

    python -m benchmarks.moe_bench --out DIR [--presets deepseek-v3.2,kimi-k2,glm-5.2] [--tokens 2048,16384,65536]
                                   [--paths eager,grouped_mm,fp8] [--repeats 5] [--smoke]

Writes DIR/moe-bench.json (schema mla_eval_moe_bench_v1) and prints one line per row. Numbers about time, never
quality (random weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from mla_eval.errors import UserError

SCHEMA = "mla_eval_moe_bench_v1"
PATHS = ("eager", "grouped_mm", "fp8")
DEFAULT_PRESETS = ("deepseek-v3.2", "kimi-k2", "glm-5.2")
DEFAULT_TOKENS = (2048, 16384, 65536)
SMOKE = dict(hidden=256, experts=8, top_k=2, intermediate=128, shared=1)


@dataclasses.dataclass(frozen=True)
class Geometry:
    name: str  # the presets sharing it
    hidden: int
    experts: int
    top_k: int
    intermediate: int
    shared: int
    family: str  # transformers family: DeepseekV3 (DeepSeek, Kimi) or GlmMoeDsa


def geometries(presets: list[str], smoke: bool) -> list[Geometry]:
    from mla_eval.model_presets import get_preset

    if smoke:
        return [Geometry("smoke", family="DeepseekV3", **SMOKE)]
    out: dict[tuple, list[str]] = {}
    family: dict[tuple, str] = {}
    for name in presets:
        p = get_preset(name)
        if p.moe is None:
            raise UserError(f"preset {name} has no MoE geometry")
        m = p.moe
        key = (m.hidden, m.experts, m.top_k, m.intermediate, m.shared)
        out.setdefault(key, []).append(p.name)
        family[key] = "GlmMoeDsa" if p.config["model_type"] == "glm_moe_dsa" else "DeepseekV3"
    return [Geometry("/".join(names), *key, family=family[key]) for key, names in out.items()]


def moe_block(g: Geometry, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """The family's MoE block at geometry `g`, random weights (N(0, 0.02); router bias 0), on `device`."""
    import transformers

    cfg_cls = getattr(transformers, f"{g.family}Config")
    cfg = cfg_cls(hidden_size=g.hidden, n_routed_experts=g.experts, num_experts_per_tok=g.top_k,
                  moe_intermediate_size=g.intermediate, n_shared_experts=g.shared, n_group=1, topk_group=1,
                  num_hidden_layers=1, first_k_dense_replace=0)
    module = sys.modules[getattr(transformers, f"{g.family}ForCausalLM").__module__]
    block_cls = getattr(module, f"{g.family}MoE")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
        torch.manual_seed(seed)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            block = block_cls(cfg).eval()
        finally:
            torch.set_default_dtype(default)
        with torch.no_grad():
            for name, p in block.named_parameters():
                if "bias" in name:
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02)
    return block, cfg


def block_quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (e4m3 codes, fp32 scales [..., ceil(N/128), ceil(K/128)]): scale = block amax / 448, as the
    checkpoints are written (mla_eval.model.checkpoint_writer.quantise_fp8_block's rule, over leading dims)."""
    from mla_eval.model.fp8_math import block_grid

    *lead, n, k = w.shape
    nb, kb = block_grid(n, k)
    pad = torch.zeros(*lead, nb * 128, kb * 128, dtype=torch.float32, device=w.device)
    pad[..., :n, :k] = w.float()
    blocks = pad.view(*lead, nb, 128, kb, 128)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp_min(1e-12) / 448.0
    codes = (blocks / scale[..., :, None, :, None]).clamp(-448, 448).view(*lead, nb * 128, kb * 128)
    return codes[..., :n, :k].to(torch.float8_e4m3fn).contiguous(), scale


def to_fp8(block) -> None:
    """Swap the block's routed experts and shared-expert Linears for their FP8 twins, weights block-quantised."""
    from mla_eval.model.fp8_linear import Fp8Experts, Fp8Linear

    old = block.experts
    e, two_i, h = old.gate_up_proj.shape
    i = two_i // 2
    new = Fp8Experts(e, h, i, old.act_fn, device=old.gate_up_proj.device)
    with torch.no_grad():
        gq, gs = block_quantise(old.gate_up_proj[:, :i])
        uq, us = block_quantise(old.gate_up_proj[:, i:])
        new.gate_up_proj.copy_(torch.cat([gq.view(torch.uint8), uq.view(torch.uint8)], 1).view(torch.float8_e4m3fn))
        new.gate_up_proj_scale_inv.copy_(torch.cat([gs, us], 1))
        dq, ds = block_quantise(old.down_proj)
        new.down_proj.copy_(dq)
        new.down_proj_scale_inv.copy_(ds)
    block.experts = new
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(block.shared_experts, name)
        fp8 = Fp8Linear(lin.in_features, lin.out_features, device=lin.weight.device)
        with torch.no_grad():
            q, s = block_quantise(lin.weight)
            fp8.weight.copy_(q)
            fp8.weight_scale_inv.copy_(s)
        setattr(block.shared_experts, name, fp8)


def timed(fn, device: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds of `repeats` calls after `warmup` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize(device)
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def block_flops(g: Geometry, tokens: int) -> float:
    """Useful FLOPs of one block forward: routed experts (gate, up, down of top_k experts per token), shared experts,
    router."""
    routed = 2 * tokens * g.top_k * 3 * g.hidden * g.intermediate
    shared = 2 * tokens * 3 * g.hidden * g.intermediate * g.shared
    return routed + shared + 2 * tokens * g.hidden * g.experts


def ceiling_seconds(g: Geometry, tokens: int, device: torch.device, dtype: torch.dtype, warmup: int, repeats: int) -> float:
    """The block's products as dense GEMMs of the same shapes: [tokens*top_k, H] x [H, 2I] and [tokens*top_k, I] x
    [I, H] (every routed pair through one expert's weights), the shared experts likewise, the router."""
    rows = tokens * g.top_k
    x = torch.randn(rows, g.hidden, device=device, dtype=dtype)
    w13 = torch.randn(g.hidden, 2 * g.intermediate, device=device, dtype=dtype)
    a = torch.randn(rows, g.intermediate, device=device, dtype=dtype)
    w2 = torch.randn(g.intermediate, g.hidden, device=device, dtype=dtype)
    xs = torch.randn(tokens, g.hidden, device=device, dtype=dtype)
    s13 = torch.randn(g.hidden, 2 * g.intermediate * g.shared, device=device, dtype=dtype)
    as_ = torch.randn(tokens, g.intermediate * g.shared, device=device, dtype=dtype)
    s2 = torch.randn(g.intermediate * g.shared, g.hidden, device=device, dtype=dtype)
    router = torch.randn(g.hidden, g.experts, device=device, dtype=dtype)

    def run():
        x @ w13
        a @ w2
        xs @ s13
        as_ @ s2
        xs @ router

    return timed(run, device, warmup, repeats)


def bench(g: Geometry, tokens: int, paths: list[str], device: torch.device, warmup: int, repeats: int) -> list[dict]:
    from mla_eval.model import deepgemm
    from mla_eval.model.experts import select_experts

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    flops = block_flops(g, tokens)
    ceiling = ceiling_seconds(g, tokens, device, dtype, warmup, repeats)
    rows = [{"geometry": g.name, "tokens": tokens, "path": "ceiling (dense bf16 GEMMs, same shapes)" if device.type ==
             "cuda" else "ceiling (dense GEMMs, same shapes)", "seconds": ceiling, "tflops": flops / ceiling / 1e12,
             "share_of_ceiling": 1.0}]
    block, cfg = moe_block(g, device, dtype)
    x = torch.randn(1, tokens, g.hidden, device=device, dtype=dtype, generator=torch.Generator(device=device).manual_seed(1))
    want = None
    for path in paths:
        row = {"geometry": g.name, "tokens": tokens, "path": path}
        if path == "fp8":
            ok, why = deepgemm.available()
            if device.type == "cuda" and not ok:
                rows.append({**row, "skipped": f"DeepGEMM cannot run here ({why}): the torch reference is not timed"})
                continue
            to_fp8(block)
        else:
            select_experts(_Holder(block, cfg), path)
        with torch.no_grad():
            out = block(x).float()
            seconds = timed(functools.partial(block, x), device, warmup, repeats)
        if want is None:
            want = out
        row.update(seconds=seconds, tflops=flops / seconds / 1e12, share_of_ceiling=ceiling / seconds,
                   rel_diff_vs_first=float((out - want).norm() / want.norm()))
        rows.append(row)
        del out
    grouped = next((r for r in rows if r["path"] == "grouped_mm" and "seconds" in r), None)
    for r in rows:
        if grouped is not None and "seconds" in r and r["path"] == "fp8":
            r["speedup_vs_grouped_mm"] = grouped["seconds"] / r["seconds"]
    block = None  # the block's weights go before the next geometry's
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


class _Holder(torch.nn.Module):
    """A model-like wrapper so mla_eval.model.experts.select_experts can set the block's experts implementation."""

    def __init__(self, block, config) -> None:
        super().__init__()
        self.block, self.config = block, config

    def set_experts_implementation(self, path: str) -> None:
        self.config._experts_implementation = path


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--presets", default=",".join(DEFAULT_PRESETS))
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--smoke", action="store_true", help="a tiny geometry on the CPU, one repeat (for tests)")
    a = p.parse_args(argv)
    try:
        a.tokens = [int(t) for t in a.tokens.split(",")]
    except ValueError:
        raise UserError(f"--tokens {a.tokens!r}: give comma-separated integers, e.g. 2048,16384") from None
    a.paths = [x.strip() for x in a.paths.split(",") if x.strip()]
    bad = [x for x in a.paths if x not in PATHS]
    if bad:
        raise UserError(f"--paths {bad[0]!r}: choose from {', '.join(PATHS)}")
    a.paths = [x for x in PATHS if x in a.paths]  # fp8 last: it swaps the block's modules
    if a.smoke:
        a.tokens, a.repeats, a.warmup, a.device = [64], 1, 0, "cpu"
    if a.out.exists() and not a.out.is_dir():
        raise UserError(f"--out {a.out} is not a folder")
    return a


def main(argv: list[str] | None = None) -> int:
    try:
        a = parse_args(argv)
        from mla_eval.model.loader import resolve_device

        device = resolve_device(a.device)
        rows = []
        for g in geometries([x.strip() for x in a.presets.split(",") if x.strip()], a.smoke):
            for tokens in a.tokens:
                for r in bench(g, tokens, a.paths, device, a.warmup, a.repeats):
                    rows.append(r)
                    if "seconds" in r:
                        extra = f", {r['speedup_vs_grouped_mm']:.2f}x grouped" if "speedup_vs_grouped_mm" in r else ""
                        print(f"{r['geometry']} {r['tokens']} tokens {r['path']}: {r['seconds'] * 1e3:.3g} ms, "
                              f"{r['tflops']:.3g} TFLOP/s, {r['share_of_ceiling']:.0%} of the ceiling{extra}", flush=True)
                    else:
                        print(f"{r['geometry']} {r['tokens']} tokens {r['path']}: {r['skipped']}", flush=True)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from mla_eval.results import environment

    a.out.mkdir(parents=True, exist_ok=True)
    doc = {"schema": SCHEMA, "device": str(device), "rows": rows, "environment": environment(),
           "settings": {"presets": a.presets, "tokens": a.tokens, "paths": a.paths, "repeats": a.repeats,
                        "warmup": a.warmup, "smoke": a.smoke}}
    path = a.out / "moe-bench.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
