"""`mla-eval plan` as a library call: `evaluate_plan(PlanSettings(...)) -> PlanResult`.

Measure each candidate format's per-layer cost on the model and text (mla_eval.evals.sensitivity), then choose one
format per layer under the budget exactly (mla_eval.evals.knapsack). The result's document is the plan file itself
(`mla-eval/plan/v1`, mla_eval.layer_plan) with the sensitivity table it was solved from: `kld --formats plan:FILE`
measures it, `capacity --plan FILE` sizes its pool.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mla_eval.attention import dispatch
from mla_eval.errors import UserError
from mla_eval.evals import knapsack, text_sources
from mla_eval.evals.calibrate import calibrate, calibration_workload
from mla_eval.evals.kld import KldProtocol, plan_windows, resolve_prefill
from mla_eval.evals.kld_evaluation import _split_calibration, evaluation_sources
from mla_eval.evals.sensitivity import (
    Sensitivity,
    layer_scales,
    measure_sensitivity,
    sensitivity_from_dict,
    sweep_protocol,
)
from mla_eval.evals.settings import DEFAULT_CTX, ModelSettings, check_ctx, default_min_context, default_stride
from mla_eval.evals.variants import Variant, parse_variants
from mla_eval.formats import OuterScales, get_format
from mla_eval.layer_plan import LayerPlan
from mla_eval.model.deepseek_v4 import refuse_v4
from mla_eval.model_presets import architecture_digest
from mla_eval.protocol import ProgressCallback, no_progress, option, say
from mla_eval.results import environment

DEFAULT_CANDIDATES = "fp8_ds_mla,nvfp4+s_l,nvfp4_fp8rope+s_l,nvfp4_fp8_ds_mla"  # formats an engine serves today
POOL_REFERENCE = "fp8_ds_mla"  # --pool-gain compares with a uniform cache of this format


@dataclasses.dataclass(frozen=True)
class PlanSettings(ModelSettings, text_sources.TextSettings):
    """Everything `mla-eval plan` takes: each field is one of its options (and a recipe's [plan] key)."""

    candidates: str | list[str] = option(
        DEFAULT_CANDIDATES, "--candidates",
        help="Comma-separated formats a layer may take (+s_l: with its calibrated outer scale).",
    )
    budget_bytes_per_token: int | None = option(
        None, "--budget-bytes-per-token",
        help="Least predicted KLD within this many cache bytes per token, summed over the layers.",
    )
    max_kld: float | None = option(None, "--max-kld", help="Fewest bytes per token whose predicted KLD is at most this.")
    pool_gain: float | None = option(
        None, "--pool-gain",
        help=f"Least predicted KLD whose pool holds at least this many times {POOL_REFERENCE}'s tokens (1.25: 25 % more).",
    )
    ctx: int | None = option(
        None, "--ctx", help=f"Window length in tokens (default {DEFAULT_CTX}; self-samples: --sample-len)."
    )
    stride: int | None = option(None, "--stride", help="Window stride in tokens (default: as kld).")
    min_context: int | None = option(None, "--min-context", help="Score only tokens with this much context (default ctx/2).")
    batch: int | None = option(  # None: 1 window, or every self-sample at once (as kld)
        None, "--batch", help="Windows per forward (default: 1; self-samples: all samples at once)."
    )
    scales: str = option(
        "auto", "--scales",
        help="Outer scales for +s_l candidates: a JSON file (nvfp4_ds_mla_outer_scale_v1) or 'auto' (calibrate on a "
        "held-out slice, as kld does).",
    )
    calib_tokens: int = option(
        2048, "--calib-tokens",
        help="--scales auto on a text: its first tokens held out to calibrate s_l, not scored (the text then needs "
        "more than twice as many; self-samples calibrate on one more sample instead).",
    )
    sensitivity: Path | None = option(
        None, "--sensitivity", path="read",
        help="Re-solve under this budget from the sensitivity table of an earlier plan file (its model, text and "
        "candidates; --candidates may pick a subset of them), without loading the model.",
    )
    proxy: bool = option(
        True, "--proxy/--no-proxy",
        help="Also run the uniform candidates with layer statistics: each layer's attention-output error, its rank "
        "agreement with the KLD costs, and each candidate's uniform KLD (C + 1 more forwards per window).",
    )

    def __post_init__(self) -> None:
        ModelSettings.__post_init__(self)
        text_sources.TextSettings.__post_init__(self)
        check_ctx(self.ctx)
        given = [n for n, v in (("--budget-bytes-per-token", self.budget_bytes_per_token), ("--max-kld", self.max_kld),
                                ("--pool-gain", self.pool_gain)) if v is not None]
        if len(given) != 1:
            raise UserError("give one budget: --budget-bytes-per-token B, --max-kld K or --pool-gain P"
                            + (f" (got {', '.join(given)})" if given else ""))
        if self.budget_bytes_per_token is not None and self.budget_bytes_per_token < 1:
            raise UserError(f"--budget-bytes-per-token must be positive, got {self.budget_bytes_per_token}")
        if self.max_kld is not None and not self.max_kld >= 0:
            raise UserError(f"--max-kld must be >= 0, got {self.max_kld}")
        if self.pool_gain is not None and not self.pool_gain > 0:
            raise UserError(f"--pool-gain must be positive, got {self.pool_gain}")
        if self.batch is not None and self.batch < 1:
            raise UserError(f"--batch must be at least 1, got {self.batch}")
        if self.calib_tokens < 1:
            raise UserError(f"--calib-tokens must be at least 1, got {self.calib_tokens}")
        if self.scales == "none" and any(v.outer for v in self.candidate_variants()):
            raise UserError("--scales none, but +s_l candidates were asked for; drop them or give --scales FILE")
        self.candidate_variants()

    def candidate_variants(self) -> list[Variant]:
        found = parse_variants(self.candidates, option="--candidates")
        for v in found:
            if v.spec.control:
                raise UserError(f"--candidates {v.name}: controls are not cache formats to deploy; plans refuse them")
        return found

    def budget(self, num_layers: int) -> dict[str, Any]:
        if self.budget_bytes_per_token is not None:
            return {"kind": "bytes_per_token", "value": self.budget_bytes_per_token}
        if self.max_kld is not None:
            return {"kind": "max_kld", "value": self.max_kld}
        return {"kind": "pool_gain", "value": self.pool_gain}


def pool_gain_budget(gain: float, num_layers: int) -> int:
    """Bytes per token within which the pool holds `gain` x a uniform POOL_REFERENCE cache's tokens (pool tokens go as
    1 / bytes per token; vLLM's whole-block rounding moves this by under one block)."""
    return int(num_layers * get_format(POOL_REFERENCE).record_bytes / gain)


def solve(sens: Sensitivity, budget: dict[str, Any]) -> knapsack.Choice:
    """The plan's picks (candidate indices per layer) for `budget` (PlanSettings.budget)."""
    names = [c.name for c in sens.candidates]
    cost = [[sens.kld[n][layer] for n in names] for layer in range(sens.num_layers)]
    size = [c.spec.record_bytes for c in sens.candidates]
    if budget["kind"] == "max_kld":
        return knapsack.min_bytes(cost, size, budget["value"])
    limit = budget["value"] if budget["kind"] == "bytes_per_token" else pool_gain_budget(budget["value"], sens.num_layers)
    return knapsack.min_cost(cost, size, limit)


def check_reachable(budget: dict[str, Any], candidates: list[Variant], num_layers: int) -> None:
    """A byte budget below every layer in the smallest candidate fails before the sweep, not after it."""
    if budget["kind"] == "max_kld":
        return
    limit = budget["value"] if budget["kind"] == "bytes_per_token" else pool_gain_budget(budget["value"], num_layers)
    least = num_layers * min(c.spec.record_bytes for c in candidates)
    if limit < least:
        raise UserError(f"no plan fits {limit} bytes per token: {num_layers} layers of the smallest candidate take "
                        f"{least}; raise the budget or add a smaller format to --candidates")


def make_plan(sens: Sensitivity, choice: knapsack.Choice, outer: OuterScales | None, **kw) -> LayerPlan:
    layers = tuple(sens.candidates[k] for k in choice.picks)
    scales = tuple(layer_scales(v, outer, sens.num_layers)[i] for i, v in enumerate(layers))
    return LayerPlan(layers, scales, predicted_kld=choice.cost, **kw)


@dataclasses.dataclass
class PlanResult:
    plan: LayerPlan
    sensitivity: Sensitivity
    outer_scales: OuterScales | None
    environment: dict[str, Any]
    rank: int = 0

    @property
    def model(self) -> dict[str, Any]:
        return self.plan.model

    def to_document(self) -> dict[str, Any]:
        return self.plan.to_json()


def replan(st: PlanSettings) -> PlanResult:
    """--sensitivity FILE: the knapsack again, under this budget, on the costs an earlier plan file holds."""
    old = LayerPlan.load(st.sensitivity)
    source = f"plan file {st.sensitivity}"
    table, names = old.extra.get("sensitivity"), old.extra.get("candidates")
    if not isinstance(table, dict) or not isinstance(names, list):
        raise UserError(f"{source} holds no sensitivity table (a plan written by `mla-eval plan` does)")
    known = parse_variants(names, option=source)
    asked = st.candidate_variants()
    chosen = known if st.candidates == DEFAULT_CANDIDATES else asked
    extra = [v.name for v in chosen if v not in known]
    if extra:
        raise UserError(f"--candidates {', '.join(extra)}: {source} measured only {', '.join(names)}; "
                        "measure again without --sensitivity")
    try:
        sens = sensitivity_from_dict(table, chosen, old.num_layers)
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{source}: its sensitivity table is unreadable ({exc}); make the plan again") from None
    outer_doc = old.extra.get("outer_scales")
    outer = None if outer_doc is None else OuterScales.from_json(outer_doc, source=source)
    budget = st.budget(old.num_layers)
    choice = solve(sens, budget)
    extra_keys = {**old.extra, "candidates": [c.name for c in chosen], "sensitivity": sens.as_dict(),
                  "resolved_from": str(st.sensitivity)}
    plan = make_plan(sens, choice, outer if any(c.outer for c in chosen) else None, model=old.model, budget=budget,
                     extra=extra_keys)
    return PlanResult(plan, sens, outer, old.extra.get("environment", {}))


def _sweep(st: PlanSettings, lm, source):
    """The resolved window protocol of the sweep (every default decided once) and its single-layer plan rows' run,
    as kld runs it (`sensitivity.sweep_protocol`), for the plan and the sweep alike."""
    ctx = st.ctx if st.ctx is not None else (st.sample_len if st.self_samples else DEFAULT_CTX)
    min_context = st.min_context if st.min_context is not None else default_min_context(ctx)
    stride = st.stride if st.stride is not None else default_stride(ctx, min_context)
    batch = st.batch if st.batch is not None else (len(source.sequences) if st.self_samples else 1)
    candidates = st.candidate_variants()
    protocol = KldProtocol(tuple(candidates), Variant(get_format("bf16")), ctx, stride, min_context, batch,
                           layer_stats=False)
    plan_windows(lm, source, protocol)  # bad window settings fail before any work
    prefill, _ = resolve_prefill("auto", protocol, lm.adapter.is_dsa)
    return dataclasses.replace(protocol, prefill=prefill)


def _plan(ex, source, st: PlanSettings, measure: bool, read_bps: float | None = None, read_source: str = ""):
    """The sweep's run plan on execution `ex` (the single-layer rows' forwards: the pass that dominates), measured
    with kld's sample forwards where asked."""
    from mla_eval.evals import kld_plan

    protocol = _sweep(st, ex.lm, source)
    # the run plan sizes forwards and caches, which s_l does not change; calibration comes later (or never, in a dry
    # run): unit scales stand in for +s_l candidates here, and no number is scored with them
    n = ex.lm.num_layers
    stand_in = OuterScales((1.0,) * n, provenance={"stand_in": "run planning only"})
    sweep = sweep_protocol(protocol, st.candidate_variants(), stand_in, n)
    return kld_plan.plan_kld(ex, source, sweep, measure, read_bps=read_bps, read_source=read_source)


def plan_plan(st: PlanSettings, progress: ProgressCallback = no_progress, measure: bool = True):
    """`mla-eval plan --dry-run`: the plan of the sensitivity sweep these settings ask for, without running it."""
    from mla_eval.model.strategy import ExecutionStrategy

    if st.sensitivity is not None:
        raise UserError("--dry-run plans a sensitivity sweep; --sensitivity re-solves a stored one without a model: "
                        "drop one of them")
    with dispatch.use_backend(st.backend), ExecutionStrategy.open(st.execution_request(), dry_run=True) as ex:
        from mla_eval.evals.kld_plan import planning_source

        source = planning_source(st, ex.lm)  # self-samples: sequences of their shape, not generated
        if st.scales == "auto" and any(v.outer for v in st.candidate_variants()) and not st.self_samples:
            _calib, source = _split_calibration(source, st.calib_tokens)  # as evaluation_sources holds it out
        return _plan(ex, source, st, measure)


def evaluate_plan(st: PlanSettings, progress: ProgressCallback = no_progress) -> PlanResult:
    """Sensitivity of every candidate at every layer, then the exact knapsack under the budget; resident or streamed
    as the execution strategy decides (mla_eval.model.strategy)."""
    if st.sensitivity is not None:
        return replan(st)
    from mla_eval.model.fp8_linear import fp8_calls
    from mla_eval.model.strategy import ExecutionStrategy

    candidates = st.candidate_variants()
    needs_outer = any(v.outer for v in candidates)
    given = None if st.scales in ("auto", "none") else OuterScales.load(st.scales)
    with dispatch.use_backend(st.backend) as log, ExecutionStrategy.open(st.execution_request()) as ex:
        refuse_v4(ex.lm, "mla-eval plan", "a V4 session takes one cache configuration for every layer (no per-layer "
                  "plan of V4 configurations, nor sensitivity per layer)")
        if given is not None:
            given.check_layers(ex.lm.num_layers, source=st.scales)
        check_reachable(st.budget(ex.lm.num_layers), candidates, ex.lm.num_layers)
        # as kld: self-samples (no --text / --dataset) with one more sample to calibrate on, else a held-out slice
        source, calib = evaluation_sources(ex.lm, st, needs_outer, progress)
        kp = _plan(ex, source, st, measure=False)
        lm = ex.realise()
        if ex.mode == "stream":
            kp = _plan(ex, source, st, measure=True)
        for line in kp.lines():
            say(progress, f"plan: {line}")
        profile = st.apply_profile(lm, (calib or source).sequences[0], (calib or source).label, progress)
        protocol = _sweep(st, lm, source)
        ctx, stride, min_context, prefill = protocol.ctx, protocol.stride, protocol.min_context, protocol.prefill
        outer = given
        if calib is not None:
            outer = calibrate(lm, calib, ctx, progress=progress, runner=ex.runner_for(calibration_workload(lm, calib, ctx)))
        sens = measure_sensitivity(lm, source, protocol, candidates, outer if needs_outer else None, st.proxy, progress,
                                   execution=ex)
        env = environment(attention=log)
        execution = {**ex.record(), "fp8_gemm_calls": fp8_calls()}
    budget = st.budget(lm.num_layers)
    choice = solve(sens, budget)
    model = {"name": lm.name, "path": str(lm.path), "layers": lm.num_layers, "default": lm.is_default,
             "geometry": architecture_digest(lm.model.config), "latent_profile": profile, **lm.compute()}
    text = {"kind": source.kind, "label": source.label, "digest": source.digest, "tokens": source.num_tokens}
    extra = {
        "text": text,
        "candidates": [c.name for c in candidates],
        "settings": {"ctx": ctx, "stride": stride, "min_context": min_context, "batch": protocol.batch,
                     "prefill": prefill, "backend": log.backend, "scales": st.scales,
                     "calib_tokens": st.calib_tokens if calib else None, "offload": st.offload},
        "outer_scales": None if outer is None else outer.to_json(),
        "sensitivity": sens.as_dict(),
        "environment": env,
        "execution": execution,
    }
    plan = make_plan(sens, choice, outer if needs_outer else None, model=model, budget=budget, extra=extra)
    return PlanResult(plan, sens, outer, env)
