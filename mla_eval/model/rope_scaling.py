"""`--rope-scaling yarn:FACTOR`: extend a checkpoint's context with YaRN, through transformers' own config.

The option rewrites the loaded config before the weights are built: `rope_parameters` (transformers 5.x;
the legacy `rope_scaling` attribute on configs without it) becomes YaRN with the given factor and
`max_position_embeddings` grows by the factor. The YaRN parameters besides the factor follow
DeepSeek-V3's published config.json (deepseek-ai/DeepSeek-V3: beta_fast 32, beta_slow 1, mscale 1,
mscale_all_dim 1); the original length is the checkpoint's own max_position_embeddings. transformers
then computes the interpolated frequencies (`_compute_yarn_parameters`) and, for the DeepSeek family,
multiplies the attention softmax scale by mscale(factor)^2 (`yarn_apply_mscale`); our adapter reads
both (the rotary `position_embeddings` and `module.scaling`), so every cache format sees them.
Parsing imports neither torch nor transformers (settings validate it before any load).
"""

from __future__ import annotations

import math

from mla_eval.errors import UserError
from mla_eval.model_presets import DSV3_YARN_SHAPE

ROPE_SCALING_HELP = (
    "Extend the model's context with YaRN rope scaling: 'yarn:FACTOR' (FACTOR >= 1; e.g. yarn:2 takes the default "
    "model from 65,536 to 131,072 positions), other YaRN parameters as DeepSeek-V3's config (beta_fast 32, beta_slow 1, "
    "mscale = mscale_all_dim = 1). 'none' (default): the checkpoint's own rope. Recorded in the result's model.rope_scaling."
)
YARN_DEFAULTS = DSV3_YARN_SHAPE  # one definition, beside the presets that publish it


def parse_rope_scaling(text: str | None) -> float | None:
    """'yarn:4' -> 4.0; 'none' / None / '' -> None. A factor that is not a number or below 1 is a UserError."""
    if text is None or str(text).strip().lower() in ("", "none"):
        return None
    kind, sep, value = str(text).strip().partition(":")
    if kind.strip().lower() != "yarn" or not sep:
        raise UserError(f"--rope-scaling {text!r}: give yarn:FACTOR (e.g. yarn:2) or none")
    try:
        factor = float(value)
    except ValueError:
        raise UserError(f"--rope-scaling {text!r}: the YaRN factor {value.strip()!r} is not a number (e.g. yarn:2)") from None
    if not math.isfinite(factor) or factor < 1:
        raise UserError(f"--rope-scaling {text!r}: the YaRN factor must be a number >= 1 (it extends the context), got {value}")
    return factor


def _rope_dict(config) -> dict | None:
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = getattr(config, "rope_scaling", None)
    return dict(params) if isinstance(params, dict) else None


def apply_yarn(config, factor: float) -> None:
    """Rewrite `config` in place for YaRN at `factor` (see the module docstring)."""
    params = _rope_dict(config) or {}
    current = params.get("rope_type", params.get("type", "default"))
    if current not in (None, "default"):
        raise UserError(
            f"the checkpoint already uses rope_type {current!r} (factor {params.get('factor')}); --rope-scaling would "
            "replace it: drop the option or edit the checkpoint's config.json"
        )
    original = int(config.max_position_embeddings)
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    new = {**params, "rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original,
           **YARN_DEFAULTS}
    if theta is not None:
        new["rope_theta"] = theta
    if hasattr(config, "rope_parameters"):
        config.rope_parameters = new
    else:  # older configs keep the parameters under rope_scaling
        config.rope_scaling = new
    config.max_position_embeddings = int(round(original * factor))


def describe(config, from_option: bool) -> dict | None:
    """What a result records as model.rope_scaling: None for plain rope, else type, factor, original length."""
    params = _rope_dict(config) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    return {
        "type": kind,
        "factor": params.get("factor"),
        "original_max_position_embeddings": params.get("original_max_position_embeddings"),
        "source": "--rope-scaling" if from_option else "checkpoint config",
    }
