"""The library API (mla_eval.api), the README's library example, the kld table's width, and the
bad inputs of kld / calibrate / needle that must be one line and exit 2 before any model loads."""

import os
import re
from pathlib import Path

import pytest
from rich.console import Console

from mla_eval.cli import main
from mla_eval.commands.kld import COLUMNS, available_columns, print_table
from mla_eval.errors import UserError
from mla_eval.evals.kld_evaluation import KldSettings
from mla_eval.evals.variants import Variant, parse_variants, scales_for
from mla_eval.formats import OuterScales, get_format

ROOT = Path(__file__).resolve().parents[1]


def _one_line(capsys, code, needle):
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err, err


@pytest.fixture()
def text(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("The river flows past the old mill. " * 200)
    return p


def test_readme_library_example_runs(tmp_path, monkeypatch):
    """Runs exactly the README's Python block (so the README cannot drift from the API)."""
    block = re.search(r"## Library\n.*?```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README.md lost its library example"
    monkeypatch.chdir(tmp_path)
    printed = []
    exec(compile(block.group(1), "README.md", "exec"), {"print": lambda *a: printed.append(a)})
    assert [p[0] for p in printed] == ["nvfp4", "fp8_ds_mla"]
    assert all(p[1] > 0 and p[2] == "nats" for p in printed)  # a quantised cache changes the distribution
    assert printed[0][1] > printed[1][1]  # 4-bit nvfp4 moves the logits more than 8-bit fp8
    from mla_eval.results import read_result

    doc = read_result(tmp_path / "kld-example.json")
    assert doc["formats"]["nvfp4"]["kld_mean"] == pytest.approx(printed[0][1], abs=1e-5)
    assert doc["environment"]["attention"]["backend"] in ("auto", "kernel", "reference")
    # the example turns layer stats off, so the default window path (auto) is the mha form: the cache is written through
    # the dispatcher (recorded there) and read back decoded for SDPA, which the document records as settings.prefill
    assert (doc["settings"]["prefill"], doc["settings"]["prefill_reason"]) == ("mha", None)
    assert any(k.startswith("write nvfp4 on cpu") for k in doc["environment"]["attention"]["paths"])


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["kld", "--ctx", "0"], "--ctx must be at least 2"),
        (["kld", "--ctx", "-5"], "--ctx must be at least 2"),
        (["kld", "--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["kld", "--stride", "0"], "--stride must be positive"),
        (["kld", "--min-context", "-1"], "--min-context must be >= 0"),
        (["kld", "--batch", "0"], "--batch must be at least 1"),
        (["kld", "--samples", "0"], "--samples >= 1"),
        (["kld", "--ref-store", "zip"], "--ref-store 'zip'"),
        (["kld", "--ref", "nvfp4,mxfp4"], "--ref takes one format"),
        (["kld", "--formats", ","], "--formats is empty"),
        (["kld", "--formats", "bf16+s_l"], "takes no outer scale"),
        (["kld", "--backend", "bogus"], "--backend 'bogus' is not a backend"),
        (["kld", "--text", "a.txt", "--dataset", "wikitext-2"], "not both"),
        (["calibrate", "--ctx", "0", "--out", "s.json"], "--ctx must be at least 2"),
        (["calibrate", "--max-tokens", "0", "--out", "s.json"], "--max-tokens must be at least 1"),
        (["calibrate", "--backend", "gpu", "--out", "s.json"], "--backend 'gpu'"),
        (["needle", "--lengths", "0"], "positive lengths"),
        (["needle", "--lengths", "20"], "too short"),
        (["needle", "--depths", "150"], "0..100"),
        (["needle", "--depth-steps", "0"], "--depth-steps must be at least 1"),
        (["needle", "--trials", "0"], "at least 1"),
        (["needle", "--threshold", "2"], "--threshold"),
        (["needle", "--task", "nope"], "unknown task"),
        (["needle", "--backend", "nope"], "--backend 'nope'"),
    ],
)
def test_bad_settings_are_one_line_errors_before_loading(args, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    import mla_eval.model.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded the model before refusing"))
    _one_line(capsys, main(args), needle)


def test_binary_text_is_refused(tmp_path, capsys):
    blob = tmp_path / "random.bin"
    blob.write_bytes(bytes(range(256)) * 8)
    _one_line(capsys, main(["kld", "--text", str(blob)]), "not UTF-8 text")
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"hello\x00world " * 50)
    _one_line(capsys, main(["calibrate", "--text", str(nul), "--out", str(tmp_path / "s.json")]), "NUL bytes")


def test_calibrate_out_is_a_required_option():
    """A proper Typer option, so Click reports its absence as a usage error (cli.main makes it one line)."""
    import typer

    from mla_eval.cli import app

    cmd = typer.main.get_command(app).commands["calibrate"]
    out = next(p for p in cmd.params if p.name == "out")
    assert out.required and "--out" in out.opts


def test_bad_out_is_found_before_the_evaluation(tmp_path, capsys, text, monkeypatch):
    import mla_eval.model.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded the model before checking --out"))
    _one_line(capsys, main(["kld", "--text", str(text), "--out", str(tmp_path)]), "is a folder")
    existing = tmp_path / "k.json"
    existing.write_text("{}")
    _one_line(capsys, main(["kld", "--text", str(text), "--out", str(existing)]), "exists")
    _one_line(capsys, main(["needle", "--out", str(existing)]), "exists")
    _one_line(capsys, main(["calibrate", "--out", str(existing)]), "exists")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _one_line(capsys, main(["kld", "--out", str(blocker / "k.json")]), "is a file, not a folder")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        _one_line(capsys, main(["kld", "--out", str(ro / "k.json")]), "no write permission")


def test_stride_that_skips_tokens_is_refused(tmp_path, capsys, text):
    from tiny_models import tiny_checkpoint

    ckpt = tiny_checkpoint(tmp_path / "tiny")
    args = ["kld", "--model", str(ckpt), "--text", str(text), "--ctx", "64", "--formats", "nvfp4", "--scales", "none"]
    _one_line(capsys, main([*args, "--stride", "100"]), "--stride 100 skips tokens")
    _one_line(capsys, main([*args, "--stride", "33"]), "use --stride <= 32")


def test_outer_scales_follow_the_format_spec():
    """fp8_e4m3+s_l is reachable: its s_l maps the same calibrated max onto its own range (448)."""
    nv, e4 = parse_variants("nvfp4+s_l,fp8_e4m3+s_l")
    amax = [2688.0, 896.0]
    outer = OuterScales.from_amax(amax)
    assert scales_for(nv, outer).scales == (1.0, 896.0 / 2688.0)
    assert scales_for(e4, outer).scales == pytest.approx((2688.0 / 448.0, 2.0))
    assert scales_for(e4, outer).denominator == get_format("fp8_e4m3").outer_scale.denominator
    assert scales_for(Variant(get_format("nvfp4")), outer) is None
    with pytest.raises(UserError, match="needs per-layer scales"):
        scales_for(e4, None)


def test_settings_resolve_defaults_once():
    st = KldSettings(formats="nvfp4")
    assert st.resolved_ctx(self_samples=True) == st.sample_len
    assert st.resolved_ctx(self_samples=False) == 2048
    assert KldSettings(formats="nvfp4", ctx=96).resolved_ctx(self_samples=True) == 96


def _summary(with_layers=True):
    row = {"kld_mean": 0.01234, "kld_se": 0.0001, "kld_median": 0.005, "kld_p99": 0.123, "same_top1_pct": 98.5,
           "delta_p_rms_pct": 1.23, "ppl_ratio": 1.0123, "tokens": 1000, "ppl_ref": 12.3}
    if with_layers:
        row["layers"] = [{"attn_rel_l2": 0.05}, {"attn_rel_l2": 0.07}]
    return {name: dict(row) for name in ("fp8_ds_mla", "nvfp4_fp8rope_st", "nvfp4+s_l")}


@pytest.mark.parametrize("width", [80, 200])
def test_kld_table_fits_the_terminal(width):
    con = Console(width=width, record=True, color_system=None)
    summary = _summary()
    print_table(summary, "bf16", "self-samples", con)
    text = con.export_text()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    header = next(line for line in lines if "format" in line)
    shown = [c[0] for c in COLUMNS if f" {c[0]} " in header]
    assert "KLD" in shown and "±se" in shown
    # no empty header cell: every column has its title
    assert all(cell.strip() for cell in header.strip("┃│ ").split("┃" if "┃" in header else "│"))
    hidden = [c[0] for c in available_columns(summary) if c[0] not in shown]  # topk% exists for DSA rows only
    assert "topk%" not in shown
    if width == 200:
        assert hidden == []
        assert "All figures: the result JSON" in text
    else:
        assert hidden, "80 columns cannot hold all 8 figure columns"
        assert "Not shown at this terminal width: " + ", ".join(hidden) in text.replace("\n", " ")


def test_progress_reports_an_eta_and_the_first_batch_estimate():
    from mla_eval.commands.progress import duration, progress_bars

    con = Console(record=True, width=160, force_terminal=False)
    firsts = []
    with progress_bars(con, on_first=lambda *a: firsts.append(a)) as report:
        report("score", 0, 1000)
        report("score", 250, 1000)
        report("score", 500, 1000)
    assert [(s, d, t) for s, d, t, _ in firsts] == [("score", 250, 1000)]  # once, at the first batch
    text = con.export_text()
    assert "500/1000" in text and "tokens/s, left ~" in text
    assert duration(3725) == "1h02m05s" and duration(65) == "1m05s" and duration(4) == "4s"
    quiet = Console(record=True, width=160)
    with progress_bars(quiet) as report:
        pass  # no work reported: nothing drawn, so an early error stays one clean line
    assert quiet.export_text() == ""


def test_the_kld_table_is_ranked_by_kld_and_shows_the_reverse_direction():
    """The README says to rank by KLD: the table does (lowest first, whatever --formats' order); the reverse
    direction KL(format || ref) is a column where the terminal is wide enough (issue 44)."""
    summary = _summary()
    for kld, name in zip((0.03, 0.001, 0.01), summary):
        summary[name] = {**summary[name], "kld_mean": kld, "kld_reverse_mean": kld * 1.1}
    con = Console(width=250, record=True, color_system=None)
    print_table(summary, "bf16", "self-samples", con)
    text = con.export_text()
    rows = [line.split()[1] for line in text.splitlines() if line.startswith("│")]
    assert rows == ["nvfp4_fp8rope_st", "nvfp4+s_l", "fp8_ds_mla"]
    assert "revKL" in text and "0.0330" in text and "rows ranked by KLD" in " ".join(text.split())


def test_the_same_seed_samples_the_same_text_whatever_the_formats():
    """Self-samples depended on --formats (an extra calibration sample only for +s_l rows changed every sample):
    the same seed now scores the same text, so the figures of a format shared by two runs are equal (issue 44)."""
    from mla_eval.api import evaluate_kld

    runs = [evaluate_kld(KldSettings(formats=f, samples=1, sample_len=24, device="cpu", layer_stats=False))
            for f in ("fp8_ds_mla", "fp8_ds_mla,nvfp4+s_l")]
    assert runs[0].text["digest"] == runs[1].text["digest"]
    assert runs[0].formats["fp8_ds_mla"]["ppl_ref"] == runs[1].formats["fp8_ds_mla"]["ppl_ref"]
    assert runs[0].formats["fp8_ds_mla"]["kld_mean"] == runs[1].formats["fp8_ds_mla"]["kld_mean"]
