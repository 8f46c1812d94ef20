"""Per-token KLD statistics (llama.cpp `--kl-divergence` parity, plus depth buckets).

Per-token values are kept (not running sums) so medians and percentiles are exact and so shards
from several processes can be concatenated and summarised with identical results.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

PERCENTILES = (90.0, 95.0, 99.0, 99.9)
DEPTH_BUCKETS = 8  # equal-width context-depth buckets over the scored depths


def token_metrics(ref_logp: torch.Tensor, fmt_logp: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Metrics for each scored position from full-vocabulary log-probs.

    ref_logp, fmt_logp: [n, vocab] float32 log-softmax; targets: [n] observed next tokens.
    Returns float64 tensors: kld = KL(ref || fmt) (the headline), kld_rev = KL(fmt || ref) (the other direction:
    what the format's distribution puts where the reference's does not), nll of the observed token under each,
    probability of the observed token under each, and whether the argmaxes agree.
    """
    ref_logp = ref_logp.float()
    fmt_logp = fmt_logp.float()
    p_ref = ref_logp.exp()
    kld = (p_ref * (ref_logp - fmt_logp)).sum(-1).clamp_min(0.0)  # tiny negatives are rounding
    kld_rev = (fmt_logp.exp() * (fmt_logp - ref_logp)).sum(-1).clamp_min(0.0)
    idx = targets.view(-1, 1).long()
    lr = ref_logp.gather(1, idx).squeeze(1)
    lf = fmt_logp.gather(1, idx).squeeze(1)
    return {
        "kld": kld.double(),
        "kld_rev": kld_rev.double(),
        "nll_ref": (-lr).double(),
        "nll_fmt": (-lf).double(),
        "p_ref": lr.exp().double(),
        "p_fmt": lf.exp().double(),
        "same_top1": (ref_logp.argmax(-1) == fmt_logp.argmax(-1)).double(),
    }


@dataclasses.dataclass
class TokenStats:
    """Accumulates per-token metrics for one format; `depth` = tokens of context before it."""

    kld: list[np.ndarray] = dataclasses.field(default_factory=list)
    kld_rev: list[np.ndarray] = dataclasses.field(default_factory=list)
    nll_ref: list[np.ndarray] = dataclasses.field(default_factory=list)
    nll_fmt: list[np.ndarray] = dataclasses.field(default_factory=list)
    p_ref: list[np.ndarray] = dataclasses.field(default_factory=list)
    p_fmt: list[np.ndarray] = dataclasses.field(default_factory=list)
    same_top1: list[np.ndarray] = dataclasses.field(default_factory=list)
    depth: list[np.ndarray] = dataclasses.field(default_factory=list)
    order: list[np.ndarray] = dataclasses.field(default_factory=list)

    FIELDS = ("kld", "kld_rev", "nll_ref", "nll_fmt", "p_ref", "p_fmt", "same_top1", "depth", "order")
    OPTIONAL = ("kld_rev",)

    def add(self, metrics: dict[str, torch.Tensor], depth: torch.Tensor, order: torch.Tensor) -> None:
        """`order`: a global index per token, so shards concatenate into one canonical order."""
        for k in self.FIELDS[:-2]:
            getattr(self, k).append(metrics[k].cpu().numpy())
        self.depth.append(depth.cpu().numpy().astype(np.int64))
        self.order.append(order.cpu().numpy().astype(np.int64))

    def arrays(self) -> dict[str, np.ndarray]:
        """Concatenated per-token arrays, sorted by `order` (so sums do not depend on sharding)."""
        a = {k: (np.concatenate(getattr(self, k)) if getattr(self, k) else np.zeros(0)) for k in self.FIELDS}
        idx = np.argsort(a["order"], kind="stable")
        # kld_rev: absent from arrays kept before it existed (from_arrays); every other field is there
        return {k: v[idx] for k, v in a.items() if k not in self.OPTIONAL or v.size == idx.size}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> "TokenStats":
        out = cls()
        for k in cls.FIELDS:
            if k in arrays or k not in cls.OPTIONAL:
                getattr(out, k).append(np.asarray(arrays[k]))
        return out

    def summary(self) -> dict:
        return summarize(self.arrays())


