"""One format per layer under a budget, solved exactly: a multiple-choice knapsack by dynamic programming over bytes.

Each layer l picks one candidate c, costing `cost[l][c]` (its predicted KLD: the KLD measured with only layer l in
that format) and `size[c]` bytes per token (the format's record bytes; the outer scale is per layer, not per token).
A plan's predicted KLD is the sum of its layers' costs and its bytes per token the sum of their sizes. The table
holds, for every reachable total of bytes, the least summed cost and the choices behind it, so both questions are
exact: the least cost within a byte budget (`min_cost`), and the fewest bytes within a cost bound (`min_bytes`).
Totals are at most layers x the widest record (61 x 1152 B for a 61-layer model in bf16): a few thousand states per
layer, each step a pass over the candidates.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from mla_eval.errors import UserError


@dataclasses.dataclass(frozen=True)
class Choice:
    picks: tuple[int, ...]  # candidate index per layer
    cost: float  # summed cost (predicted KLD)
    bytes: int  # summed size (bytes per token)


def _table(cost: Sequence[Sequence[float]], size: Sequence[int]) -> dict[int, tuple[float, tuple[int, ...]]]:
    """Total bytes -> (least summed cost, picks) over every reachable total. Ties keep the earlier candidate
    order (a deterministic plan for equal costs)."""
    if not cost:
        raise ValueError("no layers to plan")
    if any(len(row) != len(size) for row in cost):
        raise ValueError("every layer needs one cost per candidate")
    if any(s < 0 for s in size):
        raise ValueError("sizes must be non-negative")
    best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for row in cost:
        nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
        for total, (c, picks) in best.items():
            for k, (ck, sk) in enumerate(zip(row, size)):
                if not math.isfinite(ck):
                    continue  # a candidate this layer cannot take
                key, val = total + sk, c + ck
                if key not in nxt or val < nxt[key][0]:
                    nxt[key] = (val, picks + (k,))
        best = nxt
    return best


def min_cost(cost: Sequence[Sequence[float]], size: Sequence[int], budget: int) -> Choice:
    """The picks of least summed cost whose summed size is at most `budget` (UserError when none fits)."""
    table = _table(cost, size)
    fits = [(c, b, p) for b, (c, p) in table.items() if b <= budget]
    if not fits:
        raise UserError(f"no plan fits {budget} bytes per token: the smallest takes {min(table)}; raise the budget")
    c, b, p = min(fits, key=lambda x: (x[0], x[1]))
    return Choice(p, c, b)


def min_bytes(cost: Sequence[Sequence[float]], size: Sequence[int], max_cost: float) -> Choice:
    """The picks of fewest summed bytes whose summed cost is at most `max_cost` (least cost among equal sizes)."""
    table = _table(cost, size)
    fits = [(b, c, p) for b, (c, p) in table.items() if c <= max_cost]
    if not fits:
        least = min(c for c, _ in table.values())
        raise UserError(f"no plan keeps the predicted KLD within {max_cost:g}: the least is {least:.6g}; raise --max-kld "
                        "or add a finer format to --candidates")
    b, c, p = min(fits, key=lambda x: (x[0], x[1]))
    return Choice(p, c, b)
