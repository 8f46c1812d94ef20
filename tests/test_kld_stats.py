"""KLD statistics and the window protocol, against numbers worked out by hand."""

import math

import numpy as np
import pytest
import torch

from mla_eval.evals.kld import make_windows
from mla_eval.evals.kld_stats import TokenStats, summarize, token_metrics


def logp(rows):
    return torch.tensor(rows, dtype=torch.float64).log().float()


def test_token_metrics_hand_computed():
    ref = logp([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]])
    fmt = logp([[0.25, 0.5, 0.25], [0.1, 0.2, 0.7]])
    m = token_metrics(ref, fmt, torch.tensor([0, 2]))
    assert m["kld"][0].item() == pytest.approx(0.25 * math.log(2), rel=1e-6)  # .5 ln2 + .25 ln(1/2)
    assert m["kld"][1].item() == pytest.approx(0.0, abs=1e-7)
    assert m["nll_ref"][0].item() == pytest.approx(math.log(2), rel=1e-6)
    assert m["nll_fmt"][0].item() == pytest.approx(math.log(4), rel=1e-6)
    assert m["same_top1"].tolist() == [0.0, 1.0]
    assert m["p_fmt"][0].item() == pytest.approx(0.25, rel=1e-6)


def _arrays(kld, nll_ref, nll_fmt, p_ref, p_fmt, top1, depth, kld_rev=None):
    n = len(kld)
    arrays = dict(
        kld=kld, nll_ref=nll_ref, nll_fmt=nll_fmt, p_ref=p_ref, p_fmt=p_fmt, same_top1=top1, depth=depth, order=range(n)
    )
    if kld_rev is not None:
        arrays["kld_rev"] = kld_rev
    return {k: np.asarray(v, dtype=np.float64) for k, v in arrays.items()}


def test_summary_hand_computed():
    a = _arrays(
        [0.1, 0.2, 0.3, 0.4], [1.0, 2.0, 1.0, 2.0], [1.5, 2.0, 1.5, 3.0], [0.5, 0.5, 0.4, 0.4], [0.4, 0.5, 0.2, 0.4],
        [1, 1, 0, 1], [10, 300, 600, 700],
    )
    s = summarize(a)
    assert s["kld_mean"] == pytest.approx(0.25)
    assert s["kld_se"] == pytest.approx(np.std([0.1, 0.2, 0.3, 0.4], ddof=1) / 2)
    assert s["kld_median"] == pytest.approx(0.25)
    assert s["kld_max"] == 0.4 and s["kld_min"] == 0.1
    assert s["same_top1_pct"] == pytest.approx(75.0)
    # delta p = [-.1, 0, -.2, 0]: mean -7.5 %, rms sqrt((.01 + .04) / 4) = 11.18 %
    assert s["delta_p_mean_pct"] == pytest.approx(-7.5)
    assert s["delta_p_rms_pct"] == pytest.approx(100 * math.sqrt(0.0125))
    assert s["ppl_ref"] == pytest.approx(math.exp(1.5))
    assert s["ppl_fmt"] == pytest.approx(math.exp(2.0))
    # ln ratio = mean(nll_fmt - nll_ref) = mean(.5, 0, .5, 1) = .5, se from the differences
    assert s["ln_ppl_ratio"] == pytest.approx(0.5)
    assert s["ln_ppl_ratio_se"] == pytest.approx(np.std([0.5, 0, 0.5, 1.0], ddof=1) / 2)
    # depths 10..700 in 8 equal buckets of ~86: 10 | 300 | 600 and 700 in the last two
    rows = s["kld_by_depth"]
    assert [r["tokens"] for r in rows] == [1, 1, 1, 1]
    assert rows[0]["depth_lo"] == 10 and rows[-1]["depth_hi"] == 701
    assert [r["kld_mean"] for r in rows] == pytest.approx([0.1, 0.2, 0.3, 0.4])


def test_depth_buckets_split_the_scored_range():
    from mla_eval.evals.kld_stats import depth_buckets

    depth = np.arange(1024, 2048)  # the default protocol: ctx 2048, min context 1024
    kld = depth / 2048.0
    rows = depth_buckets(kld, depth)
    assert len(rows) == 8 and all(r["tokens"] == 128 for r in rows)
    assert [r["depth_lo"] for r in rows] == list(range(1024, 2048, 128)) and rows[-1]["depth_hi"] == 2048
    assert rows[3]["kld_mean"] == pytest.approx(np.mean(kld[3 * 128 : 4 * 128]))
    assert np.all(np.diff([r["kld_mean"] for r in rows]) > 0)  # a trend with depth shows as one
    one = depth_buckets(np.array([0.5, 0.7]), np.array([300, 300]))  # a single depth: one bucket
    assert one == [{"depth_lo": 300, "depth_hi": 301, "tokens": 2, "kld_mean": pytest.approx(0.6), "kld_se": pytest.approx(0.1)}]


