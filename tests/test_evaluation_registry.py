"""The evaluation registry (mla_eval.evaluation): a toy evaluation registered from this file, touching no
module of mla-eval, becomes a command with generated options, a recipe table of `run`, a gated and
reported document and an api entry; the built-ins' options are generated from their settings."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import typer

from mla_eval import api
from mla_eval.cli import build_app, main
from mla_eval.errors import UserError
from mla_eval.evaluation import evaluations, register_evaluation, unregister_evaluation
from mla_eval.protocol import Evaluation, Metric, library_only, option, option_fields

TOY_SCHEMA = "mla-eval/toy/v1"


@dataclasses.dataclass(frozen=True)
class ToySettings:
    rows: int = option(3, "--rows", "-r", help="How many rows the toy document holds.")
    scale: float = option(1.0, "--scale", help="Every row's score is its number times this.")
    label: str | None = option(None, "--label", help="A name recorded in the document.")
    secret: int = library_only(7)

    def __post_init__(self) -> None:
        if self.rows < 1:
            raise UserError(f"--rows must be at least 1, got {self.rows}")


@dataclasses.dataclass
class ToyResult:
    settings: ToySettings
    scores: dict[str, float]

    def to_document(self) -> dict:
        return {"schema": TOY_SCHEMA, "label": self.settings.label,
                "formats": {name: {"score": s} for name, s in self.scores.items()}}


def run_toy(settings: ToySettings, progress) -> ToyResult:
    progress("rows", 0, settings.rows)
    scores = {f"row{i}": (i + 1) * settings.scale for i in range(settings.rows)}
    progress("rows", settings.rows, settings.rows)
    return ToyResult(settings, scores)


@pytest.fixture()
def toy(tmp_path):
    schema = tmp_path / "toy.schema.json"
    schema.write_text(json.dumps({
        "$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "toy", "title": TOY_SCHEMA,
        "type": "object", "required": ["schema", "formats"],
        "properties": {"schema": {"const": TOY_SCHEMA}, "label": {"type": ["string", "null"]},
                       "formats": {"type": "object", "additionalProperties": {
                           "type": "object", "required": ["score"], "properties": {"score": {"type": "number"}}}}},
    }))
    ev = register_evaluation(Evaluation(
        name="toy", summary="A toy evaluation: one score per row.", settings=ToySettings, run=run_toy, result=ToyResult,
        schema=TOY_SCHEMA, schema_file=schema, result_file="toy.json",
        metrics=(Metric("score", "higher", abs_tol=0.5),), rows=lambda doc: list(doc["formats"].items()),
    ))
    yield ev
    unregister_evaluation("toy")


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_registered_evaluation_is_a_command_with_generated_options(toy, tmp_path, capsys, monkeypatch):
    capsys.readouterr()
    assert main(["--help"]) == 0
    assert re.search(r"toy\s+A toy evaluation: one score per row\.", capsys.readouterr().out)
    cmd = typer.main.get_command(build_app()).commands["toy"]
    opts = {p.name: p for p in cmd.params}
    assert opts["rows"].opts == ["--rows", "-r"] and opts["rows"].default == 3
    assert opts["rows"].help == "How many rows the toy document holds."
    assert "secret" not in opts  # library-only
    assert opts["out"].opts == ["--out", "-o"] and "./mla-eval-out/toy-" in opts["out"].help
    out = tmp_path / "t.json"
    assert main(["toy", "-r", "2", "--scale", "1.5", "--label", "x", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["formats"] == {"row0": {"score": 1.5}, "row1": {"score": 3.0}}
    assert f"wrote {out}" in capsys.readouterr().err
    assert main(["toy", "--rows", "0"]) == 2 and "--rows must be at least 1, got 0" in _one_line_error(capsys)
    assert main(["toy", "--rows", "two"]) == 2 and "'--rows'" in _one_line_error(capsys)
    assert main(["toy", "--out", str(out)]) == 2 and "exists" in _one_line_error(capsys)
    monkeypatch.chdir(tmp_path)  # the default output folder is relative to the working directory
    assert main(["toy"]) == 0
    written = list((tmp_path / "mla-eval-out").glob("toy-*.json"))
    assert len(written) == 1 and json.loads(written[0].read_text())["schema"] == TOY_SCHEMA


def test_a_registered_evaluation_is_a_recipe_table_gated_and_reported(toy, tmp_path, capsys):
    recipe = tmp_path / "toy.toml"
    recipe.write_text('[toy]\nrows = 2\nscale = 2.0\n\n[capacity]\npreset = "glm-5"\ngpu = "h200"\n')
    out = tmp_path / "r"
    assert main(["run", str(recipe), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["capacity.json", "environment.json", "recipe.toml", "toy.json"]
    assert json.loads((out / "toy.json").read_text())["formats"]["row1"] == {"score": 4.0}
    # recipe keys are checked like the built-ins' before anything runs
    capsys.readouterr()
    recipe.write_text("[toy]\nrows = 'two'\n")
    assert main(["run", str(recipe), "--out", str(tmp_path / "never")]) == 2
    assert "[toy]: rows = 'two' has the wrong type" in _one_line_error(capsys)
    assert not (tmp_path / "never").exists()
    # gate: the toy's metric, with its direction and default tolerance
    base = tmp_path / "base"
    assert main(["gate", str(out), "--baseline", str(base), "--update"]) == 0
    assert main(["gate", str(out), "--baseline", str(base)]) == 0
    doc = json.loads((base / "toy.json").read_text())
    doc["formats"]["row1"]["score"] = 4.4  # within 0.5: the results' 4.0 is no regression
    (base / "toy.json").write_text(json.dumps(doc))
    assert main(["gate", str(out), "--baseline", str(base)]) == 0
    doc["formats"]["row1"]["score"] = 4.6  # the results fell by 0.6 > 0.5
    (base / "toy.json").write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["gate", str(out), "--baseline", str(base)]) == 1
    assert "row1.score" in capsys.readouterr().out
    tolerances = tmp_path / "tol.toml"
    tolerances.write_text("[gate]\nscore = { abs = 1.0 }\n")
    assert main(["gate", str(out), "--baseline", str(base), "--tolerances", str(tolerances)]) == 0
    assert main(["gate", "--help"]) == 0 and "score may not fall by more than 0.5" in capsys.readouterr().out
    # report: a table of its metrics (it brings no tables of its own)
    assert main(["report", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "## A toy evaluation: one score per row." in md and "| row1 | 4 |" in md


def test_a_registered_evaluation_is_an_api_entry(toy):
    assert "toy" in api.evaluations() and api.evaluation("toy").settings is ToySettings
    result = api.evaluate(ToySettings(rows=2), progress=lambda *a: None)
    assert isinstance(result, ToyResult) and result.scores == {"row0": 1.0, "row1": 2.0}
    with pytest.raises(UserError, match="is no evaluation's settings"):
        api.evaluate(object())


def test_unregistered_evaluation_is_gone_everywhere(tmp_path, capsys):
    assert "toy" not in api.evaluations()
    assert main(["toy"]) == 2 and "No such command 'toy'" in _one_line_error(capsys)
    recipe = tmp_path / "toy.toml"
    recipe.write_text("[toy]\nrows = 2\n")
    assert main(["run", str(recipe)]) == 2 and "unknown table(s) toy" in _one_line_error(capsys)


def test_registration_refuses_what_would_be_ambiguous(toy):
    base = dict(summary="s", settings=ToySettings, run=run_toy, result=ToyResult)
    with pytest.raises(ValueError, match="already registered"):
        register_evaluation(Evaluation(name="toy", schema=None, **base))
    with pytest.raises(ValueError, match="built-in"):
        register_evaluation(Evaluation(name="kld", schema=None, **base), replace=True)
    with pytest.raises(ValueError, match="schema 'mla-eval/kld/v1' is 'kld'"):
        register_evaluation(Evaluation(name="toy2", schema="mla-eval/kld/v1", **base))
    with pytest.raises(ValueError, match="metric 'kld_mean' is already defined differently"):
        register_evaluation(Evaluation(name="toy2", schema=None, metrics=(Metric("kld_mean", "higher"),),
                                       rows=lambda d: [], **base))

    @dataclasses.dataclass(frozen=True)
    class Undeclared:
        rows: int = 3  # neither option() nor library_only(): its command-line face would be lost silently

    with pytest.raises(TypeError, match="Undeclared.rows: declare it with option"):
        register_evaluation(Evaluation(name="toy2", schema=None, **{**base, "settings": Undeclared}))
    assert [ev.name for ev in evaluations()][:4] == ["kld", "calibrate", "needle", "capacity"]


@pytest.mark.parametrize("name", ["kld", "calibrate", "needle", "capacity"])
def test_builtin_options_are_their_settings_fields(name):
    """Each option of a built-in command comes from its settings field: the same flags, help and
    default, so the option is written once (on the field)."""
    ev = api.evaluation(name)
    cmd = typer.main.get_command(build_app()).commands[name]
    params = {p.name: p for p in cmd.params}
    fields = option_fields(ev.settings)
    assert len(fields) >= 12, name
    defaults = ev.settings()  # what the library does when the command line gives nothing
    for f in fields:
        p = params[f.name]
        assert [*p.opts, *p.secondary_opts] == [x for flag in f.option.flags for x in flag.split("/")], f.name
        assert p.help == f.option.help and p.default == getattr(defaults, f.name), f.name


def test_the_api_docstring_capacity_example_runs():
    block = [line.strip() for line in api.__doc__.splitlines() if line.startswith("    ") and "capacity" in line]
    assert block, "the api docstring lost its capacity example"
    scope = {"api": api}
    exec("\n".join(line.split("  #")[0] for line in block), scope)
    capacity = scope["capacity"]
    assert isinstance(capacity, api.CapacityResult) and [r.name for r in capacity.rows] == ["nvfp4"]
    assert capacity.rows[0].pool_tokens > 0 and capacity.to_document()["schema"] == "mla-eval.capacity/1"


def test_default_output_folder_is_under_the_working_directory():
    from mla_eval.results import DEFAULT_OUTPUT_DIR, default_result_path

    assert DEFAULT_OUTPUT_DIR == Path("mla-eval-out") and not DEFAULT_OUTPUT_DIR.is_absolute()
    assert default_result_path("needle", "m").parent == DEFAULT_OUTPUT_DIR
