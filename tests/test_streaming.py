"""Layer-major streaming (`mla_eval.model.executor`) computes a resident run's numbers bit for bit.

Every layer's weights leave the model for a host stash (`HostStashLoader`) and come back one layer at a time; the
windows of a pass each keep their own residual stream and their session holds one layer's cache at a time. The
per-token statistics and the per-layer statistics must equal the resident run's exactly: the executor may change
when a layer runs, never what it computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mla_eval.attention.semantics import parse_semantics_list
from mla_eval.evals import text_sources
from mla_eval.evals.kld import KldProtocol, Streaming, run_kld
from mla_eval.evals.variants import parse_variants
from mla_eval.model.executor import CheckpointLoader, HostStashLoader, stream_loader
from mla_eval.model.loader import load_model


def _source(lm, n: int, length: int, seed: int) -> text_sources.TokenSource:
    g = torch.Generator().manual_seed(seed)
    vocab = lm.model.config.vocab_size
    seqs = [torch.randint(0, vocab, (length,), generator=g) for _ in range(n)]
    return text_sources.TokenSource("test", "random tokens", seqs, f"random-{seed}")


def _protocol(formats: str, ctx: int, semantics: str = "cache", layer_stats: bool = True) -> KldProtocol:
    return KldProtocol(
        tuple(parse_variants(formats)), parse_variants("bf16")[0], ctx=ctx, stride=ctx // 2, min_context=ctx // 2,
        batch=1, layer_stats=layer_stats, semantics=tuple(parse_semantics_list(semantics)),
    )


def _same_run(a, b) -> None:
    assert a.summary() == b.summary()  # every figure, per-layer statistics included, exactly
    for key in a.stats:
        for field, x in a.stats[key].arrays().items():
            np.testing.assert_array_equal(x, b.stats[key].arrays()[field], err_msg=f"{key}.{field}")


@pytest.mark.parametrize(
    "model, formats, semantics, per_pass",
    [
        (None, "fp8_ds_mla,nvfp4", "cache", 2),  # the embedded model, several windows per pass
        (None, "nvfp4", "cache,engine:64", 1),  # engine chunks: each chunk of a window through a layer in turn
        ("random:deepseek-v3.2:layers=2:hidden=256", "fp8_ds_mla,nvfp4", "cache", 3),  # DSA: indexer top-k per layer
        ("random:glm-5.2:layers=4:hidden=256", "nvfp4,mxfp4", "cache", 2),  # shared indexer layers reuse a top-k
    ],
)
def test_streamed_equals_resident_bit_for_bit(model, formats, semantics, per_pass):
    resident = load_model(model, device="cpu")
    streamed = load_model(model, device="cpu")
    source = _source(resident, 2, 160, seed=7)
    st = _protocol(formats, ctx=128, semantics=semantics)
    want = run_kld(resident, source, st)
    loader = HostStashLoader(streamed.stack, torch.device("cpu"))
    assert all(p.device.type == "meta" for p in streamed.stack.layers[0].parameters())  # nothing resident
    seen = []
    got = run_kld(streamed, source, st, runner=Streaming(loader, per_pass), progress=lambda *a: seen.append(a))
    _same_run(want, got)
    layer_reports = [a for a in seen if a[0] == "layers"]
    windows = want.windows
    assert layer_reports[-1][1] == layer_reports[-1][2] == -(-windows // per_pass) * streamed.num_layers


def test_a_streamed_layer_is_released_before_the_next_one_loads():
    lm = load_model(None, device="cpu")
    loader = HostStashLoader(lm.stack, torch.device("cpu"))
    events = []

    def resident_layers():
        return [j for j, layer in enumerate(lm.stack.layers) if next(layer.parameters()).device.type != "meta"]

    class Watch:
        def prefetch(self, i):
            events.append(("prefetch", i))

        def load(self, i):
            assert resident_layers() == []
            loader.load(i)
            assert resident_layers() == [i]  # one decoder layer's weights in memory at a time
            events.append(("loaded", i))

        def release(self, i):
            loader.release(i)
            events.append(("released", i))

    source = _source(lm, 2, 160, seed=3)
    run_kld(lm, source, _protocol("nvfp4", ctx=128), runner=Streaming(Watch(), 4))
    n = lm.num_layers
    assert [e for e in events if e[0] == "loaded"] == [("loaded", i) for i in range(n)]  # each layer read once per pass
    assert events.index(("prefetch", 1)) < events.index(("released", 0))  # the next read starts during this layer


def test_streamed_sessions_allocate_a_layers_cache_only_when_it_runs():
    lm = load_model(None, device="cpu")
    from mla_eval.evals import kld

    st = _protocol("nvfp4", ctx=64)
    fwd = kld._window_forward(lm, st.variants[0], torch.zeros(1, 64, dtype=torch.long), 32, st, (), lazy=True)
    assert all(c is None for c in fwd.session.caches)  # nothing before a layer runs
    lm.stack.run_streamed([fwd], _Resident())
    assert all(c is None for c in fwd.session.caches)  # and each layer's cache freed after it ran


class _Resident:
    """A loader over a model whose layers are already in memory."""

    def prefetch(self, i):
        pass

    def load(self, i):
        pass

    def release(self, i):
        pass


def test_a_checkpoint_streamed_layer_by_layer_equals_the_resident_load_bit_for_bit():
    """The embedded model's own safetensors, read one decoder layer at a time by the checkpoint reader (a background
    read, dequantised into meta-built layers), against transformers' from_pretrained of the same folder."""
    resident = load_model(None, device="cpu")
    streamed = load_model(None, device="cpu", streamed=True)
    assert all(p.device.type == "meta" for layer in streamed.stack.layers for p in layer.parameters())
    loader = stream_loader(streamed)
    assert isinstance(loader, CheckpointLoader)
    source = _source(resident, 2, 160, seed=11)
    st = _protocol("fp8_ds_mla,nvfp4", ctx=128)
    want = run_kld(resident, source, st)
    try:
        got = run_kld(streamed, source, st, runner=Streaming(loader, 2))
    finally:
        loader.close()
    _same_run(want, got)
    n = streamed.num_layers
    assert loader.stats.layers == -(-want.windows // 2) * n  # each layer read once per pass
    assert loader.stats.bytes == -(-want.windows // 2) * sum(
        streamed.checkpoint.stored_bytes(layer=i) for i in range(n))
    assert all(p.device.type == "meta" for layer in streamed.stack.layers for p in layer.parameters())  # all released
