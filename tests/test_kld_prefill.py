"""`mla-eval kld --prefill`: the mha form of a window forward vs the absorbed one (issue 14).

Both read the same cache bytes; with bf16 math they are the same mathematics, differing only in
where rounding happens (mha: the up-projected K/V and the attention run in bf16; absorbed: float32
attention over the latent). So per-token KLD must agree up to that rounding, measured here rather
than assumed: eps = the largest per-token KL between the two paths' outputs on the bf16 cache (pure
path rounding, no format error). A first-order expansion of KL(ref || fmt) in a logit perturbation
of size ~sqrt(eps) bounds a token's KLD change by ~sqrt(kld * eps) + eps; TOL_FACTOR leaves room for
the format's own path rounding differing from the bf16 cache's (measured up to 3.5x on the embedded
model, 0.4x on the tiny one, with the first default-model weights).

That expansion assumes the format is smooth in its input. It is not: layer 0 writes identical bytes in both
paths, but from layer 1 on the writer sees latents that differ by ~1e-5 (the previous layers' path rounding), and
a value or block scale on a rounding boundary lands on the neighbouring code. With the shipped weights
(nvfp4, the embedded model): 11 of 320 records differ at layer 1; a flip at layer 2 moves layer 3's c_kv by 3e-4;
by layer 5, 110 records differ. That put 2 of 158 nvfp4 tokens 2-4x past the bound (KL between the two paths'
nvfp4 outputs up to 2e-3 there, against 3e-6 for the bf16 cache; nvfp4_fp8rope, mxfp4, fp8_ds_mla stay below
3e-5). So the per-token bound must hold for at least 97 % of tokens, and the means and top-1 agreement for all: a
decode or indexing error moves every token, a boundary flip a few.
"""

import dataclasses
import json

import numpy as np
import pytest
import torch
from tiny_models import tiny_checkpoint

from mla_eval.attention.semantics import MATHS, parse_semantics
from mla_eval.cli import main
from mla_eval.errors import UserError
from mla_eval.evals.kld import KldProtocol, _forward_hidden, _logp, resolve_prefill, run_kld
from mla_eval.evals.text_sources import TokenSource
from mla_eval.evals.variants import parse_variants
from mla_eval.model.loader import load_model

TOL_FACTOR = 10.0
CTX, MIN_CONTEXT = 160, 80


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module", params=["embedded", "tiny"])
def lm(request, ckpt):
    return load_model(None if request.param == "embedded" else str(ckpt), "cpu")


def _source(lm) -> TokenSource:
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 300, (CTX,), generator=g) for _ in range(2)]
    return TokenSource("text", "random tokens", seqs, "test")


def _protocol(prefill: str, formats: str = "bf16,fp8_ds_mla,nvfp4", **kw) -> KldProtocol:
    return KldProtocol(
        tuple(parse_variants(formats)), parse_variants("bf16")[0], CTX, CTX - MIN_CONTEXT, MIN_CONTEXT,
        batch=2, layer_stats=False, prefill=prefill, **kw,
    )


def _per_token(lm, st: KldProtocol) -> dict[str, dict[str, np.ndarray]]:
    return {k: v.arrays() for k, v in run_kld(lm, _source(lm), st).stats.items()}


def _path_rounding(lm, **kw) -> float:
    """Largest per-token KL(absorbed || mha) of the bf16 cache's outputs: the two paths' rounding alone."""
    ids = torch.stack(_source(lm).sequences)
    st = _protocol("absorbed", **kw)
    ref = parse_variants("bf16")[0]
    sem = st.semantics[0]
    a = _logp(lm, _forward_hidden(lm, ref, ids, MIN_CONTEXT, st, None, sem))
    m = _logp(lm, _forward_hidden(lm, ref, ids, MIN_CONTEXT, dataclasses.replace(st, prefill="mha"), None, sem))
    return float((a.exp() * (a - m)).sum(-1).max())


