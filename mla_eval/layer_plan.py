"""A per-layer cache plan: one format (a `Variant`) per decoder layer, as `mla-eval plan` chooses it and as
`kld --formats plan:FILE` and `capacity --plan FILE` read it.

The file is the JSON document `mla-eval/plan/v1` (mla_eval/schemas/plan-v1.schema.json): per layer the format,
what engines call that record (`builtin.ENGINE_NAMES`, the spec's own `Engine` flag), its record bytes and, where
the layer's variant applies the outer scale (+s_l), the s_l an engine divides the latent by (in that format's own
terms: s_l = max |c_kv| / the format's denominator); plus the model it was made for, the budget it was made under,
its bytes per token (records summed over the layers) and its predicted KLD. A plan made by `mla-eval plan` also
carries the sensitivity table it was solved from; readers ignore keys they do not know.

Bad plans are one-line UserErrors naming the file and the layer: an unknown format, a control format (controls are
measurement instruments, never cache formats to deploy), +s_l on a format that takes no outer scale, +s_l without
its s_l, a scale without +s_l, an s_l standing for a latent no model has, record bytes that are not the format's, a
negative or non-finite predicted KLD, a budget no plan is solved under, a layer count that is not the model's
(`check_layers`), or a plan made for another model: another name, architecture digest or latent profile
(`check_model`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from mla_eval.atomic_io import write_json_atomic
from mla_eval.errors import UserError
from mla_eval.formats import FormatSpec, get_format
from mla_eval.formats.builtin import ENGINE_NAMES
from mla_eval.formats.outer_scale import check_latent_max_abs
from mla_eval.formats.variant import Variant
from mla_eval.result_schemas import PLAN_SCHEMA, validate
from mla_eval.user_paths import read_small_json

PLAN_PREFIX = "plan:"  # `--formats plan:FILE`


def engine_names(spec: FormatSpec) -> list[dict[str, str]]:
    """What engines call this record: each `ENGINE_NAMES` entry naming the format, then the spec's own engine flag
    where that is not among them."""
    out = [{"engine": e.engine, "name": e.name, "version": e.version} for e in ENGINE_NAMES if e.format == spec.name]
    if spec.engine is not None and not any(e["engine"] == spec.engine.name and e["name"] == spec.engine.flag for e in out):
        out.append({"engine": spec.engine.name, "name": spec.engine.flag, "version": spec.engine.citation()})
    return out


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One format per layer. `scales[i]` is layer i's s_l (the format's own terms) where `layers[i].outer`, else None."""

    layers: tuple[Variant, ...]
    scales: tuple[float | None, ...]
    model: dict[str, Any] = dataclasses.field(default_factory=dict)  # name, path, layers, latent_profile
    budget: dict[str, Any] | None = None  # {"kind": bytes_per_token | max_kld | pool_gain | uniform, "value": ...}
    predicted_kld: float | None = None
    name: str = "plan"  # the row label's stem: `plan:<name>` (a loaded plan: its file's stem)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # text, candidates, sensitivity, ...: kept as is

    def __post_init__(self) -> None:
        if len(self.scales) != len(self.layers):
            raise ValueError(f"{len(self.scales)} scales for {len(self.layers)} layers")
        for i, (v, s) in enumerate(zip(self.layers, self.scales)):
            check_layer(v, s, i, "plan")

    @classmethod
    def uniform(cls, variant: Variant, num_layers: int, scales: tuple[float, ...] | None = None, **kw) -> "LayerPlan":
        """Every layer `variant`; `scales` (one per layer, the format's own terms) where it is +s_l."""
        per = tuple(scales) if variant.outer and scales is not None else (None,) * num_layers
        return cls((variant,) * num_layers, per, **kw)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def label(self) -> str:
        return PLAN_PREFIX + self.name

    @property
    def specs(self) -> tuple[FormatSpec, ...]:
        return tuple(v.spec for v in self.layers)

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes over all the plan's layers (the outer scale is per layer, not per token)."""
        return sum(v.spec.record_bytes for v in self.layers)

    def check_layers(self, num_layers: int, source: str | None = None) -> None:
        if self.num_layers != num_layers:
            raise UserError(
                f"{source or self.label} has {self.num_layers} layers but the model has {num_layers}; "
                "make a plan for this model with `mla-eval plan`"
            )

    def check_model(self, name: str, geometry: str, latent_profile: str | None, source: str | None = None) -> str | None:
        """The plan was made for this model: its name, its architecture digest (`model_presets.architecture_digest`)
        and the latent profile it ran under (its s_l were calibrated on that model) -- a one-line UserError naming
        both sides otherwise. A plan that does not say (written by hand, or before plans carried an identity) is
        applied as it is: the line returned says so, for a warning."""
        where = source or self.label
        made = self.model
        fix = "make a plan for this model with `mla-eval plan`"
        if "name" in made and made["name"] != name:
            raise UserError(f"{where} was made for model {made['name']!r}, this run's model is {name!r}; {fix}")
        if "geometry" in made and made["geometry"] != geometry:
            raise UserError(f"{where} was made for a model of architecture {made['geometry']}, this run's model "
                            f"({name}) is {geometry}; {fix}")
        planned = (made.get("latent_profile") or {}).get("name") if "latent_profile" in made else latent_profile
        if planned != latent_profile:
            said = lambda p: f"--latent-profile {p}" if p else "no --latent-profile"  # noqa: E731
            raise UserError(f"{where} was made under {said(planned)}, this run has {said(latent_profile)}: its layer costs "
                            f"and s_l belong to that model; run with {said(planned)} or {fix}")
        if "name" not in made or "geometry" not in made:
            return f"{where} does not say which model it was made for (model.name and model.geometry): applied as it is"
        return None

    def summary(self) -> str:
        """'fp8_ds_mla x2, nvfp4+s_l x4' in layer order, runs collapsed."""
        runs: list[list] = []
        for v in self.layers:
            if runs and runs[-1][0] == v.name:
                runs[-1][1] += 1
            else:
                runs.append([v.name, 1])
        return ", ".join(f"{n} x{c}" if c > 1 else n for n, c in runs)

    def to_json(self) -> dict[str, Any]:
        layers = []
        for i, (v, s) in enumerate(zip(self.layers, self.scales)):
            layers.append({
                "layer": i,
                "format": v.spec.name,
                "variant": v.name,
                "record_bytes": v.spec.record_bytes,
                "engine_names": engine_names(v.spec),
                "outer_scale": None if s is None else {"s_l": s, "denominator": v.spec.outer_scale.denominator},
            })
        doc = {
            "schema": PLAN_SCHEMA,
            "model": dict(self.model),
            "num_layers": self.num_layers,
            "budget": self.budget,
            "bytes_per_token": self.bytes_per_token,
            "predicted_kld": self.predicted_kld,
            "layers": layers,
        }
        doc.update({k: v for k, v in self.extra.items() if k not in doc})
        return doc

    def save(self, path: str | Path, replace: bool = True) -> None:
        """Validate, then write atomically (temp file + rename): a crash never leaves half a plan."""
        doc = self.to_json()
        validate(doc, f"plan {path}")
        write_json_atomic(Path(path), doc, replace=replace)

    @classmethod
    def load(cls, path: str | Path) -> "LayerPlan":
        path = Path(path)
        doc = read_small_json(path, "plan file", "make one with `mla-eval plan`")
        return cls.from_json(doc, source=f"plan file {path}", name=path.stem)

    @classmethod
    def from_json(cls, doc: Any, source: str = "plan JSON", name: str = "plan") -> "LayerPlan":
        if not isinstance(doc, dict) or doc.get("schema") != PLAN_SCHEMA:
            got = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
            raise UserError(f"{source}: not a plan (schema {got!r}, expected {PLAN_SCHEMA}); make one with `mla-eval plan`")
        validate(doc, source)
        entries = doc["layers"]
        if doc["num_layers"] != len(entries):
            raise UserError(f"{source}: 'num_layers' is {doc['num_layers']} but 'layers' has {len(entries)} entries")
        variants, scales = [], []
        for i, e in enumerate(entries):
            if e["layer"] != i:
                raise UserError(f"{source}: entry {i} names layer {e['layer']}; list the layers in order from 0")
            v, s = _entry_variant(e, i, source)
            variants.append(v)
            scales.append(s)
        _check_fields(doc, source)
        if doc["bytes_per_token"] != sum(v.spec.record_bytes for v in variants):
            raise UserError(f"{source}: 'bytes_per_token' is {doc['bytes_per_token']} but its layers' records sum to "
                            f"{sum(v.spec.record_bytes for v in variants)}; the file was edited: make it again")
        known = {"schema", "model", "num_layers", "budget", "bytes_per_token", "predicted_kld", "layers"}
        return cls(tuple(variants), tuple(scales), dict(doc["model"]), doc.get("budget"), doc.get("predicted_kld"),
                   name, {k: v for k, v in doc.items() if k not in known})


