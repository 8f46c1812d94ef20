"""`mla-eval kld` and `mla-eval calibrate`: parse options, call the library, print, write the document."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from mla_eval.attention.semantics import MATH_HELP, SEMANTICS_HELP
from mla_eval.commands.progress import duration, peak_memory_line, progress_bars
from mla_eval.evals.calibrate import CalibrateSettings, evaluate_calibration
from mla_eval.evals.kld import DEFAULT_KLD_PREFILL
from mla_eval.evals.kld_evaluation import DEFAULT_FORMATS, KldSettings, evaluate_kld
from mla_eval.evals.settings import DEFAULT_CTX, DEVICES_HELP
from mla_eval.model.loader import DEVICE_MAP_HELP, MAX_MEMORY_HELP, MODEL_HELP
from mla_eval.model.rope_scaling import ROPE_SCALING_HELP
from mla_eval.results import check_output_path, default_out_help, default_result_path, write_result

console = Console(stderr=True)
BACKEND_HELP = (
    "Attention path: auto (kernel for CUDA tensors where it can run), kernel, or reference (default: MLA_EVAL_BACKEND or auto)."
)


def kld(
    model: str = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    formats: str = typer.Option(
        DEFAULT_FORMATS, "--formats", "-f", help="Comma-separated formats; append +s_l to use the per-layer outer scales."
    ),
    ref: str = typer.Option(
        "bf16", "--ref", help="Reference cache format (bf16, or e.g. fp8_ds_mla to compare against production fp8)."
    ),
    text: Path = typer.Option(None, "--text", help="Plain-text (UTF-8) file to evaluate on."),
    dataset: str = typer.Option(
        None, "--dataset", help="A `datasets` name (wikitext-2 = wikitext-2-raw-v1 test); needs the data extra."
    ),
    max_tokens: int = typer.Option(None, "--max-tokens", help="Use at most this many tokens of the text (default: all)."),
    samples: int = typer.Option(4, "--samples", help="Self-samples (no --text/--dataset): number of sequences."),
    sample_len: int = typer.Option(256, "--sample-len", help="Self-samples: tokens per sequence."),
    ctx: int = typer.Option(None, "--ctx", help=f"Window length in tokens (default {DEFAULT_CTX}; self-samples: --sample-len)."),
    stride: int = typer.Option(None, "--stride", help="Window stride in tokens (default 512, or ctx - min-context if smaller)."),
    min_context: int = typer.Option(
        None, "--min-context", help="Score only tokens with at least this much context (default ctx/2)."
    ),
    batch: int = typer.Option(None, "--batch", help="Windows per forward (default: 1; self-samples: all samples at once)."),
    scales: str = typer.Option(
        "auto", "--scales",
        help="Outer scales for +s_l: a JSON file (nvfp4_ds_mla_outer_scale_v1), 'auto' (calibrate on a held-out slice), "
        "or 'none'.",
    ),
    calib_tokens: int = typer.Option(2048, "--calib-tokens", help="--scales auto: tokens held out for calibration."),
    layer_stats: bool = typer.Option(
        True, "--layer-stats/--no-layer-stats", help="Per-layer attention-output error and latent SNR."
    ),
    out: Path = typer.Option(None, "--out", "-o", help=default_out_help("kld")),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out file."),
    save_ref: Path = typer.Option(
        None, "--save-ref", help="Store the reference log-probs here, to score more formats later with --ref-file."
    ),
    ref_file: Path = typer.Option(
        None, "--ref-file",
        help="Reuse stored reference log-probs (same model, text and window settings) instead of the reference forward.",
    ),
    ref_store: str = typer.Option(
        "topk", "--ref-store",
        help="--save-ref encoding: topk (64 largest + tail mass; KL is a lower bound) or fp16 (full rows).",
    ),
    plot: Path = typer.Option(None, "--plot", help="Folder for PNG plots: KLD CDF, KLD by depth, per-layer error."),
    device: str = typer.Option("auto", "--device", help=DEVICES_HELP + "."),
    device_map: str = typer.Option("none", "--device-map", help=DEVICE_MAP_HELP),
    max_memory: str = typer.Option(None, "--max-memory", help=MAX_MEMORY_HELP),
    backend: str = typer.Option(None, "--backend", help=BACKEND_HELP),
    seed: int = typer.Option(0, "--seed", help="Seed of the self-samples."),
    semantics: str = typer.Option("cache", "--semantics", help=SEMANTICS_HELP),
    math: str = typer.Option("bf16", "--math", help=MATH_HELP),
    explain: str = typer.Option(
        None, "--explain",
        help="A format (e.g. nvfp4): add its storage-only (format cache, bf16 math), compute-only (bf16 cache, fp8 "
        "math) and both rows under every --semantics, and the breakdown in the JSON.",
    ),
    prefill: str = typer.Option(
        None, "--prefill", show_default=False,  # None: the default, asked for by nobody (no note where auto falls back)
        help="How each window's forward reads the quantised cache: 'absorbed' runs every position through the absorbed "
        "MQA attention (decode's arithmetic), 'mha' decodes the cache once, up-projects it through kv_b_proj and runs "
        "causal SDPA (flash on CUDA; the same mathematics with bf16 math, up to bf16 rounding of K/V; 2.5-3.2x faster "
        "on an H200). 'auto': mha wherever it computes the same semantics (bf16 math, no --explain fp8 rows, "
        "--no-layer-stats, not a DSA model), else absorbed; the reason is recorded (settings.prefill_reason) and, when "
        f"--prefill auto is given, printed as a note. Default {DEFAULT_KLD_PREFILL}. The JSON records the path "
        "(settings.prefill); give 'absorbed' to compare with figures computed that way.",
    ),
    rope_scaling: str = typer.Option("none", "--rope-scaling", help=ROPE_SCALING_HELP),
    text_note: str = typer.Option(
        None, "--text-note", help="How the --text file was built (recorded in the result's text.note), e.g. which articles."
    ),
) -> None:
    """Teacher-forced KL divergence of each cache format vs a reference format.

    Sliding windows (--ctx, --stride); a token is scored once, with at least --min-context tokens
    before it; every layer writes its latent through the format's cache writer and reads attention
    from the quantised cache. Prints a side-by-side table and writes a versioned JSON.
    """
    settings = KldSettings(
        model=model, device=device, device_map=device_map, max_memory=max_memory, backend=backend, text=text, dataset=dataset,
        max_tokens=max_tokens, samples=samples, sample_len=sample_len, seed=seed, formats=formats, ref=ref, ctx=ctx,
        stride=stride, min_context=min_context, batch=batch, scales=scales, calib_tokens=calib_tokens,
        layer_stats=layer_stats, save_ref=save_ref, ref_file=ref_file, ref_store=ref_store,
        semantics=semantics, math=math, explain=explain, prefill=prefill,
        rope_scaling=rope_scaling, text_note=text_note,
    )
    # a bad --out costs nothing: checked before the model loads (the default name's folder too)
    check_output_path(out if out is not None else default_result_path("kld", "model"), force)
    if save_ref is not None:
        check_output_path(save_ref, force=True)
    # under torchrun only rank 0 draws (every rank reports the same kind of progress)
    with progress_bars(console, disable=os.environ.get("RANK", "0") != "0", on_first=print_estimate) as progress:
        result = evaluate_kld(settings, progress)
    if save_ref is not None and result.rank == 0:
        console.print(f"wrote reference log-probs to {save_ref}", soft_wrap=True)  # a path is never wrapped: users copy it
    if result.rank != 0:
        return
    if result.model.get("random"):  # never let a random-weights figure pass for a quality number
        console.print(f"[bold yellow]model: {result.model['label']}[/]")
    print_table(result.formats, result.settings["ref"], result.text["label"], Console(), attention_title(result.settings))
    for note in result.notes:
        console.print(f"[bold]note:[/] {note}")
    if result.explain is not None:
        print_explain(result.explain, Console())
    if (line := peak_memory_line(result.environment)) is not None:
        console.print(line)
    path = write_result(out or default_result_path("kld", result.model["name"]), result.to_document(), force=force)
    console.print(f"wrote {path}", soft_wrap=True)  # a path is never wrapped: users copy it
    if plot:
        write_kld_plots(result, plot)


def write_kld_plots(result, folder: Path) -> list[Path]:
    from mla_eval.report.plots import kld_plots

    paths = kld_plots({"stats": result.run.stats}, result.formats, folder)
    for p in paths:
        console.print(f"wrote {p}", soft_wrap=True)  # a path is never wrapped: users copy it
    return paths


def print_estimate(stage: str, done: int, total: int, seconds: float) -> None:
    if stage == "score" and done < total:
        whole = seconds / done * total
        console.print(f"first batch: {done / max(seconds, 1e-9):.3g} scored tokens/s (every format); scoring takes about "
                      f"{duration(whole)} in all (~{duration(whole - seconds)} left)")


# (title, cell, priority): the narrowest terminal keeps the lowest priorities; the JSON keeps them all
COLUMNS = (
    ("KLD", lambda s: f"{s['kld_mean']:.4f}", 0),
    ("±se", lambda s: f"{s['kld_se']:.4f}", 1),
    ("top1%", lambda s: f"{s['same_top1_pct']:.1f}", 2),
    ("p99", lambda s: f"{s['kld_p99']:.3f}", 3),
    ("PPLx", lambda s: f"{s['ppl_ratio']:.4f}", 4),
    ("med", lambda s: f"{s['kld_median']:.4f}", 5),
    ("RMSΔp%", lambda s: f"{s['delta_p_rms_pct']:.2f}", 6),
    ("attn", lambda s: f"{max(r['attn_rel_l2'] for r in s['layers']):.3f}", 7),
)
GLOSSARY = {
    "KLD": "mean KL(ref || format) in nats over the full vocabulary", "±se": "its standard error",
    "top1%": "same argmax as the reference", "p99": "99th percentile of the per-token KLD", "PPLx": "PPL ratio",
    "med": "median per-token KLD", "RMSΔp%": "RMS change of the target token's probability",
    "attn": "worst layer's attention-output relative L2 vs exact float32",
}


def table_columns(summary: dict, width: int) -> list[tuple]:
    """The columns that fit in `width` terminal columns, in display order (by priority first)."""
    with_layers = all("layers" in s for s in summary.values())
    cols = [c for c in COLUMNS if c[0] != "attn" or with_layers]
    used = max(len("format"), *(len(n) for n in summary)) + 4  # borders and padding of the format column
    chosen = []
    for col in sorted(cols, key=lambda c: c[2]):
        w = max(len(col[0]), *(len(col[1](s)) for s in summary.values())) + 3
        if used + w > width:
            break
        chosen.append(col)
        used += w
    return [c for c in cols if c in chosen]


def attention_title(settings: dict) -> str:
    """' — semantics cache, engine:512; math bf16, fp8-q' (documents before semantics existed: '')."""
    sems = [s["semantics"] for s in settings.get("semantics", [])]
    if not sems:
        return ""
    prefill = f"; {settings['prefill']} prefill" if "prefill" in settings else ""
    return f" — semantics {', '.join(sems)}; math {', '.join(settings.get('math', ['bf16']))}{prefill}"


def print_explain(explain: dict, con: Console) -> None:
    """The storage / compute split of one format, one line per semantics and fp8 math."""
    fmt = explain["format"]
    table = Table(title=f"Where {fmt}'s KLD comes from: storage (its cache, bf16 math) vs compute (bf16 cache, fp8 math)")
    for c in ("semantics", "math", "storage only", "compute only", "both", "both - sum"):
        table.add_column(c, justify="right" if c not in ("semantics", "math") else "left")
    for sem, row in explain["semantics"].items():
        for m, both in row["both"].items():
            table.add_row(sem, m, f"{row['storage_only']:.5f}", f"{row['compute_only'][m]:.5f}", f"{both:.5f}",
                          f"{row['interaction'][m]:+.5f}")
    con.print(table)


def print_table(summary: dict, ref: str, label: str, con: Console, attention: str = "") -> None:
    """Formats as rows (they are what the reader compares); columns that do not fit the terminal
    are named below the table, and every figure is in the result JSON."""
    cols = table_columns(summary, con.width)
    table = Table(title=f"Teacher-forced KLD vs {ref} cache — {label}{attention}")
    table.add_column("format", style="bold", no_wrap=True)
    for title, _, _ in cols:
        table.add_column(title, justify="right", no_wrap=True)
    for name, s in summary.items():
        table.add_row(name, *(fn(s) for _, fn, _ in cols))
    con.print(table)
    first = next(iter(summary.values()))
    shown = [c[0] for c in cols]
    hidden = [c[0] for c in COLUMNS if c[0] not in shown and (c[0] != "attn" or "layers" in first)]
    con.print(f"{first['tokens']} scored tokens; PPL({ref}) = {first['ppl_ref']:.3f}. "
              + "; ".join(f"{c} = {GLOSSARY[c]}" for c in shown) + ".")
    if hidden:
        con.print(
            f"Not shown at this terminal width: {', '.join(hidden)} (widen the terminal); all figures are in the result JSON."
        )
    else:
        con.print("All figures: the result JSON.")


def calibrate_cmd(
    model: str = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    text: Path = typer.Option(None, "--text", help="Calibration text file (use a different slice than you evaluate on)."),
    dataset: str = typer.Option(None, "--dataset", help="A `datasets` name to calibrate on."),
    max_tokens: int = typer.Option(None, "--max-tokens", help="Use at most this many tokens (default: all)."),
    samples: int = typer.Option(1, "--samples", help="Self-samples (no --text/--dataset): number of sequences."),
    sample_len: int = typer.Option(768, "--sample-len", help="Self-samples: tokens per sequence."),
    seed: int = typer.Option(1000, "--seed", help="Self-samples seed (differs from kld's default 0 on purpose)."),
    ctx: int = typer.Option(DEFAULT_CTX, "--ctx", help="Forward window length in tokens."),
    out: Path = typer.Option(..., "--out", "-o", help="Where to write the nvfp4_ds_mla_outer_scale_v1 JSON."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out file."),
    device: str = typer.Option("auto", "--device", help=DEVICES_HELP + "."),
    device_map: str = typer.Option("none", "--device-map", help=DEVICE_MAP_HELP),
    backend: str = typer.Option(None, "--backend", help=BACKEND_HELP),
    semantics: str = typer.Option(
        "cache", "--semantics",
        help="One attention semantics for the calibration forwards (see `mla-eval kld --help`); with the bf16 cache "
        "calibration runs, only the schedule changes.",
    ),
    math: str = typer.Option("bf16", "--math", help="One attention math (bf16, fp8-q, fp8-qp) for the calibration forwards."),
) -> None:
    """Compute per-layer outer scales s_l = max|c_kv| / (6*448) and write the published JSON schema."""
    from mla_eval.atomic_io import write_json_atomic

    settings = CalibrateSettings(
        model=model, device=device, device_map=device_map, backend=backend, text=text, dataset=dataset,
        max_tokens=max_tokens, samples=samples, sample_len=sample_len, seed=seed, ctx=ctx, semantics=semantics, math=math,
    )
    check_output_path(out, force)
    with progress_bars(console) as progress:
        result = evaluate_calibration(settings, progress)
    write_json_atomic(out, result.to_document())
    table = Table(title=f"Per-layer outer scales — {result.source_label}")
    table.add_column("layer", justify="right")
    table.add_column("max |c_kv|", justify="right")
    table.add_column("s_l", justify="right")
    for i, (a, s) in enumerate(zip(result.scales.provenance["max_abs_c_kv"], result.scales.scales)):
        table.add_row(str(i), f"{a:.4g}", f"{s:.6g}")
    Console().print(table)
    console.print(f"wrote {out}", soft_wrap=True)  # a path is never wrapped: users copy it


def register(app: typer.Typer) -> None:
    app.command("kld")(kld)
    app.command("calibrate")(calibrate_cmd)
