"""The command line of every registered evaluation, generated from its settings (mla_eval.evaluation).

Each settings field declared with `option()` becomes a typer option: its flags, help, default and
type are written once, on the field. A command adds only what the command alone has (--out,
--force, --plot, ...) as a small dataclass of the same `option()` fields, and a body that runs the
evaluation, prints and writes. An evaluation names the module holding its `COMMAND` (an
`EvaluationCommand`); one that names none gets the generic command: its settings, --out and
--force, and a body that writes the result document. `mla-eval run` shows and plots a recipe's
results with the same command's `show` and `plots`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
from pathlib import Path
from typing import Any, Callable

import typer
from rich.console import Console

from mla_eval.commands.progress import peak_memory_line, progress_bars
from mla_eval.errors import UserError
from mla_eval.evals.settings import SCALES_MODES
from mla_eval.protocol import Evaluation, OptionField, option, option_fields, path_options
from mla_eval.report.plots import check_plot_folder
from mla_eval.results import check_output_path, default_out_help, default_result_path, write_result
from mla_eval.user_paths import check_not_special, same_file

console = Console(stderr=True)


def _show_nothing(result: Any) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class EvaluationCommand:
    """How `mla-eval NAME` runs and shows one evaluation, beyond its settings."""

    options: type  # dataclass of the options only the command has (option() fields), e.g. --out and --force
    body: Callable[[Evaluation, Any, Any], None]  # body(evaluation, settings, options): run, print, write
    details: str = ""  # the command's help after the evaluation's summary line
    show: Callable[[Any], None] = _show_nothing  # print a result (the command and `mla-eval run`)
    after_run: Callable[[Any, Any], None] | None = None  # after_run(settings, result): e.g. say what else was written
    # a result's PNGs into a folder (--plot; run's plots/), returned, not printed: a recipe run stages them elsewhere
    plots: Callable[[Any, Path], list[Path]] | None = None
    plot_files: tuple[str, ...] = ()  # names `plots` always writes: checked in --plot's folder before the work
    on_first: Callable[[str, int, int, float], None] | None = None  # progress_bars' first-report hook (an estimate)
    order: tuple[str, ...] = ()  # --help order of the options named here; the others follow in field order


def out_option(kind: str) -> Any:
    """--out of a command writing one result document (default: a new file in ./mla-eval-out/)."""
    return option(None, "--out", "-o", path="write", help=default_out_help(kind))


def force_option() -> Any:
    return option(False, "--force", help="Replace an existing --out file.")


def model_name(result: Any) -> str | None:
    """The model a result is about (its default file name says so), if it names one."""
    model = getattr(result, "model", None)
    return model.get("name") if isinstance(model, dict) else None


def write_document(ev: Evaluation, settings: Any, opts: Any) -> None:
    """The body of a command that writes one result document (its options hold `out` and `force`):
    --out (the default name's folder too) and every file the settings write checked before any work,
    so a bad path never costs a run; the evaluation run with progress bars; the result shown and
    written (under torchrun by rank 0 only); then the plots, if the command draws any and --plot asks."""
    cmd = command_of(ev)
    out = opts.out if opts.out is not None else default_result_path(ev.name, "model")
    check_output_path(out, opts.force)
    for flag, path in path_options(settings, "write"):  # e.g. kld --save-ref
        check_output_path(path, force=True, option=flag)
    plot = getattr(opts, "plot", None)
    if plot is not None and cmd.plots is not None:
        check_plot_folder(plot, cmd.plot_files)
    check_inputs_and_outputs(settings, [("--out", out), *path_options(settings, "write")])
    # under torchrun only rank 0 draws (every rank reports the same kind of progress)
    with progress_bars(console, disable=os.environ.get("RANK", "0") != "0", on_first=cmd.on_first) as progress:
        result = ev.run(settings, progress)
    if getattr(result, "rank", 0) != 0:  # a torchrun worker: rank 0 writes the document
        return
    if cmd.after_run is not None:
        cmd.after_run(settings, result)
    cmd.show(result)
    env = getattr(result, "environment", None)
    if isinstance(env, dict) and (line := peak_memory_line(env)) is not None:
        console.print(line)
    path = write_result(opts.out or default_result_path(ev.name, model_name(result)), result.to_document(), force=opts.force)
    console.print(f"wrote {path}", soft_wrap=True)  # a path is never wrapped: users copy it
    if plot is not None and cmd.plots is not None:
        for p in cmd.plots(result, plot):
            console.print(f"wrote {p}", soft_wrap=True)


def input_paths(settings: Any) -> list[tuple[str, Path]]:
    """(flag, path) of the files a run reads: its path="read" options, and --scales where it names a file."""
    found = path_options(settings, "read")
    scales = getattr(settings, "scales", None)
    if isinstance(scales, str) and scales not in SCALES_MODES:
        found.append(("--scales", Path(scales)))
    return found


def check_inputs_and_outputs(settings: Any, outputs: list[tuple[str, Path]]) -> None:
    """Before any work: no input is a device or a pipe (read without end), and no output is one of the
    inputs (`--scales s.json --out s.json` would replace the file the run reads)."""
    inputs = input_paths(settings)
    for flag, path in inputs:
        check_not_special(path, flag)
    for out_flag, out in outputs:
        for in_flag, path in inputs:
            if path.exists() and same_file(out, path):
                raise UserError(f"{out_flag} {out} is also the {in_flag} input; write the result to another path")


def _generic_command(ev: Evaluation) -> EvaluationCommand:
    options = dataclasses.make_dataclass(
        f"{ev.name.title().replace('-', '')}Options",
        [("out", Path | None, out_option(ev.name)), ("force", bool, force_option())],
        frozen=True,
    )
    return EvaluationCommand(options=options, body=write_document)


def command_of(ev: Evaluation) -> EvaluationCommand:
    """The evaluation's command: the `COMMAND` of its `cli` module, or the generic one."""
    if ev.cli is None:
        return _generic_command(ev)
    command = getattr(importlib.import_module(ev.cli), "COMMAND", None)
    if not isinstance(command, EvaluationCommand):
        raise TypeError(f"{ev.cli} must define COMMAND = EvaluationCommand(...) for the {ev.name!r} evaluation")
    return command


def _typer_option(f: OptionField, panel: str | None = None) -> Any:
    return typer.Option(... if f.option.required else f.default, *f.option.flags, help=f.option.help,
                        show_default=f.option.show_default, rich_help_panel=panel)


def _panel(settings: type, name: str, ev: Evaluation) -> str:
    """The --help panel of a settings field: the settings class that declares it (the model and device, the text,
    or the evaluation's own)."""
    for cls in reversed(settings.__mro__):  # the most basic class declaring the field names the panel
        if name in getattr(cls, "__annotations__", {}):
            return _PANELS.get(cls.__name__, f"{ev.name} options")
    return f"{ev.name} options"


_PANELS = {"ModelSettings": "Model, device and attention path", "TextSettings": "Text (default: self-samples)"}
OUTPUT_PANEL = "Output"


def _ordered(fields: list[OptionField], order: tuple[str, ...], where: str) -> list[OptionField]:
    by_name = {f.name: f for f in fields}
    unknown = [n for n in order if n not in by_name]
    if unknown:
        raise TypeError(f"{where}: order names no option {unknown}")
    return [by_name[n] for n in order] + [f for f in fields if f.name not in order]


def typer_command(ev: Evaluation) -> Callable[..., None]:
    """A function typer reads as the command `mla-eval NAME`: one keyword parameter per option of
    the settings and of the command; called, it builds both and runs the command's body."""
    cmd = command_of(ev)
    own, extra = option_fields(ev.settings), option_fields(cmd.options)
    names = [f.name for f in own + extra]
    flags = [flag.split("/")[0] for f in own + extra for flag in f.option.flags]
    for what, seen in (("option name", names), ("flag", flags)):
        twice = sorted({x for x in seen if seen.count(x) > 1})
        if twice:
            raise TypeError(f"{ev.name}: {what}(s) {', '.join(twice)} declared twice (settings and command)")
    setting_names = {f.name for f in own}

    def command(**values: Any) -> None:
        settings = ev.settings(**{k: v for k, v in values.items() if k in setting_names})
        opts = cmd.options(**{k: v for k, v in values.items() if k not in setting_names})
        cmd.body(ev, settings, opts)

    panels = {**{f.name: _panel(ev.settings, f.name, ev) for f in own}, **{f.name: OUTPUT_PANEL for f in extra}}
    params = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=_typer_option(f, panels[f.name]),
                          annotation=f.type)
        for f in _ordered(own + extra, cmd.order, f"{ev.name} command")
    ]
    command.__name__ = ev.name.replace("-", "_")
    command.__doc__ = ev.summary + (f"\n\n{cmd.details}" if cmd.details else "")
    command.__signature__ = inspect.Signature(params)  # what typer reads
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


def register(app: typer.Typer, ev: Evaluation) -> None:
    app.command(ev.name)(typer_command(ev))