def check_layer(v: Variant, s: float | None, i: int, source: str) -> None:
    """One layer's variant and scale, or a one-line UserError naming the layer."""
    if v.spec.control:
        raise UserError(f"{source}: layer {i} is the control {v.spec.name}; controls measure the evaluation, they are not "
                        "cache formats to deploy: plans refuse them")
    if v.outer and v.spec.outer_scale is None:
        raise UserError(f"{source}: layer {i}: {v.spec.name} takes no outer scale s_l, but the layer asks for +s_l")
    if v.outer and s is None:
        raise UserError(f"{source}: layer {i} is {v.name} but gives no s_l; a +s_l layer needs its scale "
                        "(make the plan with `mla-eval plan`, which calibrates them)")
    if not v.outer and s is not None:
        raise UserError(f"{source}: layer {i} gives an s_l but its format {v.name} does not apply one; write {v.name}+s_l "
                        "or drop the scale")
    if s is not None:  # s_l = max |c_kv| / the format's denominator: the max it stands for must be a latent's
        if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
            raise UserError(f"{source}: layer {i}: s_l {s!r} is not a positive finite number")
        den = v.spec.outer_scale.denominator
        check_latent_max_abs(s * den, f"{source}: layer {i}: s_l {s!r} stands for a max |c_kv| of {s * den:.3g}, which")


