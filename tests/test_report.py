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


def test_report_of_a_capacity_document_with_null_figures(tmp_path, capsys):
    """`capacity --kv-cache-memory-bytes 1000 --json` is a valid document whose concurrency and
    ratio are null (no format fits one block): the page shows a dash instead of crashing."""
    res = tmp_path / "r"
    res.mkdir()
    assert main(["capacity", "--preset", "glm-5", "--kv-cache-memory-bytes", "1000", "--max-model-len", "1024", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["formats"][0]["ratio_vs_fp8_ds_mla"] is None
    doc["formats"][0]["max_concurrency"] = None  # null as well where the model states no length
    (res / "capacity.json").write_text(json.dumps(doc))
    assert main(["report", str(res)]) == 0
    md = (res / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith(f"| {doc['formats'][0]['name']} |"))
    assert row.endswith("| – | – |")


def test_rerunning_report_replaces_our_page_but_not_a_users(tmp_path, capsys):
    res = tmp_path / "r"
    shutil.copytree(BASELINE, res)
    assert main(["report", str(res)]) == 0
    assert main(["report", str(res)]) == 0  # our own page: replaced
    (res / "report.md").write_text("my notes")
    assert main(["report", str(res)]) == 2
    assert "report.md exists and is not a report mla-eval wrote" in capsys.readouterr().err
    assert (res / "report.md").read_text() == "my notes"


def test_report_library_call(tmp_path):
    from mla_eval.report.page import build_report, report_paths, write_report

    report = build_report(BASELINE)
    kinds = [t.split(" ")[0] for t, _, _ in report.sections]
    assert kinds[0] == "Teacher-forced" and "Needle" in kinds and kinds[-1] == "KV-cache"
    assert report.title == "mla-eval report — ci-smoke"
    html_path, md_path = report_paths(BASELINE, tmp_path / "page.html")
    write_report(report, html_path, md_path)
    assert html_path.read_text() == report.html() and md_path.read_text() == report.markdown()
