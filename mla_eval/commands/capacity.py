"""`mla-eval capacity`: how many tokens each cache format fits for a model on a GPU setup.

The options are `mla_eval.capacity.CapacitySettings`' (mla_eval.commands.evaluation builds them) and
--json / --plot / --list-presets; the command calls `evaluate_capacity` and prints.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from mla_eval.capacity import GIB, REFERENCE_FORMAT, CapacityResult, CapacitySettings
from mla_eval.commands.evaluation import EvaluationCommand
from mla_eval.gpu_presets import GPU_PRESETS
from mla_eval.model_presets import MODEL_PRESETS
from mla_eval.protocol import Evaluation, no_progress, option
from mla_eval.report.plots import capacity_plot, plot_path


@dataclasses.dataclass(frozen=True)
class CapacityOptions:
    """The options only the command has (the rest are CapacitySettings')."""

    as_json: bool = option(
        False, "--json", help="Print one JSON document (inputs + a row per format) instead of the table."
    )
    plot: str | None = option(  # str, not Path: a trailing slash ("plots/": a folder, made if missing) must survive
        None, "--plot", path="write",
        help="Also write a PNG bar chart of pool tokens and concurrency: a .png file, or a folder (an existing one, or "
        "one written with a trailing slash: gets capacity.png).",
    )
    list_presets: bool = option(
        False, "--list-presets", help="List the model and GPU presets with their sources and exit."
    )


def run_capacity(ev: Evaluation, settings: CapacitySettings, opts: CapacityOptions) -> None:
    if opts.list_presets:
        _print_presets(opts.as_json)
        return
    plot = plot_path(opts.plot, "capacity.png") if opts.plot is not None else None  # a bad path fails before the work
    result = ev.run(settings, no_progress)
    doc = result.to_document()
    if plot is not None:
        capacity_plot(doc, plot)
    if opts.as_json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        _print_table(result, doc, plot)


def _print_table(result: CapacityResult, doc: dict, plot: Path | None) -> None:
    rows = result.rows
    console = Console()
    model, setup = doc["model"], doc["setup"]
    console.print(f"[bold]{escape(model['name'])}[/bold] ({escape(model['model_type'])})")
    for line in _layers_lines(model) + _setup_lines(setup):
        console.print(f"  {escape(line)}")
    length = setup["max_model_len"]
    table = Table(
        title=f"KV-cache capacity per format (one engine; ratio vs {REFERENCE_FORMAT})",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 0),
    )
    table.add_column("format", style="bold", no_wrap=True)
    table.add_column("B/tok\nlayer", justify="right")
    table.add_column("B/tok\nmodel", justify="right")
    table.add_column("blocks", justify="right")
    table.add_column("pool\ntokens", justify="right")
    table.add_column("max\ncontext", justify="right")
    table.add_column(f"conc. @\n{length:,}" if length else "conc.", justify="right")
    table.add_column("x fp8\nds_mla", justify="right")
    for r in rows:
        table.add_row(
            escape(r.name),
            str(r.bytes_per_token_per_layer),
            f"{r.bytes_per_token:,}",
            f"{r.num_blocks:,}",
            f"{r.pool_tokens:,}",
            f"{r.max_context:,}" + ("*" if r.max_context_limited_by == "model" else ""),
            "-" if r.max_concurrency is None else f"{r.max_concurrency:.2f}",
            "-" if r.ratio_vs_fp8_ds_mla is None else f"{r.ratio_vs_fp8_ds_mla:.2f}",
        )
    # never cut a number: a table wider than the terminal is printed at its own width (the terminal wraps)
    needed = Measurement.get(console, console.options.update_width(1 << 16), table).maximum
    wide = console if needed <= console.width else Console(width=needed)
    wide.print(table)
    console.print(
        "B/tok model = latent records of every cache layer + DSA indexer keys. pool tokens = blocks x block size "
        "x DCP (vLLM's 'GPU KV cache size'). max context = one request's limit: the pool less vLLM's null block, "
        "or the model's max_position_embeddings where that is smaller (*). conc. = blocks / blocks per "
        "full-length request, as vLLM logs it."
    )
    if any(r.entries for r in rows):
        _print_v4_entries(console, rows)
    if setup["data_parallel_engines"] > 1:
        console.print(f"{setup['data_parallel_engines']} data-parallel engines: the system holds that many such pools.")
    for note in doc["notes"]:
        console.print(f"note: {escape(note)}")
    if plot is not None:
        console.print(f"wrote {escape(str(plot))}", soft_wrap=True)  # a path is never wrapped: users copy it