def _check_fields(doc: dict, source: str) -> None:
    """The plan's own figures: a predicted KLD is a KL divergence (finite, >= 0), a budget one the plan command
    solves under, the model's layer count the plan's. (Each layer's format, record bytes and s_l: `_entry_variant`.)"""
    kld = doc.get("predicted_kld")
    if kld is not None and not (isinstance(kld, (int, float)) and math.isfinite(kld) and kld >= 0):
        raise UserError(f"{source}: 'predicted_kld' is {kld!r}; a KL divergence is finite and >= 0 (null: not predicted)")
    budget = doc.get("budget")
    if budget is not None:
        kind, value = budget["kind"], budget["value"]
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        good = {"bytes_per_token": number and value == int(value) and value >= 1, "max_kld": number and value >= 0,
                "pool_gain": number and value > 0, "uniform": True}[kind]
        if not good:
            raise UserError(f"{source}: budget {kind} = {value!r} is not a budget `mla-eval plan` solves under")
    layers = doc["model"].get("layers")
    if layers is not None and layers != doc["num_layers"]:
        raise UserError(f"{source}: 'model.layers' is {layers} but the plan has {doc['num_layers']} layers")


def _entry_variant(e: dict, i: int, source: str) -> tuple[Variant, float | None]:
    try:
        spec = get_format(e["format"])
    except UserError as exc:
        raise UserError(f"{source}: layer {i}: {exc}") from None
    variant = e.get("variant", spec.name)
    if variant not in (spec.name, f"{spec.name}+s_l"):
        raise UserError(f"{source}: layer {i}: variant {variant!r} is neither {spec.name} nor {spec.name}+s_l")
    v = Variant(spec, outer=variant.endswith("+s_l"))
    if e["record_bytes"] != spec.record_bytes:
        raise UserError(f"{source}: layer {i}: 'record_bytes' is {e['record_bytes']} but a {spec.name} record is "
                        f"{spec.record_bytes} bytes; the file was edited: make it again")
    outer = e.get("outer_scale")
    s = None
    if outer is not None:
        s = float(outer["s_l"])
        if v.spec.outer_scale is not None and float(outer.get("denominator", v.spec.outer_scale.denominator)) != \
                v.spec.outer_scale.denominator:
            raise UserError(f"{source}: layer {i}: s_l denominator {outer['denominator']} is not {v.spec.name}'s "
                            f"{v.spec.outer_scale.denominator:g}")
    check_layer(v, s, i, source)
    return v, s
