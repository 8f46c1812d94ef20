"""`mla-eval needle`: long-context retrieval per cache format (length x depth grid)."""

from __future__ import annotations

from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from mla_eval.commands.kld import parse_variants
from mla_eval.errors import UserError
from mla_eval.evals import needle as nd
from mla_eval.evals.calibrate import calibrate as run_calibration
from mla_eval.evals.needle_tasks import TASKS, VALUE_KINDS, PromptBuilder, load_haystack
from mla_eval.evals.text_sources import TokenSource
from mla_eval.formats import OuterScales
from mla_eval.model.loader import DEVICE_MAP_HELP
from mla_eval.model.session import PREFILL_MODES
from mla_eval.result_schemas import NEEDLE_SCHEMA
from mla_eval.results import default_result_path, environment, write_result
console = Console(stderr=True)


def parse_lengths(text: str) -> list[int]:
    out = []
    for tok in (t.strip().upper() for t in text.split(",") if t.strip()):
        try:
            out.append(int(float(tok[:-1]) * 1024) if tok.endswith("K") else int(tok))
        except ValueError:
            raise UserError(f"--lengths: {tok!r} is not a length (use e.g. 4K,8K or 4096)") from None
    if not out or min(out) <= 0:
        raise UserError("--lengths needs positive lengths, e.g. 4K,8K,16K,32K,64K")
    return sorted(set(out))


def parse_depths(text: str | None, steps: int) -> list[float]:
    if text is None:
        return [round(100 * i / (steps - 1), 4) for i in range(steps)] if steps > 1 else [50.0]
    try:
        vals = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UserError(f"--depths {text!r}: give percentages such as 0,25,50,75,100") from None
    bad = [v for v in vals if not 0 <= v <= 100]
    if bad or not vals:
        raise UserError(f"--depths must lie in 0..100 (percent of the haystack), got {bad or text}")
    return sorted(set(vals))


