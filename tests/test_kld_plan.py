"""`mla-eval kld --offload` and `--dry-run` end to end on a CPU: a streamed document equals the resident one (plain and
FP8-block checkpoints, a DSA model, +s_l with calibration streamed, layer statistics on), the plan printed and
recorded, a dry run from a folder without shards, and the refusals (self-samples streamed, a missing shard, a read
error mid-run leaving no document, host memory too small, an unsupported weight quantisation)."""

from __future__ import annotations

import json
import shutil

import pytest
from test_checkpoint import TOKENIZER, small_config
from tiny_models import tiny_checkpoint

from mla_eval.cli import main
from mla_eval.errors import UserError
from mla_eval.model.checkpoint_writer import write_random_checkpoint

TEXT = " ".join(f"The river {w} flows past the old mill near the {w} bridge." for w in ["north", "south", "east", "west"] * 30)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    (root / "t.txt").write_text(TEXT)
    return {
        "plain": tiny_checkpoint(root / "plain"),
        "fp8": write_random_checkpoint(root / "fp8", small_config("deepseek_v3", vocab=12288), "fp8-block",
                                       tokenizer_from=TOKENIZER).path,
        "dsa": write_random_checkpoint(root / "dsa", small_config("deepseek_v32", vocab=12288), "fp8-block",
                                       tokenizer_from=TOKENIZER).path,
        "text": root / "t.txt",
    }


def run(args, capsys):
    code = main(args)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def common(model, text, formats="nvfp4,fp8_ds_mla"):
    return ["kld", "--model", str(model), "--text", str(text), "--ctx", "64", "--stride", "32", "--formats", formats,
            "--device", "cpu", "--force"]


@pytest.mark.parametrize("kind", ["plain", "fp8", "dsa"])
def test_streamed_document_equals_resident(folders, kind, tmp_path, capsys):
    """Layer statistics on (the default) and, for the plain checkpoint, +s_l with --scales auto: the calibration
    pass runs streamed too and must find the same scales."""
    formats = "nvfp4,nvfp4+s_l" if kind == "plain" else "nvfp4,fp8_ds_mla"
    scales = ["--calib-tokens", "64"] if kind == "plain" else ["--scales", "none"]
    docs = {}
    for offload in ("none", "stream"):
        out = tmp_path / f"{offload}.json"
        code, _, err = run([*common(folders[kind], folders["text"], formats), *scales, "--offload", offload,
                            "--out", str(out)], capsys)
        assert code == 0, err[-2000:]
        assert "plan: execution: " + ("resident" if offload == "none" else "stream") in err
        docs[offload] = json.loads(out.read_text())
    resident, streamed = docs["none"], docs["stream"]
    assert streamed["formats"] == resident["formats"]  # every figure, layer statistics included, bit for bit
    assert streamed["outer_scales"] == resident["outer_scales"]
    assert all("layers" in row for row in streamed["formats"].values())
    ex = streamed["execution"]
    assert ex["plan"]["mode"] == "stream" and resident["execution"]["plan"]["mode"] == "resident"
    n = streamed["model"]["layers"]
    assert ex["read"]["layers"] >= n and ex["read"]["bytes"] > 0  # every layer read from the shards
    assert ex["plan"]["time"]["projected_seconds"] > 0 and ex["plan"]["measured"]["layers"]
    assert set(ex["phases"]["seconds"]) >= {"load", "plan", "score"}
    assert streamed["settings"]["offload"] == "stream"
    if kind != "plain":
        assert streamed["model"]["weights"]["quantisation"]["method"] == "fp8"
        assert streamed["execution"]["plan"]["weights"]["stored_by_dtype"]["F8_E4M3"] > 0


def test_auto_plans_resident_for_a_model_that_fits(folders, tmp_path, capsys):
    out = tmp_path / "k.json"
    code, _, err = run([*common(folders["plain"], folders["text"], "nvfp4"), "--scales", "none", "--out", str(out)], capsys)
    assert code == 0, err[-2000:]
    doc = json.loads(out.read_text())
    assert doc["execution"]["plan"]["mode"] == "resident" and "fits" in doc["execution"]["plan"]["reason"]
    assert doc["execution"]["read"] is None


