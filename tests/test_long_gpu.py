"""The longest contexts on a GPU (issue 17): every kernel launch valid at the model's full window.

- a 65,536-token KLD window (the model's own limit; `--ctx 65536` used to fail at launch with
  CUDA_LAUNCH_INVALID_CONFIG: one grid dimension counted the queries) through the absorbed
  attention of every position, bf16 reference vs nvfp4;
- the same at 131,072 tokens with `--rope-scaling yarn:2` (the largest length the grid asks for);
- a 64K passkey needle, which bf16 retrieves (H200 grid: 1.00 at every depth), through mha prefill
  and replayed decode steps; and a 128K one under YaRN, whose answer must decode without error.
Each KLD check scores only the last positions of the window (min_context close to the window), so
the cost is the prefills. Skipped without CUDA and CuTe DSL.
"""

from __future__ import annotations

import math

import pytest
import torch

cutlass = pytest.importorskip("cutlass")

from mla_eval.evals import kld  # noqa: E402
from mla_eval.evals import needle as nd  # noqa: E402
from mla_eval.evals.needle_tasks import PromptBuilder, load_haystack  # noqa: E402
from mla_eval.evals.text_sources import TokenSource  # noqa: E402
from mla_eval.evals.variants import parse_variants  # noqa: E402
from mla_eval.model.loader import load_model  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _tokens(lm, n: int) -> torch.Tensor:
    """n tokens of a passkey prompt in the filler haystack (natural for the model, no data files)."""
    hay, noise, _ = load_haystack(lm.tokenizer, None)
    return torch.tensor(PromptBuilder(lm.tokenizer, hay, noise).build("passkey", "number", n, 40.0, 0, 5).ids)


def _window_kld(lm, ctx: int) -> dict:
    source = TokenSource("text", f"{ctx}-token passkey prompt", [_tokens(lm, ctx)], "gpu-long")
    ref, fmt = parse_variants("bf16")[0], parse_variants("nvfp4")[0]
    st = kld.KldProtocol((fmt,), ref, ctx=ctx, stride=ctx, min_context=ctx - 257, layer_stats=False)
    return kld.run_kld(lm, source, st).stats["nvfp4"].summary()


@pytest.mark.parametrize("ctx, rope", [(65536, "none"), (131072, "yarn:2")])
def test_full_window_kld(ctx, rope):
    lm = load_model(None, "cuda", rope_scaling=rope)
    assert lm.max_positions >= ctx
    s = _window_kld(lm, ctx)
    assert s["tokens"] == 256
    assert math.isfinite(s["kld_mean"]) and 0 < s["kld_mean"] < 0.05, s["kld_mean"]
    assert s["same_top1_pct"] > 90, s["same_top1_pct"]
    assert s["kld_by_depth"][-1]["depth_hi"] == ctx - 1  # the last scored position has ctx - 2 tokens before it


@pytest.mark.parametrize("length, rope, must_retrieve", [(65536, "none", True), (131072, "yarn:2", False)])
def test_longest_needle(length, rope, must_retrieve):
    lm = load_model(None, "cuda", rope_scaling=rope)
    hay, noise, _ = load_haystack(lm.tokenizer, None)
    max_new = nd.new_tokens_for("number", "passkey")
    p = PromptBuilder(lm.tokenizer, hay, noise).build("passkey", "number", length - max_new, 50.0, 0, 3)
    for v in parse_variants("bf16,nvfp4"):
        out = nd.generate(lm, v, [p], nd.DecodeOptions(max_new))
        assert len(out.tokens[0]) >= 1
        text = lm.tokenizer.decode(out.tokens[0], skip_special_tokens=True)
        if must_retrieve and v.name == "bf16":
            assert p.expected[0] in text, text