def test_shards_concatenate_to_identical_statistics():
    rng = np.random.default_rng(0)
    n = 1000
    a = _arrays(
        rng.exponential(0.1, n), rng.random(n) * 5, rng.random(n) * 5, rng.random(n), rng.random(n), rng.integers(0, 2, n),
        rng.integers(0, 4096, n), rng.exponential(0.1, n),
    )
    whole = TokenStats.from_arrays(a).summary()
    assert "kld_reverse_mean" in whole
    perm = rng.permutation(n)
    halves = [{k: v[perm[: n // 2]] for k, v in a.items()}, {k: v[perm[n // 2 :]] for k, v in a.items()}]
    merged = TokenStats.from_arrays({k: np.concatenate([h[k] for h in halves]) for k in a}).summary()
    assert merged == whole  # exactly, not approximately


def test_windows_score_each_position_once():
    # ctx 8, stride 2, min context 4, a 14-token sequence (positions predict the next token)
    ws = make_windows([14], ctx=8, stride=2, min_context=4)
    scored = []
    for w in ws:
        scored += list(range(w.start + w.score_from, w.start + w.length - 1))
    # every position with >= 4 tokens before it that has a next token is scored exactly once
    assert sorted(scored) == list(range(4, 13)) and len(scored) == len(set(scored))
    assert (ws[0].start, ws[0].score_from) == (0, 4)
    assert (ws[1].start, ws[1].score_from) == (2, 5)  # only the 2 new positions (7 and 8)


def test_windows_skip_sequences_too_short():
    assert make_windows([4], ctx=8, stride=2, min_context=4) == []


def test_both_kl_directions_against_a_float64_sum():
    """KL(ref || fmt) stays the headline; KL(fmt || ref) is reported beside it (issue 44): each checked against
    sum p log(p / q) worked out in float64 numpy, and the two differ (KL is not symmetric)."""
    g = torch.Generator().manual_seed(0)
    ref = torch.log_softmax(torch.randn(5, 50, generator=g), -1)
    fmt = torch.log_softmax(ref + 0.5 * torch.randn(5, 50, generator=g), -1)
    m = token_metrics(ref, fmt, torch.zeros(5, dtype=torch.long))
    p, q = ref.double().exp().numpy(), fmt.double().exp().numpy()
    forward = (p * np.log(p / q)).sum(-1)
    reverse = (q * np.log(q / p)).sum(-1)
    assert m["kld"].numpy() == pytest.approx(forward, rel=1e-4)
    assert m["kld_rev"].numpy() == pytest.approx(reverse, rel=1e-4)
    assert not np.allclose(forward, reverse, rtol=1e-2)
    stats = TokenStats()
    stats.add(m, torch.arange(5), torch.arange(5))
    summary = stats.summary()
    assert summary["kld_reverse_mean"] == pytest.approx(reverse.mean(), rel=1e-4)
    assert summary["kld_mean"] == pytest.approx(forward.mean(), rel=1e-4)


def test_a_stored_reference_gives_the_reverse_direction_too():
    """--ref-file: fp16 rows give both directions as the live reference does; top-k rows (k + one tail bin) give
    lower bounds of both (merging outcomes never raises a KL)."""
    from mla_eval.evals.ref_store import metrics_from_store

    g = torch.Generator().manual_seed(1)
    ref = torch.log_softmax(torch.randn(4, 300, generator=g), -1)
    fmt = torch.log_softmax(ref + 0.3 * torch.randn(4, 300, generator=g), -1)
    targets = torch.zeros(4, dtype=torch.long)
    live = token_metrics(ref, fmt, targets)
    common = {"target_logp": ref.gather(1, targets.view(-1, 1)).squeeze(1), "top1": ref.argmax(-1).int()}
    full = metrics_from_store({**common, "logp_fp16": ref}, fmt, targets)
    assert full["kld_rev"].numpy() == pytest.approx(live["kld_rev"].numpy(), rel=1e-5)
    top, idx = ref.topk(64, -1)
    topk = metrics_from_store({**common, "topk_logp": top, "topk_idx": idx}, fmt, targets)
    assert (topk["kld_rev"] <= live["kld_rev"] + 1e-6).all() and (topk["kld"] <= live["kld"] + 1e-6).all()
    assert (topk["kld_rev"] > 0).all()
