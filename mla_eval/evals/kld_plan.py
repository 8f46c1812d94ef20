"""How a KLD run executes (`--offload`, `--dry-run`): its execution strategy (mla_eval.model.strategy) asked for from
the settings, the run plan from the forwards the settings ask for, with a measured layer cost where asked.

The order of a run: `request` (what the settings need: a run of self-samples or a latent profile needs the whole
model), `ExecutionStrategy.open` (a checkpoint folder opened without reading a weight), the text and windows,
`plan_kld` (the plan, printed), `realise` (the model loaded resident, or made streamable: embeddings and head read,
decoder layers read one at a time by the run), and for a streamed run `plan_kld(measure=True)`: one layer of each
build timed, which sizes the passes. A dry run stops after the plan.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from mla_eval.evals.kld import (
    KldProtocol,
    _logp,
    _same_shape_groups,
    _window_forward,
    loss_chunk_rows,
    plan_windows,
    workload,
)
from mla_eval.evals.kld_stats import token_metrics
from mla_eval.evals.layer_stats import LayerStats
from mla_eval.evals.text_sources import TokenSource
from mla_eval.evals.variants import Variant
from mla_eval.formats import get_format
from mla_eval.model.run_plan import RunPlan
from mla_eval.model.strategy import TIMING_REPEATS, ExecutionRequest, ExecutionStrategy, inventory, random_fill

__all__ = ["KldPlan", "PhasePeaks", "inventory", "plan_kld", "planning_source", "request"]


def request(st) -> ExecutionRequest:
    """What a KLD run asks of its execution (ModelSettings.execution_request: self-samples and a latent profile need
    the whole model)."""
    return st.execution_request()


def planning_source(st, lm) -> TokenSource:
    """The token source a plan counts windows on: the text itself, or (self-samples, not generated for a plan)
    sequences of the self-samples' shape."""
    from mla_eval.evals import text_sources

    if st.self_samples:
        return TokenSource("self-samples", f"{st.samples} self-samples of {st.sample_len} tokens (not generated for the plan)",
                           [torch.zeros(st.sample_len, dtype=torch.long) for _ in range(st.samples)], "plan")
    return text_sources.load_source(lm, st)


@dataclasses.dataclass
class KldPlan:
    """A run plan and how it was measured."""

    plan: RunPlan
    measured: dict[str, Any]  # what the layer-cost measurement timed (layers, sessions, weights used)

    def as_dict(self) -> dict[str, Any]:
        return {**self.plan.as_dict(), "measured": self.measured}

    def lines(self) -> list[str]:
        return self.plan.lines()


def plan_kld(ex: ExecutionStrategy, source: TokenSource, protocol: KldProtocol, measure: bool, ref_file=None,
             rank: int = 0, world: int = 1, read_bps: float | None = None, read_source: str = "") -> KldPlan:
    """The plan of a KLD run of `protocol` over `source` on execution `ex` (decided on the first call). `measure`:
    time one decoder layer of each distinct build on the device (`ExecutionStrategy.measure`) and the output head's
    loss for the projection, and the checkpoint's read speed (`read_bps`: a disk read rate measured elsewhere, named
    by `read_source`, instead)."""
    lm = ex.lm
    plan_windows(lm, source, protocol)
    work = workload(lm, source, protocol, ref_file, rank, world)
    plan = ex.decide(work)  # refusals (nothing fits) before any measurement
    if not measure:
        return KldPlan(plan, dict(ex.measured))
    samples, ws, names = sample_forwards(ex, source, protocol, ref_file)
    hidden = ex.planning_input(len(ws), samples[0][0].chunks()[0][1])
    head = _time_head(lm, len(ws) * (ws[0].length - 1 - ws[0].score_from))
    cost, measured_bps, read_src = ex.measure(samples, head, hidden, describe=(
        f"one window batch of {samples[0][0].ids.numel()} tokens through {names} (weighted by their forwards)"))
    if read_bps is None:
        read_bps = measured_bps
    else:
        read_src = read_source or "given"
    plan = ex.decide(work, cost, read_bps, read_src)
    return KldPlan(plan, {**ex.measured, "sessions": names.split(", ")})


