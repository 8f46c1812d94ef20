"""One protocol for every evaluation, and the registry that the command line, recipes, the gate,
the report and the api read.

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

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Literal

from mla_eval.errors import UserError

# progress(stage, done, total): `stage` names the work ("sample", "calibrate", "score", "prompts"), `done` of
# `total` units. The library reports; commands draw the bar (the library never prints).
ProgressCallback = Callable[[str, int, int], None]


def no_progress(stage: str, done: int, total: int) -> None:
    return None


# --- options: a settings field's command-line face ----------------------------------------------------

OPTION_KEY = "mla_eval.option"  # the dataclasses.field metadata key holding a field's Option


@dataclasses.dataclass(frozen=True)
class Option:
    """How one settings field appears on the command line. A recipe table uses the same field
    names (the long option without dashes, `-` or `_`)."""

    flags: tuple[str, ...]  # ("--model", "-m"); a boolean pair is one flag "--x/--no-x"
    help: str
    type: type | None = None  # what the command line parses; None: derived from the field's annotation
    path: Literal["read", "write"] | None = None  # the value names a file the evaluation reads or writes
    show_default: bool = True  # --help shows "[default: ...]"
    required: bool = False  # no default: the option must be given


REQUIRED: Any = dataclasses.MISSING  # option(REQUIRED, "--out", ...): no default, the option must be given


def option(default: Any, *flags: str, help: str, type: type | None = None,
           path: Literal["read", "write"] | None = None, show_default: bool = True) -> Any:
    """A settings field with its command-line option, e.g.
    `ctx: int | None = option(None, "--ctx", help="Window length in tokens.")`."""
    if not flags or not all(f.startswith("-") for f in flags):
        raise ValueError(f"option flags must start with '-', got {flags!r}")
    required = default is REQUIRED
    meta = {OPTION_KEY: Option(tuple(flags), help, type, path, show_default, required)}
    return dataclasses.field(metadata=meta) if required else dataclasses.field(default=default, metadata=meta)


def library_only(default: Any) -> Any:
    """A settings field the library takes and the command line does not offer (e.g. calibrate's
    --rope-scaling): said explicitly, so a field can never lose its option by omission."""
    return dataclasses.field(default=default, metadata={OPTION_KEY: None})


def _parsed_type(annotation: Any, where: str) -> type:
    """The type the command line parses for a field annotation: `X | None` -> X; a union holding str
    (`str | list[str]`, `Path | str`) -> str, whose text the settings parse."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if str in args:
            return str
        if len(args) == 1:
            return _parsed_type(args[0], where)
        raise TypeError(f"{where}: cannot tell the command-line type of {annotation}; give option(type=...)")
    if annotation in (str, int, float, bool, Path):
        return annotation
    raise TypeError(f"{where}: cannot tell the command-line type of {annotation}; give option(type=...)")


@dataclasses.dataclass(frozen=True)
class OptionField:
    """A settings field resolved for the command line."""

    name: str
    option: Option
    type: type  # what the command line parses
    default: Any  # dataclasses.MISSING when required


def option_fields(cls: type) -> list[OptionField]:
    """The command-line options of a settings (or command-options) dataclass, in field order.
    Every field must say what it is: `option(...)` or `library_only(...)` (a TypeError otherwise)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if OPTION_KEY not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name}: declare it with option(...) or library_only(...)")
        opt = f.metadata[OPTION_KEY]
        if opt is None:
            continue
        typ = opt.type if opt.type is not None else _parsed_type(hints[f.name], f"{cls.__name__}.{f.name}")
        out.append(OptionField(f.name, opt, typ, f.default))
    return out


def written_paths(settings: Any) -> list[Path]:
    """The files a settings object asks its evaluation to write (options declared path="write")."""
    return [Path(getattr(settings, f.name)) for f in option_fields(type(settings))
            if f.option.path == "write" and getattr(settings, f.name) is not None]


# --- the evaluation protocol --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Metric:
    """A figure the gate compares: a change against `direction` fails when it exceeds
    max(abs_tol, rel_tol * |baseline|); "exact" fails on any change."""

    name: str  # the key in a document row
    direction: Literal["lower", "higher", "exact"]  # which way is better
    abs_tol: float = 0.0
    rel_tol: float = 0.0

    def __post_init__(self) -> None:
        if self.direction not in ("lower", "higher", "exact"):
            raise ValueError(f"metric {self.name}: direction must be lower, higher or exact, got {self.direction!r}")


Table = tuple[str, list[str], list[list[str]]]  # (title, header, rows); no header: a one-line note


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One evaluation, as every part of mla-eval sees it."""

    name: str  # the command (`mla-eval NAME`), the recipe table ([NAME]) and the api name
    summary: str  # one line: what it measures
    settings: type  # frozen dataclass; fields declared with option() / library_only()
    run: Callable[[Any, ProgressCallback], Any]  # run(settings, progress) -> result with to_document()
    result: type  # the result's class
    schema: str | None  # the id in the document's "schema" key; None: a document of another kind
    schema_file: str | Path | None = None  # JSON Schema of `schema`: a file in mla_eval/schemas/, or a path
    result_file: str | None = None  # its document in a results directory ("kld.json"); None: no recipe table
    metrics: tuple[Metric, ...] = ()  # what the gate compares, per row of `rows(document)`
    rows: Callable[[dict], Iterable[tuple[str, dict]]] | None = None  # a document's (row identity, figures)
    comparable: Callable[[dict, dict, str], None] | None = None  # gate: UserError if results and baseline differ in kind
    report: Callable[[dict], list[Table]] | None = None  # report tables of one document (None: its metrics)
    setups: bool = False  # a recipe may hold several tables ([[NAME]]), one document each
    setup_name: Callable[[dict], str] | None = None  # an unnamed setup's name, from its recipe table
    from_table: Callable[[dict, str, dict], Any] | None = None  # (table, where, fixed) -> settings; None: settings_from_table
    instant: bool = False  # no model, well under a second: recipes run it first, so its errors cost nothing
    cli: str | None = None  # module holding its `COMMAND` (mla_eval.commands.evaluation); None: the generic command

    @property
    def stem(self) -> str | None:
        """The results-directory file stem ("kld"); a recipe's setups are `<stem>-<name>.json`."""
        return None if self.result_file is None else Path(self.result_file).stem

    def settings_from_table(self, table: dict, where: str, fixed: dict) -> Any:
        """Settings from a recipe table; `fixed` (the recipe's model, device, backend) applies where
        the settings have such a field."""
        from mla_eval.evals.settings import settings_from_table

        names = {f.name for f in dataclasses.fields(self.settings)}
        fixed = {k: v for k, v in fixed.items() if k in names}
        if self.from_table is not None:
            return self.from_table(table, where, fixed)
        return settings_from_table(self.settings, table, where, **fixed)


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
    _REGISTRY.pop(name, None)


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
