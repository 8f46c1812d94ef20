"""`mla-eval report`: a self-contained page from a results directory."""

import json
import shutil
from pathlib import Path

from mla_eval.cli import main
from mla_eval.report.plots import needle_heatmaps

BASELINE = Path(__file__).resolve().parents[1] / "results" / "baselines" / "ci-smoke"


def test_report_embeds_tables_and_plots(tmp_path, capsys):
    res = tmp_path / "r"
    shutil.copytree(BASELINE, res)
    needle = json.loads((res / "needle.json").read_text())
    st = needle["settings"]
    # a plot drawn here from the baseline itself (no dependence on committed device results)
    pngs = needle_heatmaps(needle["formats"], st["lengths"], st["depths"], res / "plots")
    assert pngs
    assert main(["report", str(res)]) == 0
    page = (res / "report.html").read_text()
    kld = json.loads((res / "kld.json").read_text())
    assert "Teacher-forced KLD" in page and "Needle retrieval" in page and "KV-cache capacity" in page
    for fmt in kld["formats"]:
        assert f"<td>{fmt}</td>" in page
    assert "data:image/png;base64," in page and "src='http" not in page  # self-contained
    md = (res / "report.md").read_text()
    assert md.count("\n| nvfp4 |") == 3  # kld, needle and capacity tables


def test_report_bad_input(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert main(["report", str(tmp_path)]) == 2
    assert "holds no" in capsys.readouterr().err


def test_report_out_may_be_a_folder(tmp_path, capsys):
    res = tmp_path / "r"
    shutil.copytree(BASELINE, res)
    folder = tmp_path / "pages"
    folder.mkdir()
    assert main(["report", str(res), "--out", str(folder)]) == 0
    assert (folder / "report.html").is_file() and (folder / "report.md").is_file()


def test_atomic_write_to_a_folder_is_a_clear_error(tmp_path):
    import pytest

    from mla_eval.atomic_io import write_text_atomic
    from mla_eval.errors import UserError

    with pytest.raises(UserError, match="is a folder; give a file path"):
        write_text_atomic(tmp_path, "x")
    assert not list(tmp_path.glob(".*tmp"))
