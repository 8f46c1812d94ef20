"""`mla-eval kld`: the options are KldSettings' (mla_eval.commands.evaluation builds them) and
--out / --force / --plot; the shared body runs it and writes the document; this module prints the table."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mla_eval.commands.evaluation import EvaluationCommand, force_option, out_option, write_document
from mla_eval.commands.progress import duration, progress_bars
from mla_eval.evals.kld_evaluation import KldSettings
from mla_eval.formats.spec import CONTROL_PREFIX
from mla_eval.protocol import option
from mla_eval.report.plots import KLD_PLOT_FILES

console = Console(stderr=True)


@dataclasses.dataclass(frozen=True)
class KldOptions:
    """The options only the command has (the rest are KldSettings')."""

    out: Path | None = out_option("kld")
    force: bool = force_option()
    plot: Path | None = option(
        None, "--plot", path="write", help="Folder for PNG plots: KLD CDF, KLD by depth, per-layer error."
    )
    dry_run: bool = option(
        False, "--dry-run",
        help="Print the run plan and stop: weight bytes by stored dtype, resident or streamed (--offload), memory, and "
        "with the shards present (or random values of their shapes) one layer of each build timed on the device for "
        "a projection. Needs only config.json, the safetensors index and the tokenizer of a --model folder.",
    )


def kld_body(ev, settings: KldSettings, opts: KldOptions) -> None:
    """--dry-run: the plan alone; otherwise the document (mla_eval.commands.evaluation.write_document)."""
    if not opts.dry_run:
        write_document(ev, settings, opts)
        return
    from mla_eval.evals.kld_evaluation import plan_kld_run

    with progress_bars(console) as progress:
        planned = plan_kld_run(settings, progress)
    out = Console()
    for line in planned.lines():
        out.print(line, soft_wrap=True)
    if planned.plan.cost is None:
        out.print("time: not measured", soft_wrap=True)


def say_reference_written(settings: KldSettings, result) -> None:
    if settings.save_ref is not None:
        console.print(f"wrote reference log-probs to {settings.save_ref}", soft_wrap=True)  # a path is never wrapped


def show_kld(result) -> None:
    """The table of every format's figures, the notes and the --explain breakdown."""
    if result.model.get("random"):  # never let a random-weights figure pass for a quality number
        console.print(f"[bold yellow]model: {result.model['label']}[/]")
    profile = result.model.get("latent_profile")  # a setting that changes every figure: in the title with the others
    title = attention_title(result.settings) + (f"; latent profile {profile['name']}" if profile else "")
    print_table(result.formats, result.settings["ref"], result.text["label"], Console(), title)
    for note in result.notes:
        console.print(f"[bold]note:[/] {note}")
    if result.explain is not None:
        print_explain(result.explain, Console())


def write_kld_plots(result, folder: Path) -> list[Path]:
    from mla_eval.report.plots import kld_plots

    return kld_plots({"stats": result.run.stats}, result.formats, folder)  # the caller says where they went


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
    ("topk%", lambda s: f"{100 * min(r['topk_overlap'] for r in s['layers'] if 'topk_overlap' in r):.1f}", 3.5),
    ("revKL", lambda s: f"{s['kld_reverse_mean']:.4f}", 8),
)
GLOSSARY = {
    "KLD": "mean KL(ref || format) in nats over the full vocabulary", "±se": "its standard error",
    "top1%": "same argmax as the reference", "p99": "99th percentile of the per-token KLD", "PPLx": "PPL ratio",
    "med": "median per-token KLD", "RMSΔp%": "RMS change of the target token's probability",
    "attn": "worst layer's attention-output relative L2 vs exact float32",
    "topk%": "DSA: the worst layer's share of the reference run's top-k positions that this format's run also chose",
    "revKL": "mean KL(format || ref), the other direction",
}


def available_columns(summary: dict) -> list[tuple]:
    """The columns these rows have figures for: attn with layer stats, topk% on a DSA model's layer stats."""
    with_layers = all("layers" in s for s in summary.values())
    with_topk = with_layers and all(any("topk_overlap" in r for r in s["layers"]) for s in summary.values())
    with_reverse = all("kld_reverse_mean" in s for s in summary.values())
    return [c for c in COLUMNS if (c[0] != "attn" or with_layers) and (c[0] != "topk%" or with_topk)
            and (c[0] != "revKL" or with_reverse)]


def table_columns(summary: dict, width: int) -> list[tuple]:
    """The columns that fit in `width` terminal columns, in display order (by priority first)."""
    cols = available_columns(summary)
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
    """Formats as rows (they are what the reader compares), ranked by KLD (the ranking figure: lowest first);
    columns that do not fit the terminal are named below the table, and every figure is in the result JSON."""
    cols = table_columns(summary, con.width)
    table = Table(title=f"Teacher-forced KLD vs {ref} cache — {label}{attention}")
    table.add_column("format", style="bold", no_wrap=True)
    for title, _, _ in cols:
        table.add_column(title, justify="right", no_wrap=True)
    for name, s in sorted(summary.items(), key=lambda kv: kv[1]["kld_mean"]):  # stable: ties keep --formats order
        table.add_row(name, *(fn(s) for _, fn, _ in cols))
    con.print(table)
    first = next(iter(summary.values()))
    shown = [c[0] for c in cols]
    hidden = [c[0] for c in available_columns(summary) if c[0] not in shown]
    con.print(f"{first['tokens']} scored tokens; PPL({ref}) = {first['ppl_ref']:.3f}; rows ranked by KLD. "
              + "; ".join(f"{c} = {GLOSSARY[c]}" for c in shown) + ".")
    if hidden:
        con.print(
            f"Not shown at this terminal width: {', '.join(hidden)} (widen the terminal); all figures are in the result JSON."
        )
    else:
        con.print("All figures: the result JSON.")
    if any(name.startswith(CONTROL_PREFIX) for name in summary):
        con.print("control:* rows are deliberately damaging yardsticks, not real formats (mla-eval formats).")


COMMAND = EvaluationCommand(
    options=KldOptions,
    body=kld_body,
    details="Sliding windows (--ctx, --stride); a token is scored once, with at least --min-context tokens\n"
    "before it; every layer writes its latent through the format's cache writer and reads attention\n"
    "from the quantised cache. Prints a side-by-side table and writes a versioned JSON.",
    show=show_kld,
    after_run=say_reference_written,
    plots=write_kld_plots,
    plot_files=KLD_PLOT_FILES,
    on_first=print_estimate,
    order=(
        "model", "formats", "ref", "text", "dataset", "max_tokens", "samples", "sample_len", "ctx", "stride", "min_context",
        "batch", "scales", "calib_tokens", "layer_stats", "out", "force", "save_ref", "ref_file", "ref_store", "plot",
        "dry_run", "offload", "device", "device_map", "max_memory", "backend", "seed", "semantics", "math", "explain",
        "prefill", "rope_scaling",
        "text_note",
    ),
)
