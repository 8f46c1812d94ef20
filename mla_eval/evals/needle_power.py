"""What a needle grid can detect: the power of its paired test (`needle --power`).

"No significant format-induced failure" is worth as much as the grid's ability to see one. Two answers:

1. **Analytic** (every run): the paired test of a cell (exact McNemar vs bf16, Holm over the run's m tests:
   mla_eval.evals.stats) under a simple damage model. Of the cell's n prompts, k1 are ones bf16 retrieves and
   k0 = n - k1 ones it misses; a format loses each of the k1 with probability q (the damage) and recovers each of
   the k0 with probability w (chance: the run's own recovery rate of its real formats). The accuracy drop is
   (k1 q - k0 w) / n. The test detects the damage when McNemar's p <= alpha / m (Holm's first step: the bound
   every rejection must pass when one cell fails alone) and the format loses more than it recovers. From this:
   the smallest accuracy drop detected with `POWER` (80 %) probability given the prompts of the cell, and the
   prompts a cell needs to detect a drop of D (at the cell's bf16 accuracy).
2. **Empirical** (where the run has control formats, mla_eval.formats.controls): which rungs of the ladder the
   grid flagged at each task and length, and the smallest accuracy drop among the flagged ones.

Exact arithmetic where it decides: the rejection boundary comes from the exact binomial test itself; only the
probabilities of reaching it are floats.
"""

from __future__ import annotations

import functools
import math

from mla_eval.evals.stats import ALPHA, mcnemar_exact

POWER = 0.8  # the conventional detection probability a "detectable" effect must reach
MAX_PROMPTS = 100_000  # prompts_needed searches up to here; beyond: None ("not within reach")

METHOD = {
    "model": "of a cell's n prompts, k1 bf16 retrieves and k0 it misses; a format loses each of the k1 with probability "
    "q and recovers each of the k0 with probability w (the run's recovery rate of its real formats); accuracy drop = "
    "(k1 q - k0 w) / n",
    "test": "exact McNemar p <= alpha / m (m: the run's paired tests, Holm's first step) and losses > recoveries",
    "power": POWER,
}


@functools.lru_cache(maxsize=None)
def _min_losses(recovered: int, alpha_test: float) -> int:
    """The fewest losses b that the test rejects with when the format recovered `recovered` prompts: b > c and
    mcnemar(b, c) <= alpha_test. The p-value falls as b grows (c fixed), so the first b found is the boundary."""
    b = recovered + 1
    while mcnemar_exact(b, recovered) > alpha_test:
        b += 1
    return b


def _binom_pmf(n: int, p: float) -> list[float]:
    if p <= 0.0:
        return [1.0] + [0.0] * n
    if p >= 1.0:
        return [0.0] * n + [1.0]
    lp, lq = math.log(p), math.log1p(-p)
    lg = math.lgamma(n + 1)
    return [math.exp(lg - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * lp + (n - k) * lq) for k in range(n + 1)]


def detection_power(k1: int, k0: int, q: float, w: float, alpha_test: float) -> float:
    """P(the test flags the cell) when the format loses each of k1 prompts w.p. q and recovers each of k0 w.p. w."""
    loss_tail = _binom_pmf(k1, q)
    for i in range(k1 - 1, -1, -1):  # loss_tail[i] = P(B >= i)
        loss_tail[i] += loss_tail[i + 1]
    total = 0.0
    for c, pc in enumerate(_binom_pmf(k0, w)):
        if pc < 1e-15:
            continue
        b_min = _min_losses(c, alpha_test)
        if b_min <= k1:
            total += pc * loss_tail[b_min]
    return min(1.0, total)


