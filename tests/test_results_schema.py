"""Result documents: JSON Schemas (mla_eval/schemas/), validated on write and on read."""

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator
from tiny_models import tiny_checkpoint

from mla_eval.cli import main
from mla_eval.errors import UserError
from mla_eval.result_schemas import ENVIRONMENT_SCHEMA, json_path, load_schema, schema_files, validate
from mla_eval.results import read_result, write_result

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_DIR = ROOT / "mla_eval" / "schemas"
BASELINE = ROOT / "results" / "baselines" / "ci-smoke"
TOKENIZER_DIR = ROOT / "mla_eval" / "default_model"
SCHEMA_FILES = schema_files()  # the built-in evaluations' and the environment's (a test registers nothing here)
TEXT = " ".join(f"The river {w} flows past the old mill near the {w} bridge." for w in ["north", "south", "east", "west"] * 30)


def _tracked_json() -> list[Path]:
    """The JSON files under results/ that git tracks (a file left there by hand is not the project's
    to validate). Without git (an unpacked archive) every file there came with the project."""
    try:
        proc = subprocess.run(
            ["git", "ls-files", "-z", "--", "results"], cwd=ROOT, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        proc = None
    if proc is None or proc.returncode != 0:
        return sorted((ROOT / "results").rglob("*.json"))
    return sorted(ROOT / name for name in proc.stdout.split("\0") if name.endswith(".json"))


def _committed():
    """(path, schema id) of every tracked JSON under results/ whose schema has a schema file."""
    out = []
    for p in _tracked_json():
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("schema") in SCHEMA_FILES:
            out.append((p, None))
        elif p.name == "environment.json":
            out.append((p, ENVIRONMENT_SCHEMA))
    return out


COMMITTED = _committed()


def _kld_doc() -> dict:
    return json.loads((BASELINE / "kld.json").read_text())


def _one_line(exc: pytest.ExceptionInfo, *parts: str) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    for p in parts:
        assert p in msg, msg
    return msg


# --- the schema files --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(p.name for p in SCHEMA_DIR.glob("*.schema.json")))
def test_schema_files_are_valid_draft_2020_12(name):
    schema = json.loads((SCHEMA_DIR / name).read_text())
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] and schema["title"] and schema["description"]


def test_every_schema_file_is_registered_and_names_its_id():
    assert sorted(SCHEMA_FILES.values()) == sorted(p.name for p in SCHEMA_DIR.glob("*.schema.json"))
    ids = set()
    for schema_id, name in SCHEMA_FILES.items():
        schema = load_schema(schema_id)
        ids.add(schema["$id"])
        if schema_id != ENVIRONMENT_SCHEMA:
            assert schema["properties"]["schema"]["const"] == schema_id
            assert "schema" in schema["required"]
        assert schema_id in schema["title"]
    assert len(ids) == len(SCHEMA_FILES)


def test_every_results_directory_document_has_a_schema_file():
    from mla_eval.evaluation import results_dir_files

    assert {*results_dir_files().values(), ENVIRONMENT_SCHEMA} == set(SCHEMA_FILES)


def test_shared_definitions_agree_across_schema_files():
    kld, needle, env = (load_schema(s) for s in ("mla-eval/kld/v1", "mla-eval/needle/v1", ENVIRONMENT_SCHEMA))
    for key in ("float", "environment", "outer_scales"):
        assert kld["$defs"][key] == needle["$defs"][key], key
    for key in ("type", "required", "properties", "additionalProperties"):
        assert env[key] == kld["$defs"]["environment"][key], key


def test_the_documented_committed_documents_exist():
    # a plan (mla-eval/plan/v1) has no committed document under results/ (its tracked files are capped):
    # tests/test_layer_plan.py writes, validates and reads plans instead
    kinds = {json.loads(p.read_text()).get("schema") if s is None else s for p, s in COMMITTED}
    assert kinds == set(SCHEMA_FILES) - {"mla-eval/plan/v1"}


