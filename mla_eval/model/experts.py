"""Which code computes a MoE layer's routed experts: transformers' own implementations, chosen once per model.

transformers (5.17 and 5.25 alike) decorates the experts module of every MoE class we load (`DeepseekV3Experts`,
used by Kimi-K2 too, `DeepseekV32Experts`, `GlmMoeDsaExperts`) with `use_experts_implementation`: its forward
dispatches on `config._experts_implementation`, which `PreTrainedModel.set_experts_implementation` sets for the
model and its sub-models (modeling_utils.py of both versions; integrations/moe.py holds the implementations):

- `eager`: the class's own loop, one expert after another (a host sync per expert hit on a GPU);
- `grouped_mm`: the (token, expert) pairs sorted by expert and both projections run as two grouped matrix products
  (`torch.nn.functional.grouped_mm`, else `torch._grouped_mm`; a per-expert `mm` loop where neither can run).

Both versions already default to `grouped_mm` when nothing is asked (`get_correct_experts_implementation`), and
silently fall back to eager where a class cannot set it. We ask for the path by name instead, so a run never depends
on a library default, a fallback is impossible, and the result records what computed the experts (`describe`).
The two paths compute the same function; they differ by the order of bf16 / fp32 rounding
(tests/test_experts.py holds them together per class).

FP8 weights computed in FP8 (`--weight-math fp8`) replace the experts module itself (`mla_eval.model.fp8_linear`);
this module's choice then concerns only models whose experts stay in the run dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from mla_eval.errors import UserError

EXPERT_PATHS = ("grouped_mm", "eager")  # transformers' own names
DEFAULT_EXPERTS = "grouped_mm"
EXPERTS_HELP = (
    "How a MoE layer's routed experts run (transformers' implementations): 'grouped_mm' (two grouped matrix "
    "products over every expert at once: matmul speed) or 'eager' (one expert after another, as the model class "
    "writes it). The same function up to bf16 rounding order; the result records which ran."
)


def check_experts(path: str) -> str:
    """`path` when it is one of EXPERT_PATHS; a one-line UserError otherwise."""
    if path not in EXPERT_PATHS:
        raise UserError(f"--experts {path!r}: choose one of {', '.join(EXPERT_PATHS)}")
    return path


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routed-experts modules of `model` (a MoE block's `.experts`), in layer order."""
    return [m.experts for m in model.modules() if isinstance(getattr(m, "experts", None), torch.nn.Module)
            and hasattr(m, "gate")]


def select_experts(model: torch.nn.Module, path: str) -> dict[str, Any] | None:
    """Make every routed-experts module of `model` run `path` (EXPERT_PATHS); the record `describe` gives, or None for
    a model without routed experts. A class that cannot switch is a one-line UserError, never a silent fallback."""
    check_experts(path)
    mods = experts_modules(model)
    if not mods:
        return None
    if all(getattr(m, "weight_math", None) is not None for m in mods):  # FP8 experts (fp8_linear): their own path
        return describe(model)
    setter = getattr(model, "set_experts_implementation", None)
    if setter is None:
        raise UserError(f"{type(model).__name__}: this transformers has no set_experts_implementation; "
                        "mla-eval needs transformers 5.17 or newer for its MoE models")
    try:
        setter(path)
    except (ValueError, KeyError, ImportError) as exc:
        raise UserError(f"{type(model).__name__} cannot run its experts as {path!r} "
                        f"({str(exc).splitlines()[0]}); use --experts eager") from None
    record = describe(model)
    if record is not None and record["implementation"] != path:
        raise UserError(f"{type(model).__name__} kept its experts on {record['implementation']!r} when {path!r} was "
                        "asked; use --experts eager")
    return record


def describe(model: torch.nn.Module) -> dict[str, Any] | None:
    """What computes the routed experts (recorded in results): the implementation, how many MoE layers, and the
    experts modules' classes; None for a model without routed experts."""
    mods = experts_modules(model)
    if not mods:
        return None
    own = [m for m in mods if getattr(m, "weight_math", None) is not None]  # our FP8 experts (fp8_linear)
    impl = "fp8-grouped" if own and len(own) == len(mods) else getattr(model.config, "_experts_implementation", None)
    return {"implementation": impl, "moe_layers": len(mods), "classes": sorted({type(m).__name__ for m in mods})}
