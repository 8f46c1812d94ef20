"""GPU: attention math fp8-q and the engine chunked-prefill attention, CuTe kernel vs torch reference.

fp8-q feeds the bf16-MMA kernel the E4M3 codes of Q (exact in bf16) with the Q scale folded into
the softmax scale: the kernel then computes the same QK^T products as the reference (float32
accumulation; summation order and the kernel's bf16 P in P.V differ), so the two agree to the
kernels' usual bf16 tolerance, and both differ from bf16 math by more than that. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass")

from mla_eval import api  # noqa: E402
from mla_eval.attention import dispatch  # noqa: E402
from mla_eval.attention.semantics import row_label  # noqa: E402
from mla_eval.errors import UserError  # noqa: E402
from mla_eval.formats import get_format  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BLOCK = 64


def _cache(fmt: str, tokens: int, gen):
    spec = get_format(fmt)
    blocks = -(-tokens // BLOCK)
    cache = torch.zeros(blocks, BLOCK, spec.record_bytes, dtype=torch.uint8, device="cuda")
    latent = (torch.randn(tokens, 512, generator=gen) * 2).cuda()
    rope = torch.randn(tokens, 64, generator=gen).cuda()
    dispatch.write_cache(spec, latent, rope, torch.arange(tokens, device="cuda"), cache, backend="reference")
    return spec, cache, torch.arange(blocks, dtype=torch.int32, device="cuda").view(1, -1), latent, rope


def _agree(out, ref, label):
    a, b = out.double().flatten(), ref.double().flatten()
    cos = float(a @ b / (a.norm() * b.norm()))
    err = float((out - ref).abs().max())
    assert cos >= 0.9999, f"{label}: cosine {cos}"
    assert err <= 2e-2 * float(ref.abs().max()), f"{label}: max abs error {err}"
    return err


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "fp8_ds_mla"])
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_fp8_q_kernel_matches_reference(fmt, mode):
    gen = torch.Generator().manual_seed(7)
    spec, cache, table, _, _ = _cache(fmt, 700, gen)
    n, h = 6, 16
    q = (torch.randn(n, h, 576, generator=gen) * 4).cuda()  # wide enough that E4M3 rounding is visible
    if mode == "dense":
        lists = dict(block_table=table.repeat(n, 1), seq_lens=torch.tensor([1, 63, 64, 65, 400, 700], dtype=torch.int32).cuda())
    else:
        lists = dict(indices=torch.randint(0, 700, (n, 128), generator=gen, dtype=torch.int32).cuda())
    runs = {}
    for backend in ("kernel", "reference"):
        for m in ("bf16", "fp8-q"):
            out, _ = dispatch.mla_attention(spec, q, cache, softmax_scale=576**-0.5, backend=backend, math=m, **lists)
            runs[backend, m] = out
    err = _agree(runs["kernel", "fp8-q"], runs["reference", "fp8-q"], f"{fmt} {mode} fp8-q")
    moved = float((runs["reference", "fp8-q"] - runs["reference", "bf16"]).abs().max())
    assert moved > 4 * err, f"fp8-q moved the output by {moved}, kernel-vs-reference {err}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("prefix", [0, 100])
@pytest.mark.parametrize("math", ["bf16", "fp8-q"])
def test_engine_chunk_attention_kernel_matches_reference(fmt, prefix, math):
    gen = torch.Generator().manual_seed(3)
    t, b, h = 70, 2, 16
    spec = get_format(fmt)
    per_seq = -(-(prefix + t) // BLOCK)
    cache = torch.zeros(b * per_seq, BLOCK, spec.record_bytes, dtype=torch.uint8, device="cuda")
    table = torch.arange(b * per_seq, dtype=torch.int32, device="cuda").view(b, per_seq)
    pos = torch.arange(prefix + t, device="cuda")
    slots = (table[:, pos // BLOCK].long() * BLOCK + pos % BLOCK).reshape(-1)
    latent = (torch.randn(b * (prefix + t), 512, generator=gen) * 2).cuda()
    rope = torch.randn(b * (prefix + t), 64, generator=gen).cuda()
    dispatch.write_cache(spec, latent, rope, slots, cache, backend="reference")
    keys = torch.cat([latent, rope], -1).view(b, prefix + t, 576)[:, prefix:].to(torch.bfloat16).float()
    q = torch.randn(b * t, h, 576, generator=gen).cuda()
    outs = {
        backend: dispatch.mla_attention_chunk(spec, q, cache, softmax_scale=576**-0.5, block_table=table, prefix_len=prefix,
                                              chunk_keys=keys, backend=backend, math=math)
        for backend in ("kernel", "reference")
    }
    _agree(outs["kernel"][0], outs["reference"][0], f"{fmt} prefix={prefix} {math}")
    assert float((outs["kernel"][1] - outs["reference"][1]).abs().max()) < 0.05


@pytest.mark.gpu
@needs_cuda
def test_fp8_qp_refused_on_the_kernel_path():
    gen = torch.Generator().manual_seed(1)
    spec, cache, table, _, _ = _cache("nvfp4", 64, gen)
    q = torch.randn(1, 16, 576, generator=gen).cuda()
    with pytest.raises(UserError, match="torch reference only"):
        dispatch.mla_attention(spec, q, cache, softmax_scale=0.1, block_table=table, seq_lens=torch.tensor([64]).int().cuda(),
                               backend="kernel", math="fp8-qp")


@pytest.mark.gpu
@needs_cuda
def test_kld_engine_and_fp8_math_agree_between_backends(wikitext_path):
    """The whole evaluation on the default model: kernel and reference paths give the same KLD for engine semantics
    and fp8-q math (within the kernels' bf16 rounding), on the same tokens. (This test once scored self-samples,
    which each backend draws with its own forward: the two paths then scored different text -- nvfp4 (cache, fp8-q)
    0.004586 vs 0.002521 on an H100 -- and an absolute slack of 2e-3, as large as the KLDs themselves, hid it for the
    other rows.)"""
    # prefill named: the bf16 rows must run the absorbed kernel too (the fp8 rows keep auto on absorbed today)
    common = dict(formats="nvfp4", text=wikitext_path, max_tokens=8192, device="cuda", layer_stats=False,
                  semantics="cache,engine:64", math="bf16,fp8-q", prefill="absorbed")
    kern = api.evaluate_kld(api.KldSettings(**common, backend="kernel"))
    ref = api.evaluate_kld(api.KldSettings(**common, backend="reference"))
    for sem in ("cache", "engine:64"):
        for m in ("bf16", "fp8-q"):
            key = row_label("nvfp4", sem, m)
            a, b = kern.mean_kld(key), ref.mean_kld(key)
            print(f"{key}: kernel {a:.6f} reference {b:.6f}")
            assert abs(a - b) <= max(1e-4, 0.03 * b), f"{key}: kernel {a} vs reference {b}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("semantics", ["cache", "engine:512"])
def test_kld_mha_window_path_agrees_with_absorbed_kernel(semantics):
    """`mla-eval kld --prefill mha` (decoded cache, kv_b_proj, flash SDPA) vs the absorbed CuTe kernel path
    on the default model at ctx 2048, with the criteria of tests/test_kld_prefill.py. eps, the two paths'
    rounding on the bf16 cache, is measured here: on the H200 its largest per-token value was
    2.2e-3 (cache) / 1.5e-3 (engine:512) on random tokens, above the 1e-3 first assumed, so the test no
    longer caps the largest value at bf16-rounding size (1e-2 still catches a wrong path); as on the CPU it
    asks that nvfp4's mean KLD exceed 5x the mean path rounding (the comparison resolves it), that the means
    agree within 5 % and that the per-token bound hold for at least 97 % of tokens. H200 figures (cache):
    eps mean 2.5e-4, p99 1.0e-3; fp8_ds_mla 6.63e-4 absorbed vs 6.76e-4 mha, nvfp4 4.61e-3 vs 4.62e-3, no
    token past the bound. The figures go to the log (-s)."""
    import dataclasses
    import json

    import numpy as np
    from test_kld_prefill import TOL_FACTOR

    from mla_eval.attention.semantics import parse_semantics
    from mla_eval.evals.kld import KldProtocol, _forward_hidden, _logp, run_kld
    from mla_eval.evals.text_sources import TokenSource
    from mla_eval.evals.variants import parse_variants
    from mla_eval.model.loader import load_model

    ctx, min_ctx = 2048, 1024
    lm = load_model(None, "cuda")
    g = torch.Generator().manual_seed(3)
    source = TokenSource("text", "random tokens", [torch.randint(0, 12000, (ctx,), generator=g) for _ in range(2)], "gpu")
    sem = (parse_semantics(semantics),)
    st = KldProtocol(tuple(parse_variants("bf16,fp8_ds_mla,nvfp4")), parse_variants("bf16")[0], ctx, ctx - min_ctx, min_ctx,
                     batch=2, layer_stats=False, semantics=sem, prefill="absorbed")
    with dispatch.use_backend("kernel"):
        ids = torch.stack(source.sequences).cuda()
        bf16 = parse_variants("bf16")[0]
        a = _logp(lm, _forward_hidden(lm, bf16, ids, min_ctx, st, None, sem[0]))
        m = _logp(lm, _forward_hidden(lm, bf16, ids, min_ctx, dataclasses.replace(st, prefill="mha"), None, sem[0]))
        eps_t = (a.exp() * (a - m)).sum(-1).flatten().float().cpu().numpy()
        runs = {p: run_kld(lm, source, dataclasses.replace(st, prefill=p)).stats for p in ("absorbed", "mha")}
    eps = float(eps_t.max())
    figures = {"semantics": semantics, "tokens": int(eps_t.size), "eps_mean": float(eps_t.mean()),
               "eps_p99": float(np.quantile(eps_t, 0.99)), "eps_max": eps, "formats": {}}
    checks = []
    for key in runs["absorbed"]:
        ka, km = runs["absorbed"][key].arrays()["kld"], runs["mha"][key].arrays()["kld"]
        assert np.isfinite(ka).all() and np.isfinite(km).all()
        bound = TOL_FACTOR * (np.sqrt(np.maximum(ka, km) * eps) + eps)
        past = float((np.abs(ka - km) > bound).mean())
        figures["formats"][key] = {"absorbed_mean": float(ka.mean()), "mha_mean": float(km.mean()), "past_bound": past}
        checks.append((key, ka, km, past))
    print("mha-window agreement", json.dumps(figures))
    assert 0 <= eps < 1e-2, f"the two paths' bf16 outputs differ by a KL of {eps}: more than path rounding"
    for key, ka, km, past in checks:
        if key.startswith("bf16"):
            continue
        if key.startswith("nvfp4"):  # the largest format error: the comparison must resolve it (as on the CPU)
            assert km.mean() > 5 * figures["eps_mean"], f"{key}: the format error must exceed the path rounding"
        assert past <= 0.03, f"{key}: {past:.1%} of tokens past the rounding bound"
        assert km.mean() == pytest.approx(ka.mean(), rel=0.05, abs=1e-6)
