"""A cache format as an evaluation runs it (`Variant`), and the `--formats` list syntax.

'nvfp4,nvfp4+s_l' -> variants; '+s_l' applies the per-layer outer scales s_l; 'control:*' is the control
ladder (mla_eval.formats.controls), mildest first. Which formats take an
outer scale, and how the calibrated max |c_kv| maps onto it (its denominator), is the format
spec's fact (`FormatSpec.outer_scale`), never repeated here.
"""

from __future__ import annotations

import dataclasses

from mla_eval.errors import UserError
from mla_eval.formats import FormatSpec, OuterScales, get_format
from mla_eval.formats.controls import ALL_CONTROLS
from mla_eval.formats.registry import all_formats, control_formats

OUTER_OPTIONS = ("s_l", "sl")


@dataclasses.dataclass(frozen=True)
class Variant:
    """A format as evaluated: its spec, and whether the per-layer outer scales are applied."""

    spec: FormatSpec
    outer: bool = False

    @property
    def name(self) -> str:
        return f"{self.spec.name}+s_l" if self.outer else self.spec.name


def parse_variants(text: str | list[str] | tuple[str, ...], option: str = "--formats") -> list[Variant]:
    """'nvfp4,nvfp4+s_l' (or a list of names) -> distinct variants in order; one-line UserError on a bad name."""
    tokens = text.split(",") if isinstance(text, str) else [str(t) for t in text]
    tokens = [name for t in tokens for name in ([s.name for s in control_formats()] if t.strip() == ALL_CONTROLS else [t])]
    out: list[Variant] = []
    for tok in (t.strip() for t in tokens):
        if not tok:
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
