"""`mla-eval needle`: parse options, call the library, print the grids, write the document."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from mla_eval.commands.kld import BACKEND_HELP
from mla_eval.commands.progress import peak_memory_line, progress_bars
from mla_eval.evals.needle_evaluation import DEFAULT_FORMATS, DEFAULT_LENGTHS, NeedleSettings, evaluate_needle
from mla_eval.evals.needle_tasks import TASKS, VALUE_KINDS
from mla_eval.evals.settings import DEVICES_HELP
from mla_eval.model.loader import DEVICE_MAP_HELP, MAX_MEMORY_HELP, MODEL_HELP
from mla_eval.model.rope_scaling import ROPE_SCALING_HELP
from mla_eval.results import check_output_path, default_out_help, default_result_path, write_result

console = Console(stderr=True)


def needle(
    model: str = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    formats: str = typer.Option(
        DEFAULT_FORMATS, "--formats", "-f",
        help="Formats to compare with the bf16 baseline (always run first); +s_l uses outer scales.",
    ),
    lengths: str = typer.Option(DEFAULT_LENGTHS, "--lengths", help="Prompt lengths in tokens (4K = 4096)."),
    depths: str = typer.Option(None, "--depths", help="Needle depths in percent (default: 0..100 in --depth-steps steps)."),
    depth_steps: int = typer.Option(11, "--depth-steps", help="Number of evenly spaced depths when --depths is not given."),
    trials: int = typer.Option(1, "--trials", help="Prompts per cell, each with a different needle and seed."),
    task: str = typer.Option(
        "passkey", "--task",
        help=f"One task or a comma list, each NAME[:VALUES], NAME one of {', '.join(TASKS)} (e.g. "
        "single:word,multikey:uuid,multivalue,vt): every task runs the whole length x depth x trials grid.",
    ),
    values: str = typer.Option(
        "number", "--values",
        help=f"Needle values of tasks without ':VALUES': {', '.join(VALUE_KINDS)} (passkey and vt always use numbers).",
    ),
    needles: int = typer.Option(
        0, "--needles",
        help="Needles of the multi-needle tasks: multikey keys (1 asked + distractors, default 4), multivalue values "
        "(default 3), vt chain variables (default 5); 0: those defaults. Single-needle tasks ignore it.",
    ),
    haystack: Path = typer.Option(
        None, "--haystack", help="Text file or folder of .txt files (default: noise of repeated filler sentences)."
    ),
    scales: str = typer.Option(
        "auto", "--scales", help="Outer scales for +s_l: JSON file, 'auto' (calibrate on a separate prompt), or 'none'."
    ),
    batch: int = typer.Option(1, "--batch", help="Prompts of one length per forward."),
    prefill: str = typer.Option(
        "mha", "--prefill",
        help="How the prompt's prefill reads the quantised cache: 'mha' decodes it, up-projects through kv_b_proj and runs "
        "causal SDPA (how serving engines prefill MLA; fast), 'absorbed' runs every prompt token through the absorbed "
        "MLA attention that decode uses (our kernel on CUDA; slow at 64K). Decode steps are always absorbed.",
    ),
    full_answers: bool = typer.Option(
        False, "--full-answers",
        help="Decode every answer to its full token budget. By default a prompt stops once its output holds every "
        "expected string: the score cannot change by that (appending never removes a match); "
        "only the recorded output is shorter.",
    ),
    cuda_graphs: bool = typer.Option(
        True, "--cuda-graphs/--no-cuda-graphs",
        help="On a GPU, capture the decode step once per prompt shape as a CUDA graph and replay it for every step of "
        "every cell of that shape (a step is host-bound otherwise). The arithmetic is identical; --no-cuda-graphs runs "
        "every step eagerly (for debugging).",
    ),
    threshold: float = typer.Option(
        0.9, "--threshold", help="Accuracy that a length must keep to count toward the effective length."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the needles and haystack offsets."),
    out: Path = typer.Option(None, "--out", "-o", help=default_out_help("needle")),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out file."),
    plot: Path = typer.Option(None, "--plot", help="Folder for heatmap PNGs (one per format + difference vs bf16)."),
    device: str = typer.Option("auto", "--device", help=DEVICES_HELP + "."),
    device_map: str = typer.Option("none", "--device-map", help=DEVICE_MAP_HELP),
    max_memory: str = typer.Option(None, "--max-memory", help=MAX_MEMORY_HELP),
    backend: str = typer.Option(None, "--backend", help=BACKEND_HELP),
    semantics: str = typer.Option(
        "cache", "--semantics",
        help="How the prompt's prefill reads the cache: cache (default), engine:C (chunked prefill: earlier chunks "
        "through the cache, the own chunk fresh) or a preset (vllm, vllm-offline, sglang). Decode steps read the cache.",
    ),
    math: str = typer.Option("bf16", "--math", help="Attention math of the absorbed reads (decode steps): bf16, fp8-q, fp8-qp."),
    rope_scaling: str = typer.Option("none", "--rope-scaling", help=ROPE_SCALING_HELP),
) -> None:
    """Needle-in-a-haystack retrieval per cache format, on identical prompts of exact token length.

    A cell of length L holds L tokens: the prompt and the decoded answer. Prefill and greedy
    decoding both read the format's quantised cache (see --prefill). Reports a length x depth
    accuracy table per format, a 95 % Wilson interval per (task, length) cell, format-induced
    failures decided by an exact McNemar test against bf16 on the same prompts (Holm-corrected,
    alpha 0.05), and an effective length per format. The default grid is a GPU job (hours on a CPU).
    """
    settings = NeedleSettings(
        model=model, device=device, device_map=device_map, max_memory=max_memory, backend=backend, formats=formats,
        lengths=lengths, depths=depths, depth_steps=depth_steps, trials=trials, task=task, values=values, needles=needles,
        haystack=haystack,
        scales=scales, batch=batch, prefill=prefill, full_answers=full_answers, cuda_graphs=cuda_graphs,
        threshold=threshold, seed=seed, semantics=semantics, math=math, rope_scaling=rope_scaling,
    )
    check_output_path(out if out is not None else default_result_path("needle", "model"), force)
    with progress_bars(console) as progress:
        result = evaluate_needle(settings, progress)
    print_needle(result, Console())
    if (line := peak_memory_line(result.environment)) is not None:
        console.print(line)
    path = write_result(out or default_result_path("needle", result.model["name"]), result.to_document(), force=force)
    console.print(f"wrote {path}", soft_wrap=True)  # a path is never wrapped: users copy it
    if plot:
        write_needle_plots(result, plot)


def write_needle_plots(result, folder: Path) -> list[Path]:
    from mla_eval.report.plots import needle_document_plots

    doc = {"settings": result.settings, "formats": result.formats, "tasks": result.tasks}
    paths = needle_document_plots(doc, folder)
    for p in paths:
        console.print(f"wrote {p}", soft_wrap=True)  # a path is never wrapped: users copy it
    return paths


def print_needle(result, con: Console) -> None:
    s = result.settings
    if result.model.get("random"):  # never let a random-weights figure pass for a quality number
        con.print(f"[bold yellow]model: {result.model['label']}[/]")
    if "semantics" in s:
        con.print(f"prefill semantics {s['semantics']['semantics']}; attention math {s['math']}")
    _print(result.formats, result.format_induced_failures, s["lengths"], s["depths"], s["threshold"], con)
    if result.tasks:
        _print_cells(result, con)


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


def register(app: typer.Typer) -> None:
    app.command("needle")(needle)