def test_dry_run_plans_from_config_index_and_tokenizer_alone(folders, tmp_path, capsys):
    """The folder a user has before downloading: config.json, the index and the tokenizer, no shard."""
    bare = tmp_path / "bare"
    write_random_checkpoint(bare, small_config("deepseek_v32", vocab=12288), "fp8-block", tokenizer_from=TOKENIZER,
                            index_only=True)
    assert not list(bare.glob("*.safetensors"))
    code, out, err = run([*common(bare, folders["text"]), "--scales", "none", "--dry-run"], capsys)
    assert code == 0, err[-2000:]
    assert "weights: " in out and "(estimated) all" in out and "quantisation fp8" in out
    assert "execution: resident" in out and "random values of the stored shapes (shards absent)" in out
    assert "projected" in out
    assert not list(tmp_path.glob("**/*.json")) or all(p.name.endswith("index.json") or p.name.startswith("tokenizer")
                                                        or p.name == "config.json" for p in tmp_path.glob("**/*.json"))
    # with the shards present the layers timed are the checkpoint's own, read from disk
    code, out, err = run([*common(folders["fp8"], folders["text"]), "--scales", "none", "--dry-run",
                          "--offload", "stream"], capsys)
    assert code == 0, err[-2000:]
    assert "execution: stream (asked (--offload stream))" in out and "weights read from the checkpoint" in out


def test_self_samples_cannot_stream(folders, capsys):
    code, _, err = run(["kld", "--model", str(folders["plain"]), "--offload", "stream", "--samples", "1",
                        "--sample-len", "16", "--formats", "nvfp4", "--scales", "none", "--device", "cpu"], capsys)
    assert code == 2 and err.count("error:") == 1 and "--offload stream needs --text or --dataset" in err


def test_bad_offload_is_one_line(folders, capsys):
    code, _, err = run([*common(folders["plain"], folders["text"]), "--offload", "disk"], capsys)
    assert code == 2 and "--offload 'disk': choose one of auto, none, stream" in err and "Traceback" not in err


