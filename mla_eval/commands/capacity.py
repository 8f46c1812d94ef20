"""`mla-eval capacity`: how many tokens each cache format fits for a model on a GPU setup."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mla_eval.capacity import (
    DEFAULT_RESERVE_GIB,
    GIB,
    REFERENCE_FORMAT,
    FormatCapacity,
    KvBudget,
    Parallelism,
    capacity_table,
    gib_to_bytes,
    kv_budget_from_memory,
    kv_budget_given,
)
from mla_eval.errors import UserError
from mla_eval.formats import parse_format_list
from mla_eval.gpu_presets import GPU_PRESETS, get_gpu, gpu_names
from mla_eval.model_presets import (
    MODEL_PRESETS,
    WEIGHT_DTYPE_BYTES,
    MlaCacheGeometry,
    WeightsInfo,
    get_preset,
    load_config,
    preset_names,
)
from mla_eval.result_schemas import CAPACITY_SCHEMA

DEFAULT_GPU = "h200"


def capacity(
    preset: str = typer.Option(
        None, "--preset", "-p", help=f"Built-in model: {', '.join(preset_names())}. See --list-presets for sources."
    ),
    config: Path = typer.Option(
        None, "--config", "-c", help="A Hugging Face config.json, or a checkpoint directory holding one "
        "(its model.safetensors.index.json then gives the weights size)."
    ),
    gpu: str = typer.Option(
        None, "--gpu", "-g", help=f"GPU preset: {', '.join(gpu_names())} (default {DEFAULT_GPU}). "
        "Uses the total memory CUDA reports, not the datasheet figure."
    ),
    gpu_mem_gib: float = typer.Option(None, "--gpu-mem-gib", help="Total memory per GPU in GiB (2^30 B); overrides --gpu."),
    tp: int = typer.Option(8, "--tp", help="Tensor-parallel size. The MLA latent is replicated on every TP rank."),
    gpus: int = typer.Option(
        None, "--gpus", help="GPUs the weights are spread over (default: --tp). Extra GPUs beyond --tp are "
        "data-parallel engines, each with its own pool (pipeline parallelism is not modelled)."
    ),
    dcp: int = typer.Option(1, "--dcp", help="Decode-context-parallel size (divides --tp): each rank stores 1/dcp of "
                            "every sequence, so the pool holds dcp x more tokens."),
    gpu_memory_utilization: float = typer.Option(
        0.9, "--gpu-memory-utilization", help="Fraction of each GPU's memory vLLM may use (vLLM's --gpu-memory-utilization)."
    ),
    block_size: int = typer.Option(64, "--block-size", help="Tokens per KV block (vLLM block_size; FlashMLA uses 64)."),
    weights_gib: float = typer.Option(
        None, "--weights-gib", help="Total weights of the whole model in GiB, split evenly over --gpus. "
        "Default: the checkpoint's safetensors index (with --config DIR) or parameters x dtype (presets)."
    ),
    weights_dtype: str = typer.Option(
        None, "--weights-dtype", help=f"Weights dtype for a preset's parameter count: {', '.join(WEIGHT_DTYPE_BYTES)} "
        "(nvfp4 = 4.5 bits incl. block scales). Default: the preset's checkpoint dtype."
    ),
    reserve_gib: float = typer.Option(
        DEFAULT_RESERVE_GIB, "--reserve-gib", help="Per-GPU GiB kept for peak activations, non-torch memory and CUDA "
        "graphs (a rough default; use the KV size vLLM logs via --kv-memory-gib for an exact match)."
    ),
    kv_memory_gib: float = typer.Option(
        None, "--kv-memory-gib", help="KV-cache memory per GPU in GiB, given directly (skips GPU, weights, reserve)."
    ),
    kv_cache_memory_bytes: int = typer.Option(
        None, "--kv-cache-memory-bytes", help="KV-cache memory per GPU in bytes, as vLLM's --kv-cache-memory-bytes."
    ),
    mtp: bool = typer.Option(
        True, "--mtp/--no-mtp", help="Count MTP/next-n layers (num_nextn_predict_layers), which have caches when "
        "MTP speculative decoding runs (default on)."
    ),
    max_model_len: int = typer.Option(
        None, "--max-model-len", help="Tokens per request for the concurrency column (default: the model's "
        "max_position_embeddings)."
    ),
    names: str = typer.Option(None, "--formats", "-f", help="Comma-separated cache formats (default: all registered)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (inputs + a row per format) instead of the table."),
    plot: Path = typer.Option(None, "--plot", help="Also write a PNG bar chart of pool tokens and concurrency to this file."),
    list_presets: bool = typer.Option(False, "--list-presets", help="List the model and GPU presets with their sources and exit."),
) -> None:
    """KV-cache capacity per cache format: bytes per token, blocks, pool tokens, max context, concurrency.

    Follows vLLM's pool arithmetic per GPU: KV budget = ceil(total x utilization) - weights/GPU -
    reserve (or --kv-memory-gib); num_blocks = budget // (block_size x bytes per token over all
    cache layers, latent + DSA indexer keys); pool tokens = num_blocks x block_size x DCP. The pool
    is that of one engine (TP group). Ratios compare pool tokens with fp8_ds_mla.
    """
    if list_presets:
        _print_presets(as_json)
        return

    if block_size < 1:
        raise UserError(f"--block-size must be >= 1, got {block_size}")
    if max_model_len is not None and max_model_len < 1:
        raise UserError(f"--max-model-len must be >= 1, got {max_model_len}")
    geometry, weights = _resolve_model(preset, config, weights_dtype)
    if weights_gib is not None:
        if weights_gib <= 0:
            raise UserError(f"--weights-gib must be positive, got {weights_gib}")
        weights = WeightsInfo(bytes=gib_to_bytes(weights_gib), source="--weights-gib")
    parallel = Parallelism(gpus=gpus if gpus is not None else tp, tp=tp, dcp=dcp)
    specs = parse_format_list(names)
    gpu_label, budget = _resolve_budget(
        gpu, gpu_mem_gib, gpu_memory_utilization, weights, parallel, reserve_gib, kv_memory_gib, kv_cache_memory_bytes,
        geometry,
    )
    rows = capacity_table(
        specs, geometry, budget, parallel, block_size=block_size, include_mtp=mtp, max_model_len=max_model_len
    )
    doc = capacity_document(geometry, weights, budget, parallel, gpu_label, block_size, mtp, max_model_len, rows)
    if plot is not None:
        write_plot(doc, rows, plot)
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        _print_table(doc, rows, plot)


def _resolve_model(preset: str | None, config: Path | None, weights_dtype: str | None) -> tuple[MlaCacheGeometry, WeightsInfo | None]:
    if preset and config:
        raise UserError("give either --preset or --config, not both")
    if preset:
        chosen = get_preset(preset)
        return chosen.geometry(), chosen.weights(weights_dtype)
    if config is None:
        raise UserError(f"give --preset NAME ({', '.join(preset_names())}) or --config PATH to a HF config.json")
    if weights_dtype is not None:
        raise UserError("--weights-dtype needs a parameter count, which only presets carry; give --weights-gib instead")
    return load_config(config)


def _resolve_budget(
    gpu: str | None,
    gpu_mem_gib: float | None,
    utilization: float,
    weights: WeightsInfo | None,
    parallel: Parallelism,
    reserve_gib: float,
    kv_memory_gib: float | None,
    kv_cache_memory_bytes: int | None,
    geometry: MlaCacheGeometry,
) -> tuple[str | None, KvBudget]:
    """The per-GPU KV budget and the GPU's label (None when the budget is given directly)."""
    if kv_memory_gib is not None and kv_cache_memory_bytes is not None:
        raise UserError("give either --kv-memory-gib or --kv-cache-memory-bytes, not both")
    if kv_cache_memory_bytes is not None:
        return None, kv_budget_given(kv_cache_memory_bytes, "--kv-cache-memory-bytes")
    if kv_memory_gib is not None:
        if kv_memory_gib <= 0:
            raise UserError(f"--kv-memory-gib must be positive, got {kv_memory_gib}")
        return None, kv_budget_given(gib_to_bytes(kv_memory_gib), "--kv-memory-gib")

    if gpu_mem_gib is not None:
        if gpu_mem_gib <= 0:
            raise UserError(f"--gpu-mem-gib must be positive, got {gpu_mem_gib}")
        total, label = gib_to_bytes(gpu_mem_gib), f"custom GPU ({gpu_mem_gib:g} GiB)"
    else:
        preset = get_gpu(gpu or DEFAULT_GPU)
        total, label = preset.memory_bytes, preset.title + ("" if preset.verified else " [unverified memory figure]")
    if weights is None:
        raise UserError(
            f"cannot tell the weights size of {geometry.name}: pass --weights-gib (whole checkpoint), "
            "point --config at a checkpoint directory with model.safetensors.index.json, or give --kv-memory-gib"
        )
    if reserve_gib < 0:
        raise UserError(f"--reserve-gib must be >= 0, got {reserve_gib}")
    budget = kv_budget_from_memory(
        total_bytes_per_gpu=total,
        gpu_memory_utilization=utilization,
        weights_bytes_total=weights.bytes,
        gpus=parallel.gpus,
        reserve_bytes_per_gpu=gib_to_bytes(reserve_gib),
    )
    return label, budget


