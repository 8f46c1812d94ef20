"""`mla-eval run RECIPE`: every evaluation a recipe names, into one results directory.

A recipe (recipes/*.toml) has optional tables [kld], [needle], [capacity] whose keys are the
long options of those commands (without the leading dashes, `_` or `-` alike), a top-level
`model` (path; omitted = the embedded model) and `device`, and a [gate] table of tolerances used
by `mla-eval gate --tolerances RECIPE`. The results directory gets kld.json, needle.json,
capacity.json, plots/, the resolved recipe and the environment; it is never overwritten.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import typer

from mla_eval.errors import UserError
from mla_eval.results import ENVIRONMENT_SCHEMA, environment, write_result

SECTIONS = ("kld", "needle", "capacity")


def load_recipe(path: Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    if not path.is_file():
        raise UserError(f"recipe {path} does not exist (see recipes/)")
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"recipe {path}: {exc}") from None
    unknown = [k for k, v in doc.items() if isinstance(v, dict) and k not in SECTIONS + ("gate",)]
    if unknown:
        raise UserError(f"recipe {path}: unknown table(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}, gate")
    if not any(s in doc for s in SECTIONS):
        raise UserError(f"recipe {path} has none of the tables {', '.join(SECTIONS)}")
    return doc


def _args(table: dict) -> list[str]:
    out: list[str] = []
    for key, value in table.items():
        opt = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(opt if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, list):
            out += [opt, ",".join(str(v) for v in value)]
        else:
            out += [opt, str(value)]
    return out


def run(
    recipe: Path = typer.Argument(..., help="Recipe TOML (see recipes/)."),
    out: Path = typer.Option(None, "--out", "-o", help="Results directory (default results/<recipe name>)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing results directory."),
) -> None:
    """Run every evaluation of a recipe and write one results directory."""
    from mla_eval.cli import main

    doc = load_recipe(recipe)
    out = out or Path("results") / recipe.stem
    if out.exists():
        if not force:
            raise UserError(f"results directory {out} exists; choose another --out or pass --force")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shutil.copyfile(recipe, out / "recipe.toml")
    write_result(out / "environment.json", environment(), schema=ENVIRONMENT_SCHEMA)
    common = []
    if doc.get("model"):
        common += ["--model", str(doc["model"])]
    if doc.get("device"):
        common += ["--device", str(doc["device"])]
    for section in SECTIONS:
        if section not in doc:
            continue
        args = [section, *_args(doc[section]), "--out", str(out / f"{section}.json")]
        if section in ("kld", "needle"):
            args += common + ["--plot", str(out / "plots")]
            code = main(args)
        else:
            # capacity prints its one JSON document on stdout
            import contextlib
            import io

            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                code = main([section, *_args(doc[section]), "--json"])
            if code == 0:
                write_result(out / "capacity.json", json.loads(buf.getvalue()))
        if code != 0:
            raise UserError(f"recipe section [{section}] failed (exit {code}); see the message above")
    typer.echo(f"wrote {out}/")


def register(app: typer.Typer) -> None:
    app.command("run")(run)