def detectable_drop(k1: int, k0: int, w: float, alpha_test: float, power: float = POWER) -> float | None:
    """The smallest accuracy drop (fraction of the cell's n prompts) detected with probability `power`; None if
    even a format that loses every prompt bf16 retrieves is not detected that often."""
    if k1 == 0 or detection_power(k1, k0, 1.0, w, alpha_test) < power:
        return None
    lo, hi = 0.0, 1.0  # power rises with q: bisect to 1e-4 of q
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if detection_power(k1, k0, mid, w, alpha_test) >= power else (mid, hi)
    return max(0.0, (k1 * hi - k0 * w) / (k1 + k0))


def prompts_needed(base_accuracy: float, drop: float, w: float, alpha_test: float, power: float = POWER) -> int | None:
    """The fewest prompts a cell needs for a format that costs `drop` of accuracy (bf16 at `base_accuracy`) to be
    detected with probability `power`: the smallest n at which it does and keeps doing so for the next 8 prompt
    counts (a discrete test's power zigzags in n). None when the drop exceeds what bf16 retrieves, or past MAX_PROMPTS."""
    if base_accuracy <= 0 or not 0 < drop <= base_accuracy:
        return None
    q = min(1.0, (drop + (1 - base_accuracy) * w) / base_accuracy)  # the loss rate whose net drop is `drop`

    def ok(n: int) -> bool:
        k1 = round(n * base_accuracy)
        return detection_power(k1, n - k1, q, w, alpha_test) >= power

    n = 1
    while not ok(n):  # doubling to a detecting n, then the first n of a run of detecting ones below it
        n *= 2
        if n > MAX_PROMPTS:
            return None
    lo = n // 2
    for m in range(lo + 1, n + 1):
        if all(ok(k) for k in range(m, min(n, m + 8) + 1)):
            return m
    return n


def recovery_rate(paired_tests: list[dict], formats: list[str]) -> float:
    """w: of the prompts bf16 misses in the given formats' cells, the share the format retrieves (0 with none)."""
    rows = [r for r in paired_tests if r["format"] in formats]
    missed = sum(r["format_only"] + r["neither"] for r in rows)
    return sum(r["format_only"] for r in rows) / missed if missed else 0.0


def power_report(paired_tests: list[dict], controls: list[str], drop: float, alpha: float = ALPHA,
                 power: float = POWER) -> dict:
    """The `power` section of a needle document: per (task, length) cell the analytic figures and, where the run
    has control formats, the rungs it flagged."""
    if not 0 < drop < 1:
        raise ValueError(f"drop must lie in (0, 1), got {drop}")
    m = max(1, len(paired_tests))
    alpha_test = alpha / m
    real = sorted({r["format"] for r in paired_tests} - set(controls))
    w = recovery_rate(paired_tests, real)
    cells = []
    for task, length in dict.fromkeys((r["task"], r["length"]) for r in paired_tests):
        rows = [r for r in paired_tests if r["task"] == task and r["length"] == length]
        first = rows[0]
        n = first["n"]
        k1 = first["both"] + first["base_only"]  # the prompts bf16 retrieves (the same prompts in every row)
        base = k1 / n if n else 0.0
        flagged = []
        for r in rows:
            if r["format"] in controls:
                flagged.append({"format": r["format"], "drop": (r["base_only"] - r["format_only"]) / n if n else 0.0,
                                "p_value": r["p_value"], "detected": r["format_induced_failure"]})
        detected = [f["drop"] for f in flagged if f["detected"]]
        missed = [f["drop"] for f in flagged if not f["detected"]]
        cells.append({
            "task": task, "length": length, "n": n, "bf16_accuracy": base,
            "detectable_drop": detectable_drop(k1, n - k1, w, alpha_test, power),
            "prompts_for_drop": prompts_needed(base, drop, w, alpha_test, power),
            "controls": flagged,
            "smallest_detected_drop": min(detected) if detected else None,
            "largest_missed_drop": max(missed) if missed else None,
        })
    return {"method": dict(METHOD), "alpha": alpha, "tests": m, "alpha_per_test": alpha_test, "recovery_rate": w,
            "recovery_from": real, "drop": drop, "cells": cells}
