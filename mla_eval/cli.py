"""The `mla-eval` command line: a thin Typer layer over the library.

Each registered evaluation (mla_eval.evaluation) is a command whose options are generated from its
settings (mla_eval.commands.evaluation); the other commands live in `mla_eval/commands/<name>.py`
and expose `register(app)`. `main` is the one place where failures meet the user: a `UserError` or
a usage error (bad option, missing argument) becomes one `error: ...` line on stderr and exit code 2,
never a traceback; SIGINT / SIGTERM end the run with one line naming the results that were not
written (exit 130 / 143).
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import io
import os
import signal
import sys
import threading
import warnings

import typer

from mla_eval.errors import UserError
from mla_eval.evaluation import evaluations
from mla_eval.results import pending_outputs
from mla_eval.version import __version__

TOOL_COMMANDS = ("formats", "gate", "run", "report", "plot")  # the commands that are not evaluations


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mla-eval {__version__}")
        raise typer.Exit()


def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Evaluate what a KV-cache format does to an MLA model: bytes, capacity, KLD, retrieval."""


def build_app() -> typer.Typer:
    """The app: one command per registered evaluation (mla_eval.evaluation), then the tools."""
    from typer.core import TyperCommand

    from mla_eval.commands import evaluation as evaluation_command
    from mla_eval.commands.help import HelpCommand, HelpGroup

    app = typer.Typer(
        name="mla-eval",
        help="Quality and capacity evaluator for low-precision MLA KV caches (NVFP4 / FP8).",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        cls=HelpGroup,  # --help pages that read at 80 columns (mla_eval.commands.help)
    )
    app.callback()(_root)
    for ev in evaluations():
        evaluation_command.register(app, ev)
    for name in TOOL_COMMANDS:
        importlib.import_module(f"mla_eval.commands.{name}").register(app)
    for info in app.registered_commands:  # typer fills in its own TyperCommand where a command named none
        if info.cls is None or info.cls is TyperCommand:
            info.cls = HelpCommand
    return app


_built: dict[tuple, typer.Typer] = {}


def current_app() -> typer.Typer:
    """The app for the evaluations registered now (built again only when they changed)."""
    key = tuple(evaluations())  # the (frozen, hashable) declarations themselves: an equal set builds an equal app
    if key not in _built:
        _built.clear()
        _built[key] = build_app()
    return _built[key]


app = current_app()  # the built-ins and whatever was registered before this import; main() uses current_app()


def _usage_error_types() -> tuple[type[BaseException], ...]:
    """The usage-error base classes of whichever click typer runs on: typer < 0.2x uses the `click`
    package (errors derive from click.ClickException); newer typer bundles its own copy of click whose
    errors derive from typer.exceptions.TyperException and are not click's classes at all."""
    types: list[type[BaseException]] = []
    with contextlib.suppress(ImportError):
        import click

        types.append(click.ClickException)
    with contextlib.suppress(ImportError):
        from typer.exceptions import TyperException

        types.append(TyperException)
    with contextlib.suppress(ImportError, AttributeError):
        from typer import _click

        types.append(_click.exceptions.ClickException)
    return tuple(types)


USAGE_ERRORS = _usage_error_types()
SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + signal number, as shells report them


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _usage_message(exc: BaseException) -> str:
    """A usage error as one line: Click's message plus where the help is."""
    message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    ctx = getattr(exc, "ctx", None)
    command = getattr(ctx, "command_path", None) or "mla-eval"
    return f"{_one_line(message)} (see '{command} --help')"


class _SignalScope:
    """SIGINT and SIGTERM raise KeyboardInterrupt inside `main` (so `finally` blocks and atomic writes
    clean up their temporary files) and remember which signal came; the previous handlers come back on
    exit. Only the main thread may install handlers; elsewhere (an in-process test runner thread) this
    does nothing."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._saved: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        self.received = signum
        raise KeyboardInterrupt

    def __enter__(self) -> _SignalScope:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNAL_EXIT:
                self._saved[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._saved.items():
            signal.signal(sig, old)


def _interrupted(scope: _SignalScope, pending) -> int:
    sig = scope.received if scope.received is not None else signal.SIGINT
    missing = [str(p) for p in pending.paths]
    what = f"no result written (would have been {', '.join(missing)})" if missing else "no result written"
    typer.echo(f"interrupted by {signal.Signals(sig).name}: {what}", err=True)
    return SIGNAL_EXIT[sig]


# a write that cannot go on (stdout on a full device or a closed pipe, a full disk): the user's to fix
OUTPUT_ERRNOS = {errno.ENOSPC, errno.EPIPE, errno.EDQUOT, errno.EFBIG, errno.EIO}


def _output_failed(exc: OSError) -> int:
    """One line for a write that failed (the file it names, else the command's standard output), exit 2. What
    stdout still buffers is dropped (fd 1 pointed at /dev/null), so the exit does not fail on it again."""
    where = f"{exc.filename}" if exc.filename else "the output (standard output)"
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stdout.flush()
    with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
        fd = sys.stdout.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    typer.echo(f"error: cannot write {where}: {exc.strerror or exc}; free space there or send the output elsewhere", err=True)
    return 2


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """The library's warnings (e.g. the kernel fallback) as one `warning: ...` line on stderr."""
    typer.echo(f"warning: {_one_line(message)}", err=True)


def main(argv: list[str] | None = None) -> int:
    """Console entry point: runs the app; every failure a user can fix is one line and exit 2."""
    args = sys.argv[1:] if argv is None else list(argv)
    app = current_app()  # an evaluation registered after import is a command too
    if not args:  # bare `mla-eval`: the command list, and one line saying what is missing (any click version)
        app(args=["--help"], prog_name="mla-eval", standalone_mode=False)
        typer.echo("error: no command given; choose one of the commands above", err=True)
        return 2
    with _SignalScope() as scope, pending_outputs() as pending, warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            # without standalone mode click returns a command's typer.Exit code instead of exiting
            code = app(args=args, prog_name="mla-eval", standalone_mode=False)
        except KeyboardInterrupt:
            return _interrupted(scope, pending)
        except UserError as exc:
            typer.echo(f"error: {_one_line(exc)}", err=True)
            return 2
        except typer.Exit as exc:  # a command's own exit code (gate: 1 on a regression)
            code = exc.exit_code
        except typer.Abort:  # older click turns KeyboardInterrupt into Abort
            return _interrupted(scope, pending)
        except USAGE_ERRORS as exc:
            typer.echo(f"error: {_usage_message(exc)}", err=True)
            return 2
        except OSError as exc:
            if exc.errno not in OUTPUT_ERRNOS:
                raise
            return _output_failed(exc)
        if scope.received is not None or code == SIGNAL_EXIT[signal.SIGINT]:
            return _interrupted(scope, pending)  # typer >= 0.2x turns KeyboardInterrupt into exit code 130
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
