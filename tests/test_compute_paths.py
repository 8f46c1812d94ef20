"""How the weights compute never changes what a kld document compares (CPU, float32): the experts' eager and grouped
paths give the same rows up to float32 summation order, FP8 weight math gives each format's KLD within noise of the dequantised run's (the
rows share the weights), and the document records which ran."""

from __future__ import annotations

import json

import pytest
from test_checkpoint import TOKENIZER, small_config

from mla_eval.cli import main
from mla_eval.model.checkpoint_writer import write_random_checkpoint

TEXT = " ".join(f"The river {w} flows past the old mill near the {w} bridge." for w in ["north", "south", "east", "west"] * 12)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("paths")
    (root / "t.txt").write_text(TEXT)
    return {t: write_random_checkpoint(root / t, small_config(t, vocab=12288), "fp8-block", tokenizer_from=TOKENIZER).path
            for t in ("deepseek_v3", "deepseek_v32")}, root / "t.txt"


def _kld(folder, text, out, *extra):
    code = main(["kld", "--model", str(folder), "--text", str(text), "--formats", "nvfp4,fp8_ds_mla", "--scales", "none",
                 "--no-layer-stats", "--ctx", "64", "--stride", "32", "--device", "cpu", "--out", str(out), "--force",
                 *extra])
    assert code == 0
    return json.loads(out.read_text())


def test_expert_paths_give_the_same_rows(setup, tmp_path):
    folders, text = setup
    eager = _kld(folders["deepseek_v3"], text, tmp_path / "e.json", "--experts", "eager", "--weight-math", "dequant")
    grouped = _kld(folders["deepseek_v3"], text, tmp_path / "g.json", "--experts", "grouped_mm", "--weight-math", "dequant")
    assert eager["model"]["experts"]["implementation"] == "eager"
    assert grouped["model"]["experts"]["implementation"] == "grouped_mm"
    for fmt, row in grouped["formats"].items():  # float32: only the experts' summation order differs
        want = eager["formats"][fmt]
        assert row["tokens"] == want["tokens"]
        assert row["kld_mean"] == pytest.approx(want["kld_mean"], rel=1e-5), fmt
        assert row["same_top1_pct"] == pytest.approx(want["same_top1_pct"], abs=0.5), fmt


def test_fp8_weight_math_keeps_each_formats_kld_within_noise(setup, tmp_path):
    folders, text = setup
    deq = _kld(folders["deepseek_v32"], text, tmp_path / "d.json", "--weight-math", "dequant")
    fp8 = _kld(folders["deepseek_v32"], text, tmp_path / "f.json")  # auto: the engines' math for FP8 block weights
    assert fp8["model"]["weight_math"]["math"] == "fp8" and deq["model"]["weight_math"]["math"] == "dequant"
    assert fp8["model"]["experts"]["implementation"] == "fp8-grouped"
    assert fp8["execution"]["fp8_gemm_calls"]["torch-grouped"] > 0
    for fmt, row in fp8["formats"].items():
        a, b = row["kld_mean"], deq["formats"][fmt]["kld_mean"]
        noise = 3 * (row["kld_se"] ** 2 + deq["formats"][fmt]["kld_se"] ** 2) ** 0.5
        assert abs(a - b) <= max(noise, 0.1 * b), (fmt, a, b, noise)
