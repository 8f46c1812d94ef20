"""Teacher-forced KL divergence of each cache format against a reference format.

Protocol (llama.cpp / vLLM-fork parity): sliding windows of `ctx` tokens every `stride` tokens
within each token sequence; a position is scored once, by the first window in which it has at
least `min_context` tokens before it. Under cache semantics every position of every layer reads
the quantised cache (what decode sees); under engine semantics the window is prefilled in chunks
(mla_eval.attention.semantics). One reference forward per window batch serves every format; KL(ref || fmt)
over the full vocabulary in float32.

The loss is chunked: a forward keeps only the final hidden states of its scored positions, and the
full-vocabulary log-probs are made `loss_chunk` rows at a time (reference and format side by side,
through the model's own output head), so a 64K window never holds [64K, vocab] logits, let alone
one per format.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np
import torch

from mla_eval.attention.semantics import BF16, CACHE, MATHS, AttentionMath, Semantics, row_label
from mla_eval.errors import UserError
from mla_eval.evals.kld_stats import TokenStats, token_metrics
from mla_eval.evals.layer_stats import LayerStats, TopkRecorder
from mla_eval.evals.ref_store import RefStore, metrics_from_store
from mla_eval.evals.settings import check_ctx
from mla_eval.evals.text_sources import TokenSource
from mla_eval.evals.variants import Variant, session_formats
from mla_eval.formats import OuterScales, get_format
from mla_eval.model import deepseek_v4
from mla_eval.model.executor import WindowForward
from mla_eval.model.session import PREFILL_MODES, CacheSession
from mla_eval.model.strategy import Resident, Streamed, passes
from mla_eval.protocol import ProgressCallback, no_progress

# How a window's forward reads the quantised cache (mla_eval.model.session.PREFILL_MODES), or
# `auto`: the mha form wherever it computes the same semantics as the absorbed one (see
# resolve_prefill), else absorbed. Both read only the bytes the format stored; with bf16 math they
# are the same mathematics up to the bf16 rounding of the up-projected K/V, and the mha form does
# 3.4x fewer attention FLOPs per query (causal flash attention on CUDA; issue 14).
# The default is auto since the H200 measured both (default model, ctx 2048; docs/findings/2026-12-04-kld-window-paths.md):
# forward_bench --parts kld, batch 8 x 2048: mha 2.5-3.2x faster than absorbed (bf16 53.1 -> 21.3 ms, nvfp4
# 61.7 -> 21.4 ms; 1.8-1.9x the stock forward), and tests/test_semantics_gpu.py -k mha_window passed: path
# rounding on the bf16 cache 2.5e-4 mean / 2.2e-3 max per-token KL, fp8_ds_mla and nvfp4 mean KLDs at most 2.3 %
# apart from absorbed, no token past the per-token bound. With the default layer stats auto still runs absorbed (recorded
# quietly: KldSettings.prefill None); figures that must stay comparable with absorbed baselines ask for it by name.
KLD_PREFILL_MODES = ("auto", *PREFILL_MODES)
DEFAULT_KLD_PREFILL = "auto"


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
    # attention semantics and math (mla_eval.attention.semantics): one row per format x semantics x
    # math, plus the `explain` format's storage / compute / both rows under every semantics
    semantics: tuple[Semantics, ...] = (CACHE,)
    maths: tuple[AttentionMath, ...] = (BF16,)
    explain: Variant | None = None
    loss_chunk: int = 0  # rows of full-vocabulary log-probs at a time; 0: loss_chunk_rows(vocab)
    prefill: str = "absorbed"  # resolved (resolve_prefill): one mode for the reference and every row
    # a plan row whose first layers are bf16 starts at its first other layer from the bf16 reference's state there
    # (resident one-chunk forwards; the same bits, fewer layers run): the per-layer sensitivity sweep sets it
    fork_rows: bool = False

    def rows(self, bf16: Variant) -> list[tuple[Variant, AttentionMath]]:
        """The (variant, math) pairs scored under each semantics, distinct, in order: every format in
        every math, then for `explain` the compute-only rows (bf16 cache, each fp8 math), storage only
        (the format, bf16 math) and both (the format, each fp8 math)."""
        out = [(v, m) for v in self.variants for m in self.maths]
        if self.explain is not None:
            fp8 = [m for m in self.maths if m.name != "bf16"] or [MATHS["fp8-q"]]
            out += [(bf16, m) for m in fp8] + [(self.explain, BF16)] + [(self.explain, m) for m in fp8]
        seen: list[tuple[Variant, AttentionMath]] = []
        for row in out:
            if row not in seen:
                seen.append(row)
        return seen


def mha_blocker(st: KldProtocol, is_dsa: bool) -> str | None:
    """Why the mha form cannot compute this run's rows with the absorbed path's semantics (None: it can).

    The reference and every row run one mode, so a row's KLD never mixes the two paths' rounding."""
    if is_dsa:
        return "a DSA model's queries read only their indexer's top-k keys (sparse absorbed attention)"
    fp8 = [m.name for v, m in st.rows(Variant(get_format("bf16"))) if m.name != "bf16"]
    if fp8:
        return f"{fp8[0]} math rounds the absorbed query / probabilities; the mha form is bf16 SDPA"
    if st.layer_stats:
        return "per-layer statistics compare the absorbed path's latent-space output (--no-layer-stats lifts this)"
    return None


def check_prefill(asked: str) -> None:
    """A --prefill value that is not one of KLD_PREFILL_MODES is a UserError naming them."""
    if asked not in KLD_PREFILL_MODES:
        raise UserError(f"--prefill {asked!r}: choose one of {', '.join(KLD_PREFILL_MODES)}")


def resolve_prefill(asked: str, st: KldProtocol, is_dsa: bool) -> tuple[str, str | None]:
    """(mode, why absorbed) for `asked` (KLD_PREFILL_MODES): auto falls back to absorbed with the
    reason; mha where it cannot express the semantics is a UserError naming it."""
    check_prefill(asked)
    if asked == "absorbed":
        return "absorbed", None
    why = mha_blocker(st, is_dsa)
    if why is None:
        return "mha", None
    if asked == "mha":
        raise UserError(f"--prefill mha cannot compute this run: {why}; use --prefill absorbed or auto")
    return "absorbed", why


LOSS_CHUNK_ELEMENTS = 1 << 26  # 64 Mi floats (256 MiB) per [rows, vocab] float32 tensor of the loss


def loss_chunk_rows(vocab: int, asked: int = 0) -> int:
    """Rows per loss chunk: `asked`, or as many as keep one [rows, vocab] float32 tensor at 256 MiB."""
    return asked if asked > 0 else max(1, LOSS_CHUNK_ELEMENTS // max(1, vocab))


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
    rows: dict[str, dict] = dataclasses.field(default_factory=dict)  # row key -> format, semantics, math, chunk

    def summary(self) -> dict[str, dict]:
        out = {}
        for name, ts in self.stats.items():
            out[name] = {**ts.summary(), **self.rows.get(name, {})}
            if self.layers:
                out[name]["layers"] = self.layers[name].summary()
        return out


# A layer-major run's runner (mla_eval.model.strategy.Streamed: loader, window batches per pass, where streams wait);
# kept under its old name for callers that build one by hand (tests)
Streaming = Streamed


@dataclasses.dataclass
class _Batch:
    """One window batch's tokens and what its loss reads."""

    ids: torch.Tensor
    score_from: int
    targets: torch.Tensor
    depth: torch.Tensor
    order: torch.Tensor
    tokens: int


