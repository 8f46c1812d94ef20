"""The GPU memory bench (benchmarks/memory_bench.py) on a CPU: its arguments, bad input, and a tiny restartable run."""

import json

import pytest

from benchmarks import memory_bench as mb
from mla_eval.errors import UserError
from mla_eval.model.indexer import SCORE_BLOCK_BYTES


def test_arguments_parse_to_settings(tmp_path):
    st = mb.parse_args(["--out", str(tmp_path), "--presets", "deepseek-v3.2", "--ctx", "8192,2048", "--no-layer-stats",
                        "--budget-s", "60"])
    assert st.presets == ("deepseek-v3.2",) and st.ctx == (8192, 2048) and not st.layer_stats and st.budget_s == 60
    default = mb.parse_args(["--out", str(tmp_path)])
    assert default.presets == ("deepseek-v3.2", "glm-5") and default.ctx == (2048, 4096, 8192) and default.layer_stats
    default.check()


@pytest.mark.parametrize("argv, says", [
    (["--presets", "glm-9"], "no preset 'glm-9'"),
    (["--ctx", "1"], "--ctx must be >= 2"),
    (["--ctx", "4k"], "--ctx must be comma-separated integers"),
    (["--formats", "int3"], "int3"),
    (["--budget-s", "0"], "--budget-s must be positive"),
])
def test_bad_input_is_one_line(tmp_path, capsys, argv, says):
    assert mb.main(["--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0]


def test_out_must_be_a_folder(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(UserError, match="not a folder"):
        mb.parse_args(["--out", str(tmp_path / "f")]).check()


@pytest.mark.slow
def test_tiny_cpu_run_is_restartable(tmp_path, capsys):
    """Two window lengths of a GLM-5-geometry model (64 heads, indexer 32 x 128, top-k 16) on a CPU: every phase
    reports its growth, the indexer check runs, a rerun keeps the case files, and a spent budget skips cases."""
    argv = ["--out", str(tmp_path), "--presets", "glm-5", "--ctx", "24,48", "--layers", "1", "--formats", "nvfp4",
            "--hidden-override", "64", "--topk-override", "16", "--indexer-check-ctx", "48", "--device", "cpu"]
    assert mb.main(argv) == 0
    summary = json.loads((tmp_path / mb.SUMMARY).read_text())
    short, long = summary["cases"]
    assert (short["ctx"], long["ctx"]) == (24, 48) and long["status"] == "ok"
    assert set(long["phases"]) == {"load", "forward bf16", "forward nvfp4", "loss", "kld"}
    assert all(ph["peak_gib"] is None and ph["growth_gib"] > 0 for ph in long["phases"].values())
    blocks = [SCORE_BLOCK_BYTES, SCORE_BLOCK_BYTES // 4]
    assert long["indexer_check"] == {"ctx": 48, "index_topk": 16, "block_bytes": blocks, "equal": True}
    assert 0 < long["sparse_reads"]["selected_keys"] < long["sparse_reads"]["causal_keys"]
    assert long["kld_mean"]["nvfp4"] > 0 and 0 < long["weights"]["one_layer_gib"] < long["weights"]["resident_gib"]
    assert long["weights"]["real_layer"]["layers"] == 79  # 78 layers + 1 MTP
    out = capsys.readouterr().out
    assert "glm-5" in out and "full-size decoder layer" in out
    before = (tmp_path / mb.case_name("glm-5", 48)).read_text()
    assert mb.main(argv) == 0 and "kept from an earlier run" in capsys.readouterr().out
    assert (tmp_path / mb.case_name("glm-5", 48)).read_text() == before
    assert mb.main([*argv, "--ctx", "24,32,48", "--budget-s", "1e-9"]) == 0  # spent before the new case 32
    summary = json.loads((tmp_path / mb.SUMMARY).read_text())
    assert summary["skipped_for_budget"] == ["glm-5_ctx32.json"] and len(summary["cases"]) == 2
    assert "not run (--budget-s spent): glm-5_ctx32.json" in capsys.readouterr().out
