"""The public library surface: typed settings in, typed results out, each result serialisable to
its versioned JSON document (`result.to_document()`). The CLI commands are thin layers over these.

    from mla_eval import api
    result = api.evaluate_kld(api.KldSettings(formats="nvfp4,fp8_ds_mla", device="cpu"))
    result.mean_kld("nvfp4")

Every call accepts `progress(stage, done, total)` for long work and never prints.

`KldSettings.prefill` left at None is `auto` (`mla_eval.evals.kld.DEFAULT_KLD_PREFILL`): the mha window path where
it computes the absorbed path's semantics (`layer_stats=False`, bf16 math, not a DSA model), else absorbed with the
reason in `result.settings["prefill_reason"]`; `prefill="auto"` adds that reason to `result.notes`, and
`prefill="absorbed"` keeps a run comparable with figures computed that way.
"""

from mla_eval.evals.calibrate import CalibrateSettings, CalibrationResult, evaluate_calibration
from mla_eval.evals.kld_evaluation import KldResult, KldSettings, evaluate_kld
from mla_eval.evals.needle_evaluation import NeedleResult, NeedleSettings, evaluate_needle
from mla_eval.evals.variants import Variant, parse_variants
from mla_eval.evaluation import ProgressCallback
from mla_eval.results import write_result

__all__ = [
    "CalibrateSettings", "CalibrationResult", "evaluate_calibration",
    "KldResult", "KldSettings", "evaluate_kld",
    "NeedleResult", "NeedleSettings", "evaluate_needle",
    "ProgressCallback", "Variant", "parse_variants", "write_result",
]
