"""Small-sample statistics for retrieval accuracies: Wilson intervals, exact McNemar, Holm.

A needle cell holds tens of pass/fail samples, so a normal-approximation interval (p +- z sqrt(p(1-p)/n))
collapses to zero width at 0 % and 100 %: Wilson's score interval does not. A format is compared with
bf16 on the SAME prompts, so the comparison is paired: only the discordant prompts carry information
(b: bf16 right and the format wrong; c: the opposite), and under "no difference" each discordant
prompt is a fair coin, which is the exact (binomial) McNemar test.

Format-induced failure (the rule the needle results apply): a (task, length, format) cell whose exact
McNemar p-value against bf16 stays below `ALPHA` after Holm's step-down correction over every such
test of the run (the family), and in which the format loses more prompts than it wins (b > c).
A single miss is never a failure by itself.
"""

from __future__ import annotations

import dataclasses
import math

ALPHA = 0.05  # family-wise error rate of the format-induced-failure decisions of one run
Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile: a two-sided 95 % interval


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion; (0, 1) when n == 0 (nothing is known)."""
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    z2 = z * z
    denom = 1 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # at p = 0 or 1 the bound is exact in theory; clamp the rounding of centre - half
    return max(0.0, centre - half) if successes else 0.0, min(1.0, centre + half) if successes < n else 1.0


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts b and c.

    Under the null each of the n = b + c discordant pairs falls either way with probability 1/2:
    p = min(1, 2 * P(X <= min(b, c))), X ~ Binomial(n, 1/2). No discordant pair: p = 1.
    """
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got {b}, {c}")
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n  # exact integers, one division
    return min(1.0, 2 * tail)


def holm_reject(p_values: list[float], alpha: float = ALPHA) -> list[bool]:
    """Holm's step-down procedure: which hypotheses are rejected at family-wise error `alpha`.

    Sorted ascending, the i-th smallest p (i = 0..m-1) is compared with alpha / (m - i); rejection
    stops at the first that fails. Uniformly more powerful than Bonferroni, same guarantee.
    """
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    out = [False] * m
    for rank, i in enumerate(order):
        if p_values[i] > alpha / (m - rank):
            break
        out[i] = True
    return out


@dataclasses.dataclass(frozen=True)
class PairedCounts:
    """bf16 vs a format over the same prompts: both right, bf16 only (b), format only (c), both wrong."""

    both: int
    base_only: int  # b: what the format broke
    format_only: int  # c: what the format fixed (by chance)
    neither: int

    @classmethod
    def from_pairs(cls, pairs: list[tuple[bool, bool]]) -> "PairedCounts":
        """pairs: (baseline correct, format correct) per prompt."""
        both = sum(1 for a, f in pairs if a and f)
        b = sum(1 for a, f in pairs if a and not f)
        c = sum(1 for a, f in pairs if f and not a)
        return cls(both, b, c, len(pairs) - both - b - c)

    @property
    def p_value(self) -> float:
        return mcnemar_exact(self.base_only, self.format_only)
