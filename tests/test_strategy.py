"""One execution strategy for every evaluation (mla_eval.model.strategy), on a small written FP8-block checkpoint:
standalone calibrate and plan's sensitivity sweep stream and equal their resident runs bit for bit, the scoring hook
(`ExecutionStrategy.score`) streams, needle plans resident, every evaluation has --dry-run, and the refusals share
one wording."""

from __future__ import annotations

import json

import pytest
import torch
from test_checkpoint import TOKENIZER, small_config

from mla_eval.cli import main
from mla_eval.errors import UserError
from mla_eval.model.checkpoint_writer import write_random_checkpoint
from mla_eval.model.strategy import ExecutionRequest, ExecutionStrategy, check_request

TEXT = " ".join(f"The river {w} flows past the old mill near the {w} bridge." for w in ["north", "south", "east", "west"] * 12)
REFUSAL = "--offload stream runs one decoder layer at a time on one device: "


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("strategy")
    (root / "t.txt").write_text(TEXT)
    folder = write_random_checkpoint(root / "c", small_config("deepseek_v32", vocab=12288), "fp8-block",
                                     tokenizer_from=TOKENIZER).path
    return folder, root / "t.txt"


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A dense-attention checkpoint: needle decodes answers (DSA decode is issue 40's)."""
    return write_random_checkpoint(tmp_path_factory.mktemp("dense") / "c", small_config("deepseek_v3", vocab=12288),
                                   "fp8-block", tokenizer_from=TOKENIZER).path


def run(args, capsys):
    code = main(args)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_standalone_calibrate_streams_and_finds_the_resident_scales(ckpt, tmp_path, capsys):
    folder, text = ckpt
    docs = {}
    for offload in ("none", "stream"):
        out = tmp_path / f"{offload}.json"
        code, _, err = run(["calibrate", "--model", str(folder), "--text", str(text), "--ctx", "64", "--device", "cpu",
                            "--offload", offload, "--out", str(out)], capsys)
        assert code == 0, err[-2000:]
        docs[offload] = json.loads(out.read_text())
    assert docs["stream"]["scales"] == docs["none"]["scales"]
    assert docs["stream"]["max_abs_c_kv"] == docs["none"]["max_abs_c_kv"]
    ex = docs["stream"]["execution"]
    assert ex["strategy"] == "stream" and docs["none"]["execution"]["strategy"] == "resident"
    assert ex["read"]["layers"] >= 3 and ex["plan"]["mode"] == "stream"


def test_plan_sweep_streams_and_equals_the_resident_plan(ckpt, tmp_path, capsys):
    """The single-layer rows fork from the reference at their own layer in both runners; the proxy pass (layer
    statistics) is sized by its own workload."""
    folder, text = ckpt
    docs = {}
    for offload in ("none", "stream"):
        out = tmp_path / f"plan-{offload}.json"
        code, _, err = run(["plan", "--model", str(folder), "--text", str(text), "--candidates", "fp8_ds_mla,nvfp4",
                            "--budget-bytes-per-token", "1600", "--ctx", "64", "--stride", "32", "--device", "cpu",
                            "--offload", offload, "--out", str(out)], capsys)
        assert code == 0, err[-2000:]
        docs[offload] = json.loads(out.read_text())
    s, r = docs["stream"], docs["none"]
    assert s["layers"] == r["layers"] and s["predicted_kld"] == r["predicted_kld"]
    for name, row in s["sensitivity"]["formats"].items():
        want = r["sensitivity"]["formats"][name]
        assert row["kld"] == want["kld"] and row["attn_rel_l2"] == want["attn_rel_l2"], name
    assert s["execution"]["strategy"] == "stream" and r["execution"]["strategy"] == "resident"


def test_the_scoring_hook_streams_like_resident(ckpt):
    """`ExecutionStrategy.score`: teacher-forced sequences through their sessions, in passes; needle's forced scoring
    (issue 40) hands its sequences here."""
    from mla_eval.evals.kld import KldProtocol, _window_forward
    from mla_eval.evals.variants import parse_variants
    from mla_eval.model.run_plan import Workload

    folder, _ = ckpt
    ids = torch.randint(0, 12000, (2, 48), generator=torch.Generator().manual_seed(3))
    got = {}
    for offload in ("none", "stream"):
        with ExecutionStrategy.open(ExecutionRequest(model=folder, device="cpu", offload=offload)) as ex:
            lm = ex.lm
            work = Workload(batches=2, forwards_per_batch=1, tokens=48, hidden=256, dtype_bytes=4, record_bytes=1152,
                            kept=47)
            ex.decide(work)
            lm = ex.realise()
            st = KldProtocol(tuple(parse_variants("nvfp4")), parse_variants("bf16")[0], ctx=48, stride=24,
                             min_context=0)
            v = st.variants[0]
            makers = [lambda row=row: _window_forward(lm, v, ids[row: row + 1], 0, st, None, lazy=ex.runner.lazy)
                      for row in range(2)]
            got[offload] = ex.score(makers)
            assert ex.mode == ("stream" if offload == "stream" else "resident")
    for a, b in zip(got["none"], got["stream"]):
        assert torch.equal(a, b)


def test_needle_plans_resident_and_refuses_to_stream(dense, tmp_path, capsys):
    args = ["needle", "--model", str(dense), "--formats", "nvfp4", "--lengths", "160", "--depths", "50", "--trials", "1",
            "--device", "cpu"]
    code, _, err = run([*args, "--offload", "stream"], capsys)
    assert code == 2 and err.count("error:") == 1
    assert (REFUSAL + "needle decodes each answer token by token through every layer; use --offload none or auto") in err
    out = tmp_path / "n.json"
    code, _, err = run([*args, "--out", str(out)], capsys)
    assert code == 0, err[-2000:]
    assert json.loads(out.read_text())["settings"]["execution"] == "resident"


@pytest.mark.parametrize("command", [
    ["calibrate", "--ctx", "64", "--out", "never-written.json"],
    ["plan", "--candidates", "nvfp4", "--budget-bytes-per-token", "2000", "--ctx", "64", "--stride", "32"],
    ["needle", "--formats", "nvfp4", "--lengths", "160", "--depths", "50"],
])
def test_every_evaluation_has_a_dry_run(ckpt, dense, command, tmp_path, capsys):
    folder, text = ckpt
    folder = dense if command[0] == "needle" else folder
    extra = ["--text", str(text)] if command[0] in ("calibrate", "plan") else []
    code, out, err = run([*command, "--model", str(folder), *extra, "--device", "cpu", "--dry-run"], capsys)
    assert code == 0, err[-2000:]
    assert "weights: " in out and "execution: " in out and "projected" in out, out
    assert not list(tmp_path.iterdir()) and not (tmp_path / "never-written.json").exists()  # a dry run writes nothing


def test_every_refusal_has_one_wording(ckpt):
    folder, _ = ckpt
    with pytest.raises(UserError) as e1:
        check_request(ExecutionRequest(model=folder, offload="stream", device_map="auto"))
    with pytest.raises(UserError) as e2:
        check_request(ExecutionRequest(model=folder, offload="stream", whole_model="self-samples are generated by the "
                                       "whole model", whole_model_fix="give --text or --dataset"))
    assert str(e1.value).startswith(REFUSAL) and str(e2.value).startswith(REFUSAL)
    with pytest.raises(UserError, match="holds quantised weights: --device-map auto loads only bf16/fp32 checkpoints"):
        check_request(ExecutionRequest(model=folder, device_map="auto"))
    with pytest.raises(UserError, match="--offload 'disk': choose one of auto, none, stream"):
        check_request(ExecutionRequest(model=folder, offload="disk"))