def run_kld(
    lm,
    source: TokenSource,
    st: KldProtocol,
    progress: ProgressCallback = no_progress,
    save_ref: RefStore | None = None,
    ref_file: RefStore | None = None,
    rank: int = 0,
    world: int = 1,
    runner=None,
) -> KldRun:
    """Evaluate every variant; returns per-variant token arrays and layer stats.

    `save_ref` collects the reference log-probs; with `ref_file` the reference forward is skipped
    and the stored reference is used instead. `runner` (mla_eval.model.strategy: `Resident`, the default, or
    `Streamed`) runs the forwards, a pass of `runner.batches_per_pass` window batches at a time (streamed: layer-major,
    the same numbers as resident, bit for bit).
    """
    runner = Resident() if runner is None else runner
    windows = plan_windows(lm, source, st)
    mine = list(enumerate(windows))[rank::world]
    rows = st.rows(Variant(get_format("bf16")))
    keys = [(sem, v, m, row_label(v.name, sem, m)) for sem in st.semantics for v, m in rows]
    stats = {k: TokenStats() for *_, k in keys}
    layers = {k: LayerStats(lm.num_layers) for *_, k in keys} if st.layer_stats else {}
    total_scored = sum(w.length - 1 - w.score_from for _, w in mine)
    loss_rows = loss_chunk_rows(lm.model.config.vocab_size, st.loss_chunk)
    groups = [g for i in range(0, len(mine), st.batch) for g in _same_shape_groups(mine[i : i + st.batch])]
    cut = passes(groups, runner)
    done, t0 = 0, time.perf_counter()
    progress("score", 0, total_scored)
    for p, pass_groups in enumerate(cut):
        batches = [_batch(lm, source, group, st) for group in pass_groups]
        # every forward of the pass, in the order a resident run takes them: per batch and semantics, the
        # reference (unless stored), then each row; `make(lazy)` builds its cache session only when it runs
        todo = []
        # DSA models with layer stats: the reference forward records its top-k, each format's the overlap with it
        topk = TopkRecorder() if layers and lm.adapter.is_dsa and ref_file is None else None
        for bi, b in enumerate(batches):
            for sem in st.semantics:
                ref_key = (bi, sem.label, None)
                ref_at = None
                if ref_file is None:
                    ref_obs = (topk.observer(ref_key),) if topk is not None else None
                    ref_at = len(todo)
                    todo.append((ref_key, functools.partial(
                        _window_forward, lm, st.ref, b.ids, b.score_from, st, ref_obs, sem, keep_exact=False,
                        lazy=runner.lazy, record=st.fork_rows)))
                ref_topk = functools.partial(topk.lookup, ref_key) if topk is not None else None
                for s2, v, am, key in keys:
                    if s2 == sem:
                        obs = layers[key].observers(v.spec, ref_topk) if layers else ()
                        # a plan row whose first layers are the reference's starts at its own layer from the
                        # reference's state there (the same bits, fewer layers run): the per-layer sensitivity sweep
                        layer = fork_layer(v, am, st.ref) if st.fork_rows and ref_at is not None else 0
                        todo.append(((bi, sem.label, key), functools.partial(
                            _window_forward, lm, v, b.ids, b.score_from, st, obs, sem, am, lazy=runner.lazy,
                            fork=(ref_at, layer) if layer > 0 else None)))
        n, first = lm.num_layers, p * lm.num_layers
        out = runner.forwards(lm, [make for _, make in todo],
                              progress=lambda d, _t: progress("layers", first + d, len(cut) * n))
        hidden = {k: h for (k, _), h in zip(todo, out)}
        for bi, b in enumerate(batches):
            chunks = [slice(c, min(c + loss_rows, b.targets.numel())) for c in range(0, b.targets.numel(), loss_rows)]
            for sem in st.semantics:
                stored = ref_file.lookup(b.order) if ref_file is not None else None
                ref_h = hidden.get((bi, sem.label, None))
                # each chunk's reference log-probs are made once for all rows, not once per row
                rows_h = [(key, hidden[(bi, sem.label, key)]) for s2, _, _, key in keys if s2 == sem]
                parts: dict[str, list[dict]] = {key: [] for key, _ in rows_h}
                for c in chunks:
                    ref_logp = None if ref_h is None else _logp(lm, ref_h[c])
                    if save_ref is not None and ref_logp is not None and sem == st.semantics[0]:
                        save_ref.add(ref_logp, b.targets[c], b.order[c])
                    for key, fmt_h in rows_h:
                        logp = _logp(lm, fmt_h[c])
                        if stored is not None:
                            parts[key].append(metrics_from_store({k: x[c] for k, x in stored.items()}, logp, b.targets[c]))
                        else:
                            parts[key].append(token_metrics(ref_logp, logp, b.targets[c]))
                        del logp
                    del ref_logp
                for key, ps in parts.items():
                    stats[key].add({k: torch.cat([p[k] for p in ps]) for k in ps[0]}, b.depth, b.order)
            done += b.tokens
            progress("score", done, total_scored)
        del hidden, topk
    info = {
        k: {"format": v.name, "semantics": sem.label, "math": m.name, "chunk": sem.chunk, "prefill": st.prefill}
        for sem, v, m, k in keys
    }
    run = KldRun(stats, layers, len(windows), time.perf_counter() - t0, unscored_positions(source, windows, st.min_context))
    run.rows = info
    return run


