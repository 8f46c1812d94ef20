"""One protocol for every evaluation, and the registry that the command line, recipes, the gate,
the report and the api read (the protocol itself: `mla_eval.protocol`).

An evaluation is
- a frozen settings dataclass whose fields carry their command-line options (`option()`): flags,
  help, the type the command line parses, whether the value is a file read or written;
- `run(settings, progress) -> result`, a typed result with `to_document()`;
- the schema id its document names and the JSON Schema file that checks it;
- the file its document gets in a results directory (which also makes it a recipe table);
- the metrics the gate compares, each with its direction and default tolerances.

`register_evaluation(Evaluation(...))` is all it takes to appear as a command (`mla-eval NAME`), a
recipe table ([NAME]), a gated and reported document and an api entry (`api.evaluate(settings)`);
none of them keeps a list of evaluations. The built-ins are declared in `mla_eval.evals.builtin`.
"""

from __future__ import annotations

import re
from typing import Any

from mla_eval.errors import UserError
from mla_eval.protocol import Evaluation, Metric, option_fields
from mla_eval.result_schemas import register_schema, unregister_schema

# --- the registry -------------------------------------------------------------------------------------

_NAME = re.compile(r"[a-z][a-z0-9_-]*")
_REGISTRY: dict[str, Evaluation] = {}
_BUILTIN: set[str] = set()
_loaded = False


def _load_builtins() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        from mla_eval.evals import builtin

        for ev in builtin.BUILTIN_EVALUATIONS:
            _add(ev, replace=False)
            _BUILTIN.add(ev.name)


def _add(ev: Evaluation, replace: bool) -> Evaluation:
    if not isinstance(ev, Evaluation):
        raise TypeError("register_evaluation takes an Evaluation")
    if not _NAME.fullmatch(ev.name):
        raise ValueError(f"evaluation name {ev.name!r}: use lower-case letters, digits, '-' and '_'")
    if ev.name in _REGISTRY and not replace:
        raise ValueError(f"evaluation {ev.name!r} is already registered; pass replace=True to override it")
    option_fields(ev.settings)  # every field declares its option: a mistake fails here, not at the first command
    others = [o for o in _REGISTRY.values() if o.name != ev.name]
    for o in others:
        if ev.schema is not None and o.schema == ev.schema:
            raise ValueError(f"evaluation {ev.name!r}: schema {ev.schema!r} is {o.name!r}'s")
        if ev.stem is not None and o.stem == ev.stem:
            raise ValueError(f"evaluation {ev.name!r}: results file {ev.result_file!r} is {o.name!r}'s")
    known = {m.name: m for o in others for m in o.metrics}
    for m in ev.metrics:
        if m.name in known and known[m.name] != m:  # tolerances are given per metric name: one meaning each
            raise ValueError(f"evaluation {ev.name!r}: metric {m.name!r} is already defined differently")
    if ev.metrics and ev.rows is None:
        raise ValueError(f"evaluation {ev.name!r}: metrics need rows(document) to find them")
    if ev.result_file is not None and (ev.schema is None or ev.schema_file is None):
        raise ValueError(f"evaluation {ev.name!r}: a results-directory document needs a schema id and its schema file")
    if ev.schema is not None and ev.schema_file is not None:
        register_schema(ev.schema, ev.schema_file)
    _REGISTRY[ev.name] = ev
    return ev


def register_evaluation(ev: Evaluation, *, replace: bool = False) -> Evaluation:
    """Add an evaluation: from now on it is a command, a recipe table, a gated and reported
    document and an api entry. Raises ValueError if its name, schema or results file is taken."""
    _load_builtins()
    if ev.name in _BUILTIN:
        raise ValueError(f"{ev.name!r} is a built-in evaluation and cannot be replaced")
    return _add(ev, replace)


def unregister_evaluation(name: str) -> None:
    """Remove a registered evaluation (built-ins cannot be removed)."""
    _load_builtins()
    if name in _BUILTIN:
        raise ValueError(f"{name!r} is a built-in evaluation and cannot be removed")
    gone = _REGISTRY.pop(name, None)
    if gone is not None and gone.schema is not None:
        unregister_schema(gone.schema)


def evaluations() -> list[Evaluation]:
    """Every registered evaluation, built-ins first, in registration order."""
    _load_builtins()
    return list(_REGISTRY.values())


def get_evaluation(name: str) -> Evaluation:
    _load_builtins()
    if name not in _REGISTRY:
        raise UserError(f"unknown evaluation {name!r}; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def evaluation_for_schema(schema: Any) -> Evaluation | None:
    """The evaluation whose documents name `schema`, if any."""
    return next((ev for ev in evaluations() if ev.schema is not None and ev.schema == schema), None)


def evaluation_for_settings(settings: Any) -> Evaluation:
    """The evaluation that takes this settings object (its exact class)."""
    for ev in evaluations():
        if type(settings) is ev.settings:
            return ev
    names = ", ".join(ev.settings.__name__ for ev in evaluations())
    raise UserError(f"{type(settings).__name__} is no evaluation's settings; known: {names}")


def gate_metrics() -> dict[str, Metric]:
    """Every metric the gate knows, by name, in registry order."""
    return {m.name: m for ev in evaluations() for m in ev.metrics}


def results_dir_files() -> dict[str, str]:
    """A results directory's file stem -> the schema its document must have."""
    return {ev.stem: ev.schema for ev in evaluations() if ev.stem is not None}
