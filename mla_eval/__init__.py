"""mla-eval: quality and capacity evaluation of low-precision MLA KV caches.

The library API lives in `mla_eval.api` (also reachable as `mla_eval.evaluate_kld` etc., loaded
on first use so that `import mla_eval` stays light).
"""

from mla_eval.version import __version__ as __version__

_API = (
    "CalibrateSettings", "CalibrationResult", "evaluate_calibration", "KldResult", "KldSettings", "evaluate_kld",
    "NeedleResult", "NeedleSettings", "evaluate_needle", "Variant", "parse_variants",
)


def __getattr__(name: str):
    if name in _API:
        from mla_eval import api

        return getattr(api, name)
    if name == "api":
        import importlib

        return importlib.import_module("mla_eval.api")
    raise AttributeError(f"module 'mla_eval' has no attribute {name!r}")