@pytest.mark.parametrize("semantics", ["cache", "engine:64"])
def test_mha_and_absorbed_agree_per_token(lm, semantics):
    sem = (parse_semantics(semantics),)
    eps = _path_rounding(lm, semantics=sem)
    assert 0 <= eps < 1e-4, "the two paths differ by more than bf16 rounding"
    absorbed, mha = _per_token(lm, _protocol("absorbed", semantics=sem)), _per_token(lm, _protocol("mha", semantics=sem))
    assert absorbed.keys() == mha.keys()
    for key in absorbed:
        a, m = absorbed[key], mha[key]
        assert np.array_equal(a["order"], m["order"]) and a["kld"].size == 2 * (CTX - 1 - MIN_CONTEXT)
        if key.startswith("bf16"):
            # the bf16 row and the reference run the very same computation (same path, same bytes): exactly 0
            assert np.all(a["kld"] == 0) and np.all(m["kld"] == 0)
            continue
        if key.startswith("nvfp4"):  # the largest format error: the comparison must resolve it
            assert m["kld"].mean() > 5 * eps, f"{key}: the format error must exceed the path rounding"
        bound = TOL_FACTOR * (np.sqrt(np.maximum(a["kld"], m["kld"]) * eps) + eps)
        past = np.abs(a["kld"] - m["kld"]) > bound
        assert past.mean() <= 0.03, f"{key}: {past.sum()} of {past.size} tokens past the rounding bound"
        if m["kld"].mean() > 5 * eps:
            assert m["kld"].mean() == pytest.approx(a["kld"].mean(), rel=0.02)
        else:  # a format error at the path rounding's own size (fp8_ds_mla on the tiny model: both ~1e-6) cannot be
            # resolved to 2 %; its mean must stay inside the rounding bound (measured 3.5 % apart on one CPU, 1 % on another)
            assert abs(m["kld"].mean() - a["kld"].mean()) <= bound.mean(), key
        assert np.mean(a["same_top1"] == m["same_top1"]) > 0.97


def test_resolve_prefill_refusals_and_fallbacks():
    plain = _protocol("absorbed")
    assert resolve_prefill("auto", plain, is_dsa=False) == ("mha", None)
    assert resolve_prefill("absorbed", plain, is_dsa=False) == ("absorbed", None)
    for st, dsa, why in (
        (dataclasses.replace(plain, layer_stats=True), False, "per-layer statistics"),
        (dataclasses.replace(plain, maths=(MATHS["fp8-q"],)), False, "fp8-q math"),
        (dataclasses.replace(plain, explain=parse_variants("nvfp4")[0]), False, "fp8-q math"),  # explain adds fp8 rows
        (plain, True, "DSA model"),
    ):
        mode, reason = resolve_prefill("auto", st, dsa)
        assert mode == "absorbed" and why in reason
        with pytest.raises(UserError, match=f"--prefill mha cannot compute this run: .*{why}"):
            resolve_prefill("mha", st, dsa)
    with pytest.raises(UserError, match="--prefill 'flash'"):
        resolve_prefill("flash", plain, False)


def _cli(args, capsys):
    code = main(args)
    cap = capsys.readouterr()
    return code, cap.err


