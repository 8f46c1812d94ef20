"""Teacher-forced KL divergence of each cache format against a reference format.

Protocol (llama.cpp / vLLM-fork parity): sliding windows of `ctx` tokens every `stride` tokens
within each token sequence; a position is scored once, by the first window in which it has at
least `min_context` tokens before it. Every position of every layer reads the quantised cache
(what decode sees). One reference forward per window batch serves every format; KL(ref || fmt)
over the full vocabulary in float32.
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import numpy as np
import torch

from mla_eval.errors import UserError
from mla_eval.evals.kld_stats import TokenStats, token_metrics
from mla_eval.evals.layer_stats import LayerStats
from mla_eval.evals.ref_store import RefStore, metrics_from_store
from mla_eval.evals.settings import ProgressCallback, check_ctx, no_progress
from mla_eval.evals.text_sources import TokenSource
from mla_eval.evals.variants import Variant, scales_for
from mla_eval.formats import OuterScales
from mla_eval.model.session import CacheSession


@dataclasses.dataclass(frozen=True)
class Window:
    seq: int
    start: int
    length: int
    score_from: int  # first scored position inside the window; positions score_from..length-2
    # are scored, each predicting the token after it


def make_windows(lengths: list[int], ctx: int, stride: int, min_context: int) -> list[Window]:
    """Windows over each sequence and the positions each one scores (each position at most once)."""
    out = []
    for s, n in enumerate(lengths):
        if n < min_context + 1:
            continue
        scored_until = 0  # every position below this (in sequence coordinates) is scored already
        start = 0
        while True:
            length = min(ctx, n - start)
            first = max(start + min_context, scored_until)
            if first < start + length - 1:
                out.append(Window(s, start, length, first - start))
                scored_until = start + length - 1
            if start + length >= n:
                break
            start += stride
    return out


@dataclasses.dataclass(frozen=True)
class KldProtocol:
    """The resolved window protocol of one KLD run (every default already applied)."""

    variants: tuple[Variant, ...]
    ref: Variant
    ctx: int
    stride: int
    min_context: int
    batch: int = 1
    block_size: int = 64
    layer_stats: bool = True
    outer_scales: OuterScales | None = None


def plan_windows(lm, source: TokenSource, st: KldProtocol) -> list[Window]:
    """Validate the protocol settings against the model and the text; return the windows."""
    check_ctx(st.ctx)
    if st.ctx > lm.max_positions > 0:
        raise UserError(f"--ctx {st.ctx} is beyond the model's {lm.max_positions} positions; lower --ctx")
    if not 0 <= st.min_context < st.ctx:
        raise UserError(f"--min-context {st.min_context} must be in [0, ctx={st.ctx})")
    if st.stride <= 0:
        raise UserError(f"--stride must be positive, got {st.stride}")
    lengths = [int(s.numel()) for s in source.sequences]
    windows = make_windows(lengths, st.ctx, st.stride, st.min_context)
    if not windows:
        raise UserError(
            f"the text is shorter than one window: longest sequence {max(lengths)} tokens, need more than "
            f"--min-context {st.min_context}; give more text or lower --ctx/--min-context"
        )
    if st.stride > st.ctx - st.min_context and any(n > st.ctx for n in lengths):
        raise UserError(
            f"--stride {st.stride} skips tokens: a window scores at most ctx - min_context = {st.ctx - st.min_context} "
            f"new positions, so every step of {st.stride} leaves some unscored; use --stride <= {st.ctx - st.min_context}"
        )
    return windows


def unscored_positions(source: TokenSource, windows: list[Window], min_context: int) -> int:
    """Positions with at least `min_context` tokens before them that no window scores (a window's
    last position has no target inside it: with stride = ctx - min_context one per window)."""
    scorable = sum(max(0, int(s.numel()) - 1 - min_context) for s in source.sequences)
    return scorable - sum(w.length - 1 - w.score_from for w in windows)


@dataclasses.dataclass
class KldRun:
    """Per-variant token statistics (and layer statistics) of one run, before summarising."""

    stats: dict[str, TokenStats]
    layers: dict[str, LayerStats]
    windows: int
    seconds: float
    unscored: int = 0  # see unscored_positions

    def summary(self) -> dict[str, dict]:
        out = {}
        for name, ts in self.stats.items():
            out[name] = ts.summary()
            if self.layers:
                out[name]["layers"] = self.layers[name].summary()
        return out


def run_kld(
    lm,
    source: TokenSource,
    st: KldProtocol,
    progress: ProgressCallback = no_progress,
    save_ref: RefStore | None = None,
    ref_file: RefStore | None = None,
    rank: int = 0,
    world: int = 1,
) -> KldRun:
    """Evaluate every variant; returns per-variant token arrays and layer stats.

    `save_ref` collects the reference log-probs; with `ref_file` the reference forward is skipped
    and the stored reference is used instead.
    """
    windows = plan_windows(lm, source, st)
    mine = list(enumerate(windows))[rank::world]
    stats = {v.name: TokenStats() for v in st.variants}
    layers = {v.name: LayerStats(lm.num_layers) for v in st.variants} if st.layer_stats else {}
    total_scored = sum(w.length - 1 - w.score_from for _, w in mine)
    done, t0 = 0, time.perf_counter()
    progress("score", 0, total_scored)
    for i in range(0, len(mine), st.batch):
        for group in _same_shape_groups(mine[i : i + st.batch]):
            ws = [w for _, w in group]
            ids = torch.stack([source.sequences[w.seq][w.start : w.start + w.length] for w in ws]).to(lm.device)
            sf = ws[0].score_from
            targets = ids[:, sf + 1 :].reshape(-1)
            # position p predicts token p+1: the window's last position has no target in it
            depth = torch.arange(sf, ws[0].length - 1).repeat(len(ws))
            order = torch.cat([wi * st.ctx + torch.arange(sf, ws[0].length - 1) for wi, _ in group])
            if ref_file is not None:
                stored = ref_file.lookup(order)
            else:
                ref_logp = _forward_logp(lm, st.ref, ids, sf, st, None)
                if save_ref is not None:
                    save_ref.add(ref_logp, targets, order)
            for v in st.variants:
                obs = layers[v.name].observers(v.spec) if layers else ()
                logp = _forward_logp(lm, v, ids, sf, st, obs)
                m = metrics_from_store(stored, logp, targets) if ref_file is not None else token_metrics(ref_logp, logp, targets)
                stats[v.name].add(m, depth, order)
            done += len(ws) * (ws[0].length - 1 - sf)
            progress("score", done, total_scored)
    return KldRun(stats, layers, len(windows), time.perf_counter() - t0, unscored_positions(source, windows, st.min_context))


def _same_shape_groups(ws: list[tuple[int, Window]]) -> list[list[tuple[int, Window]]]:
    """Windows batch together only when their length and scored range agree."""
    groups: dict[tuple[int, int], list[tuple[int, Window]]] = {}
    for wi, w in ws:
        groups.setdefault((w.length, w.score_from), []).append((wi, w))
    return list(groups.values())


@torch.no_grad()
def _forward_logp(lm, variant: Variant, ids: torch.Tensor, score_from: int, st: KldProtocol, observers) -> torch.Tensor:
    """log-softmax (float32) of the positions score_from..len-2 of every row, stacked [n, vocab]."""
    b, t = ids.shape
    scales = scales_for(variant, st.outer_scales)
    session = CacheSession(
        variant.spec,
        lm.num_layers,
        b,
        t,
        lm.layer_devices,
        block_size=st.block_size,
        outer_scales=scales,
        observers=tuple(observers or ()),
        keep_exact=bool(observers),
    )
    pos = torch.arange(t, device=lm.device).expand(b, -1)
    with lm.adapter.session(session), warnings.catch_warnings():
        # transformers may warn that past_key_values is deprecated: our cache session replaces it
        warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated.*")
        logits = lm.model(input_ids=ids, position_ids=pos, use_cache=False).logits
    # under --device-map auto the logits come out on the last GPU: score on the input's device
    return torch.log_softmax(logits[:, score_from : t - 1].float(), dim=-1).reshape(-1, logits.shape[-1]).to(lm.device)


def gather_arrays(stats: dict[str, TokenStats], group=None) -> dict[str, TokenStats]:
    """Concatenate every rank's per-token arrays (exact: the same numbers as one process); `group`: the
    process group to gather through (the gloo group of `evals.distributed` under NCCL)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return stats
    local = {k: v.arrays() for k, v in stats.items()}
    allv: list = [None] * dist.get_world_size()
    dist.all_gather_object(allv, local, group=group)
    return {k: TokenStats.from_arrays({f: np.concatenate([r[k][f] for r in allv]) for f in TokenStats.FIELDS}) for k in stats}
