"""`mla-eval needle`: the options are NeedleSettings' (mla_eval.commands.evaluation builds them); the
generic body runs it and writes the document; this module prints the grids and draws the heatmaps."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mla_eval.commands.evaluation import EvaluationCommand, force_option, out_option, write_document
from mla_eval.formats.spec import CONTROL_PREFIX
from mla_eval.protocol import option

console = Console(stderr=True)


@dataclasses.dataclass(frozen=True)
class NeedleOptions:
    """The options only the command has (the rest are NeedleSettings')."""

    out: Path | None = out_option("needle")
    force: bool = force_option()
    plot: Path | None = option(
        None, "--plot", path="write", help="Folder for heatmap PNGs (one per format + difference vs bf16)."
    )


def write_needle_plots(result, folder: Path) -> list[Path]:
    from mla_eval.report.plots import needle_document_plots

    doc = {"settings": result.settings, "formats": result.formats, "tasks": result.tasks}
    return needle_document_plots(doc, folder)  # the caller says where they went


def print_needle(result, con: Console) -> None:
    s = result.settings
    if result.model.get("random"):  # never let a random-weights figure pass for a quality number
        con.print(f"[bold yellow]model: {result.model['label']}[/]")
    if "semantics" in s:
        con.print(f"prefill semantics {s['semantics']['semantics']}; attention math {s['math']}")
    _print(result.formats, result.format_induced_failures, s["lengths"], s["depths"], s["threshold"], con)
    if result.tasks:
        _print_cells(result, con)
    if result.power is not None:
        _print_power(result.power, con)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}"


def _print_power(power: dict, con: Console) -> None:
    """What the grid can detect (mla_eval.evals.needle_power): analytic per cell, and the control rungs flagged."""
    t = Table(title=f"Power: smallest accuracy drop (points) detected with {power['method']['power']:.0%} probability; "
              f"prompts needed for a {100 * power['drop']:.0f}-point drop (alpha {power['alpha']} over "
              f"{power['tests']} tests; recovery rate {power['recovery_rate']:.2f})")
    for c in ("task", "length", "n", "bf16 acc", "detectable drop", f"n for {100 * power['drop']:.0f} pts",
              "controls flagged", "smallest flagged drop"):
        t.add_column(c, justify="left" if c in ("task", "controls flagged") else "right")
    for c in power["cells"]:
        flagged = [f["format"].removeprefix(CONTROL_PREFIX) for f in c["controls"] if f["detected"]]
        t.add_row(c["task"], str(c["length"]), str(c["n"]), f"{c['bf16_accuracy']:.2f}", _pct(c["detectable_drop"]),
                  str(c["prompts_for_drop"] or "-"),
                  f"{len(flagged)}/{len(c['controls'])} " + ", ".join(flagged) if c["controls"] else "-",
                  _pct(c["smallest_detected_drop"]))
    con.print(t)
    if any(c["controls"] for c in power["cells"]):
        con.print("Control formats are deliberately damaging yardsticks, not real formats (mla-eval formats).")
    else:  # the detectable drops are analytic; which real damage the grid flags needs the control rows
        con.print("No control format ran: the detectable drops above are computed from the prompts; add "
                  "--formats ...,control:* to see which deliberate damage this grid flags.")


def _print_cells(result, con: Console) -> None:
    """Accuracy with its 95 % Wilson interval per task x length x format, and the paired verdicts."""
    lens = result.settings["lengths"]
    for label, per_format in result.tasks.items():
        t = Table(title=f"{label}: accuracy [95 % Wilson interval], {result.settings.get('samples_per_cell')} samples per cell")
        t.add_column("format", style="bold")
        for length in lens:
            t.add_column(str(length), justify="right")
        for name, s in per_format.items():
            t.add_row(name, *(
                "-" if c["n"] == 0 else f"{c['accuracy']:.2f} [{c['wilson_lo']:.2f},{c['wilson_hi']:.2f}]" for c in s["cells"]
            ))
        con.print(t)
    sig = [r for r in result.paired_tests if r["format_induced_failure"]]
    alpha = result.statistics.get("alpha")
    if not sig:
        con.print(f"[green]No significant format-induced failure (exact McNemar vs bf16, Holm, alpha {alpha}) "
                  f"over {len(result.paired_tests)} tests.[/]")
        return
    t = Table(title=f"Format-induced failures (exact McNemar vs bf16, Holm over {len(result.paired_tests)} tests, "
              f"alpha {alpha})", title_style="bold red")
    for c in ("task", "length", "format", "bf16 only", "format only", "n", "p"):
        t.add_column(c)
    for r in sig:
        t.add_row(r["task"], str(r["length"]), r["format"], str(r["base_only"]), str(r["format_only"]), str(r["n"]),
                  f"{r['p_value']:.2g}")
    con.print(t)


def _print(summary: dict, failures: list[dict], lens: list[int], deps: list[float], threshold: float, con: Console) -> None:
    if failures:
        t = Table(title=f"Prompts bf16 retrieves and the format does not ({len(failures)}; one is not a significant failure)",
                  title_style="yellow")
        for c in ("format", "length", "depth %", "trial", "expected", "output"):
            t.add_column(c)
        for r in failures[:30]:
            t.add_row(
                r["format"], str(r["length"]), f"{r['depth']:g}", str(r["trial"]), ", ".join(r["expected"]),
                repr(r["output"][:40]),
            )
        con.print(t)
    else:
        con.print("[green]Every format retrieves wherever bf16 does.[/]")
    for name, s in summary.items():
        t = Table(
            title=f"{name}: accuracy by length (rows) x depth % (columns); "
            f"effective length {s['effective_length'] or '-'} (>= {threshold:g})"
        )
        t.add_column("length", justify="right", style="bold")
        for d in deps:
            t.add_column(f"{d:g}", justify="right")
        for length, row in zip(lens, s["accuracy"]):
            t.add_row(str(length), *(f"[{'green' if a >= threshold else 'red'}]{a:.2f}[/]" for a in row))
        con.print(t)


def show_needle(result) -> None:
    print_needle(result, Console())


COMMAND = EvaluationCommand(
    options=NeedleOptions,
    body=write_document,
    details="A cell of length L holds L tokens: the prompt and the decoded answer. Prefill and greedy\n"
    "decoding both read the format's quantised cache (see --prefill). Reports a length x depth\n"
    "accuracy table per format, a 95 % Wilson interval per (task, length) cell, format-induced\n"
    "failures decided by an exact McNemar test against bf16 on the same prompts (Holm-corrected,\n"
    "alpha 0.05), and an effective length per format. The default grid is a GPU job (hours on a CPU).",
    show=show_needle,
    plots=write_needle_plots,
    order=(
        "model", "formats", "lengths", "depths", "depth_steps", "trials", "task", "values", "needles", "haystack", "scales",
        "batch", "prefill", "full_answers", "cuda_graphs", "threshold", "seed", "power", "power_drop", "out", "force",
        "plot", "device",
        "device_map", "max_memory", "backend", "semantics", "math", "rope_scaling",
    ),
)
