"""PNG plots of evaluation results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


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
    paths.append(_save(fig, folder / "kld_cdf.png"))

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
    paths.append(_save(fig, folder / "kld_by_depth.png"))

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
        paths.append(_save(fig, folder / "kld_layer_error.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.replace(path)
    _plt().close(fig)
    return path


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
