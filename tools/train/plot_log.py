"""Plots a training log: `python -m tools.train.plot_log DIR`.

Reads DIR/train_log.jsonl (one JSON line per optimizer step, written by the trainer) and writes
DIR/loss_curve.png: the 2K-window LM loss with the held-out loss at each phase end (top), and the
answer exact-match rate of the needle micro-batches by document length (bottom).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

NEEDLE_LENGTHS = ((2048, "C0"), (4096, "C5"), (8192, "C1"), (16384, "C2"), (32768, "C4"), (65536, "C3"))


def smooth(x, k: int = 25) -> np.ndarray:
    """Trailing k-point mean (NaN for the first k - 1 points)."""
    x = np.asarray(x, float)
    if len(x) < k:
        return x
    return np.concatenate([np.full(k - 1, np.nan), np.convolve(x, np.ones(k) / k, mode="valid")])


def _runs(rows: list[dict], key: str) -> list[list[tuple[int, float]]]:
    """Contiguous step runs of (step, value) where the log has `key`."""
    runs: list[list[tuple[int, float]]] = []
    for r in rows:
        if key in r:
            if not runs or r["step"] != runs[-1][-1][0] + 1:
                runs.append([])
            runs[-1].append((r["step"], r[key]))
    return runs


def main(d: Path) -> None:
    rows = [json.loads(line) for line in open(d / "train_log.jsonl")]
    rows = [r for r in rows if "phase" in r]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    steps = [r["step"] for r in rows]
    lm = [r["lm2048_lm"] for r in rows]
    a1.plot(steps, lm, color="0.8", lw=0.6, label="LM loss, 2K Wikipedia windows (per step)")
    a1.plot(steps, smooth(lm), color="C0", label="same, 25-step mean")
    val = [(r["step"], r["val_loss_2k"]) for r in rows if "val_loss_2k" in r]
    if val:
        a1.plot(*zip(*val), "o", color="C3", label="held-out Wikipedia loss (2K), end of each phase")
    a1.set_ylabel("cross-entropy (nats/token)")
    a1.set_ylim(3.8, 9.6)
    a1.legend(fontsize=8)
    for length, color in NEEDLE_LENGTHS:
        for i, run in enumerate(_runs(rows, f"needle{length}_exact")):
            s, e = zip(*run)
            a2.plot(s, smooth(e), color=color, label=f"needle docs {length // 1024}K" if i == 0 else None)
    a2.set_ylabel("answer exact match, all needle styles\n(train batches, 25-step mean)")
    a2.set_xlabel("optimizer step")
    a2.set_ylim(-0.02, 1.02)
    a2.legend(fontsize=8, loc="upper left")
    prev = None
    for r in rows:
        if r["phase"] != prev:
            for a in (a1, a2):
                a.axvline(r["step"], color="k", lw=0.5, ls=":")
            a1.text(r["step"] + 5, 9.3, r["phase"], fontsize=7)
            prev = r["phase"]
    tokens = rows[-1]["tokens"] / 1e6
    seconds = sum(r["step_s"] for r in rows)
    fig.suptitle(f"mla-eval default model: training curve ({tokens:.1f} M tokens, {seconds:.0f} s of steps)", fontsize=10)
    fig.tight_layout()
    fig.savefig(d / "loss_curve.png", dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tools.train.plot_log DIR  (DIR holds train_log.jsonl, e.g. a device run's $OUT/runs)")
    main(Path(sys.argv[1]))
