"""Per-layer outer scales s_l = max |c_kv| / (6 * 448) over a calibration text.

`evaluate_calibration(CalibrateSettings(...)) -> CalibrationResult` is the library call behind
`mla-eval calibrate`; `calibrate(lm, source, ctx)` is the step kld and needle run on a held-out slice.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import torch

from mla_eval.attention import dispatch
from mla_eval.attention.semantics import BF16, CACHE, AttentionMath, Semantics, get_math, parse_semantics
from mla_eval.evals import text_sources
from mla_eval.evals.settings import DEFAULT_CTX, ModelSettings, check_ctx, check_math_backend
from mla_eval.evals.text_sources import TokenSource
from mla_eval.formats import OuterScales, get_format
from mla_eval.model.deepseek_v4 import refuse_v4
from mla_eval.model.session import CacheSession
from mla_eval.protocol import ProgressCallback, library_only, no_progress, option, say
from mla_eval.results import environment


def calibration_windows(source: TokenSource, ctx: int) -> list[torch.Tensor]:
    """The non-overlapping windows of `ctx` tokens of every sequence that calibration runs (at least 2 tokens each)."""
    check_ctx(ctx)
    return [s[i : i + ctx] for s in source.sequences for i in range(0, int(s.numel()), ctx) if s[i : i + ctx].numel() > 1]


def calibration_workload(lm, source: TokenSource, ctx: int):
    """The forwards calibration runs (one per window, bf16 cache, one final state kept), for its run plan."""
    from mla_eval.model.run_plan import Workload

    windows = calibration_windows(source, ctx)
    return Workload(batches=len(windows), forwards_per_batch=1, tokens=max((int(w.numel()) for w in windows), default=1),
                    hidden=int(lm.model.config.hidden_size), dtype_bytes=torch.finfo(lm.model.dtype).bits // 8,
                    record_bytes=get_format("bf16").record_bytes, kept=1, exact=False)


@torch.no_grad()
def latent_amax(
    lm, source: TokenSource, ctx: int, progress: ProgressCallback = no_progress,
    semantics: Semantics = CACHE, attn_math: AttentionMath = BF16, runner=None,
) -> list[float]:
    """max |c_kv| per layer over non-overlapping windows of `ctx` tokens of every sequence.

    The windows run through a bf16 cache, where engine and cache semantics read the same keys; under
    engine semantics a window runs in chunks (the engine's schedule). The attention math changes the
    activations that reach later layers, so it can move the scales. `runner` (mla_eval.model.strategy: `Resident`,
    the default, or `Streamed`, layer-major in passes of `batches_per_pass` windows) runs the windows' forwards."""
    from mla_eval.model.executor import WindowForward
    from mla_eval.model.strategy import Resident, passes

    runner = Resident() if runner is None else runner
    amax = [0.0] * lm.num_layers

    def observe(ev) -> None:
        amax[ev.layer] = max(amax[ev.layer], float(ev.latent.abs().max()))

    def forward(chunk: torch.Tensor) -> WindowForward:
        ids = chunk.view(1, -1).to(lm.device)
        session = CacheSession(get_format("bf16"), lm.num_layers, 1, ids.shape[1], lm.layer_devices, observers=(observe,),
                               semantics=semantics, attn_math=attn_math, lazy=runner.lazy)
        # the scales come from the observer: one position's final state is kept, nothing else leaves the layers
        t = ids.shape[1]
        return WindowForward(ids, session, semantics.forward_chunk(t, lm.adapter.is_dsa), slice(t - 1, t))

    chunks = calibration_windows(source, ctx)
    progress("calibrate", 0, len(chunks))
    done = 0
    for batch in passes(chunks, runner):
        runner.forwards(lm, [functools.partial(forward, c) for c in batch])
        done += len(batch)
        progress("calibrate", done, len(chunks))
    return amax


def calibrate(
    lm, source: TokenSource, ctx: int, progress: ProgressCallback = no_progress,
    semantics: Semantics = CACHE, attn_math: AttentionMath = BF16, runner=None,
) -> OuterScales:
    amax = latent_amax(lm, source, ctx, progress, semantics, attn_math, runner)
    provenance = {"model": lm.name, "calibration": source.label, "tokens": source.num_tokens, "max_abs_c_kv": amax}
    if semantics.is_engine or attn_math.name != "bf16":  # older scale files stay byte-identical
        provenance.update(semantics=semantics.label, math=attn_math.name)
    return OuterScales.from_amax(amax, provenance=provenance)


@dataclasses.dataclass(frozen=True)
class CalibrateSettings(ModelSettings, text_sources.TextSettings):
    """Everything `mla-eval calibrate` takes (each field one of its options). Its self-samples default
    to one 768-token sample of seed 1000: not the text kld evaluates on (seed 0) by default."""

    text: Path | None = option(
        None, "--text", path="read", help="Calibration text file (use a different slice than you evaluate on)."
    )
    dataset: str | None = option(None, "--dataset", help="A `datasets` name to calibrate on.")
    max_tokens: int | None = option(None, "--max-tokens", help="Use at most this many tokens (default: all).")
    samples: int = option(1, "--samples", help="Self-samples (no --text/--dataset): number of sequences.")
    sample_len: int = option(768, "--sample-len", help="Self-samples: tokens per sequence.")
    seed: int = option(1000, "--seed", help="Self-samples seed (differs from kld's default 0 on purpose).")
    ctx: int = option(DEFAULT_CTX, "--ctx", help="Forward window length in tokens.")
    semantics: str = option(  # mla_eval.attention.semantics (one value)
        "cache", "--semantics",
        help="One attention semantics for the calibration forwards (see `mla-eval kld --help`); with the bf16 cache "
        "calibration runs, only the schedule changes.",
    )
    math: str = option("bf16", "--math", help="One attention math (bf16, fp8-q, fp8-qp) for the calibration forwards.")
    # inherited settings the library accepts and `mla-eval calibrate` does not offer (its document records no text note)
    text_note: str | None = library_only(None)
    rope_scaling: str = library_only("none")
    max_memory: str | None = library_only(None)

    def __post_init__(self) -> None:
        ModelSettings.__post_init__(self)
        text_sources.TextSettings.__post_init__(self)
        check_ctx(self.ctx)
        parse_semantics(self.semantics)
        check_math_backend([get_math(self.math)], self.backend)


@dataclasses.dataclass
class CalibrationResult:
    scales: OuterScales
    source_label: str
    environment: dict[str, Any]
    execution: dict[str, Any] | None = None  # the execution strategy, its plan, what streaming read

    def to_document(self) -> dict[str, Any]:
        """The published outer-scale schema; the environment and the execution ride along as provenance (readers
        ignore extra keys)."""
        doc = self.scales.to_json()
        doc["environment"] = self.environment
        if self.execution is not None:
            doc["execution"] = self.execution
        return doc


def _request(st: CalibrateSettings):
    """Self-samples and a latent profile need the whole model (ModelSettings.whole_model); anything else may stream."""
    return st.execution_request()


def _plan(ex, source: TokenSource, st: CalibrateSettings, measure: bool, read_bps: float | None = None,
          read_source: str = ""):
    """The calibration's run plan on execution `ex`; measured: its first window through one layer of each build."""
    work = calibration_workload(ex.lm, source, st.ctx)
    plan = ex.decide(work)
    if not measure:
        return plan
    from mla_eval.model.executor import WindowForward

    first = calibration_windows(source, st.ctx)[0].view(1, -1).to(ex.lm.device)
    session = CacheSession(get_format("bf16"), ex.lm.num_layers, 1, first.shape[1], ex.lm.layer_devices,
                           semantics=parse_semantics(st.semantics), attn_math=get_math(st.math), lazy=True)
    t = first.shape[1]
    fwd = WindowForward(first, session, parse_semantics(st.semantics).forward_chunk(t, ex.lm.adapter.is_dsa),
                        slice(t - 1, t))
    cost, bps, src = ex.measure([(fwd, 1.0)], 0.0, ex.planning_input(1, fwd.chunks()[0][1]),
                                describe=f"one calibration window of {t} tokens")
    return ex.decide(work, cost, read_bps if read_bps is not None else bps, read_source if read_bps is not None else src)


def plan_calibration(st: CalibrateSettings, progress: ProgressCallback = no_progress, measure: bool = True):
    """`mla-eval calibrate --dry-run`: the plan of the calibration these settings ask for, without running it."""
    from mla_eval.model.strategy import ExecutionStrategy

    with dispatch.use_backend(st.backend), ExecutionStrategy.open(_request(st), dry_run=True) as ex:
        from mla_eval.evals.kld_plan import planning_source

        source = planning_source(st, ex.lm)  # self-samples: sequences of their shape, not generated
        return _plan(ex, source, st, measure)


def evaluate_calibration(st: CalibrateSettings, progress: ProgressCallback = no_progress) -> CalibrationResult:
    from mla_eval.model.fp8_linear import fp8_calls
    from mla_eval.model.strategy import ExecutionStrategy

    with dispatch.use_backend(st.backend) as log, ExecutionStrategy.open(_request(st)) as ex:
        refuse_v4(ex.lm, "mla-eval calibrate", "its writers take no per-layer outer scale s_l")
        semantics = parse_semantics(st.semantics)
        semantics.check_positions(ex.lm.max_positions)
        source = text_sources.load_source(ex.lm, st, progress)
        plan = _plan(ex, source, st, measure=False)
        lm = ex.realise()
        if ex.mode == "stream":
            plan = _plan(ex, source, st, measure=True)
        for line in plan.lines():
            say(progress, f"plan: {line}")
        profile = st.apply_profile(lm, source.sequences[0], source.label, progress)
        scales = calibrate(lm, source, st.ctx, progress, semantics, get_math(st.math), ex.runner)
        if profile is not None:  # the scales are of the reparametrised model: say which
            scales.provenance["latent_profile"] = {k: profile[k] for k in ("name", "source", "calibration")}
        env = environment(attention=log)
        execution = {**ex.record(), "fp8_gemm_calls": fp8_calls(), "compute": lm.compute()}
    return CalibrationResult(scales, source.label, env, execution)
