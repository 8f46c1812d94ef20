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


CAPACITY_ONLY = '[capacity]\npreset = "glm-5"\ngpu = "h200"\n'


def test_force_never_deletes_what_the_run_did_not_write(tmp_path, capsys, monkeypatch):
    """`run RECIPE --out . --force` used to rmtree the user's folder: their files must survive."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("my notes")
    (work / "sub").mkdir()
    (work / "sub" / "data.csv").write_text("1,2,3")
    recipe = work / "c.toml"
    recipe.write_text(CAPACITY_ONLY)
    monkeypatch.chdir(work)
    assert main(["run", "c.toml", "--out", ".", "--force"]) == 0
    assert (work / "notes.txt").read_text() == "my notes" and (work / "sub" / "data.csv").read_text() == "1,2,3"
    assert (work / "capacity.json").is_file() and (work / "environment.json").is_file() and recipe.is_file()
    # a second forced run replaces only its own documents
    assert main(["run", "c.toml", "--out", ".", "--force"]) == 0
    assert (work / "notes.txt").read_text() == "my notes"
    assert not [p for p in work.iterdir() if p.name.startswith(".")]  # no staging folder left behind


def test_force_refuses_to_replace_a_file_it_did_not_write(tmp_path, capsys):
    out = tmp_path / "r"
    out.mkdir()
    (out / "capacity.json").write_text('{"mine": true}')
    recipe = tmp_path / "c.toml"
    recipe.write_text(CAPACITY_ONLY)
    assert main(["run", str(recipe), "--out", str(out)]) == 2
    assert "pass --force" in _err(capsys)
    assert main(["run", str(recipe), "--out", str(out), "--force"]) == 2
    assert "not one; move it away" in _err(capsys)
    assert (out / "capacity.json").read_text() == '{"mine": true}'


def test_a_failed_section_leaves_no_partial_folder(tmp_path, capsys):
    recipe = tmp_path / "c.toml"
    # capacity succeeds, then the kld section fails (no such checkpoint): nothing may be left
    recipe.write_text(f'model = "{tmp_path / "missing-ckpt"}"\n' + CAPACITY_ONLY + '[kld]\nformats = "nvfp4"\n')
    out = tmp_path / "r"
    assert main(["run", str(recipe), "--out", str(out)]) == 2
    err = _err(capsys)
    assert "recipe section [kld]" in err and f"nothing was written to {out}" in err
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["c.toml"]  # no staging folder either


def test_recipe_settings_are_checked_before_anything_runs(tmp_path, capsys):
    recipe = tmp_path / "c.toml"
    for body, msg in {
        CAPACITY_ONLY + "[kld]\nbogus = 3\n": "[kld]: unknown key 'bogus'",
        CAPACITY_ONLY + "[kld]\nctx = 'abc'\n": "ctx = 'abc' has the wrong type",
        CAPACITY_ONLY + "[kld]\nctx = 0\n": "--ctx must be at least 2",
        CAPACITY_ONLY + "[needle]\nlengths = '0'\n": "positive lengths",
        'backend = "tpu"\n' + CAPACITY_ONLY: "backend 'tpu' is not a backend",
        'colour = "red"\n' + CAPACITY_ONLY: "unknown top-level key(s) colour",
        '[capacity]\npreset = "glm-5"\nbogus = 1\n': "unknown capacity option(s) bogus",
    }.items():
        recipe.write_text(body)
        assert main(["run", str(recipe), "--out", str(tmp_path / "never")]) == 2, body
        assert msg in _err(capsys), body
        assert not (tmp_path / "never").exists()
    recipe.write_text(CAPACITY_ONLY)
    assert main(["run", str(recipe), "--out", str(tmp_path / "ok"), "--backend", "bogus"]) == 2
    assert "--backend 'bogus'" in _err(capsys)


def test_a_recipes_file_names_are_relative_to_the_recipe(tmp_path, capsys, monkeypatch):
    """Relative paths in a recipe resolved against the current folder (issue 44): they are the recipe's, wherever
    `mla-eval run` starts; absolute ones, words (auto, none, a built-in profile) and random specs stay as written."""
    import shutil
    from pathlib import Path

    from mla_eval.commands.run import resolve_paths
    from mla_eval.evaluation import evaluations

    ev = {e.name: e for e in evaluations()}
    base = tmp_path / "recipes"
    table = {"text": "t.txt", "scales": "s.json", "latent-profile": "profiles/p.json", "formats": "nvfp4,plan:p.json",
             "save_ref": "/abs/ref.pt", "ctx": 64}
    assert resolve_paths(ev["kld"], table, base) == {
        "text": str(base / "t.txt"), "scales": str(base / "s.json"), "latent-profile": str(base / "profiles/p.json"),
        "formats": f"nvfp4,plan:{base / 'p.json'}", "save_ref": "/abs/ref.pt", "ctx": 64}
    words = {"scales": "auto", "latent_profile": "glm-5.2", "formats": "nvfp4,nvfp4+s_l"}
    assert resolve_paths(ev["kld"], words, base) == words
    # end to end: a capacity --config beside the recipe, run from another folder
    (base / "model").mkdir(parents=True)
    shutil.copy(Path(__file__).resolve().parents[1] / "mla_eval" / "default_model" / "config.json", base / "model")
    recipe = base / "cap.toml"
    recipe.write_text('[capacity]\nconfig = "model/config.json"\ngpu = "h200"\nkv_memory_gib = 10\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["run", str(recipe), "--out", str(tmp_path / "r")]) == 0, capsys.readouterr().err[-800:]
    assert str(base / "model" / "config.json") in (tmp_path / "r" / "capacity.json").read_text()


def test_run_says_where_files_are_and_force_removes_a_stale_report(tmp_path, capsys):
    """`run` printed paths inside its staging folder, gone after the run; `run --force` kept a report.html /
    report.md made from the documents it replaced (issue 44)."""
    recipe = tmp_path / "k.toml"
    recipe.write_text('device = "cpu"\n[kld]\nformats = "nvfp4"\nscales = "none"\nsamples = 1\nsample_len = 24\n'
                      "layer_stats = false\n")
    out = tmp_path / "r"
    assert main(["run", str(recipe), "--out", str(out)]) == 0
    screen = capsys.readouterr()
    assert ".mla-eval-staging" not in screen.out + screen.err
    assert f"wrote {out}/: environment.json, kld.json, plots/" in screen.out
    for line in screen.out.splitlines() + screen.err.splitlines():  # every path said exists
        for word in line.split():
            if word.startswith(str(tmp_path)):
                assert (tmp_path / word[len(str(tmp_path)) + 1:].rstrip(":,")).exists(), word
    assert main(["report", str(out)]) == 0 and (out / "report.html").exists()
    (out / "report-notes.md").write_text("my notes")  # not ours: kept
    capsys.readouterr()
    assert main(["run", str(recipe), "--out", str(out), "--force"]) == 0
    said = capsys.readouterr().out
    assert not (out / "report.html").exists() and not (out / "report.md").exists()
    assert "removed report.html and report.md: made from the documents this run replaced" in said
    assert (out / "report-notes.md").read_text() == "my notes"
