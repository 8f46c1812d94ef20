"""PNG plots of evaluation results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from mla_eval.atomic_io import write_bytes_atomic
from mla_eval.errors import UserError
from mla_eval.user_paths import check_output_target, is_special

GIB = 1 << 30
KLD_PLOT_FILES = ("kld_cdf.png", "kld_by_depth.png", "kld_layer_error.png")  # what kld --plot writes (the last with layer stats)
PNG_SOFTWARE = "mla-eval"  # PNG metadata of every plot we write: how --plot recognises a file it may replace


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def kld_plots(result: dict, summary: dict, folder: Path) -> list[Path]:
    """KLD CDF per format, mean KLD by context depth, per-layer attention-output error."""
    plt = _plt()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ts in result["stats"].items():
        k = np.sort(ts.arrays()["kld"])
        ax.plot(np.maximum(k, 1e-8), np.arange(1, k.size + 1) / k.size, label=f"{name} (mean {summary[name]['kld_mean']:.4f})")
    ax.set_xscale("log")
    ax.set_xlabel("per-token KL(ref || format), nats")
    ax.set_ylabel("fraction of tokens")
    ax.set_title("KLD CDF per cache format")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_save(fig, folder / KLD_PLOT_FILES[0]))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, s in summary.items():
        rows = s["kld_by_depth"]
        x = [(r["depth_lo"] + r["depth_hi"]) / 2 for r in rows]
        ax.errorbar(x, [r["kld_mean"] for r in rows], yerr=[r["kld_se"] or 0 for r in rows], marker="o", capsize=3, label=name)
    ax.set_xlabel("context depth of the scored token (tokens; bucket centres)")
    ax.set_ylabel("mean KLD")
    ax.set_title("KLD by context depth")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_save(fig, folder / KLD_PLOT_FILES[1]))

    if all("layers" in s for s in summary.values()):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, s in summary.items():
            rows = s["layers"]
            ax.plot([r["layer"] for r in rows], [r["attn_rel_l2"] for r in rows], marker="o", label=name)
        ax.set_xlabel("layer")
        ax.set_ylabel("attention output relative L2 error")
        ax.set_yscale("log")
        ax.set_title("Per-layer attention-output error vs exact float32")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(_save(fig, folder / KLD_PLOT_FILES[2]))
    return paths


def _save(fig, path: Path) -> Path:
    """Render to memory, then write atomically (never half a PNG); the figure is closed either way."""
    try:
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=120, metadata={"Software": PNG_SOFTWARE})
    finally:
        _plt().close(fig)
    if path.exists() and not is_our_png(path):  # a user's file of the same name is never replaced
        raise UserError(f"{path} exists and is not a plot mla-eval wrote; it was not replaced (choose another plot folder)")
    try:
        write_bytes_atomic(path, buf.getvalue())
    except OSError as exc:
        raise UserError(f"cannot write the plot {path}: {exc.strerror or exc}") from None
    from mla_eval.results import fulfil_output

    fulfil_output(path)
    return path


def is_our_png(path: Path) -> bool:
    """A PNG written by mla-eval (its tEXt Software chunk, near the start of the file)."""
    if is_special(path):  # a device or a pipe: never opened (a FIFO would wait for a writer)
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"\x89PNG") and b"Software\x00" + PNG_SOFTWARE.encode() in head


def check_plot_folder(folder: Path, names: tuple[str, ...] = (), option: str = "--plot") -> Path:
    """Before the work: can plots be written into `folder` (a folder, or a path where one can be made)?
    Of the files to be written, `names` are known now: each that exists must be a plot we wrote."""
    from mla_eval.results import check_writable_folder

    folder = Path(folder)
    check_output_target(folder, option)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{option} {folder} is a file; give a folder for the PNG plots (it is created if missing)")
    check_writable_folder(folder / "plot.png")
    for name in names:
        target = folder / name
        check_output_target(target, option)
        if target.exists() and not is_our_png(target):
            raise UserError(f"{option}: {target} exists and is not a plot mla-eval wrote; choose another folder")
    return folder


def plot_path(path: Path | str, default_name: str) -> Path:
    """Where `--plot PATH` writes: an existing folder, or a path written with a trailing slash (`plots/`: a folder,
    made if missing), gets `default_name` inside it; a path without a suffix gets `.png`; an existing file is
    replaced only if it is a plot we wrote. Checked before the work (one-line UserError)."""
    import os

    from mla_eval.results import check_writable_folder, promise_output

    as_folder = str(path).endswith(("/", os.sep))  # Path() drops the slash that says "a folder"
    path = Path(path)
    check_output_target(path, "--plot")
    if path.is_dir() or (as_folder and not path.exists()):  # a new folder is made when the plot is written
        path = path / default_name
    elif not path.suffix:
        path = path.with_suffix(".png")
    if path.suffix.lower() != ".png":
        raise UserError(f"--plot {path}: plots are PNG files; give a .png path or a folder")
    if path.is_dir():
        raise UserError(f"--plot {path} is a folder")
    check_output_target(path, "--plot")
    if path.exists() and not is_our_png(path):
        raise UserError(f"--plot {path} exists and is not a plot mla-eval wrote; choose another path")
    check_writable_folder(path)
    promise_output(path)
    return path


def kld_depth_across_windows(docs: list[dict], path: Path) -> Path:
    """One KLD-vs-depth figure from several kld documents (e.g. --ctx 16K, 32K, 64K): a colour per
    format, a line style per window length, log-scaled depth, so the error can be followed to 64K."""
    plt = _plt()
    styles = ("-", "--", ":", "-.")
    colours: dict[str, str] = {}
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, doc in enumerate(sorted(docs, key=lambda d: d["settings"]["ctx"])):
        ctx = doc["settings"]["ctx"]
        for name, s in doc["formats"].items():
            rows = s["kld_by_depth"]
            x = [(r["depth_lo"] + r["depth_hi"]) / 2 for r in rows]
            line = ax.plot(x, [r["kld_mean"] for r in rows], styles[i % len(styles)], marker="o", ms=3,
                           color=colours.get(name), label=f"{name}, ctx {ctx}")[0]
            colours.setdefault(name, line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context depth of the scored token (tokens; bucket centres)")
    ax.set_ylabel("mean KLD vs the reference, nats")
    ax.set_title("KLD by context depth, per window length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    return _save(fig, Path(path))


def needle_heatmaps(summary: dict, lengths: list[int], depths: list[float], folder: Path) -> list[Path]:
    """An accuracy heatmap per format and a difference heatmap (format - bf16) per format."""
    plt = _plt()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    base = np.asarray(summary["bf16"]["accuracy"]) if "bf16" in summary else None

    def draw(mat, title, path, cmap, vmin, vmax, label):
        fig, ax = plt.subplots(figsize=(max(5.0, 1.5 + 0.55 * len(depths)), max(3.2, 1.4 + 0.5 * len(lengths))))
        im = ax.imshow(mat, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", origin="lower")
        ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_yticks(range(len(lengths)), [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
        ax.set_xlabel("needle depth (%)")
        ax.set_ylabel("prompt length (tokens)")
        ax.set_title(title, fontsize=10)
        for i in range(mat.shape[0]):
            for j in range(mat.shape[1]):
                ax.text(j, i, f"{mat[i, j]:.1f}" if mat.shape[1] <= 12 else "", ha="center", va="center", fontsize=7)
        fig.colorbar(im, ax=ax, label=label)
        paths.append(_save(fig, path))

    for name, s in summary.items():
        acc = np.asarray(s["accuracy"], dtype=float)
        safe = name.replace("+", "_")
        draw(acc, f"{name}: retrieval accuracy", folder / f"needle_{safe}.png", "RdYlGn", 0, 1, "accuracy")
        if base is not None and name != "bf16":
            draw(acc - base, f"{name} minus bf16", folder / f"needle_{safe}_vs_bf16.png", "RdBu", -1, 1, "accuracy difference")
    return paths


def needle_document_plots(doc: dict, folder: Path) -> list[Path]:
    """Pooled heatmaps per format (and the difference to bf16) in `folder`, and one set per task in
    `folder/<task>` when the run had several tasks: the same files `needle --plot` writes."""
    lengths, depths = doc["settings"]["lengths"], doc["settings"]["depths"]
    paths = needle_heatmaps(doc["formats"], lengths, depths, folder)
    tasks = doc.get("tasks") or {}
    if len(tasks) > 1:
        for label, per_format in tasks.items():
            paths += needle_heatmaps(per_format, lengths, depths, Path(folder) / label.replace(":", "_"))
    return paths


def capacity_plot(doc: dict, path: Path) -> Path:
    """A PNG of a capacity document: pool tokens per format (left), concurrency at max_model_len (right)."""
    plt = _plt()
    from matplotlib.ticker import FuncFormatter

    from mla_eval.capacity import REFERENCE_FORMAT

    setup, model = doc["setup"], doc["model"]
    rows = doc["formats"]
    names = [r["name"] for r in rows]
    pools = [r["pool_tokens"] for r in rows]
    concurrency = [r["max_concurrency"] or 0.0 for r in rows]
    colors = ["#c44e52" if r["name"] == REFERENCE_FORMAT else "#4c72b0" for r in rows]
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
        ratio = "" if r["ratio_vs_fp8_ds_mla"] is None else f"  {r['ratio_vs_fp8_ds_mla']:.2f}x fp8_ds_mla"
        label = f"{r['pool_tokens']:,}{ratio}"
        left.text(r["pool_tokens"] + top * 0.01, i, label, va="center", fontsize=8, bbox=label_box, zorder=3)
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
    return _save(fig, Path(path))


def _tokens_label(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:g}M"
    if value >= 1e3:
        return f"{value / 1e3:g}K"
    return f"{value:g}"