def test_cli_records_the_path_and_refuses_bad_input(ckpt, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"The {w} river flows past the mill." for w in ["north", "south"] * 60))
    base = ["kld", "--model", str(ckpt), "--text", str(text), "--ctx", "64", "--formats", "nvfp4", "--scales", "none"]
    runs = {  # name: the options; "" is a plain run (default --prefill, layer stats on)
        "": [], "stats auto": ["--prefill", "auto"], "fast": ["--no-layer-stats"],
        "fast auto": ["--no-layer-stats", "--prefill", "auto"], "slow": ["--no-layer-stats", "--prefill", "absorbed"],
    }
    docs, errs = {}, {}
    for name, extra in runs.items():
        out = tmp_path / f"r{len(docs)}.json"
        keep = ["--save-ref", str(tmp_path / f"{name}.pt")] if name in ("fast", "slow") else []
        code, errs[name] = _cli(base + extra + keep + ["--out", str(out)], capsys)
        assert code == 0, errs[name]
        docs[name] = json.loads(out.read_text())
    plain, stats, fast, slow = docs[""], docs["stats auto"], docs["fast"], docs["slow"]
    # the default is auto: mha once layer stats are off, with nothing to note
    for doc in (fast, docs["fast auto"]):
        s = doc["settings"]
        assert (s["prefill"], s["prefill_asked"], s["prefill_reason"]) == ("mha", "auto", None)
        assert doc["formats"]["nvfp4"]["prefill"] == "mha" and not doc["notes"]
    # a plain run falls back to absorbed quietly: the reason is recorded, not printed
    s = plain["settings"]
    assert (s["prefill"], s["prefill_asked"]) == ("absorbed", "auto") and "per-layer statistics" in s["prefill_reason"]
    assert plain["notes"] == [] and "note:" not in errs[""]
    # asked for by name, auto's fallback is also a note, printed
    assert stats["settings"]["prefill"] == "absorbed" and stats["settings"]["prefill_reason"] == s["prefill_reason"]
    assert stats["notes"] == [f"--prefill auto: every forward ran the absorbed path ({s['prefill_reason']})"]
    assert "note: --prefill auto: every forward ran the absorbed path" in errs["stats auto"]
    assert slow["settings"]["prefill"] == slow["formats"]["nvfp4"]["prefill"] == "absorbed"
    assert slow["settings"]["prefill_reason"] is None and not slow["notes"]
    assert fast["formats"]["nvfp4"]["kld_mean"] == pytest.approx(slow["formats"]["nvfp4"]["kld_mean"], rel=0.02)
    # a stored reference serves only runs of its own path, either way round (the default may pick either)
    code, err = _cli(base + ["--no-layer-stats", "--prefill", "absorbed", "--ref-file", str(tmp_path / "slow.pt"),
                             "--out", str(tmp_path / "again.json")], capsys)
    assert code == 0, err
    for bad, says in (
        (["--prefill", "flash"], "--prefill 'flash': choose one of auto, absorbed, mha"),
        (["--prefill", "mha"], "--prefill mha cannot compute this run: per-layer statistics"),
        (["--prefill", "mha", "--no-layer-stats", "--math", "fp8-q", "--backend", "reference"], "fp8-q math"),
        (["--ref-file", str(tmp_path / "fast.pt")], "(prefill: file 'mha' vs now unset); run with the file's settings"),
        (["--no-layer-stats", "--ref-file", str(tmp_path / "slow.pt")], "(prefill: file unset vs now 'mha')"),
    ):
        code, err = _cli(base + bad + ["--out", str(tmp_path / "bad.json")], capsys)
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_library_default_is_auto_and_quiet():
    """KldSettings: the default (None) is DEFAULT_KLD_PREFILL, auto; a value given is kept, a bad one refused."""
    from mla_eval import api
    from mla_eval.evals.kld import DEFAULT_KLD_PREFILL, KLD_PREFILL_MODES

    assert DEFAULT_KLD_PREFILL == "auto" and DEFAULT_KLD_PREFILL in KLD_PREFILL_MODES
    st = api.KldSettings(device="cpu")
    assert st.prefill is None and st.prefill_mode() == "auto"
    for mode in KLD_PREFILL_MODES:
        assert api.KldSettings(device="cpu", prefill=mode).prefill_mode() == mode
    with pytest.raises(UserError, match="--prefill 'flash': choose one of auto, absorbed, mha"):
        api.KldSettings(device="cpu", prefill="flash")


def test_forward_bench_times_both_kld_paths_beside_stock(tmp_path):
    """The benchmark's structure on CPU (the figures that matter come from the H200)."""
    from benchmarks import forward_bench

    out = tmp_path / "bench.json"
    args = ["--device", "cpu", "--parts", "kld", "--ctx", "32", "--kld-batch", "1", "--repeats", "1", "--formats", "nvfp4"]
    assert forward_bench.main(args + ["--out", str(out)]) == 0
    kld = json.loads(out.read_text())["kld"]
    row = kld["formats"]["nvfp4"]
    assert kld["prefills"] == ["absorbed", "mha"] and kld["stock_seconds"] > 0
    for mode in ("absorbed", "mha"):
        assert row[mode]["ratio_vs_stock"] == pytest.approx(row[mode]["seconds"] / kld["stock_seconds"])
        assert row["meets_1p5x_stock"][mode] == (row[mode]["ratio_vs_stock"] <= kld["target_ratio_vs_stock"])
    assert row["mha_speedup_vs_absorbed"] == pytest.approx(row["absorbed"]["seconds"] / row["mha"]["seconds"])
    with pytest.raises(SystemExit):
        forward_bench.main(args + ["--kld-prefill", "flash"])


def test_forward_bench_profiles_the_kld_window(tmp_path):
    """--profile-kld writes one profiler table per forward: stock, then the first format through each path asked
    for, and the mha table shows the mha path's SDPA (the absorbed path runs no SDPA over the cache)."""
    from benchmarks import forward_bench

    prof = tmp_path / "kld-profile.txt"
    args = ["--device", "cpu", "--parts", "kld", "--ctx", "32", "--kld-batch", "1", "--repeats", "1",
            "--formats", "nvfp4", "--profile-kld", str(prof)]
    assert forward_bench.main(args) == 0
    text = prof.read_text()
    stock, rest = text.split("nvfp4 cache forward, --prefill absorbed", 1)
    absorbed, mha = rest.split("nvfp4 cache forward, --prefill mha", 1)
    assert stock.startswith("stock bf16 forward, 1 x 32 tokens") and "aten::mm" in stock
    assert "scaled_dot_product_attention" in mha and "scaled_dot_product_attention" not in absorbed