def needle(
    model: Path = typer.Option(None, "--model", "-m", help="Local Hugging Face MLA checkpoint folder (default: the embedded model)."),
    formats: str = typer.Option("fp8_ds_mla,nvfp4,nvfp4+s_l,nvfp4_fp8rope,mxfp4", "--formats", "-f", help="Formats to compare with the bf16 baseline (always run first); +s_l uses outer scales."),
    lengths: str = typer.Option("4K,8K,16K,32K,64K", "--lengths", help="Prompt lengths in tokens (4K = 4096)."),
    depths: str = typer.Option(None, "--depths", help="Needle depths in percent (default: 0..100 in --depth-steps steps)."),
    depth_steps: int = typer.Option(11, "--depth-steps", help="Number of evenly spaced depths when --depths is not given."),
    trials: int = typer.Option(1, "--trials", help="Prompts per cell, each with a different needle and seed."),
    task: str = typer.Option("passkey", "--task", help=f"One of {', '.join(TASKS)}."),
    values: str = typer.Option("number", "--values", help=f"Needle values: {', '.join(VALUE_KINDS)} (passkey always uses numbers)."),
    haystack: Path = typer.Option(None, "--haystack", help="Text file or folder of .txt files (default: noise of repeated filler sentences)."),
    scales: str = typer.Option("auto", "--scales", help="Outer scales for +s_l: JSON file, 'auto' (calibrate on a separate prompt), or 'none'."),
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
        "expected string: the score cannot change by that (appending never removes a match); only the recorded output is shorter.",
    ),
    cuda_graphs: bool = typer.Option(
        True, "--cuda-graphs/--no-cuda-graphs",
        help="On a GPU, capture the decode step once per prompt shape as a CUDA graph and replay it for every step of "
        "every cell of that shape (a step is host-bound otherwise). The arithmetic is identical; --no-cuda-graphs runs "
        "every step eagerly (for debugging).",
    ),
    threshold: float = typer.Option(0.9, "--threshold", help="Accuracy that a length must keep to count toward the effective length."),
    seed: int = typer.Option(0, "--seed", help="Seed of the needles and haystack offsets."),
    out: Path = typer.Option(None, "--out", "-o", help="Result JSON (default results/needle-<model>-<time>.json)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out file."),
    plot: Path = typer.Option(None, "--plot", help="Folder for heatmap PNGs (one per format + difference vs bf16)."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda, cuda:N or auto."),
    device_map: str = typer.Option("none", "--device-map", help=DEVICE_MAP_HELP),
) -> None:
    """Needle-in-a-haystack retrieval per cache format, on identical prompts of exact token length.

    A cell of length L holds L tokens: the prompt and the decoded answer. Prefill and greedy
    decoding both read the format's quantised cache (see --prefill). Reports a length x depth
    accuracy table per format, the failures the format causes (bf16 right, format wrong) first,
    and an effective length per format.
    """
    from mla_eval.model.loader import load_model

    if task not in TASKS:
        raise UserError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if values not in VALUE_KINDS:
        raise UserError(f"--values {values!r}: choose one of {', '.join(VALUE_KINDS)}")
    if prefill not in PREFILL_MODES:
        raise UserError(f"--prefill {prefill!r}: choose one of {', '.join(PREFILL_MODES)}")
    if trials < 1 or batch < 1:
        raise UserError("--trials and --batch must be at least 1")
    if out is not None and out.exists() and not force:
        raise UserError(f"{out} exists; choose another --out or pass --force to replace it")
    lens = parse_lengths(lengths)
    deps = parse_depths(depths, depth_steps)
    variants = [v for v in parse_variants("bf16," + formats)]
    lm = load_model(model, device, device_map=device_map)
    max_new = nd.new_tokens_for(values, task)
    if lm.max_positions and max(lens) > lm.max_positions:
        raise UserError(
            f"--lengths {max(lens)} exceeds the model's {lm.max_positions} positions; "
            "use shorter lengths (context extension such as YaRN must be set in the checkpoint's config)"
        )
    hay_ids, noise, hay_label = load_haystack(lm.tokenizer, haystack)
    builder = PromptBuilder(lm.tokenizer, hay_ids, noise)
    st = nd.NeedleSettings(
        variants, lens, deps, trials, task, values, seed=seed, batch=batch, prefill=prefill, stop_at_answer=not full_answers, cuda_graphs=cuda_graphs
    )
    if min(lens) <= max_new + 16:
        raise UserError(f"--lengths {min(lens)} is too short: a cell holds the prompt and {max_new} answer tokens")
    builder.build(task, values, max(lens) - max_new, deps[-1], 0, seed)  # fails early if the haystack is too short

    outer = None
    if any(v.outer for v in variants):
        if scales == "none":
            raise UserError("--scales none, but +s_l formats were asked for; drop them or give --scales FILE")
        if scales == "auto":
            calib = builder.build(task, values, min(lens), 50.0, 0, seed + 99_991)
            outer = run_calibration(lm, TokenSource("needle", "a separate needle prompt", [torch.tensor(calib.ids)], "calib"), min(lens))
        else:
            outer = OuterScales.load(scales)
            outer.check_layers(lm.num_layers, source=scales)
    st.outer_scales = outer

    console.print(f"[bold]mla-eval needle[/] model={lm.name} device={lm.device} task={task} values={values} haystack={hay_label}")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(), console=console) as bar:
        t = bar.add_task("prompts", total=len(lens) * len(deps) * trials * len(variants))
        result = nd.run_needle(lm, builder, st, progress=lambda d, n: bar.update(t, completed=d))

    records = result["records"]
    summary = {}
    for v in variants:
        acc = nd.grid(records, v.name, lens, deps)
        summary[v.name] = {
            "accuracy": acc,
            "mean_accuracy": sum(map(sum, acc)) / (len(lens) * len(deps)),
            "effective_length": nd.effective_length(acc, lens, threshold),
            "seconds": result["seconds"][v.name],
            "decode_steps": result["decode_steps"][v.name],
        }
    failures = nd.format_failures(records, "bf16")
    _print(summary, failures, lens, deps, threshold)
    doc = {
        "schema": NEEDLE_SCHEMA,
        "model": {"name": lm.name, "path": str(lm.path), "default": lm.is_default, "max_positions": lm.max_positions},
        "settings": {"task": task, "values": values, "haystack": hay_label, "lengths": lens, "depths": deps, "trials": trials, "seed": seed, "threshold": threshold, "prefill": prefill, "max_new_tokens": result["max_new_tokens"], "stop_at_answer": not full_answers, "cuda_graphs": cuda_graphs},
        "outer_scales": None if outer is None else outer.to_json(),
        "environment": environment(),
        "formats": summary,
        "format_induced_failures": failures,
        "records": records,
        "total_seconds": result["total_seconds"],
    }
    path = write_result(out or default_result_path("needle", lm.name), doc, force=force)
    console.print(f"wrote {path}")
    if plot:
        from mla_eval.report.plots import needle_heatmaps

        for p in needle_heatmaps(summary, lens, deps, plot):
            console.print(f"wrote {p}")


def _print(summary: dict, failures: list[dict], lens: list[int], deps: list[float], threshold: float) -> None:
    con = Console()
    if failures:
        t = Table(title=f"Format-induced failures ({len(failures)}): bf16 retrieves, the format does not", title_style="bold red")
        for c in ("format", "length", "depth %", "trial", "expected", "output"):
            t.add_column(c)
        for r in failures[:30]:
            t.add_row(r["format"], str(r["length"]), f"{r['depth']:g}", str(r["trial"]), ", ".join(r["expected"]), repr(r["output"][:40]))
        con.print(t)
    else:
        con.print("[green]No format-induced failures: every format retrieves wherever bf16 does.[/]")
    for name, s in summary.items():
        t = Table(title=f"{name}: accuracy by length (rows) x depth % (columns); effective length {s['effective_length'] or '-'} (>= {threshold:g})")
        t.add_column("length", justify="right", style="bold")
        for d in deps:
            t.add_column(f"{d:g}", justify="right")
        for length, row in zip(lens, s["accuracy"]):
            t.add_row(str(length), *(f"[{'green' if a >= threshold else 'red'}]{a:.2f}[/]" for a in row))
        con.print(t)


def register(app: typer.Typer) -> None:
    app.command("needle")(needle)
