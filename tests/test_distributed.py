"""torchrun failure behaviour on CPU (gloo): a rank that dies, raises or hangs mid-run leaves the other
ranks with one `error:` line within the collective timeout and no result document; the rank checks
(identical devices, the timeout setting) refuse in one line."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_models import tiny_checkpoint

from mla_eval.errors import UserError
from mla_eval.evals import distributed as d

WORKER = Path(__file__).with_name("dist_fault_worker.py")
TEXT = " ".join(f"The river {w} flows past the old mill near the {w} bridge." for w in ["north", "south"] * 40)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    (root / "t.txt").write_text(TEXT)
    return tiny_checkpoint(root / "ckpt"), root / "t.txt"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, world, out: Path, timeout_s: str = "8"):
    """Rank 0 and rank 1 as torchrun would start them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*)."""
    ckpt, text = world
    port = str(_free_port())
    args = ["kld", "--model", str(ckpt), "--text", str(text), "--ctx", "64", "--stride", "32", "--formats", "nvfp4",
            "--scales", "none", "--no-layer-stats", "--device", "cpu", "--out", str(out)]
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1", d.TIMEOUT_ENV: timeout_s}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), mode, *args], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def _finish(proc, limit: float):
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"rank still running after {limit} s: {err[-1500:]}") from None
    return proc.returncode, out, err


@pytest.mark.parametrize("mode", ["exit", "raise", "hang"])
def test_a_failing_rank_leaves_the_others_one_line_and_no_document(world, tmp_path, mode):
    out = tmp_path / "k.json"
    rank0, rank1 = _launch(mode, world, out)
    try:
        t0 = time.monotonic()
        code, _, err = _finish(rank0, 120)
        waited = time.monotonic() - t0
    finally:
        if rank1.poll() is None:  # the hanging rank: ours to stop
            rank1.kill()
        rank1.communicate()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert code == 2, err[-2000:]
    assert len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert "rank 0 of 2: gathering the per-token statistics failed" in errors[0]
    assert "no result was written" in errors[0]
    assert not out.exists() and not list(tmp_path.glob("*.json"))
    assert waited < 100  # bounded by the 8 s collective timeout (plus model load), never forever


def test_two_healthy_ranks_still_write_one_identical_document(world, tmp_path):
    """The checks above do not get in the way: the same launch without a fault writes rank 0's document."""
    out = tmp_path / "k.json"
    procs = _launch("none", world, out)
    codes = [_finish(p, 120)[0] for p in procs]
    assert codes == [0, 0]
    doc = json.loads(out.read_text())
    assert doc["settings"]["world_size"] == 2


def test_ranks_on_different_gpus_are_refused_naming_both():
    h200 = {"type": "cuda", "name": "NVIDIA H200", "capability": "9.0", "memory_gib": 139.8}
    d.check_uniform_ranks([h200, dict(h200)])
    d.check_uniform_ranks([{"type": "cpu"}] * 3)
    for other in ({**h200, "memory_gib": 79.6}, {**h200, "name": "NVIDIA A100-SXM4-80GB", "capability": "8.0"},
                  {"type": "cpu"}):
        with pytest.raises(UserError, match="rank 0: NVIDIA H200 sm_90 139.8 GiB, rank 2: ") as exc:
            d.check_uniform_ranks([h200, h200, other])
        assert "\n" not in str(exc.value) and "CUDA_VISIBLE_DEVICES" in str(exc.value)


def test_collective_failure_is_one_line_naming_the_rank_and_the_timeout():
    ranks = d.Ranks(rank=1, world=4, backend="gloo", timeout_s=42.0)
    with pytest.raises(UserError) as exc:
        with d.collective(ranks, "gathering the per-token statistics"):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234\nmore detail")
    msg = str(exc.value)
    assert msg.startswith("rank 1 of 4: gathering the per-token statistics failed (Connection closed by peer")
    assert "42 s (MLA_EVAL_DIST_TIMEOUT)" in msg and "\n" not in msg
    with d.collective(d.Ranks(), "anything"):  # single process: nothing to wrap
        pass


@pytest.mark.parametrize("raw", ["0", "-5", "soon", "nan"])
def test_bad_timeout_setting_is_refused(monkeypatch, raw):
    monkeypatch.setenv(d.TIMEOUT_ENV, raw)
    with pytest.raises(UserError, match="MLA_EVAL_DIST_TIMEOUT"):
        d.timeout_seconds()


def test_timeout_default_and_override(monkeypatch):
    monkeypatch.delenv(d.TIMEOUT_ENV, raising=False)
    assert d.timeout_seconds() == d.DEFAULT_TIMEOUT_S
    monkeypatch.setenv(d.TIMEOUT_ENV, "12.5")
    assert d.timeout_seconds() == 12.5


def test_single_process_needs_no_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert d.start("cpu") == d.Ranks()


def _as_rank(monkeypatch, rank: int, world: int = 2, port: int | None = None):
    monkeypatch.setattr(d, "_STATE", {})
    for k, v in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": port or _free_port()}.items():
        monkeypatch.setenv(k, str(v))


def _fake_gpus(monkeypatch, count: int, nccl: bool):
    import torch
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail("no GPU may be selected before the checks pass"))


def test_gpus_without_nccl_are_one_line_naming_the_fix(monkeypatch):
    _as_rank(monkeypatch, 0)
    _fake_gpus(monkeypatch, 2, nccl=False)
    with pytest.raises(UserError, match="needs NCCL, which this torch build lacks: install a CUDA build of torch"):
        d.start("auto")


def test_one_gpu_for_every_rank_and_too_many_ranks_are_refused(monkeypatch):
    _as_rank(monkeypatch, 1)
    _fake_gpus(monkeypatch, 2, nccl=True)
    with pytest.raises(UserError, match="--device cuda:0 under torchrun would put every rank on one GPU"):
        d.start("cuda:0")
    _fake_gpus(monkeypatch, 1, nccl=True)
    with pytest.raises(UserError, match="LOCAL_RANK 1 but only 1 GPU\\(s\\) are visible"):
        d.start("auto")


def test_a_process_group_that_cannot_start_is_one_line(monkeypatch):
    """Rank 1 with nobody listening at MASTER_PORT: refused within the timeout, not a hang."""
    _as_rank(monkeypatch, 1)
    monkeypatch.setenv(d.TIMEOUT_ENV, "2")
    t0 = time.monotonic()
    with pytest.raises(UserError, match="could not start the gloo process group") as exc:
        d.start("cpu")
    assert "\n" not in str(exc.value) and time.monotonic() - t0 < 30
