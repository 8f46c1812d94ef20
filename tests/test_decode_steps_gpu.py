"""Decode steps replayed from a CUDA graph on the embedded model (GPU, CuTe kernels).

A replayed step must equal the eager step bit for bit (logits and cache bytes), with the graph's
output poisoned before every replay; a non-finite step must still be caught; a capture that fails
must fall back to eager steps with the same answers.
"""

from __future__ import annotations

import warnings

import pytest
import torch

cutlass = pytest.importorskip("cutlass")

from mla_eval.errors import NonFiniteInputError  # noqa: E402
from mla_eval.evals import needle as nd  # noqa: E402
from mla_eval.evals.needle_tasks import PromptBuilder, load_haystack  # noqa: E402
from mla_eval.evals.variants import Variant  # noqa: E402
from mla_eval.formats import get_format  # noqa: E402
from mla_eval.model.decode_steps import DecodeSteps, EagerStepsWarning  # noqa: E402
from mla_eval.model.loader import load_model  # noqa: E402
from mla_eval.model.session import CacheSession  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def lm():
    return load_model(None, "cuda")


def _prompts(lm, length: int, n: int):
    hay, noise, _ = load_haystack(lm.tokenizer, None)
    b = PromptBuilder(lm.tokenizer, hay, noise)
    return [b.build("passkey", "number", length, 30.0 + 40 * i, i, 77 + i) for i in range(n)]


def _prefilled(lm, spec, prompts, max_new: int):
    ids = torch.tensor([p.ids for p in prompts], device="cuda")
    b, t = ids.shape
    s = CacheSession(spec, lm.num_layers, b, t + max_new, lm.layer_devices)
    with lm.adapter.session(s), torch.no_grad():
        logits = lm.model(
            input_ids=ids, position_ids=torch.arange(t, device="cuda").expand(b, -1), use_cache=False, logits_to_keep=1
        )
    return s, logits.logits[:, -1], t


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "nvfp4_fp8rope", "fp8_ds_mla"])
@torch.no_grad()
def test_replayed_steps_equal_eager_steps(lm, fmt):
    spec = get_format(fmt)
    prompts = _prompts(lm, 3000, 2)
    eager_s, logits, t = _prefilled(lm, spec, prompts, 12)
    graph_s, logits_g, _ = _prefilled(lm, spec, prompts, 12)
    assert torch.equal(logits, logits_g)
    eager, graph = DecodeSteps(lm, eager_s, graphs=False), DecodeSteps(lm, graph_s)
    assert eager.mode == "eager" and graph.mode == "cuda_graph", graph.blocker
    for i in range(10):
        nxt = logits.float().argmax(-1)
        if graph._graph_logits is not None:
            graph._graph_logits.fill_(float("nan"))  # the replay must overwrite every logit
        logits = eager(nxt, t + i).clone()
        got = graph(nxt, t + i)
        assert torch.equal(logits, got), f"step {i}: max |diff| {(logits.float() - got.float()).abs().max()}"
    assert graph.eager_steps == 1 and graph.replays == 9
    assert eager_s.lengths == graph_s.lengths == [t + 10] * lm.num_layers
    for a, b in zip(eager_s.caches, graph_s.caches):
        assert torch.equal(a, b)


@torch.no_grad()
def test_needle_answers_are_the_same_with_and_without_graphs(lm):
    v = Variant(get_format("nvfp4"))
    prompts = _prompts(lm, 4000, 3)
    g = nd.generate(lm, v, prompts, nd.DecodeOptions(10))
    e = nd.generate(lm, v, prompts, nd.DecodeOptions(10, graphs=False))
    with_graphs, eager = g.tokens, e.tokens
    assert (g.steps_mode, g.why_eager) == ("cuda_graph", None)
    assert e.steps_mode == "eager" and "disabled" in e.why_eager
    assert with_graphs == eager
    for p, a in zip(prompts, with_graphs):
        assert all(e in lm.tokenizer.decode(a, skip_special_tokens=True) for e in p.expected)
    # cells of one shape share a session and its graph (captured once): the same answers
    reuse = nd.SessionReuse()
    one_by_one = [nd.generate(lm, v, [p], nd.DecodeOptions(10), reuse=reuse).tokens[0] for p in prompts]
    assert one_by_one == [nd.generate(lm, v, [p], nd.DecodeOptions(10, graphs=False)).tokens[0] for p in prompts]
    steps = reuse.steps
    assert steps.eager_steps == 1 and steps.replays == 3 * 9 - 1


@torch.no_grad()
def test_a_non_finite_replayed_step_names_its_layer(lm):
    s, logits, t = _prefilled(lm, get_format("nvfp4"), _prompts(lm, 1000, 1), 6)
    steps = DecodeSteps(lm, s)
    nxt = logits.argmax(-1)
    steps(nxt, t)
    steps(nxt, t + 1)  # captured and replayed
    assert steps.replays == 1
    w = lm.adapter.modules[2].kv_a_layernorm.weight
    saved = w.clone()
    try:
        w.fill_(float("inf"))  # the graph reads the weight's memory: layer 2's latent is now inf/NaN
        with pytest.raises(NonFiniteInputError, match="decode step at position .* at layer 2"):
            steps(nxt, t + 2)
    finally:
        w.copy_(saved)


@torch.no_grad()
def test_a_failed_capture_falls_back_to_eager_steps(lm):
    prompts = _prompts(lm, 2000, 1)
    v = Variant(get_format("nvfp4"))
    expected = nd.generate(lm, v, prompts, nd.DecodeOptions(8, graphs=False)).tokens
    # a hook that synchronises (as a data-dependent MoE routing would) cannot be captured
    hook = lm.model.model.layers[1].mlp.register_forward_hook(lambda mod, args, out: out.sum().item() and None)
    try:
        with pytest.warns(EagerStepsWarning, match="decode steps run eagerly: CUDA graph capture failed"):
            got = nd.generate(lm, v, prompts, nd.DecodeOptions(8))
        assert got.tokens == expected
        assert got.steps_mode == "eager" and got.why_eager.startswith("CUDA graph capture failed")
        with warnings.catch_warnings():
            warnings.simplefilter("error", EagerStepsWarning)  # not retried: no second warning
            assert nd.generate(lm, v, prompts, nd.DecodeOptions(8)).tokens == expected
        # the failed capture left the process's CUDA random numbers usable (it once left the default generator
        # "capturing": every later CUDA draw raised, and random preset models could no longer be built)
        torch.randn(4, device="cuda")
        torch.cuda.synchronize()
    finally:
        hook.remove()
        lm.adapter.graph_failure = None
