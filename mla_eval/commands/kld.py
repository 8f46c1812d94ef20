"""`mla-eval kld` and `mla-eval calibrate`: teacher-forced KLD per cache format; s_l calibration."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from mla_eval.errors import UserError
from mla_eval.evals import text_sources
from mla_eval.evals.calibrate import calibrate as run_calibration
from mla_eval.evals.ref_store import RefStore
from mla_eval.evals.kld import KldSettings, Variant, gather_arrays, plan_windows, run_kld, summarize_result
from mla_eval.formats import OuterScales, get_format
from mla_eval.model.loader import DEVICE_MAP_HELP
from mla_eval.result_schemas import KLD_SCHEMA
from mla_eval.results import default_result_path, environment, write_result
DEFAULT_FORMATS = (
    "fp8_ds_mla,fp8_ds_mla_pow2,nvfp4,nvfp4+s_l,nvfp4_fp8rope,nvfp4_fp8rope+s_l,nvfp4_fp8rope_st,mxfp4,fp8_e4m3"
)
console = Console(stderr=True)


def parse_variants(text: str) -> list[Variant]:
    """'nvfp4,nvfp4+s_l' -> variants; '+s_l' applies the per-layer outer scales."""
    out: list[Variant] = []
    for tok in (t.strip() for t in text.split(",")):
        if not tok:
            continue
        base, plus, opt = tok.partition("+")
        if plus and opt not in ("s_l", "sl"):
            raise UserError(f"format option '+{opt}' in {tok!r} is unknown; the only option is +s_l")
        spec = get_format(base)
        if plus and (spec.outer_scale is None or spec.outer_scale.denominator != 2688.0):
            raise UserError(f"{spec.name} takes no nvfp4 outer scale; +s_l applies to nvfp4, nvfp4_fp8rope")
        v = Variant(spec, outer=bool(plus))
        if v not in out:
            out.append(v)
    if not out:
        raise UserError("--formats is empty; give e.g. nvfp4,fp8_ds_mla")
    return out


def _load_source(lm, text: Path | None, dataset: str | None, max_tokens: int | None, samples: int, sample_len: int, seed: int):
    if text and dataset:
        raise UserError("give either --text or --dataset, not both")
    if text:
        return text_sources.from_text_file(text, lm.tokenizer, max_tokens)
    if dataset:
        return text_sources.from_dataset(dataset, lm.tokenizer, max_tokens)
    return text_sources.self_samples(lm, samples, sample_len, seed)


def _self_samples_with_calibration(lm, samples: int, sample_len: int, seed: int):
    """One extra sample in the same decoding batch (nearly free) serves as the calibration text."""
    both = text_sources.self_samples(lm, samples + 1, sample_len, seed)
    calib = text_sources.TokenSource("self-samples", "a separate self-sample", both.sequences[-1:], "calib")
    evals = text_sources.self_samples_subset(both, samples)
    return evals, calib


def _split_calibration(source, calib_tokens: int):
    """Take the calibration slice off the front of the first sequence; evaluate on the rest."""
    first = source.sequences[0]
    if first.numel() <= calib_tokens * 2:
        raise UserError(f"text too short to hold out {calib_tokens} calibration tokens; pass --scales FILE or fewer --calib-tokens")
    calib = text_sources.TokenSource(source.kind, f"first {calib_tokens} tokens of {source.label}", [first[:calib_tokens]], "calib")
    rest = text_sources.TokenSource(source.kind, source.label + f" (after the {calib_tokens} calibration tokens)", [first[calib_tokens:], *source.sequences[1:]], source.digest)
    return calib, rest


def _distributed() -> tuple[int, int]:
    """(rank, world) under torchrun; initialises torch.distributed once."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), world