@pytest.mark.parametrize("path,schema", COMMITTED, ids=[str(p.relative_to(ROOT)) for p, _ in COMMITTED])
def test_committed_results_validate(path, schema):
    read_result(path, schema)


# --- validation messages ---------------------------------------------------------------------


def test_json_path_spelling():
    assert json_path(["formats", "nvfp4", "kld_mean"]) == "formats.nvfp4.kld_mean"
    assert json_path(["formats", "nvfp4+s_l", "kld_p99.9"]) == 'formats["nvfp4+s_l"]["kld_p99.9"]'
    assert json_path(["records", 2, "correct"]) == "records[2].correct"
    assert json_path([]) == "(top level)"


def test_wrong_type_names_file_path_and_problem():
    doc = _kld_doc()
    doc["formats"]["nvfp4"]["kld_mean"] = "abc"
    with pytest.raises(UserError) as exc:
        validate(doc, "results/x/kld.json")
    msg = _one_line(exc, "results/x/kld.json: formats.nvfp4.kld_mean: 'abc' is not of type 'number'")
    assert msg.startswith("results/x/kld.json: ")


def test_missing_key_and_long_values_stay_one_short_line():
    doc = _kld_doc()
    del doc["formats"]["nvfp4+s_l"]["kld_p99.9"]
    with pytest.raises(UserError) as exc:
        validate(doc, "k.json")
    _one_line(exc, 'k.json: formats["nvfp4+s_l"]: \'kld_p99.9\' is a required property')
    doc = _kld_doc()
    doc["formats"] = [doc["formats"]] * 50  # a huge wrong-typed value
    with pytest.raises(UserError) as exc:
        validate(doc, "k.json")
    assert len(_one_line(exc, "k.json: formats: ", "is not of type 'object'")) < 400


def test_unknown_or_missing_schema_id_is_refused():
    doc = _kld_doc()
    doc["schema"] = "mla-eval/kld/v9"
    with pytest.raises(UserError) as exc:
        validate(doc, "k.json")
    _one_line(exc, "k.json: unknown result schema 'mla-eval/kld/v9'", "mla-eval/kld/v1")
    del doc["schema"]
    with pytest.raises(UserError) as exc:
        validate(doc, "k.json")
    _one_line(exc, 'k.json: no "schema" key')
    with pytest.raises(UserError) as exc:
        validate([1, 2], "k.json")
    _one_line(exc, "k.json: a result document is a JSON object")


# --- on write ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "breakage,where",
    [
        (lambda d: d["formats"]["nvfp4"].__setitem__("tokens", "many"), "formats.nvfp4.tokens"),
        (lambda d: d.pop("settings"), "(top level): 'settings' is a required property"),
        (lambda d: d["formats"]["nvfp4"]["layers"][1].pop("attn_rel_l2"), "formats.nvfp4.layers[1]"),
        (lambda d: d.__setitem__("schema", "mla-eval/unknown/v1"), "unknown result schema"),
    ],
)
def test_bad_document_is_refused_on_write_and_nothing_is_written(tmp_path, breakage, where):
    doc = _kld_doc()
    breakage(doc)
    out = tmp_path / "sub" / "kld.json"
    with pytest.raises(UserError) as exc:
        write_result(out, doc)
    _one_line(exc, str(out), where)
    assert not out.exists() and not (out.parent.exists() and any(out.parent.iterdir()))


def test_nan_and_inf_are_written_as_null_and_inf_and_validate(tmp_path):
    doc = _kld_doc()
    doc["formats"]["nvfp4"]["kld_se"] = math.nan
    doc["formats"]["nvfp4"]["layers"][0]["rope_snr_db"] = math.inf
    doc["formats"]["nvfp4"]["layers"][0]["latent_snr_db"] = -math.inf
    out = write_result(tmp_path / "kld.json", doc)
    back = read_result(out)
    layer = back["formats"]["nvfp4"]["layers"][0]
    assert back["formats"]["nvfp4"]["kld_se"] is None and layer["rope_snr_db"] == "inf" and layer["latent_snr_db"] == "-inf"


