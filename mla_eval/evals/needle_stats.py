"""Statistics of a needle grid: a Wilson interval for every (task, length) cell of every format,
and the paired test that decides format-induced failures (rules in mla_eval.evals.stats).

A statistical cell is one task at one length, pooling its depths and trials (depths x trials
samples): that is the sample size the intervals and the tests use. The per-depth accuracies
remain in the heatmaps.
"""

from __future__ import annotations

from mla_eval.evals.needle import prompt_key
from mla_eval.evals.stats import ALPHA, PairedCounts, holm_reject, wilson_interval

METHOD = {
    "interval": "Wilson score, 95 %",
    "paired_test": "exact McNemar (two-sided binomial on the discordant prompts), format vs bf16 on the same prompts",
    "multiple_comparisons": "Holm step-down over every (task, length, format) test of the run",
    "alpha": ALPHA,
    "failure_rule": "Holm-rejected at alpha and the format loses more prompts than it wins (base_only > format_only)",
    "cell": "one task at one length, pooling its depths and trials",
}


def _select(records: list[dict], fmt: str, task: str, length: int) -> list[dict]:
    return [r for r in records if r["format"] == fmt and r["task"] == task and r["length"] == length]


def cell_intervals(records: list[dict], formats: list[str], tasks: list[str], lengths: list[int]) -> dict[str, dict]:
    """{task: {format: [{length, n, correct, accuracy, wilson_lo, wilson_hi}, ...]}} in length order."""
    out: dict[str, dict] = {}
    for task in tasks:
        out[task] = {}
        for fmt in formats:
            rows = []
            for length in lengths:
                cell = _select(records, fmt, task, length)
                k, n = sum(bool(r["correct"]) for r in cell), len(cell)
                lo, hi = wilson_interval(k, n)
                rows.append({"length": length, "n": n, "correct": k, "accuracy": k / n if n else None,
                             "wilson_lo": lo, "wilson_hi": hi})
            out[task][fmt] = rows
    return out


def paired_tests(records: list[dict], baseline: str, formats: list[str], tasks: list[str], lengths: list[int],
                 alpha: float = ALPHA) -> list[dict]:
    """One exact McNemar test per (task, length, format != baseline), Holm-corrected as one family."""
    base = {prompt_key(r): bool(r["correct"]) for r in records if r["format"] == baseline}
    rows = []
    for task in tasks:
        for length in lengths:
            for fmt in formats:
                if fmt == baseline:
                    continue
                pairs = [(base[prompt_key(r)], bool(r["correct"])) for r in _select(records, fmt, task, length)
                         if prompt_key(r) in base]
                pc = PairedCounts.from_pairs(pairs)
                rows.append({"task": task, "length": length, "format": fmt, "n": len(pairs), "both": pc.both,
                             "base_only": pc.base_only, "format_only": pc.format_only, "neither": pc.neither,
                             "p_value": pc.p_value})
    rejected = holm_reject([r["p_value"] for r in rows], alpha)
    for r, rej in zip(rows, rejected):
        r["holm_rejected"] = rej
        r["format_induced_failure"] = rej and r["base_only"] > r["format_only"]
    return rows