def capacity_document(
    geometry: MlaCacheGeometry,
    weights: WeightsInfo | None,
    budget: KvBudget,
    parallel: Parallelism,
    gpu_label: str | None,
    block_size: int,
    include_mtp: bool,
    max_model_len: int | None,
    rows: list[FormatCapacity],
) -> dict:
    """The --json document: resolved inputs, one row per format, and notes."""
    indexer = geometry.indexer
    derived = budget.source == "derived"
    model = {
        "name": geometry.name,
        "source": geometry.source,
        "model_type": geometry.model_type,
        "num_hidden_layers": geometry.num_hidden_layers,
        "num_nextn_predict_layers": geometry.num_nextn_predict_layers,
        "include_mtp": include_mtp,
        "cache_layers": geometry.cache_layers(include_mtp),
        "kv_lora_rank": geometry.kv_lora_rank,
        "qk_rope_head_dim": geometry.qk_rope_head_dim,
        "max_position_embeddings": geometry.max_position_embeddings,
        "indexer": None
        if indexer is None
        else {
            "index_head_dim": indexer.head_dim,
            "bytes_per_token_per_layer": indexer.bytes_per_token,
            "indexed_layers": geometry.indexed_layers(include_mtp),
            "full_main_layers": indexer.full_main_layers,
            "shared_main_layers": indexer.shared_main_layers,
            "mtp_layers": geometry.mtp_layers(include_mtp),
            "rule": indexer.rule,
        },
    }
    setup = {
        "gpu": gpu_label,
        "gpu_memory_bytes": budget.total_bytes_per_gpu,
        "gpus": parallel.gpus,
        "tp": parallel.tp,
        "dcp": parallel.dcp,
        "data_parallel_engines": parallel.dp,
        "gpu_memory_utilization": budget.gpu_memory_utilization,
        "block_size": block_size,
        "weights_bytes_total": weights.bytes if (weights and derived) else None,
        "weights_source": weights.source if (weights and derived) else None,
        "weights_bytes_per_gpu": budget.weights_bytes_per_gpu,
        "reserve_bytes_per_gpu": budget.reserve_bytes_per_gpu,
        "requested_bytes_per_gpu": budget.requested_bytes_per_gpu,
        "kv_budget_bytes_per_gpu": budget.bytes_per_gpu,
        "kv_budget_source": budget.source,
        "max_model_len": max_model_len if max_model_len is not None else geometry.max_position_embeddings,
    }
    notes = list(geometry.notes)
    if any(r.num_blocks == 0 for r in rows):
        notes.append("a format with 0 blocks does not fit one block in the KV budget (vLLM would refuse to start)")
    short = [r.name for r in rows if r.max_concurrency is not None and 0 < r.max_concurrency < 1]
    if short:
        notes.append(
            f"{', '.join(short)}: the pool holds less than one request of {rows[0].max_model_len:,} tokens; vLLM refuses "
            "to start with that --max-model-len and names the largest that fits (about the pool size)"
        )
    return {"schema": CAPACITY_SCHEMA, "model": model, "setup": setup, "formats": [r.as_dict() for r in rows], "notes": notes}


