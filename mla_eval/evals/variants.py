"""A cache format as an evaluation runs it (`Variant`), and the `--formats` list syntax.

'nvfp4,nvfp4+s_l' -> variants; '+s_l' applies the per-layer outer scales s_l; 'control:*' is the control
ladder (mla_eval.formats.controls), mildest first; 'plan:FILE' is one row running a per-layer plan
(`PlanVariant`, mla_eval.layer_plan), each layer in its own format. Which formats take an
outer scale, and how the calibrated max |c_kv| maps onto it (its denominator), is the format
spec's fact (`FormatSpec.outer_scale`), never repeated here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence, Union

from mla_eval.errors import UserError
from mla_eval.formats import FormatSpec, OuterScales, get_format
from mla_eval.formats.registry import all_formats, expand_controls
from mla_eval.formats.variant import Variant
from mla_eval.layer_plan import PLAN_PREFIX, LayerPlan

OUTER_OPTIONS = ("s_l", "sl")


@dataclasses.dataclass(frozen=True, eq=False)
class PlanVariant:
    """A per-layer plan as one evaluated row (`plan:<file stem>`): each layer's cache in that layer's format.

    Its scales travel in the plan (`outer` is False: the run's --scales never apply to it)."""

    plan: LayerPlan
    source: str = ""  # the file it was read from

    outer = False

    @property
    def name(self) -> str:
        return self.plan.label

    @property
    def spec(self) -> FormatSpec:
        """The layer spec with the widest record: what code holding one spec per row sizes memory by (the run
        plan's workload); every cache read and write goes through the layer's own spec (`session_formats`)."""
        return max(self.plan.specs, key=lambda s: s.record_bytes)

    def _key(self) -> tuple:
        return (self.plan.label, self.plan.layers, self.plan.scales)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PlanVariant) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


Row = Union[Variant, PlanVariant]  # one row of a kld run


def load_plan_variant(token: str) -> PlanVariant:
    """'plan:PATH' -> the plan read from PATH (one-line UserErrors for a missing or bad file)."""
    path = str(Path(token[len(PLAN_PREFIX):].strip()).expanduser()) if token[len(PLAN_PREFIX):].strip() else ""
    if not path:
        raise UserError(f"{token!r} names no file; write plan:PATH (a plan made by `mla-eval plan`)")
    return PlanVariant(LayerPlan.load(path), source=path)


def check_plan_layers(rows: Sequence[Row], num_layers: int) -> None:
    """Every plan row has one format per layer of the model (a one-line UserError naming the file otherwise)."""
    for v in rows:
        if isinstance(v, PlanVariant):
            v.plan.check_layers(num_layers, source=f"plan file {v.source}" if v.source else None)


def check_plan_model(rows: Sequence[Row], lm, latent_profile: str | None) -> None:
    """Every plan row was made for this model: its layer count, name, architecture digest and latent profile
    (`LayerPlan.check_model`; a one-line UserError naming both sides otherwise); a plan that does not say is a
    warning, never silent. `latent_profile`: the run's --latent-profile (None or 'none': none)."""
    import warnings

    from mla_eval.model.latent_profile import parse_profile
    from mla_eval.model_presets import architecture_digest

    check_plan_layers(rows, lm.num_layers)
    plans = [v for v in rows if isinstance(v, PlanVariant)]
    if not plans:
        return
    profile = parse_profile(latent_profile)
    digest = architecture_digest(lm.model.config)
    for v in plans:
        said = v.plan.check_model(lm.name, digest, profile.name if profile else None,
                                  source=f"plan file {v.source}" if v.source else None)
        if said is not None:
            warnings.warn(said, stacklevel=2)


def session_formats(variant: Row, outer: OuterScales | None):
    """What a cache session takes for this row: (spec, or one spec per layer; OuterScales, one s_l per layer, or None)."""
    if isinstance(variant, PlanVariant):
        return variant.plan.specs, variant.plan.scales
    return variant.spec, scales_for(variant, outer)


def split_format_list(text: str) -> list[str]:
    """'nvfp4,plan:a,b.json,fp8_ds_mla' -> its items. A comma splits items except inside a plan's file name: after
    'plan:' the longest run of items that names an existing file is one item (a path may hold a comma); where none
    exists the item ends at the first comma (and its reading names the missing file)."""
    parts = text.split(",")
    out: list[str] = []
    i = 0
    while i < len(parts):
        item, used = parts[i], 1
        if item.strip().startswith(PLAN_PREFIX):
            for j in range(len(parts), i + 1, -1):  # the longest first
                joined = ",".join(parts[i:j]).strip()[len(PLAN_PREFIX):].strip()
                if Path(joined).expanduser().is_file():
                    item, used = ",".join(parts[i:j]), j - i
                    break
        out.append(item)
        i += used
    return out


def parse_variants(text: str | list[str] | tuple[str, ...], option: str = "--formats", plans: bool = False) -> list:
    """'nvfp4,nvfp4+s_l' (or a list of names) -> distinct variants in order; one-line UserError on a bad name.
    `plans`: 'plan:FILE' items are read as `PlanVariant` rows (else refused: the evaluation runs one format per row)."""
    tokens = split_format_list(text) if isinstance(text, str) else [str(t) for t in text]
    tokens = expand_controls(tokens)
    out: list[Variant] = []
    for tok in (t.strip() for t in tokens):
        if not tok:
            continue
        if tok.startswith(PLAN_PREFIX):
            if not plans:
                raise UserError(f"{option} {tok!r}: per-layer plans run in `mla-eval kld` and `needle` (--formats plan:FILE)")
            pv = load_plan_variant(tok)
            if any(o.name == pv.name and o != pv for o in out):
                raise UserError(f"{option}: two different plans are both named {pv.name}; rename one file")
            if pv not in out:
                out.append(pv)
            continue
        base, plus, opt = tok.partition("+")
        if plus and opt not in OUTER_OPTIONS:
            raise UserError(f"format option '+{opt}' in {tok!r} is unknown; the only option is +s_l")
        spec = get_format(base)
        if plus and spec.outer_scale is None:
            takers = ", ".join(s.name for s in all_formats() if s.outer_scale is not None)
            raise UserError(f"{spec.name} takes no outer scale s_l; +s_l applies to {takers}")
        v = Variant(spec, outer=bool(plus))
        if v not in out:
            out.append(v)
    if not out:
        raise UserError(f"{option} is empty; give e.g. nvfp4,fp8_ds_mla")
    return out


def scales_for(variant: Variant, outer: OuterScales | None) -> OuterScales | None:
    """The per-layer scales a variant's cache uses: None without +s_l; else the calibrated scales
    mapped onto this format's range (s_l = max |c_kv| / the spec's denominator).

    A scales file stores max |c_kv| / its own denominator; a format with another denominator
    (fp8_e4m3: 448) gets the same max over its own.
    """
    if not variant.outer:
        return None
    if outer is None:
        raise UserError(f"{variant.name} needs per-layer scales: pass --scales FILE or --scales auto")
    den = variant.spec.outer_scale.denominator
    if den == outer.denominator:
        return outer
    ratio = outer.denominator / den
    return dataclasses.replace(outer, scales=tuple(s * ratio for s in outer.scales), denominator=den)