def _mean_se(x: np.ndarray) -> tuple[float, float]:
    n = x.size
    if n == 0:
        return math.nan, math.nan
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan


def summarize(a: dict[str, np.ndarray]) -> dict:
    """The summary table of one format (all numbers from numpy on the per-token arrays)."""
    kld = a["kld"]
    n = int(kld.size)
    if n == 0:
        raise ValueError("no scored tokens")
    kld_mean, kld_se = _mean_se(kld)
    top1, top1_se = _mean_se(a["same_top1"])
    dp = a["p_fmt"] - a["p_ref"]
    dp_mean, dp_se = _mean_se(dp)
    # ln(PPL_fmt / PPL_ref) = mean(nll_fmt - nll_ref); the per-token difference carries the
    # covariance of the two (its variance is var_f + var_r - 2 cov), as llama.cpp's estimate.
    d = a["nll_fmt"] - a["nll_ref"]
    lnr, lnr_se = _mean_se(d)
    nll_f, nll_f_se = _mean_se(a["nll_fmt"])
    nll_r, nll_r_se = _mean_se(a["nll_ref"])
    out = {
        "tokens": n,
        "kld_mean": kld_mean,
        "kld_se": kld_se,
        "kld_median": float(np.median(kld)),
        **{f"kld_p{p:g}": float(np.percentile(kld, p)) for p in PERCENTILES},
        "kld_max": float(kld.max()),
        "kld_min": float(kld.min()),
        "same_top1_pct": 100 * top1,
        "same_top1_pct_se": 100 * top1_se,
        "delta_p_mean_pct": 100 * dp_mean,
        "delta_p_mean_pct_se": 100 * dp_se,
        "delta_p_rms_pct": 100 * float(np.sqrt(np.mean(dp**2))),
        "ppl_fmt": math.exp(nll_f),
        "ppl_fmt_se": math.exp(nll_f) * nll_f_se,
        "ppl_ref": math.exp(nll_r),
        "ppl_ref_se": math.exp(nll_r) * nll_r_se,
        "ln_ppl_ratio": lnr,
        "ln_ppl_ratio_se": lnr_se,
        "ppl_ratio": math.exp(lnr),
        "kld_by_depth": depth_buckets(kld, a["depth"]),
    }
    if a.get("kld_rev") is not None and a["kld_rev"].size == n:  # arrays kept before the reverse direction lack it
        out["kld_reverse_mean"], out["kld_reverse_se"] = _mean_se(a["kld_rev"])
    return out


def depth_buckets(kld: np.ndarray, depth: np.ndarray, buckets: int = DEPTH_BUCKETS) -> list[dict]:
    """Mean KLD per context-depth bucket [lo, hi): does the error grow with distance?

    The buckets split the scored depths' own range into equal widths: the sliding-window protocol
    scores depths min_context..ctx-1 only (1024..2047 by default), so fixed power-of-two edges
    would put every token into one bucket. Empty buckets are left out.
    """
    lo, hi = int(depth.min()), int(depth.max()) + 1
    edges = np.unique(np.linspace(lo, hi, buckets + 1).round().astype(np.int64))
    which = np.searchsorted(edges, depth, side="right") - 1  # bucket i holds edges[i] <= d < edges[i+1]
    rows = []
    for i in range(edges.size - 1):
        m = which == i
        if m.any():
            mean, se = _mean_se(kld[m])
            rows.append(
                {"depth_lo": int(edges[i]), "depth_hi": int(edges[i + 1]), "tokens": int(m.sum()), "kld_mean": mean, "kld_se": se}
            )
    return rows
