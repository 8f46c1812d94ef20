"""The public library surface: typed settings in, typed results out, each result serialisable to
its versioned JSON document (`result.to_document()`). The CLI commands are thin layers over these.

    from mla_eval import api
    result = api.evaluate_kld(api.KldSettings(formats="nvfp4,fp8_ds_mla", device="cpu"))
    result.mean_kld("nvfp4")

    capacity = api.evaluate_capacity(api.CapacitySettings(preset="glm-5", gpu="h200", gpus=8, tp=8, formats="nvfp4"))
    capacity.rows[0].pool_tokens                  # tokens one engine's KV pool holds in nvfp4
    capacity.to_document()["schema"]              # "mla-eval.capacity/1"

    api.evaluate(api.NeedleSettings(lengths="1K", depths="50", formats="nvfp4", device="cpu"))  # by its settings

Every call accepts `progress(stage, done, total)` for long work and never prints. `api.evaluations()`
lists every registered evaluation (mla_eval.evaluation), built-in or added with `register_evaluation`;
`api.evaluate(settings)` runs whichever one takes those settings.

`KldSettings.prefill` left at None is `auto` (`mla_eval.evals.kld.DEFAULT_KLD_PREFILL`): the mha window path where
it computes the absorbed path's semantics (`layer_stats=False`, bf16 math, not a DSA model), else absorbed with the
reason in `result.settings["prefill_reason"]`; `prefill="auto"` adds that reason to `result.notes`, and
`prefill="absorbed"` keeps a run comparable with figures computed that way.
"""

from __future__ import annotations

from typing import Any

from mla_eval.capacity import CapacityResult, CapacitySettings, evaluate_capacity
from mla_eval.evals.calibrate import CalibrateSettings, CalibrationResult, evaluate_calibration
from mla_eval.evals.kld_evaluation import KldResult, KldSettings, evaluate_kld
from mla_eval.evals.needle_evaluation import NeedleResult, NeedleSettings, evaluate_needle
from mla_eval.evals.variants import Variant, parse_variants
from mla_eval.evaluation import evaluation_for_settings, get_evaluation, register_evaluation, unregister_evaluation
from mla_eval.evaluation import evaluations as _evaluations
from mla_eval.protocol import Evaluation, Metric, ProgressCallback, library_only, no_progress, option
from mla_eval.results import write_result

__all__ = [
    "CalibrateSettings", "CalibrationResult", "evaluate_calibration",
    "CapacityResult", "CapacitySettings", "evaluate_capacity",
    "KldResult", "KldSettings", "evaluate_kld",
    "NeedleResult", "NeedleSettings", "evaluate_needle",
    "Evaluation", "Metric", "option", "library_only", "register_evaluation", "unregister_evaluation",
    "evaluate", "evaluation", "evaluations",
    "ProgressCallback", "Variant", "parse_variants", "write_result",
]


def evaluations() -> list[str]:
    """The name of every registered evaluation (each is also a command and, with a results file, a recipe table)."""
    return [ev.name for ev in _evaluations()]


def evaluation(name: str) -> Evaluation:
    """A registered evaluation by name: its `settings` class, `run`, schema and gate metrics."""
    return get_evaluation(name)


def evaluate(settings: Any, progress: ProgressCallback = no_progress) -> Any:
    """Run the evaluation that takes `settings` (a KldSettings runs kld, ...) and return its typed result."""
    return evaluation_for_settings(settings).run(settings, progress)
