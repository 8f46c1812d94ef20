"""The production cost bench: its projection formula, and a tiny CPU run end to end."""

import json

import pytest

from benchmarks import production_bench as pb


def test_window_count():
    assert pb.window_count(2048, 2048, 512) == 1
    assert pb.window_count(2049, 2048, 512) == 2
    assert pb.window_count(2048 + 512 * 3, 2048, 512) == 4
    assert pb.window_count(100, 2048, 512) == 1  # one short window
    with pytest.raises(ValueError):
        pb.window_count(100, 2048, 0)


def test_estimate_full_run_formula():
    # 4 windows x 2048 tokens x (9 formats + reference) x (78 layers x 1 us + 10 us)
    est = pb.estimate_full_run(seconds_per_token_layer=1e-6, num_layers=78, dataset_tokens=2048 + 512 * 3, ctx=2048,
                               stride=512, formats=9, extra_seconds_per_token=1e-5)
    assert est.windows == 4 and est.forward_tokens == 4 * 2048 * 10
    assert est.seconds == pytest.approx(4 * 2048 * 10 * (78e-6 + 1e-5))
    assert est.hours == pytest.approx(est.seconds / 3600)
    twice = pb.estimate_full_run(seconds_per_token_layer=2e-6, num_layers=78, dataset_tokens=2048 + 512 * 3, ctx=2048,
                                 stride=512, formats=9)
    assert twice.seconds == pytest.approx(2 * 4 * 2048 * 10 * 78e-6)
    with pytest.raises(ValueError):
        pb.estimate_full_run(seconds_per_token_layer=1e-6, num_layers=78, dataset_tokens=10, ctx=8, stride=4, formats=0)


@pytest.mark.slow
def test_tiny_cpu_run_writes_json_and_checks_the_sparse_path(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = pb.main(["--presets", "deepseek-v3,glm-5.2", "--layers", "1", "--ctx", "48", "--windows", "1",
                  "--hidden-override", "128", "--topk-override", "16", "--formats", "bf16,nvfp4", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == pb.SCHEMA and doc["backends"] == ["reference"]
    dense, dsa = doc["presets"]
    assert dense["sparse_reads"] is None and dense["geometry"]["num_attention_heads"] == 128
    assert dsa["geometry"]["index_topk"] == 16 and dsa["model"] == "random:glm-5.2:layers=1:seed=0:hidden=128:topk=16"
    assert 0 < dsa["sparse_reads"]["selected_keys"] < dsa["sparse_reads"]["causal_keys"]
    rows = dsa["backends"]["reference"]
    assert rows["bf16"]["kld_mean"] == 0.0 < rows["nvfp4"]["kld_mean"]  # bf16 is the reference itself
    assert rows["nvfp4"]["tokens_per_s_per_layer"] > 0 and dsa["peak_memory_gib"] is None
    assert rows["nvfp4"]["attend_path"].startswith("reference") and dsa["kernel_vs_reference_kld"] == {}
    assert dsa["projection"]["line"].startswith("GLM-5.2 (DSA + IndexShare), 78 layers, wikitext-2 test (342,571 tokens")
    assert "random weights" in dsa["label"] and "random weights" in capsys.readouterr().out


def test_bad_input_is_one_line(tmp_path, capsys):
    assert pb.main(["--presets", "glm-9", "--out", str(tmp_path / "x.json")]) == 2
    assert pb.main(["--layers", "0", "--out", str(tmp_path / "x.json")]) == 2
    assert pb.main(["--formats", "int3", "--out", str(tmp_path / "x.json")]) == 2
    (tmp_path / "x.json").write_text("{}")
    assert pb.main(["--out", str(tmp_path / "x.json")]) == 2  # exists, no --force
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("error: ") for line in err)
    assert "no preset 'glm-9'" in err[0] and "--layers must be >= 1" in err[1] and "exists" in err[3]
