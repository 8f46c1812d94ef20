"""`mla-eval run RECIPE`: every evaluation a recipe names, into one results directory.

A recipe (recipes/*.toml) has one optional table per evaluation that writes a results-directory
document (mla_eval.evaluation: kld, needle, capacity, ...), whose keys are that command's long
options (without the leading dashes, `_` or `-` alike); top-level `model` (path; omitted = the
embedded model), `device` and `backend`, for every evaluation that has such a setting; and a [gate]
table of tolerances used by `mla-eval gate --tolerances RECIPE`. File names in a recipe are relative to the
recipe's own folder (not the current directory). An evaluation with setups (capacity:
several GPU setups) may be an array of tables ([[capacity]], each optionally `name`d). The results
directory gets <name>.json per evaluation (capacity-<setup>.json per setup), plots/, the recipe and
the environment.

Every section is validated before any runs; the documents are written into a staging folder and
moved into the results directory only when every section succeeded. Nothing the run did not
write is ever deleted: --force replaces only files an mla-eval run wrote there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from mla_eval.attention import dispatch
from mla_eval.commands.evaluation import command_of
from mla_eval.commands.progress import progress_bars
from mla_eval.errors import UserError
from mla_eval.evals.settings import BACKEND_HELP, SCALES_MODES
from mla_eval.evals.variants import split_format_list
from mla_eval.evaluation import evaluations
from mla_eval.layer_plan import PLAN_PREFIX
from mla_eval.model.latent_profile import PROFILES
from mla_eval.protocol import Evaluation, option_fields
from mla_eval.result_schemas import ENVIRONMENT_SCHEMA, schema_files, validate
from mla_eval.results import DEFAULT_OUTPUT_DIR, environment, write_result
from mla_eval.user_paths import RESULT_LIMIT, TOML_LIMIT, check_output_target, read_input_text

console = Console(stderr=True)
TOP_LEVEL_KEYS = ("model", "device", "backend")
_EXAMPLES = {"model": "/path/to/checkpoint", "device": "cpu", "backend": "auto"}


def sections() -> list[Evaluation]:
    """The evaluations a recipe may name: those with a results-directory document."""
    return [ev for ev in evaluations() if ev.result_file is not None]


def load_recipe(path: Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    if path.is_dir():
        raise UserError(f"recipe {path} is a folder; give a recipe .toml file (see recipes/)")
    if not path.exists():
        raise UserError(f"recipe {path} does not exist (see recipes/)")
    text = read_input_text(path, "recipe", TOML_LIMIT)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"recipe {path}: {exc}") from None
    names = [ev.name for ev in sections()]
    unknown = [k for k, v in doc.items() if _is_table(v) and k not in [*names, "gate"]]
    if unknown:
        raise UserError(f"recipe {path}: unknown table(s) {', '.join(unknown)}; known: {', '.join(names)}, gate")
    keys = [k for k, v in doc.items() if not _is_table(v) and k not in TOP_LEVEL_KEYS]
    misplaced = [k for k in keys if k in [*names, "gate"]]
    if misplaced:
        k = misplaced[0]
        raise UserError(f"recipe {path}: {k} = {doc[k]!r} must be a table of options ([{k}] with keys below it)")
    if keys:
        raise UserError(f"recipe {path}: unknown top-level key(s) {', '.join(keys)}; known: {', '.join(TOP_LEVEL_KEYS)}")
    for key in TOP_LEVEL_KEYS:
        if key in doc and not isinstance(doc[key], str):
            raise UserError(f"recipe {path}: {key} = {doc[key]!r} must be a string, e.g. {key} = \"{_EXAMPLES[key]}\"")
    if not any(s in doc for s in names):
        raise UserError(f"recipe {path} has none of the tables {', '.join(names)}")
    for ev in sections():
        if ev.name not in doc:
            continue
        if not ev.setups and not isinstance(doc[ev.name], dict):
            raise UserError(f"recipe {path}: [{ev.name}] is one table (write [{ev.name}], not [[{ev.name}]])")
        stems = [stem for stem, _ in setups(ev, doc[ev.name], path)]
        if len(set(stems)) != len(stems):
            twice = sorted(n for n in stems if stems.count(n) > 1)[0].removeprefix(f"{ev.stem}-")
            raise UserError(f"recipe {path}: two [[{ev.name}]] setups are both named {twice!r}; give each a distinct name")
    return doc


def _is_table(v) -> bool:
    return isinstance(v, dict) or (isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v))


def setups(ev: Evaluation, section, path: Path) -> list[tuple[str, dict]]:
    """(file stem, options) per document of one recipe table. An evaluation without setups: one table,
    <stem>.json. With setups: one [name] table -> <stem>.json; an array [[name]] -> <stem>-<setup>.json
    each, the setup named by its `name` key or by the evaluation (capacity: gpu / gpus / tp / dcp, e.g.
    capacity-h200-x8-tp8)."""
    if isinstance(section, dict):
        return [(ev.stem, section)]
    if not _is_table(section):
        raise UserError(f"recipe {path}: [{ev.name}] must be a table or an array of tables ([[{ev.name}]])")
    out = []
    for i, table in enumerate(section, 1):
        opts = {k: v for k, v in table.items() if k != "name"}
        name = str(table.get("name") or (ev.setup_name(opts) if ev.setup_name else "") or f"setup{i}")
        out.append((f"{ev.stem}-" + "".join(c if c.isalnum() or c in "-_." else "-" for c in name), opts))
    return out


@dataclasses.dataclass(frozen=True)
class Planned:
    """One document a recipe asks for: its evaluation, file stem and validated settings."""

    ev: Evaluation
    stem: str
    settings: Any


def _beside(value: str, base: Path) -> str:
    """A file name as the recipe wrote it, made the recipe's: relative names resolve against its folder."""
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else base / path)


