"""How streamed layers are read (mla_eval.model.checkpoint, executor): O_DIRECT gives the buffered read's bytes, a file
system that refuses it falls back (and says so per layer), the read mode follows the host's memory unless asked, and
a streamed pass records the device's busy share."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from test_checkpoint import TOKENIZER, small_config

from mla_eval.errors import UserError
from mla_eval.model.checkpoint import Checkpoint
from mla_eval.model.checkpoint_writer import write_random_checkpoint
from mla_eval.model.executor import READ_ENV, CheckpointLoader, read_mode


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return Checkpoint.open(write_random_checkpoint(tmp_path_factory.mktemp("reads") / "c",
                                                   small_config("deepseek_v3", vocab=12288), "fp8-block",
                                                   tokenizer_from=TOKENIZER).path)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_o_direct_reads_the_same_bytes(ckpt):
    for layer in range(ckpt.num_layers):
        a, b = ckpt.read_layer(layer), ckpt.read_layer(layer, direct=True)
        assert b.direct and not a.direct and set(a.tensors) == set(b.tensors)
        for name in a.tensors:
            assert torch.equal(_bytes(a.tensors[name]), _bytes(b.tensors[name])), name


def test_a_file_system_refusing_o_direct_falls_back_to_buffered(ckpt, monkeypatch):
    real = os.open

    def refusing(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *a)

    monkeypatch.setattr(os, "open", refusing)
    raw = ckpt.read_layer(1, direct=True)
    assert not raw.direct and torch.equal(_bytes(raw.tensors[next(iter(raw.tensors))]),
                                          _bytes(ckpt.read_layer(1).tensors[next(iter(raw.tensors))]))


def test_read_mode_follows_host_memory_unless_asked(ckpt, monkeypatch):
    from mla_eval.model import run_plan

    monkeypatch.delenv(READ_ENV, raising=False)
    assert read_mode(ckpt)[0] == "buffered"  # a small checkpoint: the page cache keeps it for the next pass
    monkeypatch.setattr(run_plan, "available_host_memory", lambda: 1024)
    mode, why = read_mode(ckpt)
    assert mode == "direct" and "> host available" in why
    monkeypatch.setenv(READ_ENV, "buffered")
    assert read_mode(ckpt) == ("buffered", f"{READ_ENV}=buffered")
    monkeypatch.setenv(READ_ENV, "mmap")
    with pytest.raises(UserError, match=f"{READ_ENV}='mmap': choose one of auto, direct, buffered"):
        read_mode(ckpt)


def test_a_streamed_pass_records_its_reads_and_busy_share(ckpt, monkeypatch):
    """The loader's stats after a pass: every layer read (O_DIRECT where asked), the wall time and the share of it the
    layers' forwards computed (on a CPU the host clock; never above the wall time)."""
    from mla_eval.evals.kld import KldProtocol, _window_forward
    from mla_eval.evals.variants import parse_variants
    from mla_eval.model.loader import load_model

    monkeypatch.setenv(READ_ENV, "direct")
    lm = load_model(ckpt.path, device="cpu", streamed=True, weight_math="dequant")
    loader = CheckpointLoader(lm.checkpoint, lm.stack.layers, lm.device, torch.float32)
    st = KldProtocol(tuple(parse_variants("nvfp4")), parse_variants("bf16")[0], ctx=32, stride=16, min_context=0)
    ids = torch.randint(0, 12000, (1, 32), generator=torch.Generator().manual_seed(0))
    fwd = _window_forward(lm, st.variants[0], ids, 0, st, None, lazy=True)
    try:
        lm.stack.run_streamed([fwd], loader)
    finally:
        loader.close()
    d = loader.stats.as_dict()
    assert d["layers"] == ckpt.num_layers and d["read_mode"] == "direct" and not d["overlap"]
    assert d["direct_reads"] == (ckpt.num_layers if hasattr(os, "O_DIRECT") else 0)
    assert 0 < d["compute_seconds"] <= d["wall_seconds"] and 0 < d["device_busy"] <= 1
