"""Seeded runs reproduce their result documents exactly, timings excluded."""

import json
from pathlib import Path

from tiny_models import tiny_checkpoint

from mla_eval.cli import main


def _without_timings(x):
    """The document with every wall-clock figure (keys naming seconds) removed, and the execution record (the run
    plan states the machine's free memory at the start of the run, which moves between runs)."""
    if isinstance(x, dict):
        return {k: _without_timings(v) for k, v in x.items() if "seconds" not in k and k != "execution"}
    if isinstance(x, list):
        return [_without_timings(v) for v in x]
    return x


def _twice(args: list[str], tmp_path: Path) -> tuple[dict, dict]:
    docs = []
    for i in range(2):
        out = tmp_path / f"run{i}.json"
        assert main([*args, "--out", str(out)]) == 0
        docs.append(json.loads(out.read_text()))
    return docs[0], docs[1]


def test_kld_document_reproduces_with_seeded_self_samples(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    # no text: seeded samples drawn from the model itself, then scored (the README's main job)
    args = [
        "kld", "--model", str(ckpt), "--samples", "3", "--sample-len", "64", "--formats", "nvfp4,fp8_ds_mla,mxfp4",
        "--scales", "none",
    ]
    a, b = _twice([*args, "--seed", "3"], tmp_path)
    assert "seconds" in a and a["seconds"] != 0  # the timing exists; it is what may differ
    assert _without_timings(a) == _without_timings(b)
    other = tmp_path / "other.json"
    assert main([*args, "--seed", "4", "--out", str(other)]) == 0
    assert json.loads(other.read_text())["text"] != a["text"]  # the seed does choose the samples


def test_needle_document_reproduces(tmp_path):
    a, b = _twice(
        ["needle", "--lengths", "256", "--depths", "20,80", "--trials", "2", "--formats", "nvfp4", "--scales", "none"], tmp_path
    )
    assert len(a["records"]) == 2 * 2 * 2
    assert _without_timings(a) == _without_timings(b)
