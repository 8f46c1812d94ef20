"""How the weights compute, and what that does to what a kld document compares (CPU, float32): the experts' eager and
grouped paths give the same rows up to float32 summation order; FP8 weight math computes the same model (its reference
perplexity within 2 % of the dequantised run's) but adds to each format's KLD, and the document records which ran.

Why FP8 math adds KLD (measured here, embedded model, ctx 64: fp8_ds_mla 0.00031 -> 0.00169, nvfp4 0.0034 -> 0.0045):
the engines quantise every Linear's activations to e4m3 (3 mantissa bits) per token, so a cache format's small
perturbation of the attention output flips some of those roundings, and each flip moves the next layer by a whole
e4m3 step. That floor is what an engine serving the checkpoint in FP8 shows too; it matters most for the formats that
perturb least. Whether it stays within noise at bf16 on a full model is tests/test_compute_paths_gpu.py's question."""

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


def fp8_default_model(folder):
    """The embedded default model (trained weights) stored as a DeepSeek-style FP8-block checkpoint: every 2-D
    decoder-layer weight quantised as the writer quantises (block amax / 448), the rest as it is."""
    import shutil

    from safetensors.torch import load_file, save_file

    from mla_eval.model.checkpoint_writer import quantization_config, stored_tensors

    folder.mkdir()
    state = load_file(str(TOKENIZER / "model.safetensors"))
    out = {}
    for name, w in state.items():
        out.update(stored_tensors("fp8-block", name, w))
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((TOKENIZER / "config.json").read_text())
    cfg["quantization_config"] = quantization_config("fp8-block")[0]
    (folder / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / f, folder / f)
    return folder


def test_fp8_weight_math_computes_the_same_model_and_adds_its_rounding_to_each_formats_kld(setup, tmp_path):
    """On trained weights (a random model's activations move too much under any FP8 rounding to stand for a real
    one): the embedded model stored in FP8 blocks, computed in FP8 and dequantised."""
    _, text = setup
    folder = fp8_default_model(tmp_path / "fp8-default")
    deq = _kld(folder, text, tmp_path / "d.json", "--weight-math", "dequant")
    fp8 = _kld(folder, text, tmp_path / "f.json")  # auto: the engines' math for FP8 block weights
    assert fp8["model"]["weight_math"]["math"] == "fp8" and deq["model"]["weight_math"]["math"] == "dequant"
    assert fp8["model"]["weight_math"]["linears"] > 0 and fp8["execution"]["fp8_gemm_calls"]["torch"] > 0
    assert not deq["execution"]["fp8_gemm_calls"]  # dequantised: no FP8 product ran
    for fmt, row in fp8["formats"].items():
        want = deq["formats"][fmt]
        assert row["tokens"] == want["tokens"]
        assert row["ppl_ref"] == pytest.approx(want["ppl_ref"], rel=0.02), fmt  # the same model, computed in FP8
        noise = 3 * (row["kld_se"] ** 2 + want["kld_se"] ** 2) ** 0.5
        assert row["kld_mean"] >= want["kld_mean"] - noise, fmt  # rounding flips add; they never hide the format
    order = sorted(deq["formats"], key=lambda f: deq["formats"][f]["kld_mean"])
    assert sorted(fp8["formats"], key=lambda f: fp8["formats"][f]["kld_mean"]) == order  # the ranking a user reads
