"""Peak memory of a KLD run at production attention geometry, phase by phase, against the context length.

For each preset (a random model `random:<preset>:layers=N`, mla_eval.model.random_models: the preset's exact
attention and DSA indexer geometry, a small dense MLP) and each window length, one window of random tokens goes
through what `mla-eval kld` runs, with the peak memory of each phase recorded:

- load: the model's weights on the device (and, from them, what one decoder layer weighs);
- forward <format>: a window forward through the format's cache session -- bf16 (the reference) without layer
  statistics, every other format with them when kld's default (--layer-stats) is on -- reading the final hidden
  states as kld does;
- loss: the chunked full-vocabulary log-probs and per-token metrics of every format against the reference;
- kld: `mla_eval.evals.kld.run_kld` end to end on the same window (the tool's own path, whatever it becomes);
- indexer check (DSA presets, one window length): the layer-0 top-k in the default score blocks and in blocks a
  quarter that size must be equal bit for bit on this device (the chunking may not change a selected key).

Each phase reports the peak allocated bytes (absolute, and above what was allocated when the phase began) and the
peak the caching allocator reserved. `activation_peak` = the largest phase peak minus the resident weights: the
"one layer's weights + <= 16 GiB at ctx 8192" target (issue 35) reads as activation_peak <= 16 GiB, since a
streamed run holds one decoder layer's weights where this bench holds every layer of a small random model.
`real_layer_weight_bytes` gives the mean decoder-layer weight of the full-size model (param_count / (layers +
MTP), in its checkpoint dtype and in bf16), for reading off the full target.

Restartable and bounded: every (preset, ctx) case is written to its own JSON under --out as it finishes, a rerun
skips the cases already there (--force redoes them), and no case starts once --budget-s seconds have passed
(they are listed as skipped). A case that runs out of memory is recorded as such, with its phase and the peak
reached, and the bench goes on. The summary (memory-bench.json) and the table are rebuilt from every case file.
On a CPU (tests) peaks come from torch's allocator events (torch.profiler) and count growth within a phase only.

    python -m benchmarks.memory_bench --out results/h200/memory-bench [--presets deepseek-v3.2,glm-5]
        [--ctx 2048,4096,8192] [--layers 3] [--formats fp8_ds_mla,nvfp4] [--budget-s 1500]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

import torch

from mla_eval.errors import UserError

SCHEMA = "mla_eval_memory_bench_v1"
SUMMARY = "memory-bench.json"
REFERENCE_FORMAT = "bf16"
DEFAULT_PRESETS = ("deepseek-v3.2", "glm-5")
DEFAULT_CTX = (2048, 4096, 8192)
DEFAULT_FORMATS = ("fp8_ds_mla", "nvfp4")
TARGET_ACTIVATION_GIB = 16.0  # issue 35: one layer's weights + <= 16 GiB at ctx 8192, DeepSeek-V3.2 geometry
GIB = 2**30


@dataclasses.dataclass
class BenchSettings:
    out: Path
    presets: tuple[str, ...] = DEFAULT_PRESETS
    ctx: tuple[int, ...] = DEFAULT_CTX
    layers: int = 3
    formats: tuple[str, ...] = DEFAULT_FORMATS
    layer_stats: bool = True
    batch: int = 1
    device: str = "auto"
    backend: str = "auto"
    seed: int = 0
    budget_s: float = 1500.0
    indexer_check_ctx: int = 4096  # 0: no check
    hidden: int | None = None  # override of hidden_size (CPU tests)
    topk: int | None = None  # override of a DSA preset's index_topk (CPU tests)
    force: bool = False

    def check(self) -> None:
        from mla_eval.attention import dispatch
        from mla_eval.formats import get_format
        from mla_eval.model_presets import preset_names

        for name in self.presets:
            if name not in preset_names():
                raise UserError(f"--presets: no preset {name!r}; choose from {', '.join(preset_names())}")
        if not self.presets or not self.ctx:
            raise UserError("--presets and --ctx each need at least one value")
        for name, value, low in (("--layers", self.layers, 1), ("--batch", self.batch, 1), ("--ctx", min(self.ctx), 2),
                                 ("--indexer-check-ctx", self.indexer_check_ctx, 0)):
            if value < low:
                raise UserError(f"{name} must be >= {low}, got {value}")
        if self.budget_s <= 0:
            raise UserError(f"--budget-s must be positive, got {self.budget_s}")
        for f in self.formats:
            get_format(f)  # UserError naming the known formats
        dispatch.check_backend(self.backend, source="--backend")
        if self.out.exists() and not self.out.is_dir():
            raise UserError(f"--out {self.out} exists and is not a folder; give a folder for the case files")


def case_name(preset: str, ctx: int) -> str:
    return f"{preset}_ctx{ctx}.json"


def model_spec(st: BenchSettings, preset: str) -> str:
    from mla_eval.model_presets import get_preset

    spec = f"random:{preset}:layers={st.layers}:seed={st.seed}"
    if st.hidden:
        spec += f":hidden={st.hidden}"
    if st.topk and "index_topk" in get_preset(preset).config:
        spec += f":topk={st.topk}"
    return spec


# ------------------------------------------------------------------------------------ measuring
@dataclasses.dataclass
class Peak:
    """One phase's memory: `peak` bytes allocated at most (absolute on CUDA; None on a CPU), `growth` the most above
    what was allocated when the phase began, `reserved` the caching allocator's peak (CUDA only)."""

    peak: int | None = None
    growth: int | None = None
    reserved: int | None = None

    def as_dict(self) -> dict:
        gib = lambda b: None if b is None else b / GIB  # noqa: E731
        return {"peak_gib": gib(self.peak), "growth_gib": gib(self.growth), "reserved_gib": gib(self.reserved)}