def _print_v4_entries(console: Console, rows) -> None:
    """DeepSeek-V4: the bytes of each kind of entry (per token over the layers of that kind; the window per request)."""
    table = Table(title="DeepSeek-V4 entries: record bytes, bytes per token over the layers of each kind, window per "
                  "request", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0))
    table.add_column("format", style="bold", no_wrap=True)
    for head in ("window\nrecord", "compr.\nrecord", "CSA\nB/tok", "HCA\nB/tok", "indexer\nB/tok", "window\nMiB/req"):
        table.add_column(head, justify="right")
    for r in rows:
        e = r.entries
        per, rec = e["bytes_per_token"], e["record_bytes"]
        table.add_row(escape(r.name), str(rec["sliding"]), str(rec["compressed"]), f"{per['compressed_csa']:,.2f}",
                      f"{per['compressed_hca']:,.2f}", f"{per['indexer']:,.2f}",
                      f"{e['sliding_bytes_per_request'] / 2**20:,.2f}")
    needed = Measurement.get(console, console.options.update_width(1 << 16), table).maximum
    (console if needed <= console.width else Console(width=needed)).print(table)


def _layers_lines(model: dict) -> list[str]:
    if model["include_mtp"]:
        latent = f"{model['num_hidden_layers']} layers + {model['num_nextn_predict_layers']} MTP = {model['cache_layers']}"
    else:
        latent = f"{model['num_hidden_layers']} layers (MTP excluded: --no-mtp)"
    idx = model["indexer"]
    if idx is None:
        return [f"latent caches: {latent}; no DSA indexer"]
    shared = f", {idx['shared_main_layers']} shared" if idx["shared_main_layers"] else ""
    return [
        f"latent caches: {latent}",
        f"indexer keys: {idx['bytes_per_token_per_layer']} B x {idx['indexed_layers']} layers "
        f"({idx['full_main_layers']} full{shared}, {idx['mtp_layers']} MTP; {idx['rule']})",
    ]


def _setup_lines(setup: dict) -> list[str]:
    parallel = f"{setup['gpus']} GPU(s), TP {setup['tp']}, DCP {setup['dcp']}, block size {setup['block_size']}"
    kv = setup["kv_budget_bytes_per_gpu"] / GIB
    if setup["kv_budget_source"] != "derived":
        return [f"setup: {parallel}", f"KV budget: {kv:.2f} GiB per GPU ({setup['kv_budget_source']})"]
    total = setup["gpu_memory_bytes"] / GIB
    return [
        f"setup: {setup['gpu']} ({total:.2f} GiB), {parallel}",
        f"weights: {setup['weights_bytes_per_gpu'] / GIB:.2f} GiB per GPU ({setup['weights_source']})",
        f"KV budget: {kv:.2f} GiB per GPU = {total:.2f} x {setup['gpu_memory_utilization']} - weights - "
        f"{setup['reserve_bytes_per_gpu'] / GIB:.2f} reserve",
    ]


def _print_presets(as_json: bool) -> None:
    models = [
        {
            "name": p.name,
            "title": p.title,
            "hf_repo": p.hf_repo,
            "config": p.config,
            "param_count": p.param_count,
            "weights_dtype": p.weights_dtype,
            "sources": [{"what": what, "where": where} for what, where in p.sources],
        }
        for p in MODEL_PRESETS
    ]
    gpus = [
        {
            "name": g.name,
            "title": g.title,
            "memory_bytes": g.memory_bytes,
            "memory_gib": round(g.memory_gib, 3),
            "datasheet": g.datasheet,
            "verified": g.verified,
            "source": g.source,
        }
        for g in GPU_PRESETS
    ]
    if as_json:
        typer.echo(json.dumps({"models": models, "gpus": gpus}, indent=2))
        return
    console = Console()
    console.print("[bold]Model presets[/bold] (--preset NAME)")
    for m in models:
        console.print(
            f"[bold]{escape(m['name'])}[/bold]  {escape(m['title'])}  (hf: {escape(m['hf_repo'])}, "
            f"weights {m['param_count'] / 1e9:.0f}B x {escape(m['weights_dtype'])})"
        )
        for src in m["sources"]:
            console.print(f"  - {escape(src['what'])}\n    from: {escape(src['where'])}")
    console.print()
    console.print("[bold]GPU presets[/bold] (--gpu NAME; memory = the per-GPU total CUDA reports)")
    for g in gpus:
        flag = "" if g["verified"] else "  [UNVERIFIED]"
        console.print(
            f"[bold]{escape(g['name'])}[/bold]  {escape(g['title'])}: {g['memory_gib']:.2f} GiB "
            f"({g['memory_bytes']:,} B; datasheet {escape(g['datasheet'])}){escape(flag)}"
        )
        console.print(f"    from: {escape(g['source'])}")


COMMAND = EvaluationCommand(
    options=CapacityOptions,
    body=run_capacity,
    details="Follows vLLM's pool arithmetic per GPU: KV budget = ceil(total x utilization) - weights/GPU -\n"
    "reserve (or --kv-memory-gib); num_blocks = budget // (block_size x bytes per token over all\n"
    "cache layers, latent + DSA indexer keys); pool tokens = num_blocks x block_size x DCP. The pool\n"
    "is that of one engine (TP group). Ratios compare pool tokens with fp8_ds_mla. Without --preset\n"
    "or --config it shows the default preset.",
)
