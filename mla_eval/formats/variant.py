"""A cache format as an evaluation runs it: its spec, and whether the per-layer outer scales s_l apply.

Defined beside the specs (not with the `--formats` syntax in mla_eval.evals.variants) because a per-layer
plan (mla_eval.layer_plan) is a tuple of these, and the capacity arithmetic reads plans too.
"""

from __future__ import annotations

import dataclasses

from mla_eval.formats.spec import FormatSpec


@dataclasses.dataclass(frozen=True)
class Variant:
    """A format as evaluated: its spec, and whether the per-layer outer scales are applied."""

    spec: FormatSpec
    outer: bool = False

    @property
    def name(self) -> str:
        return f"{self.spec.name}+s_l" if self.outer else self.spec.name
