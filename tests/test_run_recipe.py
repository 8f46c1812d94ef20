"""`mla-eval run RECIPE`: one results directory per recipe, never overwritten; recipe errors are
one line; several capacity setups become one document each, gated and reported each."""

import json

from mla_eval.cli import main

CAPACITY_SETUPS = """
[[capacity]]
name = "h200"
preset = "glm-5"
gpu = "h200"
gpus = 8
tp = 8

[[capacity]]
preset = "deepseek-v3"
gpu = "b200"
gpus = 8
tp = 8
"""


def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_capacity_setups_each_get_a_document_gate_and_report_table(tmp_path, capsys):
    recipe = tmp_path / "caps.toml"
    recipe.write_text(CAPACITY_SETUPS)
    out = tmp_path / "r"
    assert main(["run", str(recipe), "--out", str(out)]) == 0
    names = sorted(p.name for p in out.glob("*.json"))
    assert names == ["capacity-b200-x8-tp8.json", "capacity-h200.json", "environment.json"]
    h200 = json.loads((out / "capacity-h200.json").read_text())
    assert h200["model"]["name"] == "glm-5" and h200["setup"]["gpus"] == 8
    # the same numbers as the capacity command run by hand
    capsys.readouterr()
    assert main(["capacity", "--preset", "glm-5", "--gpu", "h200", "--gpus", "8", "--tp", "8", "--json"]) == 0
    by_hand = json.loads(capsys.readouterr().out)
    assert [r["pool_tokens"] for r in by_hand["formats"]] == [r["pool_tokens"] for r in h200["formats"]]
    # gate: each setup's pool is compared; a changed pool in one setup fails
    base = tmp_path / "base"
    assert main(["gate", str(out), "--baseline", str(base), "--update"]) == 0
    assert main(["gate", str(out), "--baseline", str(base)]) == 0
    doc = json.loads((base / "capacity-b200-x8-tp8.json").read_text())
    doc["formats"][2]["pool_tokens"] += 64
    (base / "capacity-b200-x8-tp8.json").write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["gate", str(out), "--baseline", str(base)]) == 1
    assert "capacity-b200-x8-tp8.json" in capsys.readouterr().out
    # report: one capacity table per setup
    assert main(["report", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert md.count("## KV-cache capacity") == 2 and "glm-5 on 8 x H200" in md and "deepseek-v3 on 8 x B200" in md


def test_results_directory_is_never_overwritten(tmp_path, capsys):
    recipe = tmp_path / "c.toml"
    recipe.write_text('[capacity]\npreset = "glm-5"\ngpu = "h200"\n')
    out = tmp_path / "r"
    assert main(["run", str(recipe), "--out", str(out)]) == 0
    assert (out / "capacity.json").is_file()
    capsys.readouterr()
    assert main(["run", str(recipe), "--out", str(out)]) == 2
    assert "exists" in _err(capsys)
    assert main(["run", str(recipe), "--out", str(out), "--force"]) == 0


def test_bad_recipes_are_one_line_errors(tmp_path, capsys):
    cases = {
        "[kld2]\nctx = 64\n": "unknown table(s) kld2",
        "model = 'x'\n": "has none of the tables",
        "[[kld]]\nctx = 64\n": "[kld] is one table",
        CAPACITY_SETUPS.replace('name = "h200"', 'name = "b200-x8-tp8"'): "both named 'b200-x8-tp8'",
        "[capacity\n": "c.toml",
    }
    for text, msg in cases.items():
        recipe = tmp_path / "c.toml"
        recipe.write_text(text)
        assert main(["run", str(recipe), "--out", str(tmp_path / "never")]) == 2
        assert msg in _err(capsys), text
        assert not (tmp_path / "never").exists()
    assert main(["run", str(tmp_path / "missing.toml")]) == 2
    assert "does not exist" in _err(capsys)