def cpu_peak_growth(trace: dict) -> int:
    """The most bytes torch's CPU allocator held above the start of a profiled region, from its chrome trace: each
    allocation or free event carries the running total of the allocations the profiler tracks (those of earlier
    profiled regions still alive included), so the region's baseline is the first event's total less its bytes."""
    events = [e["args"] for e in trace["traceEvents"] if e.get("name") == "[memory]"]
    if not events:
        return 0
    return max(e["Total Allocated"] for e in events) - (events[0]["Total Allocated"] - events[0]["Bytes"])


@contextlib.contextmanager
def measure(device: torch.device, scratch: Path) -> Iterator[Peak]:
    """Record the peak memory of the block into the yielded Peak (filled when the block ends)."""
    peak = Peak()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            yield peak
        finally:
            torch.cuda.synchronize(device)
            peak.peak = torch.cuda.max_memory_allocated(device)
            peak.growth = peak.peak - start
            peak.reserved = torch.cuda.max_memory_reserved(device)
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield peak
    trace = scratch / "memory-bench-trace.json"
    prof.export_chrome_trace(str(trace))
    try:
        peak.growth = cpu_peak_growth(json.loads(trace.read_text()))
    finally:
        trace.unlink(missing_ok=True)


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def real_layer_weight_bytes(preset: str) -> dict:
    """Mean decoder-layer weights of the full-size model: param_count / (layers + MTP layers), embeddings included
    in the mean (a small share at these sizes), in the checkpoint's dtype and in bf16 (dequantised for compute)."""
    from mla_eval.model_presets import get_preset

    p = get_preset(preset)
    layers = p.config["num_hidden_layers"] + p.config.get("num_nextn_predict_layers", 0)
    ckpt = p.weights().bytes / layers
    return {"layers": layers, "checkpoint_dtype": p.weights_dtype, "checkpoint_gib": ckpt / GIB,
            "bf16_gib": p.param_count * 2 / layers / GIB, "source": p.weights().source}


