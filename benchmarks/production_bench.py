"""What a full-depth KLD run costs at production attention shapes, measured on random preset models.

For each preset geometry (mla_eval.model_presets) a random model with N layers (`random:<preset>`,
see mla_eval.model.random_models) runs teacher-forced windows of `ctx` tokens through the cache
session, first with the reference format (bf16) and then each format, under each attention backend
("auto" -- the CuTe kernels wherever they serve the format -- and the torch reference on CUDA; the
reference on a CPU). It records which path served each format, and:

- seconds per token per layer of each format's forward (the whole forward, embedding, lm head and
  log-softmax included, divided by tokens x layers: an upper bound of the attention layer's cost);
- the peak GPU memory of the preset;
- the mean KLD of each format against the bf16 forward, per backend, and the kernel-vs-reference
  gap of every format the kernels served;
- for DSA presets, the keys the indexers selected vs the keys causal attention would read (the
  bench refuses to report a DSA preset whose sparse path did not select fewer);
- a projection of a full-depth run (`estimate_full_run`).

The weights are random: the numbers are about time and memory, never about quality. The random
model's MLP is small and dense, so the projection leaves out the real model's experts; it says so.

    python -m benchmarks.production_bench [--presets ...] [--layers 3] [--ctx 4096] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from mla_eval.attention import dispatch
from mla_eval.errors import UserError
from mla_eval.evals.kld_stats import token_metrics
from mla_eval.formats import get_format
from mla_eval.model.session import CacheSession
from mla_eval.model_presets import get_preset, mla_preset_names, preset_names
from mla_eval.results import DEFAULT_OUTPUT_DIR

SCHEMA = "mla_eval_production_bench_v1"
REFERENCE_FORMAT = "bf16"
DEFAULT_FORMATS = ("bf16", "fp8_ds_mla", "nvfp4", "nvfp4_fp8rope")
DEFAULT_OUT = DEFAULT_OUTPUT_DIR / "production-bench.json"  # never into the repository's published results/
# wikitext-2-raw-v1 test split counted with the embedded tokenizer (342,571 tokens of 1,285,622
# characters); a real model's tokenizer gives a somewhat different count, and the cost scales with it.
WIKITEXT2_TEST_TOKENS = 342_571
PROTOCOL_CTX, PROTOCOL_STRIDE = 2048, 512  # the published KLD protocol (windows of 2048, stride 512)
PROJECTION_FORMATS = 9


# ------------------------------------------------------------------------------------ projection
@dataclasses.dataclass(frozen=True)
class RunEstimate:
    seconds: float
    windows: int
    forward_tokens: int  # tokens pushed through the model, all forwards together

    @property
    def hours(self) -> float:
        return self.seconds / 3600


def window_count(tokens: int, ctx: int, stride: int) -> int:
    """Windows of `ctx` tokens every `stride` tokens over one text of `tokens` tokens (the last one may be short)."""
    if tokens <= 0 or ctx <= 0 or stride <= 0:
        raise ValueError(f"tokens, ctx and stride must be positive, got {tokens}, {ctx}, {stride}")
    return 1 + max(0, math.ceil((tokens - ctx) / stride))


def estimate_full_run(*, seconds_per_token_layer: float, num_layers: int, dataset_tokens: int, ctx: int, stride: int,
                      formats: int, extra_seconds_per_token: float = 0.0) -> RunEstimate:
    """Time of a KLD run: every window runs one reference forward plus one forward per format.

    seconds = windows x ctx x (formats + 1) x (num_layers x seconds_per_token_layer + extra_seconds_per_token)
    with windows = 1 + ceil((dataset_tokens - ctx) / stride). `seconds_per_token_layer` is the mean
    measured cost of one token through one layer (formats and reference alike); `extra_seconds_per_token`
    what a layer count does not scale (e.g. a large vocabulary's lm head). Every window is counted at
    full length, so the estimate is an upper bound by at most one window.
    """
    if formats < 1 or num_layers < 1:
        raise ValueError(f"formats and num_layers must be >= 1, got {formats}, {num_layers}")
    windows = window_count(dataset_tokens, ctx, stride)
    forward_tokens = windows * ctx * (formats + 1)
    return RunEstimate(forward_tokens * (num_layers * seconds_per_token_layer + extra_seconds_per_token), windows, forward_tokens)


# ------------------------------------------------------------------------------------ the bench
@dataclasses.dataclass
class BenchSettings:
    presets: tuple[str, ...] = tuple(mla_preset_names())  # DeepSeek-V4 caches other records: not benched here
    layers: int = 3
    ctx: int = 4096
    windows: int = 2  # timed windows per format and backend (one more, untimed, warms up/compiles)
    formats: tuple[str, ...] = DEFAULT_FORMATS
    backends: tuple[str, ...] | None = None  # None: auto and reference on CUDA, reference on a CPU
    device: str = "auto"
    seed: int = 0
    hidden: int | None = None  # override of hidden_size (CPU tests)
    topk: int | None = None  # override of a DSA preset's index_topk (CPU tests)
    dataset_tokens: int = WIKITEXT2_TEST_TOKENS
    projection_formats: int = PROJECTION_FORMATS

    def check(self) -> None:
        for name in self.presets:
            if name not in preset_names():
                raise UserError(f"--presets: no preset {name!r}; choose from {', '.join(preset_names())}")
        bounds = (("--layers", self.layers, 1), ("--ctx", self.ctx, 2), ("--windows", self.windows, 1),
                  ("--dataset-tokens", self.dataset_tokens, 1), ("--projection-formats", self.projection_formats, 1))
        for name, value, low in bounds:
            if value < low:
                raise UserError(f"{name} must be >= {low}, got {value}")
        for f in self.formats:
            get_format(f)  # UserError naming the known formats
        for b in self.backends or ():
            dispatch.check_backend(b, source="--backends")


def _model_spec(st: BenchSettings, preset: str) -> str:
    spec = f"random:{preset}:layers={st.layers}:seed={st.seed}"
    if st.hidden:
        spec += f":hidden={st.hidden}"
    if st.topk and "index_topk" in get_preset(preset).config:
        spec += f":topk={st.topk}"
    return spec


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def _logp(lm, fmt: str, ids: torch.Tensor) -> torch.Tensor:
    session = CacheSession(get_format(fmt), lm.num_layers, ids.shape[0], ids.shape[1], lm.device)
    with lm.adapter.session(session):
        logits = lm.model(input_ids=ids, use_cache=False).logits
    return torch.log_softmax(logits[:, :-1].float(), dim=-1).reshape(-1, logits.shape[-1])


def _bench_preset(st: BenchSettings, preset: str, backends: Sequence[str]) -> dict:
    from mla_eval.model.loader import load_model

    lm = load_model(_model_spec(st, preset), device=st.device)
    dev = lm.device
    cfg = lm.model.config
    if st.ctx > lm.max_positions > 0:
        raise UserError(f"--ctx {st.ctx} is beyond {preset}'s {lm.max_positions} positions")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    g = torch.Generator().manual_seed(st.seed)
    windows = [torch.randint(0, cfg.vocab_size, (1, st.ctx), generator=g).to(dev) for _ in range(st.windows + 1)]
    tokens = st.windows * st.ctx
    per_backend: dict[str, dict] = {}
    paths: dict[str, str] = {}
    for backend in backends:
        with dispatch.use_backend(backend) as log:
            rows: dict[str, dict] = {}
            ref = [_logp(lm, REFERENCE_FORMAT, w) for w in windows[1:]]
            for fmt in st.formats:
                _logp(lm, fmt, windows[0])  # warm-up: kernel compiles and allocator growth stay out of the timing
                _sync(dev)
                t0 = time.perf_counter()
                outs = [_logp(lm, fmt, w) for w in windows[1:]]
                _sync(dev)
                seconds = time.perf_counter() - t0
                kld = torch.cat([token_metrics(r, o, w[0, 1:])["kld"] for r, o, w in zip(ref, outs, windows[1:])])
                rows[fmt] = {
                    "seconds": seconds,
                    "tokens_per_s_per_layer": tokens * lm.num_layers / seconds,
                    "seconds_per_token_layer": seconds / (tokens * lm.num_layers),
                    "kld_mean": float(kld.mean()),
                }
            for fmt, row in rows.items():  # what really served the format's attention (auto may fall back)
                key = f"attend {get_format(fmt).name} on "
                row["attend_path"] = next((v for k, v in log.paths.items() if k.startswith(key)), "unknown")
            paths.update({f"{k} [{backend}]": v for k, v in log.paths.items()})
        per_backend[backend] = rows
    selected, causal = lm.adapter.sparse_read_counts()
    dsa = getattr(cfg, "index_topk", None) is not None
    if dsa and st.ctx > cfg.index_topk and not 0 < selected < causal:
        raise RuntimeError(f"{preset}: ctx {st.ctx} > top-k {cfg.index_topk}, but the sparse path read {selected} "
                           f"of {causal} keys")
    agreement = {}
    fast = next((b for b in ("kernel", "auto") if b in per_backend), None)
    if fast and "reference" in per_backend:
        for fmt in st.formats:
            if per_backend[fast][fmt]["attend_path"] != "kernel":
                continue  # no kernel served it: a gap would compare the reference with itself
            k, r = per_backend[fast][fmt]["kld_mean"], per_backend["reference"][fmt]["kld_mean"]
            agreement[fmt] = {"kernel": k, "reference": r, "abs_diff": abs(k - r)}
    timed = per_backend[backends[0]]  # the production path: kernel when it runs
    mean_cost = sum(row["seconds_per_token_layer"] for row in timed.values()) / len(timed)
    full_layers = get_preset(preset).config["num_hidden_layers"]
    est = estimate_full_run(seconds_per_token_layer=mean_cost, num_layers=full_layers, dataset_tokens=st.dataset_tokens,
                            ctx=PROTOCOL_CTX, stride=PROTOCOL_STRIDE, formats=st.projection_formats)
    return {
        "preset": preset,
        "model": lm.name,
        "label": lm.label,
        "geometry": {k: getattr(cfg, k, None) for k in ("hidden_size", "num_attention_heads", "q_lora_rank", "qk_nope_head_dim",
                                                      "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "index_n_heads",
                                                      "index_head_dim", "index_topk", "indexer_types")},
        "device": str(dev),
        "dtype": str(next(lm.model.parameters()).dtype).replace("torch.", ""),
        "layers": lm.num_layers,
        "ctx": st.ctx,
        "timed_tokens": tokens,
        "backends": per_backend,
        "kernel_vs_reference_kld": agreement,
        "sparse_reads": {"selected_keys": selected, "causal_keys": causal} if dsa else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
        "attention_paths": paths,
        "projection": {
            "line": projection_line(preset, full_layers, st, est),
            "hours": est.hours,
            "windows": est.windows,
            "forward_tokens": est.forward_tokens,
            "seconds_per_token_layer": mean_cost,
            "excludes": "the real model's MoE experts and its full-vocabulary lm head (the random model has a small dense MLP)",
        },
    }


def projection_line(preset: str, layers: int, st: BenchSettings, est: RunEstimate) -> str:
    return (f"{get_preset(preset).title}, {layers} layers, wikitext-2 test ({st.dataset_tokens:,} tokens, ctx {PROTOCOL_CTX} "
            f"stride {PROTOCOL_STRIDE}), {st.projection_formats} formats + reference: {est.hours:.2f} h of attention-path time")


def run_bench(st: BenchSettings) -> dict:
    """Run every preset; returns the JSON document (schema SCHEMA)."""
    from mla_eval.model.loader import resolve_device
    from mla_eval.results import environment

    st.check()
    dev = resolve_device(st.device)
    backends = tuple(st.backends or (("auto", "reference") if dev.type == "cuda" else ("reference",)))
    with dispatch.use_backend(backends[0]) as log:
        env = environment(attention=log)
    presets = [_bench_preset(st, p, backends) for p in st.presets]
    return {"schema": SCHEMA, "settings": dataclasses.asdict(st), "backends": list(backends), "environment": env,
            "presets": presets}


# ------------------------------------------------------------------------------------ command line
def table(doc: dict) -> str:
    lines = []
    backend = doc["backends"][0]
    fmts = list(doc["presets"][0]["backends"][backend]) if doc["presets"] else []
    head = "".join(f"{f + ' tok/s/layer':>26}" for f in fmts)
    lines.append(f"{'preset':<14}{head}{'peak GiB':>10}{'max |dKLD| k-r':>16}")
    for p in doc["presets"]:
        rows = p["backends"][backend]
        peak = "-" if p["peak_memory_gib"] is None else f"{p['peak_memory_gib']:.1f}"
        gap = max((a["abs_diff"] for a in p["kernel_vs_reference_kld"].values()), default=None)
        lines.append(f"{p['preset']:<14}" + "".join(f"{rows[f]['tokens_per_s_per_layer']:>26,.0f}" for f in fmts)
                     + f"{peak:>10}{'-' if gap is None else f'{gap:.2e}':>16}")
    lines.append(f"({backend} backend; random weights: time and memory only, not quality)")
    lines += [p["projection"]["line"] for p in doc["presets"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from mla_eval.atomic_io import write_json_atomic
    from mla_eval.results import check_output_path

    ap = argparse.ArgumentParser(prog="python -m benchmarks.production_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(mla_preset_names()), help="comma-separated preset names")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=4096, help="window length; above 2048 the DSA presets select sparsely")
    ap.add_argument("--windows", type=int, default=2, help="timed windows per format and backend")
    ap.add_argument("--formats", default=",".join(DEFAULT_FORMATS))
    ap.add_argument("--backends", default=None, help="comma-separated (default: auto,reference on CUDA, reference on CPU)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden-override", type=int, default=None, help="replace hidden_size (CPU tests)")
    ap.add_argument("--topk-override", type=int, default=None, help="replace a DSA preset's index_topk (CPU tests)")
    ap.add_argument("--dataset-tokens", type=int, default=WIKITEXT2_TEST_TOKENS)
    ap.add_argument("--projection-formats", type=int, default=PROJECTION_FORMATS)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--force", action="store_true", help="replace --out if it exists")
    a = ap.parse_args(argv)
    split = lambda text: tuple(x.strip() for x in text.split(",") if x.strip())  # noqa: E731
    st = BenchSettings(presets=split(a.presets), layers=a.layers, ctx=a.ctx, windows=a.windows, formats=split(a.formats),
                       backends=split(a.backends) if a.backends else None, device=a.device, seed=a.seed,
                       hidden=a.hidden_override, topk=a.topk_override, dataset_tokens=a.dataset_tokens,
                       projection_formats=a.projection_formats)
    try:
        out = check_output_path(a.out, a.force)
        st.check()
        doc = run_bench(st)
        write_json_atomic(out, doc)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(doc))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