def test_missing_shard_is_named_before_any_work(folders, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(folders["fp8"], broken)
    (broken / "model-00002-of-00004.safetensors").unlink()
    for extra in ([], ["--offload", "stream"], ["--offload", "none"]):
        code, _, err = run([*common(broken, folders["text"]), "--scales", "none", *extra,
                            "--out", str(tmp_path / "k.json")], capsys)
        assert code == 2 and "shard model-00002-of-00004.safetensors named by model.safetensors.index.json is missing" in err
        assert "Traceback" not in err and not (tmp_path / "k.json").exists()


def test_read_error_mid_run_leaves_no_document(folders, tmp_path, capsys, monkeypatch):
    from mla_eval.model import checkpoint

    real = checkpoint.Checkpoint.read_layer
    calls = []

    def failing(self, layer, pin_memory=False):
        calls.append(layer)
        if len(calls) > 3:  # after the plan's measurement and the first layers of the run
            raise UserError(f"reading {self.path}/model-00002-of-00004.safetensors failed (Input/output error)")
        return real(self, layer, pin_memory)

    monkeypatch.setattr(checkpoint.Checkpoint, "read_layer", failing)
    out = tmp_path / "k.json"
    code, _, err = run([*common(folders["fp8"], folders["text"]), "--scales", "none", "--offload", "stream",
                        "--out", str(out)], capsys)
    assert code == 2 and "Input/output error" in err and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_host_memory_too_small_is_refused_at_plan_time(folders, tmp_path, capsys, monkeypatch):
    from mla_eval.evals.kld_plan import inventory
    from mla_eval.model import run_plan
    from mla_eval.model.loader import load_skeleton

    weights = inventory(load_skeleton(folders["fp8"], "cpu"))
    fixed = weights.other_bytes + max(weights.layer_bytes)
    # a GPU run's budget (no GPU here): room for the embeddings, head and one layer but not for one window batch's
    # streams beside them, and 1 KiB of host memory: the streams fit nowhere
    small = classmethod(lambda cls, device: cls(fixed + 1024, 1024, "cuda:0", "test"))
    monkeypatch.setattr(run_plan.Budget, "measure", small)
    out = tmp_path / "k.json"
    code, _, err = run([*common(folders["fp8"], folders["text"]), "--scales", "none", "--offload", "stream",
                        "--out", str(out)], capsys)
    assert code == 2 and err.count("error:") == 1 and "fit neither the device" in err
    assert not out.exists()


def test_unsupported_weight_quantisation_names_the_supported_ones(folders, tmp_path, capsys):
    odd = tmp_path / "odd"
    shutil.copytree(folders["plain"], odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (odd / "config.json").write_text(json.dumps(cfg))
    for extra in ([], ["--dry-run"]):
        code, _, err = run([*common(odd, folders["text"]), "--scales", "none", *extra], capsys)
        assert code == 2 and err.count("error:") == 1 and "'gptq' is not supported" in err and "fp8" in err, err


def test_torchrun_ranks_stream_the_same_layers_and_reduce_exactly(folders, tmp_path):
    """Data parallel composes with streaming: two gloo ranks on the CPU each stream every layer and score every
    second window; the gathered document equals one resident process's."""
    import os
    import subprocess
    import sys

    args = [*common(folders["fp8"], folders["text"], "nvfp4"), "--scales", "none", "--no-layer-stats"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "mla_eval", *args, "--offload", "none", "--out", str(tmp_path / "one.json")],
                         env=env, capture_output=True, text=True)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29563",
                          "-m", "mla_eval", *args, "--offload", "stream", "--out", str(tmp_path / "two.json")],
                         env=env, capture_output=True, text=True)
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    assert b["settings"]["world_size"] == 2 and b["execution"]["plan"]["mode"] == "stream"
    assert a["formats"] == b["formats"]


# ------------------------------------------------------------------------------------------------ random models (issue 44)

RANDOM = "random:deepseek-v3:layers=2:hidden=128"


def test_a_random_model_streams_as_it_runs_resident(folders, tmp_path, capsys):
    """`--offload stream` on a random model crashed (the host stash has no read statistics): it runs, streamed from
    the host stash, and its figures equal the resident run's."""
    docs = {}
    for offload in ("none", "stream"):
        out = tmp_path / f"{offload}.json"
        code, _, err = run(["kld", "--model", RANDOM, "--text", str(folders["text"]), "--ctx", "64", "--stride", "32",
                            "--formats", "nvfp4", "--scales", "none", "--device", "cpu", "--offload", offload,
                            "--max-tokens", "128", "--no-layer-stats", "--out", str(out)], capsys)
        assert code == 0 and "Traceback" not in err, err[-2000:]
        docs[offload] = json.loads(out.read_text())
    assert docs["stream"]["execution"]["plan"]["mode"] == "stream"
    assert docs["stream"]["formats"] == docs["none"]["formats"]
    assert "from the host stash" in docs["stream"]["execution"]["plan"]["time"]["cost_source"]


def test_a_random_dry_run_plans_from_shapes_without_building_the_model(folders, capsys, monkeypatch):
    """A dry run on random:<preset> never draws a weight (a 61-layer DeepSeek-V3 needs ~48 GiB built): the model is
    made on the meta device and the timed layer gets random values of its shapes."""
    from mla_eval.model import random_models

    def never(*args, **kwargs):
        raise AssertionError("a dry run built the random model")

    monkeypatch.setattr(random_models, "build_random_model", never)
    code, out, err = run(["kld", "--model", "random:glm-5:layers=2:hidden=128", "--text", str(folders["text"]),
                          "--ctx", "64", "--formats", "nvfp4", "--scales", "none", "--device", "cpu", "--dry-run"], capsys)
    assert code == 0 and "Traceback" not in err, err[-2000:]
    assert "execution: resident" in out and "random values of the model's shapes (planned without building it)" in out
    assert "2 decoder layers" in out and "projected" in out