def resolve_paths(ev: Evaluation, table: dict, base: Path) -> dict:
    """A recipe's relative file names are relative to the recipe's folder, wherever `mla-eval run` is started: every
    option declared as a path (option(path=...)), and the options that take a file or a word (--scales FILE|auto|none,
    --latent-profile FILE|NAME|none, --formats plan:FILE items)."""
    declared = {f.name for f in option_fields(ev.settings) if f.option.path is not None}

    def plan_item(item):
        item = str(item)
        stripped = item.strip()
        return PLAN_PREFIX + _beside(stripped[len(PLAN_PREFIX):].strip(), base) if stripped.startswith(PLAN_PREFIX) else item

    out = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if isinstance(value, str) and value:
            if name in declared or (name == "scales" and value not in SCALES_MODES) or (
                    name == "latent_profile" and value != "none" and value not in PROFILES):
                value = _beside(value, base)
            elif name in ("formats", "candidates"):
                value = value if PLAN_PREFIX not in value else _join_plan_items(value, plan_item)
        elif isinstance(value, list) and name in ("formats", "candidates"):
            value = [plan_item(v) for v in value]
        out[key] = value
    return out


def _join_plan_items(text: str, plan_item) -> str:
    return ",".join(plan_item(t) for t in split_format_list(text))


def plan(doc: dict, recipe: Path, fixed: dict) -> list[Planned]:
    """Every document of the recipe with its settings, each validated (before any work); the instant
    evaluations first, so a bad setup there costs no model run. Relative file names are the recipe's
    (`resolve_paths`)."""
    planned = []
    for ev in sections():
        for stem, opts in setups(ev, doc[ev.name], recipe) if ev.name in doc else []:
            where = f"recipe {recipe} [{ev.name}]" + (f" ({stem})" if ev.setups else "")
            opts = resolve_paths(ev, opts, recipe.parent)
            planned.append(Planned(ev, stem, ev.settings_from_table(opts, where, fixed)))
    return sorted(planned, key=lambda p: not p.ev.instant)  # stable: registry order otherwise


def _ours(path: Path, folder_is_ours: bool) -> bool:
    """Whether an mla-eval run wrote `path`: a JSON document naming one of our schemas, or (in a
    folder whose environment.json is ours) the recipe copy and the plots."""
    if path.suffix == ".json":
        try:
            doc = json.loads(read_input_text(path, "results file", RESULT_LIMIT))
        except (UserError, ValueError):  # a device, a pipe, not UTF-8, not JSON: not ours
            return False
        if not isinstance(doc, dict):
            return False
        if path.name == "environment.json" and "schema" not in doc:  # the environment document has no schema key
            try:
                validate(doc, str(path), ENVIRONMENT_SCHEMA)
            except UserError:
                return False
            return True
        return doc.get("schema") in schema_files()
    return folder_is_ours and path.is_file()