def test_extra_keys_are_allowed(tmp_path):
    doc = _kld_doc()
    doc["new_section"] = {"anything": 1}
    doc["formats"]["nvfp4"]["kld_p99.99"] = 0.5
    doc["environment"]["cuda"] = "13.0"
    read_result(write_result(tmp_path / "kld.json", doc))


# --- on read ------------------------------------------------------------------------------------


def test_read_refuses_bad_documents_with_one_line(tmp_path):
    with pytest.raises(UserError) as exc:
        read_result(tmp_path / "missing.json")
    _one_line(exc, "missing.json does not exist")
    junk = tmp_path / "junk.json"
    junk.write_text("{oops")
    with pytest.raises(UserError) as exc:
        read_result(junk)
    _one_line(exc, "junk.json is not valid JSON (line 1 column 2")
    nan = tmp_path / "nan.json"
    nan.write_text(json.dumps(_kld_doc()).replace('"kld_mean": 0.', '"kld_mean": NaN, "x": 0.', 1))
    with pytest.raises(UserError) as exc:
        read_result(nan)
    _one_line(exc, "nan.json is not valid JSON (NaN is not JSON")
    doc = _kld_doc()
    doc["formats"]["mxfp4"]["same_top1_pct"] = [99]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(UserError) as exc:
        read_result(bad)
    _one_line(exc, f"{bad}: formats.mxfp4.same_top1_pct: [99] is not of type 'number'")


def test_gate_and_report_refuse_an_invalid_document(tmp_path, capsys):
    res = tmp_path / "r"
    shutil.copytree(BASELINE, res)
    doc = json.loads((res / "needle.json").read_text())
    doc["records"][3]["correct"] = "yes"
    (res / "needle.json").write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["gate", str(res), "--baseline", str(BASELINE)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "records[3].correct: 'yes' is not of type 'boolean'" in err
    assert main(["gate", str(res / "needle.json"), "--baseline", str(BASELINE / "needle.json")]) == 2
    assert "records[3].correct" in capsys.readouterr().err
    assert main(["report", str(res)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needle.json: records[3].correct" in err
    assert not (res / "report.html").exists()


def test_report_refuses_a_document_of_the_wrong_kind(tmp_path, capsys):
    res = tmp_path / "r"
    res.mkdir()
    shutil.copy(BASELINE / "capacity.json", res / "kld.json")
    assert main(["report", str(res)]) == 2
    assert "kld.json is mla-eval/kld/v1" in capsys.readouterr().err


# --- freshly produced documents --------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    (d / "t.txt").write_text(TEXT)
    return d


def test_fresh_kld_document_validates(ckpt, tmp_path, capsys):
    out = tmp_path / "kld.json"
    args = ["kld", "--model", str(ckpt), "--text", str(ckpt / "t.txt"), "--ctx", "64", "--stride", "32",
            "--formats", "nvfp4,fp8_ds_mla", "--scales", "none", "--out", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    doc = read_result(out)
    assert doc["schema"] == "mla-eval/kld/v1" and "layers" in doc["formats"]["nvfp4"]


def test_fresh_needle_document_validates(tmp_path, capsys):
    out = tmp_path / "needle.json"
    args = ["needle", "--lengths", "256", "--depths", "50", "--formats", "nvfp4", "--scales", "none", "--out", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    doc = read_result(out)
    assert doc["schema"] == "mla-eval/needle/v1" and len(doc["records"]) == 2


def test_fresh_capacity_document_validates(capsys):
    assert main(["capacity", "--preset", "deepseek-v3", "--gpu", "h200", "--json"]) == 0
    validate(json.loads(capsys.readouterr().out), "capacity --json")
    assert main(["capacity", "--config", str(TOKENIZER_DIR), "--kv-memory-gib", "10", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    validate(doc, "capacity --json")
    assert doc["model"]["indexer"] is None and doc["setup"]["gpu"] is None