def kld(
    model: Path = typer.Option(None, "--model", "-m", help="Local Hugging Face MLA checkpoint folder (default: the embedded model)."),
    formats: str = typer.Option(DEFAULT_FORMATS, "--formats", "-f", help="Comma-separated formats; append +s_l to use the per-layer outer scales."),
    ref: str = typer.Option("bf16", "--ref", help="Reference cache format (bf16, or e.g. fp8_ds_mla to compare against production fp8)."),
    text: Path = typer.Option(None, "--text", help="Plain-text file to evaluate on."),
    dataset: str = typer.Option(None, "--dataset", help="A `datasets` name (wikitext-2 = wikitext-2-raw-v1 test); needs the data extra."),
    max_tokens: int = typer.Option(None, "--max-tokens", help="Use at most this many tokens of the text."),
    samples: int = typer.Option(4, "--samples", help="Self-samples (no --text/--dataset): number of sequences."),
    sample_len: int = typer.Option(256, "--sample-len", help="Self-samples: tokens per sequence."),
    ctx: int = typer.Option(None, "--ctx", help="Window length in tokens (default 2048; self-samples: --sample-len)."),
    stride: int = typer.Option(512, "--stride", help="Window stride in tokens."),
    min_context: int = typer.Option(None, "--min-context", help="Score only tokens with at least this much context (default ctx/2)."),
    batch: int = typer.Option(None, "--batch", help="Windows per forward (default: 1; self-samples: all samples at once)."),
    scales: str = typer.Option("auto", "--scales", help="Outer scales for +s_l: a JSON file (nvfp4_ds_mla_outer_scale_v1), 'auto' (calibrate on a held-out slice), or 'none'."),
    calib_tokens: int = typer.Option(2048, "--calib-tokens", help="--scales auto: tokens held out for calibration."),
    layer_stats: bool = typer.Option(True, "--layer-stats/--no-layer-stats", help="Per-layer attention-output error and latent SNR."),
    out: Path = typer.Option(None, "--out", "-o", help="Result JSON path (default results/kld-<model>-<time>.json)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out file."),
    save_ref: Path = typer.Option(None, "--save-ref", help="Store the reference log-probs here, to score more formats later with --ref-file."),
    ref_file: Path = typer.Option(None, "--ref-file", help="Reuse stored reference log-probs (same model, text and window settings) instead of the reference forward."),
    ref_store: str = typer.Option("topk", "--ref-store", help="--save-ref encoding: topk (64 largest + tail mass; KL is a lower bound) or fp16 (full rows)."),
    plot: Path = typer.Option(None, "--plot", help="Folder for PNG plots: KLD CDF, KLD by depth, per-layer error."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda, cuda:N or auto."),
    device_map: str = typer.Option("none", "--device-map", help=DEVICE_MAP_HELP),
    seed: int = typer.Option(0, "--seed", help="Seed of the self-samples."),
) -> None:
    """Teacher-forced KL divergence of each cache format vs a reference format.

    Sliding windows (--ctx, --stride); a token is scored once, with at least --min-context tokens
    before it; every layer writes its latent through the format's cache writer and reads attention
    from the quantised cache. Prints a side-by-side table and writes a versioned JSON.
    """
    from mla_eval.model.loader import load_model

    rank, world = _distributed()
    if world > 1 and device_map != "none":
        raise UserError("--device-map auto spreads one model over the GPUs; under torchrun each rank holds its own copy: use one or the other")
    variants = parse_variants(formats)
    ref_v = parse_variants(ref)[0]
    if out is not None and out.exists() and not force:
        raise UserError(f"{out} exists; choose another --out or pass --force to replace it")
    lm = load_model(model, device, device_map=device_map)
    needs_outer = any(v.outer for v in variants + [ref_v])
    calib = None
    if not text and not dataset and scales == "auto" and needs_outer:
        source, calib = _self_samples_with_calibration(lm, samples, sample_len, seed)
    else:
        source = _load_source(lm, text, dataset, max_tokens, samples, sample_len, seed)
    ctx = ctx or (sample_len if source.kind == "self-samples" else 2048)
    if batch is None:
        batch = len(source.sequences) if source.kind == "self-samples" else 1

    settings = KldSettings(variants=variants, ref=ref_v, ctx=ctx, stride=stride, min_context=min_context, batch=batch, layer_stats=layer_stats)
    plan_windows(lm, source, settings)  # bad settings fail here, before any work or output
    outer = None
    if scales == "none":
        if needs_outer:
            raise UserError("--scales none, but +s_l formats were asked for; drop them or give --scales FILE")
    elif scales == "auto":
        if needs_outer:
            if calib is None:
                calib, source = _split_calibration(source, calib_tokens)
            outer = run_calibration(lm, calib, ctx)
    else:
        outer = OuterScales.load(scales)
        outer.check_layers(lm.num_layers, source=scales)

    settings.outer_scales = outer
    ref_meta = {"model": str(lm.path.resolve()), "text": source.digest, "ctx": ctx, "stride": stride, "min_context": settings.min_context if settings.min_context is not None else ctx // 2, "ref": ref_v.name}
    if ref_v.outer:
        ref_meta["ref_scales"] = list(outer.scales)
    saver = RefStore(mode=ref_store, meta=ref_meta) if save_ref else None
    loaded = RefStore.load(ref_file, ref_meta) if ref_file else None
    if rank == 0:
        console.print(f"[bold]mla-eval kld[/] model={lm.name} device={lm.device} ref={ref_v.name} tokens: {source.label}")
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} tok"), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn(), console=console, disable=rank != 0) as bar:
        task = bar.add_task("scoring", total=None, rate="")

        def progress(done, total, secs):
            bar.update(task, completed=done, total=total, rate=f"{done / max(secs, 1e-9):.0f} tok/s")

        result = run_kld(lm, source, settings, progress=progress, save_ref=saver, ref_file=loaded, rank=rank, world=world)
    if saver is not None:
        if world > 1:
            raise UserError("--save-ref is single-process only; run it without torchrun")
        saver.save(save_ref)
        console.print(f"wrote reference log-probs to {save_ref}")
    result["stats"] = gather_arrays(result["stats"])
    if rank != 0:
        return
    summary = summarize_result(result)
    doc = {
        "schema": KLD_SCHEMA,
        "model": {"name": lm.name, "path": str(lm.path), "default": lm.is_default, "layers": lm.num_layers},
        "text": {"kind": source.kind, "label": source.label, "digest": source.digest, "tokens": source.num_tokens},
        "settings": {"ref": ref_v.name, "ctx": ctx, "stride": stride, "min_context": settings.min_context if settings.min_context is not None else ctx // 2, "batch": batch, "block_size": settings.block_size, "world_size": world},
        "outer_scales": None if outer is None else outer.to_json(),
        "windows": result["windows"],
        "seconds": result["seconds"],
        "environment": environment(),
        "formats": summary,
    }
    print_table(summary, ref_v.name, source.label)
    path = write_result(out or default_result_path("kld", lm.name), doc, force=force)
    console.print(f"wrote {path}")
    if plot:
        from mla_eval.report.plots import kld_plots

        for p in kld_plots(result, summary, plot):
            console.print(f"wrote {p}")


COLUMNS = (
    ("KLD", lambda s: f"{s['kld_mean']:.4f}"),
    ("±se", lambda s: f"{s['kld_se']:.4f}"),
    ("med", lambda s: f"{s['kld_median']:.4f}"),
    ("p99", lambda s: f"{s['kld_p99']:.3f}"),
    ("top1%", lambda s: f"{s['same_top1_pct']:.1f}"),
    ("RMSΔp%", lambda s: f"{s['delta_p_rms_pct']:.2f}"),
    ("PPLx", lambda s: f"{s['ppl_ratio']:.4f}"),
)


def print_table(summary: dict, ref: str, label: str) -> None:
    """Formats as rows (they are what the reader compares); every other figure is in the JSON."""
    table = Table(title=f"Teacher-forced KLD vs {ref} cache — {label}")
    table.add_column("format", style="bold", no_wrap=True)
    for title, _ in COLUMNS:
        table.add_column(title, justify="right", no_wrap=True)
    with_layers = all("layers" in s for s in summary.values())
    if with_layers:
        table.add_column("attn", justify="right")
    first = next(iter(summary.values()))
    for name, s in summary.items():
        cells = [fn(s) for _, fn in COLUMNS]
        if with_layers:
            cells.append(f"{max(r['attn_rel_l2'] for r in s['layers']):.3f}")
        table.add_row(name, *cells)
    Console().print(table)
    Console().print(
        f"{first['tokens']} scored tokens; PPL({ref}) = {first['ppl_ref']:.3f}. KLD = mean KL(ref || format) in nats over the full "
        "vocabulary, ±se its standard error, med/p99 its percentiles; top1% = same argmax as the reference; PPLx = PPL ratio; "
        "attn = worst layer's attention-output relative L2 vs exact float32. All figures: the result JSON."
    )


def calibrate_cmd(
    model: Path = typer.Option(None, "--model", "-m", help="Local Hugging Face MLA checkpoint folder (default: the embedded model)."),
    text: Path = typer.Option(None, "--text", help="Calibration text file (use a different slice than you evaluate on)."),
    dataset: str = typer.Option(None, "--dataset", help="A `datasets` name to calibrate on."),
    max_tokens: int = typer.Option(None, "--max-tokens", help="Use at most this many tokens."),
    samples: int = typer.Option(1, "--samples", help="Self-samples (no --text/--dataset): number of sequences."),
    sample_len: int = typer.Option(768, "--sample-len", help="Self-samples: tokens per sequence."),
    seed: int = typer.Option(1000, "--seed", help="Self-samples seed (differs from kld's default 0 on purpose)."),
    ctx: int = typer.Option(2048, "--ctx", help="Forward window length in tokens."),
    out: Path = typer.Option(..., "--out", "-o", help="Where to write the nvfp4_ds_mla_outer_scale_v1 JSON."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out file."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda, cuda:N or auto."),
    device_map: str = typer.Option("none", "--device-map", help=DEVICE_MAP_HELP),
) -> None:
    """Compute per-layer outer scales s_l = max|c_kv| / (6*448) and write the published JSON schema."""
    from mla_eval.model.loader import load_model

    if out.exists() and not force:
        raise UserError(f"{out} exists; choose another --out or pass --force to replace it")
    lm = load_model(model, device, device_map=device_map)
    source = _load_source(lm, text, dataset, max_tokens, samples, sample_len, seed)
    scales = run_calibration(lm, source, ctx)
    scales.save(out)
    table = Table(title=f"Per-layer outer scales — {source.label}")
    table.add_column("layer", justify="right")
    table.add_column("max |c_kv|", justify="right")
    table.add_column("s_l", justify="right")
    for i, (a, s) in enumerate(zip(scales.provenance["max_abs_c_kv"], scales.scales)):
        table.add_row(str(i), f"{a:.4g}", f"{s:.6g}")
    Console().print(table)
    console.print(f"wrote {out}")


def register(app: typer.Typer) -> None:
    app.command("kld")(kld)
    app.command("calibrate")(calibrate_cmd)