def fork_layer(variant, math: AttentionMath, ref: Variant) -> int:
    """The layer a row may start at from the reference's recorded state: its first layer that is not plain bf16 (0:
    none may be skipped). Only a per-layer plan against a plain bf16 reference, in bf16 math: its earlier layers
    then compute exactly what the reference's did."""
    plan = getattr(variant, "plan", None)
    if plan is None or math.name != "bf16" or ref.outer or ref.spec.name != "bf16":
        return 0
    for i, (v, scale) in enumerate(zip(plan.layers, plan.scales)):
        if v.spec.name != "bf16" or v.outer or scale is not None:
            return i
    return 0


def workload(lm, source: TokenSource, st: KldProtocol, ref_file: RefStore | None = None, rank: int = 0, world: int = 1):
    """The forwards this rank's share of a KLD run takes (`mla_eval.model.run_plan.Workload`), for the run plan."""
    from mla_eval.model.run_plan import Workload

    windows = plan_windows(lm, source, st)
    mine = list(enumerate(windows))[rank::world]
    groups = [g for i in range(0, len(mine), st.batch) for g in _same_shape_groups(mine[i : i + st.batch])]
    rows = st.rows(Variant(get_format("bf16")))
    specs = [v.spec for v, _ in rows] + [st.ref.spec]
    widest = max(groups, key=lambda g: len(g) * g[0][1].length)
    dtype = next(lm.model.parameters()).dtype
    return Workload(
        batches=len(groups),
        forwards_per_batch=len(st.semantics) * (len(rows) + (ref_file is None)),
        tokens=len(widest) * widest[0][1].length,
        hidden=int(lm.model.config.hidden_size),
        dtype_bytes=torch.finfo(dtype).bits // 8,
        record_bytes=max(s.record_bytes for s in specs),
        kept=max(len(g) * (g[0][1].length - 1 - g[0][1].score_from) for g in groups),
        exact=st.layer_stats,
    )