def _print_table(doc: dict, rows: list[FormatCapacity], plot: Path | None) -> None:
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
    console.print(table)
    console.print(
        "B/tok model = latent records of every cache layer + DSA indexer keys. pool tokens = blocks x block size "
        "x DCP (vLLM's 'GPU KV cache size'). max context = one request's limit: the pool less vLLM's null block, "
        "or the model's max_position_embeddings where that is smaller (*). conc. = blocks / blocks per "
        "full-length request, as vLLM logs it."
    )
    if setup["data_parallel_engines"] > 1:
        console.print(f"{setup['data_parallel_engines']} data-parallel engines: the system holds that many such pools.")
    for note in doc["notes"]:
        console.print(f"note: {escape(note)}")
    if plot is not None:
        console.print(f"wrote {escape(str(plot))}")


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


def write_plot(doc: dict, rows: list[FormatCapacity], path: Path) -> None:
    """A PNG: pool tokens per format (left) and concurrency at max_model_len (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    setup, model = doc["setup"], doc["model"]
    names = [r.name for r in rows]
    pools = [r.pool_tokens for r in rows]
    concurrency = [r.max_concurrency or 0.0 for r in rows]
    colors = ["#c44e52" if r.name == REFERENCE_FORMAT else "#4c72b0" for r in rows]
    label_box = {"facecolor": "white", "edgecolor": "none", "pad": 0.5, "alpha": 0.85}

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.55 * len(rows) + 2.2), sharey=True)
    y = list(range(len(rows)))
    left.barh(y, pools, color=colors, zorder=2)
    left.set_yticks(y, names)
    left.invert_yaxis()
    left.set_xlabel("physical pool: tokens per engine (blocks x block size x DCP)")
    left.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _tokens_label(v)))
    top = max(pools) if pools and max(pools) > 0 else 1
    model_max = model["max_position_embeddings"]
    if model_max:
        left.axvline(model_max, color="gray", ls="--", lw=1, zorder=1)
        left.annotate(
            f"model max context {model_max:,}", (model_max, 1.0), xycoords=("data", "axes fraction"),
            xytext=(3, -10), textcoords="offset points", color="gray", fontsize=8,
        )
    for i, r in enumerate(rows):
        ratio = "" if r.ratio_vs_fp8_ds_mla is None else f"  {r.ratio_vs_fp8_ds_mla:.2f}x fp8_ds_mla"
        left.text(r.pool_tokens + top * 0.01, i, f"{r.pool_tokens:,}{ratio}", va="center", fontsize=8, bbox=label_box, zorder=3)
    left.set_xlim(0, max(top, model_max or 0) * 1.5)

    right.barh(y, concurrency, color=colors, zorder=2)
    length = setup["max_model_len"]
    right.set_xlabel(f"max concurrency at {length:,} tokens per request" if length else "max concurrency")
    right.axvline(1.0, color="gray", ls=":", lw=1, zorder=1)
    ctop = max(concurrency) if concurrency and max(concurrency) > 0 else 1
    for i, c in enumerate(concurrency):
        right.text(c + ctop * 0.01, i, f"{c:.2f}", va="center", fontsize=8, bbox=label_box, zorder=3)
    right.set_xlim(0, max(ctop, 1.0) * 1.2)

    where = (
        f"{setup['gpu']}, {setup['gpus']} GPU(s), TP {setup['tp']}, DCP {setup['dcp']}"
        if setup["kv_budget_source"] == "derived"
        else f"DCP {setup['dcp']}"
    )
    indexer = f" + indexer keys on {model['indexer']['indexed_layers']}" if model["indexer"] else ""
    fig.suptitle(
        f"{model['name']}: {model['cache_layers']} latent cache layers{indexer} | {where} | "
        f"KV {setup['kv_budget_bytes_per_gpu'] / GIB:.1f} GiB per GPU, block size {setup['block_size']}",
        fontsize=10,
    )
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise UserError(f"cannot write the plot to {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


def _tokens_label(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:g}M"
    if value >= 1e3:
        return f"{value / 1e3:g}K"
    return f"{value:g}"


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


def register(app: typer.Typer) -> None:
    app.command("capacity")(capacity)
