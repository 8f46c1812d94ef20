"""Several GPUs of one host (an x2 / x4 / x8 machine; skipped with fewer than two): each multi-GPU run equals the
single-GPU run of the same windows, every metric, and a failing rank writes no document. These were the `multigpu`
steps of the device script (issue 39: every pass / fail GPU check is a test).

- data parallel: `torchrun --nproc-per-node N -m mla_eval kld` over a random GLM-5 checkpoint (16 layers);
- `--device-map auto` with a per-GPU cap of ~1.3 / N of the weights, so the layers must spread over every GPU;
- `needle --device-map auto` at 16K;
- a rank that dies after scoring: rank 0 says so in one line and no document is written.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.multigpu, pytest.mark.slow,
              pytest.mark.skipif(NGPU < 2, reason="needs two or more CUDA GPUs")]
ROOT = Path(__file__).resolve().parent.parent
KLD_FORMATS = "fp8_ds_mla,nvfp4,nvfp4_fp8rope"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A random GLM-5 checkpoint of 16 layers (`--device-map` needs a folder: random: specs are built on one device)."""
    from mla_eval.model.random_models import build_random_model, parse_random_spec
    from mla_eval.model_home import default_model_path

    out = tmp_path_factory.mktemp("ckpt-glm5-random")
    tok = default_model_path()
    vocab = json.loads((tok / "config.json").read_text())["vocab_size"]
    model = build_random_model(parse_random_spec("random:glm-5:layers=16"), vocab, torch.device("cpu"), torch.bfloat16)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / f, out / f)
    (out / "weights_bytes").write_text(str(sum(p.numel() * p.element_size() for p in model.parameters())))
    return out


def _kld_args(ckpt: Path, text: Path) -> list[str]:
    return ["kld", "--model", str(ckpt), "--text", str(text), "--max-tokens", "65536", "--ctx", "4096", "--stride", "2048",
            "--min-context", "2048", "--formats", KLD_FORMATS, "--scales", "none", "--no-layer-stats", "--prefill", "absorbed"]


def _run(argv: list[str], env: dict | None = None, timeout: int = 540) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, **(env or {})))


def _same_metrics(one: Path, other: Path) -> None:
    a, b = (json.loads(p.read_text()) for p in (one, other))
    diff = [(f, k) for f in a["formats"] for k in a["formats"][f] if a["formats"][f][k] != b["formats"].get(f, {}).get(k)]
    assert not diff, f"{len(diff)} metrics differ, first: {diff[:5]}"


@pytest.fixture(scope="module")
def single(checkpoint, tmp_path_factory) -> Path:
    from conftest import _need_data

    text = _need_data("wikitext-2/wiki.test.raw")
    out = tmp_path_factory.mktemp("single") / "kld-1.json"
    p = _run([sys.executable, "-m", "mla_eval", *_kld_args(checkpoint, text), "--out", str(out)])
    assert p.returncode == 0, p.stderr[-2000:]
    return out


@pytest.mark.parametrize("n", [2, 4, 8])
def test_data_parallel_kld_equals_one_gpu(n, checkpoint, single, tmp_path):
    if n > NGPU:
        pytest.skip(f"{NGPU} GPUs")
    from conftest import _need_data

    text = _need_data("wikitext-2/wiki.test.raw")
    out = tmp_path / f"kld-dp-{n}.json"
    p = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port", str(29500 + n),
              "-m", "mla_eval", *_kld_args(checkpoint, text), "--out", str(out)])
    assert p.returncode == 0, p.stderr[-2000:]
    _same_metrics(single, out)
    assert json.loads(out.read_text())["settings"]["world_size"] == n


@pytest.mark.parametrize("n", [2, 4, 8])
def test_device_map_kld_equals_one_gpu(n, checkpoint, single, tmp_path):
    if n > NGPU:
        pytest.skip(f"{NGPU} GPUs")
    from conftest import _need_data

    text = _need_data("wikitext-2/wiki.test.raw")
    cap = int((checkpoint / "weights_bytes").read_text()) * 13 // 10 // n
    out = tmp_path / f"kld-devmap-{n}.json"
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(n))}
    p = _run([sys.executable, "-m", "mla_eval", *_kld_args(checkpoint, text), "--device-map", "auto", "--max-memory", str(cap),
              "--out", str(out)], env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    _same_metrics(single, out)
    assert len(set(json.loads(out.read_text())["settings"]["layer_devices"])) == n


def test_device_map_needle_equals_one_gpu(checkpoint, tmp_path):
    args = ["needle", "--model", str(checkpoint), "--formats", "nvfp4,fp8_ds_mla", "--scales", "none", "--lengths", "16K",
            "--depths", "50", "--trials", "2"]
    one, many = tmp_path / "needle-1.json", tmp_path / "needle-devmap.json"
    p = _run([sys.executable, "-m", "mla_eval", *args, "--out", str(one)])
    assert p.returncode == 0, p.stderr[-2000:]
    cap = int((checkpoint / "weights_bytes").read_text()) * 13 // 10 // NGPU
    p = _run([sys.executable, "-m", "mla_eval", *args, "--device-map", "auto", "--max-memory", str(cap), "--out", str(many)])
    assert p.returncode == 0, p.stderr[-2000:]
    _same_metrics(one, many)


def test_a_rank_that_dies_leaves_no_document(checkpoint, tmp_path):
    """Rank 1 exits after scoring (tests/dist_fault_worker.py): rank 0 says so in one line (or torchrun stops it, and it
    says it was interrupted) and no document is written."""
    from conftest import _need_data

    text = _need_data("wikitext-2/wiki.test.raw")
    out = tmp_path / "kld-fail.json"
    args = _kld_args(checkpoint, text)
    args[args.index("--max-tokens") + 1] = "16384"
    p = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29599",
              "tests/dist_fault_worker.py", "exit", *args, "--out", str(out)], env={"MLA_EVAL_DIST_TIMEOUT": "60"})
    assert p.returncode != 0
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith(("error:", "interrupted by"))]
    assert lines, (p.stdout + p.stderr)[-2000:]
    assert not out.exists()
