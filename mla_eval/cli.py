"""The `mla-eval` command line: a thin Typer layer over the library.

Each command lives in `mla_eval/commands/<name>.py` and exposes `register(app)`. User errors
(`UserError`) become one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import importlib
import sys
import warnings

import typer

from mla_eval import __version__
from mla_eval.errors import UserError

COMMAND_MODULES = ("formats", "capacity", "kld", "needle", "gate", "run", "report")

app = typer.Typer(
    name="mla-eval",
    help="Quality and capacity evaluator for low-precision MLA KV caches (NVFP4 / FP8).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mla-eval {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Evaluate what a KV-cache format does to an MLA model: bytes, capacity, KLD, retrieval."""


for _name in COMMAND_MODULES:
    importlib.import_module(f"mla_eval.commands.{_name}").register(app)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """The library's warnings (e.g. the kernel fallback) as one `warning: ...` line on stderr."""
    typer.echo(f"warning: {message}", err=True)


def main(argv: list[str] | None = None) -> int:
    """Console entry point: runs the app and turns UserError into a one-line message, exit 2."""
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            # without standalone mode click returns a command's typer.Exit code instead of exiting
            code = app(args=argv, standalone_mode=False)
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        return 2
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        typer.echo("aborted", err=True)
        return 130
    except Exception as exc:  # click usage errors carry their own exit code
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            return exc.exit_code
        raise
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