def _batch(lm, source: TokenSource, group: list[tuple[int, Window]], st: KldProtocol) -> _Batch:
    ws = [w for _, w in group]
    ids = torch.stack([source.sequences[w.seq][w.start : w.start + w.length] for w in ws]).to(lm.device)
    sf = ws[0].score_from
    # position p predicts token p+1: the window's last position has no target in it
    return _Batch(
        ids=ids,
        score_from=sf,
        targets=ids[:, sf + 1 :].reshape(-1),
        depth=torch.arange(sf, ws[0].length - 1).repeat(len(ws)),
        order=torch.cat([wi * st.ctx + torch.arange(sf, ws[0].length - 1) for wi, _ in group]),
        tokens=len(ws) * (ws[0].length - 1 - sf),
    )


def _same_shape_groups(ws: list[tuple[int, Window]]) -> list[list[tuple[int, Window]]]:
    """Windows batch together only when their length and scored range agree."""
    groups: dict[tuple[int, int], list[tuple[int, Window]]] = {}
    for wi, w in ws:
        groups.setdefault((w.length, w.score_from), []).append((wi, w))
    return list(groups.values())


@torch.no_grad()
def _forward_hidden(
    lm, variant: Variant, ids: torch.Tensor, score_from: int, st: KldProtocol, observers,
    semantics: Semantics = CACHE, attn_math: AttentionMath = BF16, chunk_keys: str = "fresh",
) -> torch.Tensor:
    """Final hidden states (what the output head reads) of positions score_from..len-2 of every row,
    stacked [n, hidden], through the variant's cache; the logits are made later, chunk by chunk (_logp).

    Under engine semantics the window runs as consecutive forwards of the chunk size, each chunk's
    queries reading the earlier chunks through the cache (what an engine's chunked prefill does)."""
    return lm.stack.run_resident(_window_forward(lm, variant, ids, score_from, st, observers, semantics, attn_math, chunk_keys))


def _window_forward(
    lm, variant: Variant, ids: torch.Tensor, score_from: int, st: KldProtocol, observers,
    semantics: Semantics = CACHE, attn_math: AttentionMath = BF16, chunk_keys: str = "fresh", lazy: bool = False,
    keep_exact: bool | None = None, fork: tuple[int, int] | None = None, record: bool = False,
) -> WindowForward:
    """The forward of one window batch through the variant's cache (`mla_eval.model.executor`): its session, chunk
    schedule and the positions whose final hidden states the loss reads. `lazy`: caches allocated per layer as it
    runs (the layer-major executor). `keep_exact` (default: with observers) keeps the unquantised latents that the
    layer statistics compare with; the reference's top-k recorder needs none. `fork` / `record`: see
    mla_eval.model.executor.WindowForward."""
    if getattr(lm.adapter, "is_v4", False):  # DeepSeek-V4: the session is the attention's own cache argument
        return deepseek_v4.window_forward(lm, variant, ids, score_from)
    b, t = ids.shape
    chunk = semantics.forward_chunk(t, lm.adapter.is_dsa)
    if lm.adapter.is_dsa:
        semantics = CACHE  # engine == cache on the sparse path: one forward, every key from the cache
    specs, outer = session_formats(variant, st.outer_scales)  # a plan row: each layer's own format and s_l
    session = CacheSession(
        specs,
        lm.num_layers,
        b,
        t,
        lm.layer_devices,
        block_size=st.block_size,
        outer_scales=outer,
        observers=tuple(observers or ()),
        keep_exact=bool(observers) if keep_exact is None else keep_exact,
        semantics=semantics,
        attn_math=attn_math,
        chunk_keys=chunk_keys,
        prefill=st.prefill,
        lazy=lazy,
    )
    return WindowForward(ids, session, chunk, slice(score_from, t - 1), fork=fork, record=record)


@torch.no_grad()
def _logp(lm, hidden: torch.Tensor) -> torch.Tensor:
    """float32 log-softmax over the full vocabulary of some rows of final hidden states, [rows, vocab]:
    the model's own output head (and final logit soft-capping where a config has it), as its forward does.
    Under --device-map auto the head sits on the last GPU: the result moves to the input's device."""
    logits = lm.model.get_output_embeddings()(hidden)
    cap = getattr(lm.model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return torch.log_softmax(logits.float(), dim=-1).to(lm.device)


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
