"""`mla-eval run RECIPE`: every evaluation a recipe names, into one results directory.

A recipe (recipes/*.toml) has optional tables [kld], [needle], [capacity] whose keys are the
long options of those commands (without the leading dashes, `_` or `-` alike), a top-level
`model` (path; omitted = the embedded model) and `device`, and a [gate] table of tolerances used
by `mla-eval gate --tolerances RECIPE`. Several GPU setups are an array of tables
([[capacity]], each optionally `name`d). The results directory gets kld.json, needle.json,
capacity.json (or capacity-<name>.json per setup), plots/, the resolved recipe and the
environment; it is never overwritten.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import typer

from mla_eval.errors import UserError
from mla_eval.result_schemas import ENVIRONMENT_SCHEMA
from mla_eval.results import environment, write_result

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
    unknown = [k for k, v in doc.items() if _is_table(v) and k not in SECTIONS + ("gate",)]
    if unknown:
        raise UserError(f"recipe {path}: unknown table(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}, gate")
    if not any(s in doc for s in SECTIONS):
        raise UserError(f"recipe {path} has none of the tables {', '.join(SECTIONS)}")
    for s in ("kld", "needle"):
        if s in doc and not isinstance(doc[s], dict):
            raise UserError(f"recipe {path}: [{s}] is one table (write [{s}], not [[{s}]])")
    if "capacity" in doc:
        names = [n.removeprefix("capacity-") for n, _ in capacity_setups(doc["capacity"], path)]
        if len(set(names)) != len(names):
            raise UserError(f"recipe {path}: two [[capacity]] setups are both named {sorted(n for n in names if names.count(n) > 1)[0]!r}; give each a distinct name")
    return doc


def _is_table(v) -> bool:
    return isinstance(v, dict) or (isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v))


def capacity_setups(section, path: Path) -> list[tuple[str, dict]]:
    """(file stem, capacity options) per setup: one [capacity] table -> capacity.json; an array
    [[capacity]] -> capacity-<name>.json each, the name from its `name` key or from its
    gpu / gpus / tp / dcp (e.g. capacity-h200-x8-tp8)."""
    if isinstance(section, dict):
        return [("capacity", section)]
    if not _is_table(section):
        raise UserError(f"recipe {path}: [capacity] must be a table or an array of tables ([[capacity]])")
    out = []
    for i, table in enumerate(section, 1):
        opts = {k: v for k, v in table.items() if k != "name"}
        parts = [str(opts["gpu"])] if "gpu" in opts else []
        parts += [f"{prefix}{opts[key]}" for key, prefix in (("gpus", "x"), ("tp", "tp"), ("dcp", "dcp")) if key in opts]
        name = str(table.get("name") or "-".join(parts) or f"setup{i}")
        out.append(("capacity-" + "".join(c if c.isalnum() or c in "-_." else "-" for c in name), opts))
    return out


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
        if section in ("kld", "needle"):
            args = [section, *_args(doc[section]), "--out", str(out / f"{section}.json")]
            code = main(args + common + ["--plot", str(out / "plots")])
            if code != 0:
                raise UserError(f"recipe section [{section}] failed (exit {code}); see the message above")
            continue
        for stem, opts in capacity_setups(doc[section], recipe):
            # capacity prints its one JSON document on stdout
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                code = main([section, *_args(opts), "--json"])
            if code != 0:
                raise UserError(f"recipe section [{section}] ({stem}) failed (exit {code}); see the message above")
            write_result(out / f"{stem}.json", json.loads(buf.getvalue()))
    typer.echo(f"wrote {out}/")


def register(app: typer.Typer) -> None:
    app.command("run")(run)
