"""Decode steps in the session's step mode (fixed buffers, what a CUDA graph replays) compute what
the plain one-token forward computes; misuse and non-finite steps give clear errors (CPU)."""

import pytest
import torch

from mla_eval.errors import NonFiniteInputError
from mla_eval.formats import get_format
from mla_eval.model import session as session_mod
from mla_eval.model.decode_steps import DecodeSteps, graph_blocker
from mla_eval.model.loader import load_model
from mla_eval.model.session import CacheSession


@pytest.fixture(scope="module")
def lm():
    return load_model(None, "cpu")


def _prefill(lm, spec, ids, capacity):
    s = CacheSession(spec, lm.num_layers, ids.shape[0], capacity, lm.layer_devices)
    pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    with lm.adapter.session(s):
        logits = lm.model(input_ids=ids, position_ids=pos, use_cache=False).logits[:, -1]
    return s, logits


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@torch.no_grad()
def test_step_mode_equals_the_plain_one_token_forward(lm, fmt):
    spec = get_format(fmt)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(10, 1000, (2, 70), generator=g)  # crosses a 64-slot block
    plain, logits_p = _prefill(lm, spec, ids, 80)
    stepped, logits_s = _prefill(lm, spec, ids, 80)
    steps = DecodeSteps(lm, stepped)
    assert steps.mode == "eager" and steps.blocker == "cpu device"
    t = ids.shape[1]
    for i in range(6):
        nxt = logits_p.argmax(-1)
        with lm.adapter.session(plain):
            logits_p = lm.model(input_ids=nxt.view(-1, 1), position_ids=torch.full((2, 1), t + i), use_cache=False).logits[:, -1]
        logits_s = steps(nxt, t + i)
        assert torch.equal(logits_p, logits_s), f"step {i}"
    assert stepped.lengths == plain.lengths == [t + 6] * lm.num_layers
    for a, b in zip(plain.caches, stepped.caches):
        assert torch.equal(a, b)


def test_begin_step_checks_position_and_capacity():
    g = torch.Generator().manual_seed(0)
    s = CacheSession(get_format("nvfp4"), 2, 1, 9, "cpu")
    for layer in range(2):
        s.write(layer, torch.randn(1, 7, 512, generator=g), torch.randn(1, 7, 64, generator=g))
    with pytest.raises(ValueError, match="decode step at position 6, but the layers hold \\[7\\] tokens"):
        s.begin_step(6)
    s.begin_step(7)
    assert s._step[torch.device("cpu")].slots.tolist() == [7] and s._step[torch.device("cpu")].seq_lens.tolist() == [8]
    s.write(0, torch.randn(1, 1, 512, generator=g), torch.randn(1, 1, 64, generator=g))
    with pytest.raises(ValueError, match="layer 0 at position 8 inside the decode step at 7; call begin_step"):
        s.write(0, torch.randn(1, 1, 512, generator=g), torch.randn(1, 1, 64, generator=g))
    full = CacheSession(get_format("nvfp4"), 1, 1, 8, "cpu")
    full.write(0, torch.randn(1, 8, 512, generator=g), torch.randn(1, 8, 64, generator=g))
    with pytest.raises(ValueError, match="8 tokens per sequence; a step at position 8 needs 9"):
        full.begin_step(8)


def test_a_non_finite_step_is_caught_without_a_per_layer_check(monkeypatch):
    """The kernels cannot raise, so a step records finiteness per layer; check_step names the layer."""
    seen = []

    def unchecked_write(spec, latent, rope, slots, cache, outer_scale=None, layer=None, check_finite=True):
        seen.append(check_finite)  # stands in for the kernel: writes nothing, checks nothing

    s = CacheSession(get_format("nvfp4"), 3, 2, 8, "cpu")
    monkeypatch.setattr(session_mod.dispatch, "write_cache", unchecked_write)
    for layer in range(3):
        s.write(layer, torch.zeros(2, 4, 512), torch.zeros(2, 4, 64))
    s.begin_step(4)
    for layer in range(3):
        lat = torch.zeros(2, 1, 512)
        if layer == 1:
            lat[1, 0, 7] = float("inf")
        s.write(layer, lat, torch.zeros(2, 1, 64))
    assert seen == [True] * 3 + [False] * 3  # whole-prompt writes check at once, steps defer
    with pytest.raises(NonFiniteInputError, match="decode step at position 4 produced a non-finite latent or rope at layer 1"):
        s.check_step()


def test_graph_blockers():
    assert graph_blocker(CacheSession(get_format("nvfp4"), 2, 1, 8, "cpu")) == "cpu device"
    assert graph_blocker(CacheSession(get_format("nvfp4"), 2, 1, 8, ["cpu", "meta"])) == "the model spans several devices"


@torch.no_grad()
def test_a_reused_session_answers_like_a_fresh_one(lm):
    """needle.generate's `reuse`: same shape -> the same session, reset; answers are unchanged."""
    from mla_eval.evals import needle as nd
    from mla_eval.evals.needle_tasks import PromptBuilder, load_haystack
    from mla_eval.evals.variants import Variant

    hay, noise, _ = load_haystack(lm.tokenizer, None)
    builder = PromptBuilder(lm.tokenizer, hay, noise)
    prompts = [builder.build("passkey", "number", 300, d, 0, 5 + i) for i, d in enumerate((10.0, 60.0, 90.0))]
    shorter = builder.build("passkey", "number", 200, 50.0, 0, 9)
    v = Variant(get_format("nvfp4"))
    reuse = nd.SessionReuse()
    opts = nd.DecodeOptions(8)
    first = nd.generate(lm, v, prompts[:1], opts, reuse=reuse).tokens
    session = reuse.session
    rest = [nd.generate(lm, v, [p], opts, reuse=reuse).tokens for p in prompts[1:]]
    assert reuse.session is session  # same shape: reused
    fresh = [nd.generate(lm, v, [p], opts).tokens for p in prompts]
    assert [first, *rest] == fresh
    assert nd.generate(lm, v, [shorter], opts, reuse=reuse).tokens == nd.generate(lm, v, [shorter], opts).tokens
    assert reuse.session is not session and reuse.session.capacity == 208  # a new shape replaced it
