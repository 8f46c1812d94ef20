"""The built-in evaluations, as the command line, recipes, the gate, the report and the api see them
(the protocol: mla_eval.evaluation). A new evaluation is declared the same way: see
docs/ARCHITECTURE.md, "How to add an evaluation".
"""

from __future__ import annotations

from typing import Iterable

from mla_eval.capacity import CapacityResult, CapacitySettings, evaluate_capacity
from mla_eval.errors import UserError
from mla_eval.evals.calibrate import CalibrateSettings, CalibrationResult, evaluate_calibration
from mla_eval.evals.kld_evaluation import KldResult, KldSettings, evaluate_kld
from mla_eval.evals.needle_evaluation import NeedleResult, NeedleSettings, evaluate_needle
from mla_eval.evals.plan_evaluation import PlanResult, PlanSettings, evaluate_plan
from mla_eval.evals.report_tables import capacity_tables, identity, kld_tables, needle_tables
from mla_eval.formats.spec import OUTER_SCALE_SCHEMA
from mla_eval.protocol import Evaluation, Metric
from mla_eval.result_schemas import BUILTIN_SCHEMA_FILES, CAPACITY_SCHEMA, KLD_SCHEMA, NEEDLE_SCHEMA, PLAN_SCHEMA


def format_rows(doc: dict) -> Iterable[tuple[str, dict]]:
    """A kld or needle document's rows: `formats` maps a row label to its figures; the identity adds
    the attention semantics and math it ran under (`identity`)."""
    return [(identity(key, row, doc), row) for key, row in doc.get("formats", {}).items()]


def capacity_rows(doc: dict) -> Iterable[tuple[str, dict]]:
    return [(row["name"], row) for row in doc.get("formats", [])]


def kld_window_path(doc: dict) -> str:
    """How a kld document's windows read the cache (`settings.prefill`: absorbed or mha); a document
    written before the key existed ran absorbed."""
    return doc.get("settings", {}).get("prefill") or "absorbed"


def kld_comparable(results: dict, baseline: dict, name: str) -> None:
    """The two window paths agree only to within path rounding (about 2 % of a mean KLD on the H200), so a
    gate across them would pass or fail on the path, not the format."""
    ran, base = kld_window_path(results), kld_window_path(baseline)
    if ran != base:
        raise UserError(
            f"{name}: the results' kld windows ran --prefill {ran}, the baseline's {base}; "
            f"rerun with --prefill {base} (or refresh the baseline with --update)"
        )


def capacity_setup_name(opts: dict) -> str:
    """An unnamed capacity setup's name from its GPU and parallelism, e.g. h200-x8-tp8."""
    parts = [str(opts["gpu"])] if "gpu" in opts else []
    parts += [f"{prefix}{opts[key]}" for key, prefix in (("gpus", "x"), ("tp", "tp"), ("dcp", "dcp")) if key in opts]
    return "-".join(parts)


KLD = Evaluation(
    name="kld",
    summary="Teacher-forced KL divergence of each cache format vs a reference format.",
    settings=KldSettings,
    run=evaluate_kld,
    result=KldResult,
    schema=KLD_SCHEMA,
    schema_file=BUILTIN_SCHEMA_FILES[KLD_SCHEMA],
    result_file="kld.json",
    metrics=(
        Metric("kld_mean", "lower", abs_tol=1e-4, rel_tol=0.05),
        Metric("kld_p99", "lower", abs_tol=1e-3, rel_tol=0.10),
        Metric("same_top1_pct", "higher", abs_tol=0.5),
    ),
    rows=format_rows,
    comparable=kld_comparable,
    report=kld_tables,
    cli="mla_eval.commands.kld",
)

CALIBRATE = Evaluation(
    name="calibrate",
    summary="Compute per-layer outer scales s_l = max|c_kv| / (6*448) and write the published JSON schema.",
    settings=CalibrateSettings,
    run=evaluate_calibration,
    result=CalibrationResult,
    # the published outer-scale file names its kind in its "format" key; OuterScales.load checks it (no JSON Schema)
    schema=OUTER_SCALE_SCHEMA,
    cli="mla_eval.commands.calibrate",
)

NEEDLE = Evaluation(
    name="needle",
    summary="Needle-in-a-haystack retrieval per cache format, on identical prompts of exact token length.",
    settings=NeedleSettings,
    run=evaluate_needle,
    result=NeedleResult,
    schema=NEEDLE_SCHEMA,
    schema_file=BUILTIN_SCHEMA_FILES[NEEDLE_SCHEMA],
    result_file="needle.json",
    metrics=(Metric("mean_accuracy", "higher"), Metric("effective_length", "higher")),
    rows=format_rows,
    report=needle_tables,
    cli="mla_eval.commands.needle",
)

CAPACITY = Evaluation(
    name="capacity",
    summary="KV-cache capacity per cache format: bytes per token, blocks, pool tokens, max context, concurrency.",
    settings=CapacitySettings,
    run=evaluate_capacity,
    result=CapacityResult,
    schema=CAPACITY_SCHEMA,
    schema_file=BUILTIN_SCHEMA_FILES[CAPACITY_SCHEMA],
    result_file="capacity.json",
    metrics=(Metric("pool_tokens", "exact"), Metric("bytes_per_token", "exact")),
    rows=capacity_rows,
    report=capacity_tables,
    setups=True,
    setup_name=capacity_setup_name,
    from_table=lambda table, where, fixed: CapacitySettings.from_options(table, where=where),
    instant=True,
    cli="mla_eval.commands.capacity",
)

PLAN = Evaluation(
    name="plan",
    summary="Per-layer cache formats under a byte or quality budget: per-layer sensitivity, then an exact knapsack.",
    settings=PlanSettings,
    run=evaluate_plan,
    result=PlanResult,
    schema=PLAN_SCHEMA,
    schema_file=BUILTIN_SCHEMA_FILES[PLAN_SCHEMA],
    result_file="plan.json",
    cli="mla_eval.commands.plan",
)

# registry order: commands, recipe tables, gate metrics and report sections follow it
BUILTIN_EVALUATIONS = (KLD, CALIBRATE, NEEDLE, CAPACITY, PLAN)