def _replaceable(path: Path, folder_is_ours: bool) -> bool:
    if path.is_dir():  # only our plots folder, whose files are ours too
        return path.name == "plots" and folder_is_ours and all(_ours(p, True) for p in path.rglob("*") if not p.is_dir())
    return _ours(path, folder_is_ours)


def _check_destination(out: Path, staged: list[Path], force: bool) -> None:
    """Before any work: the results directory can take every file of the run, and --force would
    replace only files an earlier mla-eval run wrote (never anything else)."""
    check_output_target(out, "--out")
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


def _planned_files(planned: list[Planned]) -> list[Path]:
    files = [Path("recipe.toml"), Path("environment.json")] + [Path(f"{p.stem}.json") for p in planned]
    if any(command_of(p.ev).plots is not None for p in planned):
        files.append(Path("plots"))
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
    from mla_eval.model.random_models import is_random_spec

    model = doc.get("model")
    fixed = {  # a checkpoint folder named relative to the recipe is the recipe's (a random:<preset> spec is no path)
        "model": None if not model else Path(model) if is_random_spec(model) else Path(_beside(model, recipe.parent)),
        "device": str(doc.get("device") or "auto"),
        "backend": backend if backend is not None else doc.get("backend"),
    }
    if fixed["backend"] is not None:
        dispatch.check_backend(fixed["backend"], source="--backend" if backend is not None else f"recipe {recipe}: backend")
    planned = plan(doc, recipe, fixed)  # every section's settings are validated before the first one runs
    _check_destination(out, _planned_files(planned), force)

    out.parent.mkdir(parents=True, exist_ok=True)
    # beside a new results directory (renamed into place at the end), inside an existing one
    stage = Path(tempfile.mkdtemp(prefix=".mla-eval-staging-", dir=out if out.exists() else out.parent))
    umask = os.umask(0)
    os.umask(umask)
    stage.chmod(0o777 & ~umask)  # mkdtemp makes it private; the results directory it becomes should not be
    section = planned[0].ev.name
    try:
        for p in planned:
            section, cmd = p.ev.name, command_of(p.ev)
            with progress_bars(console, on_first=cmd.on_first) as progress:
                result = p.ev.run(p.settings, progress)
            cmd.show(result)
            write_result(stage / f"{p.stem}.json", result.to_document())
            if cmd.plots is not None:
                cmd.plots(result, stage / "plots")
        shutil.copyfile(recipe, stage / "recipe.toml")
        write_result(stage / "environment.json", environment(), schema=ENVIRONMENT_SCHEMA)
        written = _listing(stage)
        _move_in(stage, out)
    except UserError as exc:
        raise UserError(f"recipe section [{section}]: {exc}; nothing was written to {out}") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)  # the staging folder holds only what this run wrote
    stale = _remove_stale_report(out)
    # where the files are now (the staging folder they were written in is gone)
    typer.echo(f"wrote {out}/: {', '.join(written)}")
    if stale:
        typer.echo(f"removed {' and '.join(stale)}: made from the documents this run replaced; `mla-eval report {out}` "
                   "makes it again")


def _listing(stage: Path) -> list[str]:
    """What a run wrote, as it will lie in the results directory: its files, a folder's as one entry with a count."""
    out = []
    for p in sorted(stage.iterdir()):
        if p.is_dir():
            n = sum(1 for f in p.rglob("*") if f.is_file())
            out.append(f"{p.name}/ ({n} file{'s' if n != 1 else ''})")
        else:
            out.append(p.name)
    return out


def _remove_stale_report(out: Path) -> list[str]:
    """A report page in the results directory describes the documents it was made from, which this run replaced or
    joined: it is removed where mla-eval wrote it (a file of another origin is left alone)."""
    from mla_eval.report.page import is_our_report

    stale = []
    for name in ("report.html", "report.md"):
        path = out / name
        if path.is_file() and is_our_report(path):
            path.unlink()
            stale.append(name)
    return stale


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
