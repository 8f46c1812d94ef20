"""`mla-eval kld` / `mla-eval calibrate` end to end on a tiny checkpoint, and their bad input."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_checkpoint, tiny_model

from mla_eval.cli import main

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "mla_eval" / "default_model"
TEXT = " ".join(f"The river {w} flows past the old mill near the {w} bridge." for w in ["north", "south", "east", "west"] * 40)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "t.txt"
    p.write_text(TEXT)
    return p


def run(args, capsys):
    code = main(args)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_kld_end_to_end(ckpt, text, tmp_path, capsys):
    out = tmp_path / "r.json"
    code, stdout, err = run(
        ["kld", "--model", str(ckpt), "--text", str(text), "--ctx", "64", "--stride", "32", "--calib-tokens", "64",
         "--formats", "fp8_ds_mla,nvfp4,nvfp4+s_l", "--out", str(out), "--plot", str(tmp_path / "plots")],
        capsys,
    )
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert doc["schema"] == "mla-eval/kld/v1"
    f = doc["formats"]
    assert set(f) == {"fp8_ds_mla", "nvfp4", "nvfp4+s_l"}
    assert f["fp8_ds_mla"]["tokens"] == f["nvfp4"]["tokens"] > 0
    assert 0 < f["fp8_ds_mla"]["kld_mean"] < f["nvfp4"]["kld_mean"]
    assert len(f["nvfp4"]["layers"]) == 3 and f["nvfp4"]["layers"][0]["latent_snr_db"] > 10
    assert doc["outer_scales"]["format"] == "nvfp4_ds_mla_outer_scale_v1"
    assert "Teacher-forced KLD" in stdout and "nvfp4+s_l" in stdout
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["kld_by_depth.png", "kld_cdf.png", "kld_layer_error.png"]
    # never overwrite a result silently
    code, _, err = run(["kld", "--model", str(ckpt), "--text", str(text), "--ctx", "64", "--out", str(out)], capsys)
    assert code == 2 and "exists" in err


def test_calibrate_writes_schema_and_kld_reads_it(ckpt, text, tmp_path, capsys):
    scales = tmp_path / "s.json"
    code, _, err = run(["calibrate", "--model", str(ckpt), "--text", str(text), "--ctx", "64", "--out", str(scales)], capsys)
    assert code == 0, err
    doc = json.loads(scales.read_text())
    assert doc["num_layers"] == 3 and doc["denominator"] == 2688.0
    assert all(s == pytest.approx(a / 2688) for s, a in zip(doc["scales"], doc["max_abs_c_kv"]))
    code, _, err = run(["kld", "--model", str(ckpt), "--text", str(text), "--ctx", "64", "--formats", "nvfp4+s_l",
                        "--scales", str(scales), "--out", str(tmp_path / "k.json"), "--no-layer-stats"], capsys)
    assert code == 0, err


def _one_line_error(code, err, match):
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert match in err, err


def test_bad_inputs(ckpt, text, tmp_path, capsys):
    # a non-MLA model folder
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 100,
                "intermediate_size": 64,
            }
        )
    )
    _one_line_error(*run(["kld", "--model", str(llama), "--text", str(text)], capsys)[::2], "unsupported architecture 'llama'")
    # a folder without config / without tokenizer
    _one_line_error(*run(["kld", "--model", str(tmp_path / "nope")], capsys)[::2], "does not exist")
    notok = tmp_path / "notok"
    shutil.copytree(ckpt, notok)
    (notok / "tokenizer.json").unlink()
    (notok / "tokenizer_config.json").unlink()
    _one_line_error(*run(["kld", "--model", str(notok), "--text", str(text)], capsys)[::2], "tokenizer")
    # text shorter than one window
    short = tmp_path / "short.txt"
    short.write_text("a few words only")
    _one_line_error(
        *run(
            ["kld", "--model", str(ckpt), "--text", str(short), "--ctx", "64", "--scales", "none", "--formats", "nvfp4"], capsys
        )[::2],
        "shorter than one window",
    )
    # ctx beyond the model's positions
    _one_line_error(
        *run(["kld", "--model", str(ckpt), "--text", str(text), "--ctx", "4096", "--formats", "nvfp4"], capsys)[::2],
        "beyond the model's 256 positions",
    )
    # scales for another layer count
    wrong = tmp_path / "wrong.json"
    wrong.write_text(
        json.dumps(
            {
                "format": "nvfp4_ds_mla_outer_scale_v1", "num_layers": 61, "latent_dim": 512, "denominator": 2688,
                "scales": [0.01] * 61,
            }
        )
    )
    _one_line_error(
        *run(
            ["kld", "--model", str(ckpt), "--text", str(text), "--ctx", "64", "--formats", "nvfp4+s_l", "--scales", str(wrong)],
            capsys,
        )[::2],
        "61 layer scales but the model has 3 layers",
    )
    # unknown format / option
    _one_line_error(*run(["kld", "--model", str(ckpt), "--formats", "nvfp9"], capsys)[::2], "unknown cache format")
    _one_line_error(
        *run(["kld", "--model", str(ckpt), "--formats", "fp8_ds_mla+s_l"], capsys)[::2],
        "takes no outer scale s_l; +s_l applies to nvfp4, nvfp4_fp8rope, fp8_e4m3",
    )


def test_nan_latent_is_a_clear_error(ckpt, text, tmp_path, capsys):
    bad = tmp_path / "nan"
    model = tiny_model("deepseek_v3", vocab_size=12288, max_position_embeddings=256)
    with torch.no_grad():
        model.model.layers[1].self_attn.kv_a_layernorm.weight[7] = float("nan")
    model.save_pretrained(bad)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / f, bad / f)
    code, _, err = run(
        [
            "kld", "--model", str(bad), "--text", str(text), "--ctx", "64", "--formats", "nvfp4", "--scales", "none",
            "--out", str(tmp_path / "x.json"),
        ],
        capsys,
    )
    # found mid-run, after the header: the error is still its own single last line
    last = err.rstrip("\n").split("\n")[-1]
    assert code == 2 and "Traceback" not in err
    assert last.startswith("error: latent is nan at layer 1"), last
    assert not (tmp_path / "x.json").exists()


def test_saved_reference_reproduces_the_live_reference(ckpt, text, tmp_path, capsys):
    common = [
        "kld", "--model", str(ckpt), "--text", str(text), "--ctx", "64", "--stride", "32", "--formats", "nvfp4,fp8_ds_mla",
        "--scales", "none", "--no-layer-stats",
    ]
    results = {}
    for mode in ("fp16", "topk"):
        ref = tmp_path / f"ref-{mode}.pt"
        live_args = common + ["--save-ref", str(ref), "--ref-store", mode, "--out", str(tmp_path / f"live-{mode}.json")]
        assert run(live_args, capsys)[0] == 0
        assert run(common + ["--ref-file", str(ref), "--out", str(tmp_path / f"stored-{mode}.json")], capsys)[0] == 0
        live = json.loads((tmp_path / f"live-{mode}.json").read_text())["formats"]
        stored = json.loads((tmp_path / f"stored-{mode}.json").read_text())["formats"]
        results[mode] = (live, stored)
        for f in ("nvfp4", "fp8_ds_mla"):
            assert stored[f]["ppl_fmt"] == live[f]["ppl_fmt"]  # the format side is recomputed identically
            assert stored[f]["same_top1_pct"] == live[f]["same_top1_pct"]
    live, stored = results["fp16"]
    for f in ("nvfp4", "fp8_ds_mla"):  # fp16 log-probs: tiny relative error
        assert stored[f]["kld_mean"] == pytest.approx(live[f]["kld_mean"], rel=2e-2, abs=1e-5)
    live, stored = results["topk"]
    for f in ("nvfp4", "fp8_ds_mla"):
        # top-64 + tail is a lower bound of the full KL; how close depends on how peaked the
        # model is (this random model is nearly flat: it is not close here, see the README)
        assert 0 < stored[f]["kld_mean"] <= live[f]["kld_mean"] * (1 + 1e-6)
    # settings must match the stored reference
    code, _, err = run(
        common[:5] + ["--ctx", "48", "--formats", "nvfp4", "--ref-file", str(tmp_path / "ref-topk.pt"), "--scales", "none"],
        capsys,
    )
    assert code == 2 and "other settings" in err


def test_torchrun_two_processes_reduce_to_identical_statistics(ckpt, text, tmp_path):
    """Windows shard across ranks (gloo on CPU); the gathered statistics equal one process's."""
    import os
    import subprocess
    import sys

    common = [
        "--model", str(ckpt), "--text", str(text), "--ctx", "64", "--stride", "32", "--formats", "nvfp4", "--scales", "none",
        "--no-layer-stats", "--device", "cpu",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run(
        [sys.executable, "-m", "mla_eval", "kld", *common, "--out", str(tmp_path / "one.json")],
        env=env, capture_output=True, text=True,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29561",
            "-m", "mla_eval", "kld", *common, "--out", str(tmp_path / "two.json"),
        ],
        env=env, capture_output=True, text=True,
    )
    assert two.returncode == 0, two.stderr[-2000:]
    a = json.loads((tmp_path / "one.json").read_text())
    b = json.loads((tmp_path / "two.json").read_text())
    assert b["settings"]["world_size"] == 2
    assert a["formats"] == b["formats"]