# ------------------------------------------------------------------------------------ phases
def _window(lm, st: BenchSettings, ctx: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(st.seed + ctx)
    return torch.randint(0, lm.model.config.vocab_size, (st.batch, ctx), generator=g).to(lm.device)


@torch.no_grad()
def _forward_hidden(lm, fmt: str, ids: torch.Tensor, score_from: int, observers=()) -> torch.Tensor:
    """The final hidden states of the scored positions through the format's cache, as a kld window forward reads
    them (one whole-window forward: DSA models and cache semantics)."""
    from mla_eval.formats import get_format
    from mla_eval.model.session import CacheSession

    b, t = ids.shape
    session = CacheSession(get_format(fmt), lm.num_layers, b, t, lm.layer_devices, observers=tuple(observers),
                           keep_exact=bool(observers))
    pos = torch.arange(t, device=lm.device).expand(b, -1)
    with lm.adapter.session(session):
        hidden = lm.model.base_model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
    return hidden[:, score_from : t - 1].reshape(-1, hidden.shape[-1])


@torch.no_grad()
def _loss(lm, ref_h: torch.Tensor, rows_h: dict[str, torch.Tensor], targets: torch.Tensor) -> dict[str, float]:
    """Mean KLD of every format against the reference, log-probs made a chunk of rows at a time as kld makes them."""
    from mla_eval.evals.kld import loss_chunk_rows
    from mla_eval.evals.kld_stats import token_metrics

    head = lm.model.get_output_embeddings()
    logp = lambda h: torch.log_softmax(head(h).float(), dim=-1)  # noqa: E731
    rows = loss_chunk_rows(lm.model.config.vocab_size)
    sums = {fmt: 0.0 for fmt in rows_h}
    for c in range(0, targets.numel(), rows):
        ref = logp(ref_h[c : c + rows])
        for fmt, h in rows_h.items():
            sums[fmt] += float(token_metrics(ref, logp(h[c : c + rows]), targets[c : c + rows])["kld"].sum())
    return {fmt: s / max(1, targets.numel()) for fmt, s in sums.items()}


@torch.no_grad()
def _indexer_check(lm, ctx: int, st: BenchSettings) -> dict:
    """Layer 0's top-k over a random window in the default score blocks and in blocks a quarter that size."""
    from mla_eval.model import indexer

    attn = lm.adapter.modules[0]
    ids = _window(lm, st, ctx)[:1]
    hidden = lm.model.base_model.embed_tokens(ids)
    pos = torch.arange(ctx, device=lm.device).view(1, -1)
    pe = lm.model.base_model.rotary_emb(hidden, pos)
    q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden))
    k = lm.model.config.index_topk
    args = (attn.indexer, lm.model.config.model_type, hidden, q_resid, pe, k)
    default = indexer.indexer_topk(*args)
    quarter = indexer.indexer_topk(*args, block_bytes=indexer.SCORE_BLOCK_BYTES // 4)
    return {"ctx": ctx, "index_topk": k, "block_bytes": [indexer.SCORE_BLOCK_BYTES, indexer.SCORE_BLOCK_BYTES // 4],
            "equal": bool(torch.equal(default, quarter))}


def run_case(st: BenchSettings, preset: str, ctx: int) -> dict:
    """Every phase of one (preset, ctx) case; an out-of-memory error ends the case with what it reached."""
    from mla_eval.attention import dispatch
    from mla_eval.evals.kld import KldProtocol, run_kld
    from mla_eval.evals.layer_stats import LayerStats
    from mla_eval.evals.text_sources import TokenSource
    from mla_eval.evals.variants import parse_variants
    from mla_eval.formats import get_format
    from mla_eval.model.loader import load_model, resolve_device

    dev = resolve_device(st.device)
    doc: dict = {"schema": SCHEMA, "preset": preset, "ctx": ctx, "batch": st.batch, "layer_stats": st.layer_stats,
                 "formats": [REFERENCE_FORMAT, *st.formats], "device": str(dev), "phases": {}, "status": "running"}
    if dev.type == "cuda":
        doc["device_name"] = torch.cuda.get_device_name(dev)
    phase = "load"
    t0 = time.perf_counter()
    try:
        with dispatch.use_backend(st.backend) as log:
            with measure(dev, st.out) as p:
                lm = load_model(model_spec(st, preset), device=st.device)
            doc["phases"]["load"] = p.as_dict()
            cfg = lm.model.config
            if ctx > lm.max_positions > 0:
                raise UserError(f"--ctx {ctx} is beyond {preset}'s {lm.max_positions} positions")
            layers = list(lm.model.base_model.layers)
            doc["model"] = lm.name
            doc["geometry"] = {k: getattr(cfg, k, None) for k in ("hidden_size", "num_attention_heads", "qk_nope_head_dim",
                                                                  "qk_rope_head_dim", "v_head_dim", "index_n_heads",
                                                                  "index_head_dim", "index_topk")}
            doc["weights"] = {"resident_gib": weight_bytes(lm.model) / GIB,
                              "one_layer_gib": max(weight_bytes(layer) for layer in layers) / GIB,
                              "real_layer": real_layer_weight_bytes(preset)}
            ids = _window(lm, st, ctx)
            score_from = ctx // 2  # kld's default min_context
            targets = ids[:, score_from + 1 :].reshape(-1)
            rows_h = {}
            for fmt in (REFERENCE_FORMAT, *st.formats):
                phase = f"forward {fmt}"
                stats = LayerStats(lm.num_layers) if st.layer_stats and fmt != REFERENCE_FORMAT else None
                observers = stats.observers(get_format(fmt)) if stats else ()
                with measure(dev, st.out) as p:
                    rows_h[fmt] = _forward_hidden(lm, fmt, ids, score_from, observers)
                doc["phases"][phase] = p.as_dict()
            phase = "loss"
            ref_h = rows_h.pop(REFERENCE_FORMAT)
            with measure(dev, st.out) as p:
                doc["kld_mean"] = _loss(lm, ref_h, rows_h, targets)
            doc["phases"][phase] = p.as_dict()
            del ref_h, rows_h
            phase = "kld"
            source = TokenSource("text", "random tokens", [row.cpu() for row in ids], "memory-bench")
            protocol = KldProtocol(tuple(parse_variants(",".join(st.formats))), parse_variants(REFERENCE_FORMAT)[0], ctx,
                                   ctx - score_from, score_from, batch=st.batch, layer_stats=st.layer_stats,
                                   prefill="absorbed")
            with measure(dev, st.out) as p:
                run_kld(lm, source, protocol)
            doc["phases"][phase] = p.as_dict()
            if lm.adapter.is_dsa and st.indexer_check_ctx and ctx == min(st.ctx, key=lambda c: abs(c - st.indexer_check_ctx)):
                phase = "indexer check"
                doc["indexer_check"] = _indexer_check(lm, ctx, st)
            doc["attention_paths"] = dict(log.paths)
            selected, causal = lm.adapter.sparse_read_counts()
            doc["sparse_reads"] = {"selected_keys": selected, "causal_keys": causal} if lm.adapter.is_dsa else None
        doc["status"] = "ok"
    except torch.OutOfMemoryError as exc:
        doc["status"] = "out of memory"
        doc["oom"] = {"phase": phase, "message": str(exc).splitlines()[0][:300]}
        if dev.type == "cuda":
            doc["oom"]["peak_gib"] = torch.cuda.max_memory_allocated(dev) / GIB
    finally:
        lm = None  # noqa: F841 - the next case starts from an empty device
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    doc["seconds"] = time.perf_counter() - t0
    peaks = [ph["peak_gib"] for name, ph in doc["phases"].items() if name != "load" and ph["peak_gib"] is not None]
    if peaks and "weights" in doc:
        doc["activation_peak_gib"] = max(peaks) - doc["weights"]["resident_gib"]
        doc["target"] = {"activation_gib_max": TARGET_ACTIVATION_GIB,
                         "met": doc["activation_peak_gib"] <= TARGET_ACTIVATION_GIB}
    return doc


# ------------------------------------------------------------------------------------ driving
def run_bench(st: BenchSettings, say=print) -> dict:
    """Run every case not already under st.out (within the time budget); return the summary of every case file."""
    from mla_eval.atomic_io import write_json_atomic

    st.check()
    st.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    skipped = []
    for preset in st.presets:
        for ctx in sorted(st.ctx):
            path = st.out / case_name(preset, ctx)
            if path.exists() and not st.force:
                say(f"{path.name}: kept from an earlier run")
                continue
            if time.perf_counter() - t0 > st.budget_s:
                skipped.append(path.name)
                continue
            doc = run_case(st, preset, ctx)
            write_json_atomic(path, doc)
            say(f"{path.name}: {doc['status']} ({doc['seconds']:.0f} s)")
    summary = collect(st.out)
    summary["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(st).items()}
    summary["skipped_for_budget"] = skipped
    write_json_atomic(st.out / SUMMARY, summary)
    return summary


def collect(folder: Path) -> dict:
    """Every case file under `folder`, in (preset, ctx) order."""
    cases = []
    for f in sorted(folder.glob("*_ctx*.json")):
        doc = json.loads(f.read_text())
        if doc.get("schema") == SCHEMA:
            cases.append(doc)
    cases.sort(key=lambda d: (d["preset"], d["ctx"]))
    return {"schema": SCHEMA + "_summary", "cases": cases}


def table(summary: dict) -> str:
    phases = ["load", "forward bf16", "forward*", "loss", "kld"]
    lines = [f"{'preset':<15}{'ctx':>6}{'status':>15}" + "".join(f"{p:>14}" for p in phases)
             + f"{'1 layer':>10}{'activ.':>9}{'target':>8}"]
    for d in summary["cases"]:
        ph = d["phases"]

        def gib(name: str) -> str:
            names = [k for k in ph if k.startswith("forward ") and k != "forward bf16"] if name == "forward*" else [name]
            vals = [ph[k] for k in names if k in ph]  # forward*: the largest format forward
            if any(v["peak_gib"] is not None for v in vals):
                return f"{max(v['peak_gib'] for v in vals if v['peak_gib'] is not None):.2f}"
            vals = [v["growth_gib"] for v in vals if v["growth_gib"] is not None]
            return f"+{max(vals):.2f}" if vals else "-"

        one = d.get("weights", {}).get("one_layer_gib")
        act = d.get("activation_peak_gib")
        met = d.get("target", {}).get("met")
        lines.append(f"{d['preset']:<15}{d['ctx']:>6}{d['status']:>15}" + "".join(f"{gib(p):>14}" for p in phases)
                     + f"{'-' if one is None else f'{one:.2f}':>10}{'-' if act is None else f'{act:.2f}':>9}"
                     + f"{'-' if met is None else ('met' if met else 'MISSED'):>8}")
    lines.append("peak GiB allocated per phase (+: growth within the phase, CPU); forward*: the largest format forward; "
                 "1 layer: one decoder layer of the random model; activ.: largest peak - resident weights; "
                 f"target: activ. <= {TARGET_ACTIVATION_GIB:g} GiB")
    for d in summary["cases"]:
        real = d.get("weights", {}).get("real_layer")
        if real and d["ctx"] == max(c["ctx"] for c in summary["cases"] if c["preset"] == d["preset"]):
            lines.append(f"{d['preset']}: a full-size decoder layer weighs {real['checkpoint_gib']:.1f} GiB in "
                         f"{real['checkpoint_dtype']} ({real['bf16_gib']:.1f} GiB bf16; {real['source']})")
        if d.get("indexer_check"):
            c = d["indexer_check"]
            lines.append(f"{d['preset']} ctx {c['ctx']}: indexer top-k in quarter-size score blocks "
                         f"{'equal' if c['equal'] else 'DIFFERENT'} to the default blocks")
    if summary.get("skipped_for_budget"):
        lines.append("not run (--budget-s spent): " + ", ".join(summary["skipped_for_budget"]))
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> BenchSettings:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.memory_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the case files and memory-bench.json")
    ap.add_argument("--presets", default=",".join(DEFAULT_PRESETS), help="comma-separated preset names")
    ap.add_argument("--ctx", default=",".join(map(str, DEFAULT_CTX)), help="comma-separated window lengths")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--formats", default=",".join(DEFAULT_FORMATS), help="formats besides the bf16 reference")
    ap.add_argument("--no-layer-stats", action="store_true", help="forwards without kld's per-layer statistics")
    ap.add_argument("--batch", type=int, default=1, help="windows per forward")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--backend", default="auto", help="auto, kernel or reference (mla_eval.attention.dispatch)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=1500.0, help="start no case after this many seconds")
    ap.add_argument("--indexer-check-ctx", type=int, default=4096,
                    help="DSA presets: check the chunked top-k at the --ctx value nearest this (0: no check)")
    ap.add_argument("--hidden-override", type=int, default=None, help="replace hidden_size (CPU tests)")
    ap.add_argument("--topk-override", type=int, default=None, help="replace a DSA preset's index_topk (CPU tests)")
    ap.add_argument("--force", action="store_true", help="rerun cases whose files exist")
    a = ap.parse_args(argv)
    split = lambda text: tuple(x.strip() for x in text.split(",") if x.strip())  # noqa: E731
    try:
        ctx = tuple(int(x) for x in split(a.ctx))
    except ValueError:
        raise UserError(f"--ctx must be comma-separated integers, got {a.ctx!r}") from None
    return BenchSettings(out=a.out, presets=split(a.presets), ctx=ctx, layers=a.layers, formats=split(a.formats),
                         layer_stats=not a.no_layer_stats, batch=a.batch, device=a.device, backend=a.backend, seed=a.seed,
                         budget_s=a.budget_s, indexer_check_ctx=a.indexer_check_ctx, hidden=a.hidden_override,
                         topk=a.topk_override, force=a.force)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        st = parse_args(argv)
        st.check()
        summary = run_bench(st)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(summary))
    print(f"wrote {st.out / SUMMARY}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
