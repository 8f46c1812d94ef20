"""`mla-eval gate`: a deliberately degraded codec fails the gate (exit 1), the true one passes."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_checkpoint

from mla_eval.cli import main
from mla_eval.formats import numerics

BASELINE = Path(__file__).resolve().parents[1] / "results" / "baselines" / "ci-smoke"
TEXT = " ".join(f"The river {w} flows past the old mill near the {w} bridge." for w in ["north", "south", "east", "west"] * 30)


def _ckpt(tmp_path):
    d = tiny_checkpoint(tmp_path / "ckpt")
    (tmp_path / "t.txt").write_text(TEXT)
    return d


def _kld(ckpt, tmp_path, out):
    args = ["kld", "--model", str(ckpt), "--text", str(tmp_path / "t.txt"), "--ctx", "64", "--stride", "32",
            "--formats", "nvfp4,fp8_ds_mla", "--scales", "none", "--no-layer-stats", "--out", str(out)]
    assert main(args) == 0


def _truncating_e2m1(x):
    """A wrong rounding mode: round toward zero instead of to nearest even."""
    a = x.abs()
    code = sum((a >= v).to(torch.uint8) for v in (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def test_degraded_codec_fails_and_true_codec_passes(tmp_path, monkeypatch, capsys):
    ckpt = _ckpt(tmp_path)
    base, same, bad = tmp_path / "base.json", tmp_path / "same.json", tmp_path / "bad.json"
    _kld(ckpt, tmp_path, base)
    _kld(ckpt, tmp_path, same)
    with monkeypatch.context() as m:
        m.setattr(numerics, "e2m1_encode", _truncating_e2m1)
        _kld(ckpt, tmp_path, bad)
    capsys.readouterr()
    # seeded runs reproduce the metrics exactly
    strip = lambda p: {k: v for k, v in json.loads(p.read_text())["formats"].items()}  # noqa: E731
    assert strip(base) == strip(same)
    assert main(["gate", str(same), "--baseline", str(base), "--junit", str(tmp_path / "ok.xml")]) == 0
    assert "PASS" in capsys.readouterr().out
    code = main(["gate", str(bad), "--baseline", str(base), "--junit", str(tmp_path / "bad.xml")])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL" in out and "REGRESSION" in out and "nvfp4.kld_mean" in out
    assert "fp8_ds_mla.kld_mean" not in [line.split("|")[2].strip() for line in out.splitlines() if "REGRESSION" in line]
    assert 'failures="0"' not in (tmp_path / "bad.xml").read_text()


def test_missing_format_and_bad_input(tmp_path, capsys):
    doc = json.loads((BASELINE / "kld.json").read_text())
    assert {"nvfp4", "mxfp4"} <= set(doc["formats"])
    base = tmp_path / "b.json"
    base.write_text(json.dumps(doc))
    del doc["formats"]["mxfp4"]
    res = tmp_path / "r.json"
    res.write_text(json.dumps(doc))
    assert main(["gate", str(res), "--baseline", str(base)]) == 1
    assert "missing in results" in capsys.readouterr().out
    junk = tmp_path / "junk.json"
    junk.write_text("{oops")
    assert main(["gate", str(junk), "--baseline", str(base)]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert main(["gate", str(res), "--baseline", str(base), "--update"]) == 0
    assert main(["gate", str(res), "--baseline", str(base)]) == 0


def test_update_copies_documents_only_and_refuses_invalid_results(tmp_path, capsys):
    res, base = tmp_path / "r", tmp_path / "b"
    shutil.copytree(BASELINE, res)
    (res / "plots").mkdir()
    (res / "plots" / "x.png").write_bytes(b"png")
    (res / "report.html").write_text("<html>")
    base.mkdir()
    (base / "old.json").write_text((BASELINE / "kld.json").read_text())  # a document the results lack
    assert main(["gate", str(res), "--baseline", str(base), "--update"]) == 0
    assert sorted(p.name for p in base.iterdir()) == sorted(p.name for p in BASELINE.iterdir() if p.is_file())
    assert main(["gate", str(res), "--baseline", str(base)]) == 0
    doc = json.loads((res / "kld.json").read_text())
    doc["formats"]["nvfp4"]["kld_mean"] = "high"
    (res / "kld.json").write_text(json.dumps(doc))
    before = (base / "kld.json").read_text()
    capsys.readouterr()
    assert main(["gate", str(res), "--baseline", str(base), "--update"]) == 2
    assert "kld_mean" in capsys.readouterr().err and (base / "kld.json").read_text() == before


def test_gate_library_call_and_tolerances(tmp_path):
    from mla_eval.errors import UserError
    from mla_eval.report.gate import GateSettings, load_tolerances, run_gate

    doc = json.loads((BASELINE / "kld.json").read_text())
    base = tmp_path / "b.json"
    base.write_text(json.dumps(doc))
    doc["formats"]["nvfp4"]["kld_mean"] *= 1.5
    res = tmp_path / "r.json"
    res.write_text(json.dumps(doc))
    verdict = run_gate(GateSettings(results=res, baseline=base))
    assert not verdict.ok and verdict.exit_code == 1
    assert [c.name for c in verdict.checks if not c.ok] == ["nvfp4.kld_mean"]
    loose = tmp_path / "loose.toml"
    loose.write_text("[gate]\nkld_mean = { rel = 0.6 }\n")
    assert load_tolerances(loose) == {"kld_mean": {"rel": 0.6}}
    assert run_gate(GateSettings(results=res, baseline=base, tolerances=loose)).ok
    bad = tmp_path / "bad.toml"
    bad.write_text("[gate]\nkld_mean = 3\n")
    with pytest.raises(UserError, match="must be a table with abs and/or rel"):
        load_tolerances(bad)


def test_junit_replaces_only_a_gate_report(tmp_path, capsys):
    junit = tmp_path / "gate.xml"
    kld = str(BASELINE / "kld.json")
    assert main(["gate", kld, "--baseline", kld, "--junit", str(junit)]) == 0
    assert main(["gate", kld, "--baseline", kld, "--junit", str(junit)]) == 0  # ours: replaced
    junit.write_text("<my-own/>")
    assert main(["gate", kld, "--baseline", kld, "--junit", str(junit)]) == 2
    assert "not a gate report" in capsys.readouterr().err and junit.read_text() == "<my-own/>"


def test_results_of_another_kld_window_path_are_refused(tmp_path, capsys):
    """An mha result against an absorbed baseline (or a baseline from before settings.prefill existed, which ran
    absorbed) is exit 2 with the fix, not a pass or a fail decided by the path."""
    doc = json.loads((BASELINE / "kld.json").read_text())
    assert doc["settings"].get("prefill", "absorbed") == "absorbed"
    base, res = tmp_path / "b.json", tmp_path / "r.json"
    base.write_text(json.dumps(doc))
    doc["settings"]["prefill"] = "mha"
    res.write_text(json.dumps(doc))
    assert main(["gate", str(res), "--baseline", str(base)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--prefill mha" in err and "rerun with --prefill absorbed" in err
    assert len(err.strip().splitlines()) == 1
    legacy = json.loads(base.read_text())
    legacy["settings"].pop("prefill", None)
    base.write_text(json.dumps(legacy))
    assert main(["gate", str(res), "--baseline", str(base)]) == 2  # no key: absorbed
    res.write_text(json.dumps(legacy | {"settings": legacy["settings"] | {"prefill": "absorbed"}}))
    assert main(["gate", str(res), "--baseline", str(base)]) == 0


# --- nothing passes by omission -------------------------------------------------------------------------


def _dir_copy(tmp_path, name):
    folder = tmp_path / name
    shutil.copytree(BASELINE, folder)
    return folder


@pytest.mark.parametrize("side", ["baseline", "results"])
def test_a_document_one_side_lacks_fails(tmp_path, capsys, side):
    """The issue's case: a baseline without kld.json (or results without it) must not pass with the KLD
    silently not compared."""
    res, base = _dir_copy(tmp_path, "r"), _dir_copy(tmp_path, "b")
    ((base if side == "baseline" else res) / "kld.json").unlink()
    assert main(["gate", str(res), "--baseline", str(base)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "kld.json" in out
    assert ("document not in the baseline" if side == "baseline" else "result document missing") in out
    tol = tmp_path / "tol.toml"
    tol.write_text('[gate]\noptional = ["kld.json"]\n')
    assert main(["gate", str(res), "--baseline", str(base), "--tolerances", str(tol)]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "allowed:" in out and "(optional)" in out  # an allowed absence is still listed


def _kld_pair(tmp_path, edit_results):
    doc = json.loads((BASELINE / "kld.json").read_text())
    base, res = tmp_path / "b.json", tmp_path / "r.json"
    base.write_text(json.dumps(doc))
    edit_results(doc)
    res.write_text(json.dumps(doc))
    return res, base


def _with_variant(doc):
    """A semantics variant of nvfp4 the baseline never ran."""
    row = dict(doc["formats"]["nvfp4"], semantics="engine:512")
    doc["formats"]["nvfp4 (engine:512, bf16)"] = row


def test_a_row_or_variant_only_the_results_have_fails(tmp_path, capsys):
    res, base = _kld_pair(tmp_path, lambda d: d["formats"].setdefault("mxfp4_copy", dict(d["formats"]["mxfp4"],
                                                                                          format="mxfp4_copy")))
    assert main(["gate", str(res), "--baseline", str(base)]) == 1
    assert "mxfp4_copy" in capsys.readouterr().out
    res, base = _kld_pair(tmp_path, _with_variant)
    assert main(["gate", str(res), "--baseline", str(base)]) == 1
    out = capsys.readouterr().out
    assert "nvfp4 (engine:512, bf16)" in out and "row not in the baseline" in out
    for pattern in ("nvfp4 (engine:512, bf16)", "* (engine:512, *)", "nvfp4"):  # identity, glob, bare format
        tol = tmp_path / "tol.toml"
        tol.write_text(f"[gate]\noptional = [{json.dumps(pattern)}]\n")
        assert main(["gate", str(res), "--baseline", str(base), "--tolerances", str(tol)]) == 0, pattern
    capsys.readouterr()


def test_a_metric_one_side_lacks_fails_unless_optional():
    """A row holding a metric on one side only (documents of another version; compared through the library:
    the schema would refuse such a file) is a failure, either way round."""
    from mla_eval.report.gate import compare

    doc = json.loads((BASELINE / "kld.json").read_text())
    lacking = json.loads(json.dumps(doc))
    del lacking["formats"]["nvfp4"]["kld_p99"]
    for results, baseline, why in ((lacking, doc, "missing in results"), (doc, lacking, "not in the baseline")):
        bad = [c for c in compare({"k.json": results}, {"k.json": baseline}) if not c.ok]
        assert [(c.name, c.why) for c in bad] == [("nvfp4.kld_p99", why)]
        for pattern in ("kld_p99", "nvfp4.kld_p99", "nvfp4"):
            assert all(c.ok for c in compare({"k.json": results}, {"k.json": baseline}, {"optional": [pattern]})), pattern


def test_optional_must_be_a_list_of_names(tmp_path):
    from mla_eval.errors import UserError
    from mla_eval.report.gate import load_tolerances

    tol = tmp_path / "t.toml"
    for bad in ('optional = "kld.json"', "optional = [1]", 'optional = [""]'):
        tol.write_text(f"[gate]\n{bad}\n")
        with pytest.raises(UserError, match="optional must be a list of names"):
            load_tolerances(tol)
    tol.write_text('[gate]\noptional = ["needle.json"]\nkld_mean = {abs = 1e-3}\n')
    assert load_tolerances(tol) == {"kld_mean": {"abs": 1e-3}, "optional": ["needle.json"]}


def test_ci_smoke_gate_still_passes_and_the_rule_is_in_the_help(capsys):
    ci = str(BASELINE)
    recipe = str(BASELINE.parents[2] / "recipes" / "ci-smoke.toml")
    assert main(["gate", ci, "--baseline", ci, "--tolerances", recipe]) == 0
    assert "PASS" in capsys.readouterr().out
    assert main(["gate", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Nothing passes by omission" in help_text
    assert "[gate] table" in help_text  # the brackets survive rich markup


# --- the headline counts what was compared (issue 44) ----------------------------------------------------


def test_the_headline_counts_absent_documents_apart(tmp_path, capsys):
    """`optional = ["*"]` and results holding only capacity.json passed as "PASS -- 36/36 metrics": the headline
    counts only the metrics compared and names the documents that were absent and allowed."""
    res = tmp_path / "r"
    res.mkdir()
    shutil.copy(BASELINE / "capacity.json", res / "capacity.json")
    tol = tmp_path / "tol.toml"
    tol.write_text('[gate]\noptional = ["*"]\n')
    assert main(["gate", str(res), "--baseline", str(BASELINE), "--tolerances", str(tol)]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    compared = len(json.loads((BASELINE / "capacity.json").read_text())["formats"]) * 2  # pool_tokens, bytes_per_token
    assert head.startswith(f"**mla-eval gate: PASS** — {compared}/{compared} metrics within tolerance"), head
    assert "absent on one side, allowed as optional: 2 documents (kld.json, needle.json)" in head, head


def test_an_optional_entry_matching_nothing_warns(tmp_path, capsys):
    tol = tmp_path / "tol.toml"
    tol.write_text('[gate]\noptional = ["neddle.json", "mxfp4"]\n')
    assert main(["gate", str(BASELINE), "--baseline", str(BASELINE), "--tolerances", str(tol)]) == 0
    err = capsys.readouterr().err
    assert "warning: the tolerances' optional entry 'neddle.json' matches no document, row or metric" in err
    assert "'mxfp4'" not in err  # a row of both sides: a pattern that could allow something


def test_a_failing_gate_names_the_optional_list(tmp_path, capsys):
    res, base = _dir_copy(tmp_path, "r"), _dir_copy(tmp_path, "b")
    (res / "kld.json").unlink()
    assert main(["gate", str(res), "--baseline", str(base)]) == 1
    assert "[gate] optional = [" in capsys.readouterr().out  # how to allow an expected absence
    tol = tmp_path / "tol.toml"
    tol.write_text('[gate]\noptional = ["needle.json"]\n')
    assert main(["gate", str(res), "--baseline", str(base), "--tolerances", str(tol)]) == 1
    assert "The tolerances' optional list (needle.json) allows none of the failures" in capsys.readouterr().out


def test_counts_are_printed_whole(capsys):
    assert main(["gate", str(BASELINE / "capacity.json"), "--baseline", str(BASELINE / "capacity.json")]) == 0
    out = capsys.readouterr().out
    tokens = json.loads((BASELINE / "capacity.json").read_text())["formats"][0]["pool_tokens"]
    assert f"| {tokens} | {tokens} |" in out and "e+0" not in out
