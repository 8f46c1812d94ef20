"""The MoE block bench (benchmarks/moe_bench.py) runs on a CPU at a tiny geometry: every path, the ceiling row, the
document, and its bad input."""

import json

from benchmarks import moe_bench


def test_smoke_runs_every_path_and_writes_the_document(tmp_path, capsys):
    assert moe_bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "moe-bench.json").read_text())
    assert doc["schema"] == moe_bench.SCHEMA and doc["device"] == "cpu"
    rows = {r["path"]: r for r in doc["rows"]}
    assert set(rows) == {"ceiling (dense GEMMs, same shapes)", "eager", "grouped_mm", "fp8"}
    for r in rows.values():
        assert r["seconds"] > 0 and r["tflops"] > 0 and r["tokens"] == 64
    assert rows["grouped_mm"]["rel_diff_vs_first"] < 1e-5  # float32 on the CPU: the same function as eager
    assert 0 < rows["fp8"]["rel_diff_vs_first"] < 0.2  # FP8 weights and activations: near, never equal
    assert rows["fp8"]["speedup_vs_grouped_mm"] > 0
    assert "grouped_mm" in capsys.readouterr().out


def test_fp8_codes_of_the_bench_dequantise_to_the_weight():
    import torch

    from mla_eval.model.fp8_math import dequantise_blocks

    w = torch.randn(3, 200, 256) * 0.02
    codes, scales = moe_bench.block_quantise(w)
    back = dequantise_blocks(codes, scales)
    assert codes.shape == w.shape and scales.shape == (3, 2, 2)
    assert float((back - w).norm() / w.norm()) < 0.05


def test_bad_paths_are_one_line(tmp_path, capsys):
    assert moe_bench.main(["--out", str(tmp_path), "--paths", "eager,cutlass"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == "error: --paths 'cutlass': choose from eager, grouped_mm, fp8"