def sample_forwards(ex: ExecutionStrategy, source: TokenSource, protocol: KldProtocol, ref_file=None):
    """The forwards a layer-cost measurement times: the run's widest window batch through the reference's cache session
    and the first row's (the row's with the layer statistics' observers where the run has them: they cost time), each
    weighted by how many forwards of the run it stands for. (samples, windows, session names)."""
    lm = ex.lm
    windows = plan_windows(lm, source, protocol)
    # the run's widest window batch (the first windows of a sequence may batch apart: another scored range)
    groups = [g for i in range(0, len(windows), protocol.batch)
              for g in _same_shape_groups(list(enumerate(windows))[i : i + protocol.batch])]
    group = max(groups, key=lambda g: len(g) * g[0][1].length)
    ws = [w for _, w in group]
    ids = torch.stack([source.sequences[w.seq][w.start : w.start + w.length] for w in ws]).to(lm.device)
    rows = [v for v, _ in protocol.rows(Variant(get_format("bf16"))) if not v.outer]  # scales are not known yet
    variants = [protocol.ref, rows[0]] if rows else [protocol.ref]
    stats = LayerStats(lm.num_layers) if protocol.layer_stats else None
    fwds = [_window_forward(lm, v, ids, ws[0].score_from, protocol, stats.observers(v.spec) if stats and k else None)
            for k, v in enumerate(variants)]
    # per forward of the run: the reference's share (none with a stored reference) and the rows' share
    n_rows = len(protocol.rows(Variant(get_format("bf16"))))
    weight = [0 if ref_file is not None else 1, n_rows][: len(fwds)] if rows else [1]
    return list(zip(fwds, weight)), ws, ", ".join(v.name for v in variants)


@torch.no_grad()
def _time_head(lm, rows: int) -> float:
    """Seconds of one forward's loss: the output head's full-vocabulary log-probs of its `rows` kept positions (in
    the run's row chunks) and the token metrics against a reference's (random states: the time does not depend on
    them). A head still on the meta device gets random values of its shape for the timing, then goes back."""
    head = lm.model.get_output_embeddings()
    on_meta = head.weight.device.type == "meta"
    if on_meta:
        random_fill(head, lm.device, lm.model.dtype, seed=-1)
    hidden = torch.randn(rows, lm.model.config.hidden_size, device=lm.device).to(lm.model.dtype)
    targets = torch.zeros(rows, dtype=torch.long, device=lm.device)
    step = loss_chunk_rows(lm.model.config.vocab_size)
    times = []
    for _ in range(TIMING_REPEATS + 1):
        _sync(lm.device)
        t0 = time.perf_counter()
        for c in range(0, rows, step):
            logp = _logp(lm, hidden[c : c + step])
            token_metrics(logp, logp, targets[c : c + step])
        _sync(lm.device)
        times.append(time.perf_counter() - t0)
    if on_meta:
        head.to("meta")
    return sorted(times[1:])[len(times[1:]) // 2]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class PhasePeaks:
    """Peak device memory of each phase of a run (load, plan, calibrate, score), bytes as torch allocated them;
    nothing on a CPU run (torch keeps no such count there)."""

    def __init__(self, device: torch.device | None) -> None:
        self.device = torch.device("cpu" if device is None else device)  # None: several devices, not tracked
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.peaks: dict[str, int] = {}
        self._phase: str | None = None
        self._t0 = 0.0
        self.seconds: dict[str, float] = {}

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def start(self, phase: str) -> None:
        self.stop()
        self._phase, self._t0 = phase, time.perf_counter()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def stop(self) -> None:
        if self._phase is None:
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.peaks[self._phase] = int(torch.cuda.max_memory_allocated(self.device))
        self.seconds[self._phase] = round(time.perf_counter() - self._t0, 3)
        self._phase = None

    def merge_peaks(self, env: dict[str, Any]) -> dict[str, Any]:
        """The environment's whole-run peak (`results.environment` reads torch's counter, which each phase reset) made
        the largest phase peak again."""
        self.stop()
        gib = env.get("gpu_peak_memory_gib")
        if self.cuda and self.peaks and isinstance(gib, dict):
            for dev in gib:
                if torch.device(dev) == self.device:
                    gib[dev] = max(gib[dev], round(max(self.peaks.values()) / 2**30, 3))
        return env

    def as_dict(self) -> dict[str, Any]:
        self.stop()
        return {"device": str(self.device), "peak_bytes": dict(self.peaks) if self.cuda else None,
                "seconds": dict(self.seconds)}
