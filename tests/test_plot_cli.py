"""`mla-eval plot`: heatmaps of a saved needle result, the same files `needle --plot` writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mla_eval.cli import main

ROOT = Path(__file__).resolve().parents[1]
# a published H200 result: 3 tasks, bf16 + nvfp4
NEEDLE = ROOT / "results" / "published" / "h200" / "long-context" / "needle-96k-yarn2.json"
KLD = ROOT / "results" / "baselines" / "ci-smoke" / "kld.json"


def test_plot_draws_pooled_and_per_task_heatmaps(tmp_path, capsys):
    doc = json.loads(NEEDLE.read_text())
    assert main(["plot", str(NEEDLE), "--out", str(tmp_path / "p")]) == 0
    names = {p.relative_to(tmp_path / "p").as_posix() for p in (tmp_path / "p").rglob("*.png")}
    formats = list(doc["formats"])
    expected_one = {f"needle_{f}.png" for f in formats} | {f"needle_{f}_vs_bf16.png" for f in formats if f != "bf16"}
    expected = set(expected_one)
    for task in doc["tasks"]:
        expected |= {f"{task.replace(':', '_')}/{n}" for n in expected_one}
    assert names == expected
    assert all(p.stat().st_size > 1000 for p in (tmp_path / "p").rglob("*.png"))
    assert capsys.readouterr().out.count("wrote ") == len(expected)


@pytest.mark.parametrize("case", ["kld", "missing", "not-a-dict", "out-is-file"])
def test_plot_bad_input_one_line(tmp_path, capsys, case):
    out = tmp_path / "p"
    src = NEEDLE
    if case == "kld":
        src = KLD
    elif case == "missing":
        src = tmp_path / "nope.json"
    elif case == "not-a-dict":
        src = tmp_path / "list.json"
        src.write_text("[1, 2]")
    else:
        out.write_text("mine")
    assert main(["plot", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "Traceback" not in err
    if case == "out-is-file":
        assert out.read_text() == "mine"
