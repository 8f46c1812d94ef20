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
