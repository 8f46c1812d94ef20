"""`mla-eval run RECIPE`: every evaluation a recipe names, into one results directory.

A recipe (recipes/*.toml) has optional tables [kld], [needle], [capacity] whose keys are the
long options of those commands (without the leading dashes, `_` or `-` alike), top-level
`model` (path; omitted = the embedded model), `device` and `backend`, and a [gate] table of
tolerances used by `mla-eval gate --tolerances RECIPE`. Several GPU setups are an array of tables
([[capacity]], each optionally `name`d). The results directory gets kld.json, needle.json,
capacity.json (or capacity-<name>.json per setup), plots/, the recipe and the environment.

Every section is validated before any runs; the documents are written into a staging folder and
moved into the results directory only when every section succeeded. Nothing the run did not
write is ever deleted: --force replaces only files an mla-eval run wrote there.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import typer
from rich.console import Console

from mla_eval.attention import dispatch
from mla_eval.commands.kld import BACKEND_HELP, attention_title, print_estimate, print_table, write_kld_plots
from mla_eval.commands.needle import print_needle, write_needle_plots
from mla_eval.commands.progress import progress_bars
from mla_eval.errors import UserError
from mla_eval.evals.kld_evaluation import KldSettings, evaluate_kld
from mla_eval.evals.needle_evaluation import NeedleSettings, evaluate_needle
from mla_eval.evals.settings import settings_from_table
from mla_eval.result_schemas import ENVIRONMENT_SCHEMA, SCHEMA_FILES, validate
from mla_eval.results import DEFAULT_OUTPUT_DIR, environment, write_result

console = Console(stderr=True)
TOP_LEVEL_KEYS = ("model", "device", "backend")

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
    keys = [k for k, v in doc.items() if not _is_table(v) and k not in TOP_LEVEL_KEYS]
    if keys:
        raise UserError(f"recipe {path}: unknown top-level key(s) {', '.join(keys)}; known: {', '.join(TOP_LEVEL_KEYS)}")
    if not any(s in doc for s in SECTIONS):
        raise UserError(f"recipe {path} has none of the tables {', '.join(SECTIONS)}")
    for s in ("kld", "needle"):
        if s in doc and not isinstance(doc[s], dict):
            raise UserError(f"recipe {path}: [{s}] is one table (write [{s}], not [[{s}]])")
    if "capacity" in doc:
        names = [n.removeprefix("capacity-") for n, _ in capacity_setups(doc["capacity"], path)]
        if len(set(names)) != len(names):
            raise UserError(
                f"recipe {path}: two [[capacity]] setups are both named {sorted(n for n in names if names.count(n) > 1)[0]!r}; "
                "give each a distinct name"
            )
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


def _capacity_document(opts: dict, where: str) -> dict:
    """A capacity document from a recipe table through the capacity library (defaults as the command's)."""
    from mla_eval.capacity import CapacitySettings, evaluate_capacity

    return evaluate_capacity(CapacitySettings.from_options(opts, where=where)).to_document()


def _ours(path: Path, folder_is_ours: bool) -> bool:
    """Whether an mla-eval run wrote `path`: a JSON document naming one of our schemas, or (in a
    folder whose environment.json is ours) the recipe copy and the plots."""
    if path.suffix == ".json":
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        if not isinstance(doc, dict):
            return False
        if path.name == "environment.json" and "schema" not in doc:  # the environment document has no schema key
            try:
                validate(doc, str(path), ENVIRONMENT_SCHEMA)
            except UserError:
                return False
            return True
        return doc.get("schema") in SCHEMA_FILES
    return folder_is_ours and path.is_file()


def _replaceable(path: Path, folder_is_ours: bool) -> bool:
    if path.is_dir():  # only our plots folder, whose files are ours too
        return path.name == "plots" and folder_is_ours and all(_ours(p, True) for p in path.rglob("*") if not p.is_dir())
    return _ours(path, folder_is_ours)


def _check_destination(out: Path, staged: list[Path], force: bool) -> None:
    """Before any work: the results directory can take every file of the run, and --force would
    replace only files an earlier mla-eval run wrote (never anything else)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a folder for the results directory")
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"cannot write the results directory {out}: no write permission in {probe}")
    if not out.exists():
        return
    clashes = [rel for rel in staged if (out / rel).exists()]
    if not clashes:
        return
    names = ", ".join(str(c) for c in clashes[:4]) + (" ..." if len(clashes) > 4 else "")
    if not force:
        raise UserError(f"results directory {out} exists and holds {names}; choose another --out or pass --force to replace them")
    folder_is_ours = _ours(out / "environment.json", False)
    foreign = [rel for rel in clashes if not _replaceable(out / rel, folder_is_ours)]
    if foreign:
        raise UserError(
            f"--force replaces only files mla-eval wrote, and {out / foreign[0]} is not one; move it away or choose another --out"
        )


def _planned_files(doc: dict, recipe: Path) -> list[Path]:
    files = [Path("recipe.toml"), Path("environment.json")]
    files += [Path(f"{s}.json") for s in ("kld", "needle") if s in doc]
    if "kld" in doc or "needle" in doc:
        files.append(Path("plots"))
    if "capacity" in doc:
        files += [Path(f"{stem}.json") for stem, _ in capacity_setups(doc["capacity"], recipe)]
    return files


def run(
    recipe: Path = typer.Argument(..., help="Recipe TOML (see recipes/)."),
    out: Path = typer.Option(
        None, "--out", "-o",
        help=f"Results directory (default ./{DEFAULT_OUTPUT_DIR}/<recipe name> in the current directory).",
    ),
    force: bool = typer.Option(
        False, "--force", help="Replace the documents an earlier run wrote in the results directory (nothing else)."
    ),
    backend: str = typer.Option(None, "--backend", help=BACKEND_HELP + " Overrides the recipe's `backend`."),
) -> None:
    """Run every evaluation of a recipe and write one results directory."""
    doc = load_recipe(recipe)
    out = out or DEFAULT_OUTPUT_DIR / recipe.stem
    fixed = {
        "model": Path(doc["model"]) if doc.get("model") else None,
        "device": str(doc.get("device") or "auto"),
        "backend": backend if backend is not None else doc.get("backend"),
    }
    if fixed["backend"] is not None:
        dispatch.check_backend(fixed["backend"], source="--backend" if backend is not None else f"recipe {recipe}: backend")
    # every section's settings are validated before the first one runs
    kld_st = needle_st = None
    if "kld" in doc:
        kld_st = settings_from_table(KldSettings, doc["kld"], f"recipe {recipe} [kld]", **fixed)
    if "needle" in doc:
        needle_st = settings_from_table(NeedleSettings, doc["needle"], f"recipe {recipe} [needle]", **fixed)
    setups = capacity_setups(doc["capacity"], recipe) if "capacity" in doc else []
    _check_destination(out, _planned_files(doc, recipe), force)

    out.parent.mkdir(parents=True, exist_ok=True)
    # beside a new results directory (renamed into place at the end), inside an existing one
    stage = Path(tempfile.mkdtemp(prefix=".mla-eval-staging-", dir=out if out.exists() else out.parent))
    umask = os.umask(0)
    os.umask(umask)
    stage.chmod(0o777 & ~umask)  # mkdtemp makes it private; the results directory it becomes should not be
    section = "capacity"
    try:
        # capacity first: it is instant, and a bad setup should not cost the evaluations
        for stem, opts in setups:
            write_result(stage / f"{stem}.json", _capacity_document(opts, f"recipe {recipe} [capacity] ({stem})"))
        if kld_st is not None:
            section = "kld"
            with progress_bars(console, on_first=print_estimate) as progress:
                result = evaluate_kld(kld_st, progress)
            print_table(result.formats, result.settings["ref"], result.text["label"], Console(), attention_title(result.settings))
            for note in result.notes:
                console.print(f"note: {note}")
            write_result(stage / "kld.json", result.to_document())
            write_kld_plots(result, stage / "plots")
        if needle_st is not None:
            section = "needle"
            with progress_bars(console) as progress:
                needle = evaluate_needle(needle_st, progress)
            print_needle(needle, Console())
            write_result(stage / "needle.json", needle.to_document())
            write_needle_plots(needle, stage / "plots")
        shutil.copyfile(recipe, stage / "recipe.toml")
        write_result(stage / "environment.json", environment(), schema=ENVIRONMENT_SCHEMA)
        _move_in(stage, out)
    except UserError as exc:
        raise UserError(f"recipe section [{section}]: {exc}; nothing was written to {out}") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)  # the staging folder holds only what this run wrote
    typer.echo(f"wrote {out}/")


def _move_in(stage: Path, out: Path) -> None:
    """Move the staged files into `out` (a fresh folder: one rename; else file by file, replacing
    only what _check_destination allowed)."""
    if not out.exists():
        os.replace(stage, out)
        return
    for src in sorted(p for p in stage.rglob("*") if p.is_file()):  # the staging folder is inside `out`
        dst = out / src.relative_to(stage)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)


def register(app: typer.Typer) -> None:
    app.command("run")(run)