def test_device_map_auto_gives_the_same_numbers(ckpt, text, tmp_path, capsys):
    """--device-map auto loads through accelerate; on one device (here the CPU) every number equals
    the plain load's. Per-layer cache placement itself is covered in test_session_devices."""
    pytest.importorskip("accelerate")
    docs = []
    for i, extra in enumerate(([], ["--device-map", "auto"])):
        out = tmp_path / f"k{i}.json"
        args = [
            "kld", "--model", str(ckpt), "--text", str(text), "--ctx", "64", "--stride", "32", "--formats", "nvfp4",
            "--scales", "none", "--out", str(out), *extra,
        ]
        assert main(args) == 0, capsys.readouterr().err
        docs.append(json.loads(out.read_text())["formats"])
    assert docs[0] == docs[1]


def test_device_map_bad_input(ckpt, text, monkeypatch, capsys):
    _one_line_error(
        *run(["kld", "--model", str(ckpt), "--text", str(text), "--device-map", "balanced"], capsys)[::2],
        "--device-map 'balanced'",
    )
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    _one_line_error(
        *run(["kld", "--model", str(ckpt), "--text", str(text), "--device-map", "auto"], capsys)[::2], "pip install accelerate"
    )


def test_kld_with_trtllm_nvfp4_records_our_name_and_refuses_scales(ckpt, text, tmp_path, capsys):
    """The engine alias selects trtllm_nvfp4_dsa (torch reference on CPU); it takes no per-layer s_l (its global
    scale is the engine's own), so asking for one is a one-line error."""
    out = tmp_path / "t.json"
    code, _, err = run(["kld", "--model", str(ckpt), "--text", str(text), "--ctx", "64", "--stride", "32",
                        "--formats", "trtllm:nvfp4,sglang_fp4_e2m1", "--out", str(out), "--no-layer-stats"], capsys)
    assert code == 0, err
    f = json.loads(out.read_text())["formats"]
    assert set(f) == {"trtllm_nvfp4_dsa", "sglang_fp4_e2m1"} and f["trtllm_nvfp4_dsa"]["kld_mean"] > 0
    code, _, err = run(["kld", "--model", str(ckpt), "--text", str(text), "--ctx", "64", "--formats", "trtllm_nvfp4_dsa+s_l",
                        "--out", str(tmp_path / "u.json")], capsys)
    assert code == 2 and err.count("\n") == 1, err
