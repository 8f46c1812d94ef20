"""What every evaluation is made of: settings whose fields carry their command-line options (`option()`), the
progress callback, the metrics the gate compares, and the `Evaluation` record that declares one evaluation.

Pure declarations, low in the layering (they import only `errors`): every settings module uses them, and the
registry (`mla_eval.evaluation`), the commands, the recipes, the gate, the report and the api read them.
"""

from __future__ import annotations

import dataclasses
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


def say(progress: ProgressCallback, line: str) -> None:
    """A one-line fact for the person watching, said before the work it is about (a run's plan): through the
    callback's `note(line)` where the command gave it one (`commands.progress.progress_bars` does), else nowhere;
    what matters later is also in the result."""
    note = getattr(progress, "note", None)
    if callable(note):
        note(line)


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


def path_options(obj: Any, kind: Literal["read", "write"]) -> list[tuple[str, Path]]:
    """(long flag, path) of each set option of a settings (or command-options) object declared path=kind."""
    return [(f.option.flags[0].split("/")[0], Path(getattr(obj, f.name))) for f in option_fields(type(obj))
            if f.option.path == kind and getattr(obj, f.name) is not None]


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
        names = {f.name for f in dataclasses.fields(self.settings)}
        fixed = {k: v for k, v in fixed.items() if k in names}
        if self.from_table is not None:
            return self.from_table(table, where, fixed)
        return settings_from_table(self.settings, table, where, **fixed)


# --- recipe tables ----------------------------------------------------------------------------------


def value_fits(annotation, value) -> bool:
    """Whether a recipe value fits a settings field's annotation (int, float, str, bool, Path, X | None, lists)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(value_fits(a, value) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin in (list, tuple):
        return isinstance(value, (list, tuple))
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is Path:
        return isinstance(value, (str, Path))
    return isinstance(value, annotation)


def settings_from_table(cls: type, table: dict, where: str, **fixed):
    """Settings `cls` from a recipe table whose keys are the command's long options (`-` or `_`).

    Unknown keys and values of the wrong type are one-line errors naming the key; `fixed` are set
    by the caller (model, device, backend) and may not appear in the table.
    """
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in fields or name in fixed:
            known = ", ".join(sorted(n for n in fields if n not in fixed))
            raise UserError(f"{where}: unknown key {key!r}; known keys: {known}")
        if not value_fits(hints[name], value):
            raise UserError(f"{where}: {key} = {value!r} has the wrong type (expected {hints[name]})")
        if hints[name] in (Path, Path | None) and isinstance(value, str):
            value = Path(value)
        kwargs[name] = value
    return cls(**kwargs, **fixed)
