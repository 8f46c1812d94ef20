"""Attention semantics (cache vs engine chunked prefill) and attention math (bf16, fp8-q, fp8-qp).

What issue 16 asks the tests to show:
- with a bf16 cache, engine semantics equal cache semantics exactly, for any chunk size (same
  forward schedule: bit for bit; one-forward cache semantics: within float32 rounding);
- one chunk covering the window of a dense model: no position reads the cache, every format's
  KLD is exactly 0, and the result says so;
- chunk 1 differs from cache semantics only in each query's own key;
- fp8 math on a bf16 cache changes the result; reference and kernel agree (GPU test);
- DSA models: the sparse path reads the cache under engine semantics too.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import tiny_model

from mla_eval import api
from mla_eval.attention import dispatch, reference
from mla_eval.attention.semantics import (
    BF16,
    CACHE,
    MATHS,
    PRESETS,
    Semantics,
    parse_semantics,
    parse_semantics_list,
    quantize_q,
    row_label,
)
from mla_eval.errors import UserError
from mla_eval.evals.report_tables import identity
from mla_eval.formats import decode, encode, get_format
from mla_eval.formats.numerics import E4M3_MAX
from mla_eval.model.adapter import MlaAdapter
from mla_eval.model.session import CacheSession
from mla_eval.report.gate import compare

FP8_Q = MATHS["fp8-q"]
FP8_QP = MATHS["fp8-qp"]


# ------------------------------------------------------------------ parsing and presets
def test_parse_semantics_names_presets_and_chunks():
    assert parse_semantics("cache") == CACHE
    assert parse_semantics("engine:512") == Semantics("engine", 512)
    assert parse_semantics("vllm").chunk == PRESETS["vllm"].chunk == 8192
    assert parse_semantics("sglang").label == "engine:8192"
    assert [s.label for s in parse_semantics_list("cache,engine:64,engine:64,vllm-offline")] == [
        "cache", "engine:64", "engine:16384"]
    for bad in ("engine", "engine:0", "engine:-1", "engine:x", "trtllm", ""):
        with pytest.raises(UserError):
            parse_semantics_list(bad) if bad == "" else parse_semantics(bad)


def test_chunk_beyond_the_model_positions_is_refused():
    Semantics("engine", 256).check_positions(256)
    CACHE.check_positions(8)
    with pytest.raises(UserError, match="256 positions"):
        Semantics("engine", 257).check_positions(256)


def test_row_labels_keep_the_bare_name_for_cache_bf16():
    assert row_label("nvfp4", CACHE, BF16) == "nvfp4"
    assert row_label("nvfp4", Semantics("engine", 512), FP8_Q) == "nvfp4 (engine:512, fp8-q)"
    assert row_label("nvfp4", "cache", "fp8-q") == "nvfp4 (cache, fp8-q)"


# ------------------------------------------------------------------ model level: bf16 cache
def _chunked_logits(model, adapter, fmt, ids, chunk, semantics, chunk_keys="fresh", prefill="absorbed", attn_math=BF16):
    """Logits of `ids` [B, T] run as forwards of `chunk` tokens through a session of `fmt`."""
    b, t = ids.shape
    session = CacheSession(get_format(fmt), adapter.num_layers, b, t, "cpu", prefill=prefill, semantics=semantics,
                           attn_math=attn_math, chunk_keys=chunk_keys)
    pos = torch.arange(t).expand(b, -1)
    out = []
    with torch.no_grad(), adapter.session(session):
        for a in range(0, t, chunk):
            out.append(model(input_ids=ids[:, a : a + chunk], position_ids=pos[:, a : a + chunk], use_cache=False).logits)
    return torch.cat(out, 1)


@pytest.fixture(scope="module")
def v3():
    model = tiny_model("deepseek_v3", seed=3)
    adapter = MlaAdapter(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    yield model, adapter, ids
    adapter.restore()


@pytest.mark.parametrize("prefill", ["absorbed", "mha"])
@pytest.mark.parametrize("chunk", [1, 3, 16, 40])
def test_bf16_cache_engine_equals_cache_semantics_exactly(v3, chunk, prefill):
    """The fresh chunk keys are bit-identical to what a bf16 cache stores, so engine semantics and
    cache semantics on the same forward schedule give the same logits bit for bit; and the
    chunked schedule agrees with one whole-window forward within float32 rounding."""
    model, adapter, ids = v3
    engine = Semantics("engine", chunk)
    fresh = _chunked_logits(model, adapter, "bf16", ids, chunk, engine, "fresh", prefill)
    stored = _chunked_logits(model, adapter, "bf16", ids, chunk, engine, "cache", prefill)
    assert torch.equal(fresh, stored)
    if prefill == "absorbed":  # the plain cache-semantics path on the same schedule: bit for bit too
        assert torch.equal(fresh, _chunked_logits(model, adapter, "bf16", ids, chunk, CACHE))
    # one whole-window forward: the same keys, another schedule (matmul shapes), float32 rounding only
    whole = _chunked_logits(model, adapter, "bf16", ids, ids.shape[1], CACHE, prefill=prefill)
    assert torch.allclose(fresh, whole, atol=2e-4, rtol=0)


@pytest.mark.parametrize("prefill", ["absorbed", "mha"])
def test_quantised_cache_engine_reads_fresh_keys_in_the_chunk_only(v3, prefill):
    """With nvfp4 the chunk's own keys differ from the stored ones: engine and cache semantics on the
    same schedule differ, and the first chunk (no earlier chunk) equals the bf16 cache's logits."""
    model, adapter, ids = v3
    engine = Semantics("engine", 16)
    fresh = _chunked_logits(model, adapter, "nvfp4", ids, 16, engine, "fresh", prefill)
    stored = _chunked_logits(model, adapter, "nvfp4", ids, 16, engine, "cache", prefill)
    bf16 = _chunked_logits(model, adapter, "bf16", ids, 16, engine, "fresh", prefill)
    assert not torch.allclose(fresh, stored, atol=1e-4)
    assert torch.equal(fresh[:, :16], bf16[:, :16])  # the first chunk never reads the cache
    assert not torch.allclose(fresh[:, 16:], bf16[:, 16:], atol=1e-4)  # later chunks do


def _engine_prefill_then_last(model, adapter, ids, last):
    """Engine prefill (chunks of 8) of all but the last token of `ids` through an nvfp4 session,
    then the last token as `last`: 'step' (a decode step), 'fresh' or 'cache' (a one-token chunk
    whose own key is fresh, or read back from the cache). -> the last token's logits [B, vocab]."""
    b, t = ids.shape
    session = CacheSession(get_format("nvfp4"), adapter.num_layers, b, t, "cpu", semantics=Semantics("engine", 8))
    pos = torch.arange(t).expand(b, -1)
    with torch.no_grad(), adapter.session(session):
        for a in range(0, t - 1, 8):  # the engine's prefill, the same for every `last`
            e = min(a + 8, t - 1)
            model(input_ids=ids[:, a:e], position_ids=pos[:, a:e], use_cache=False)
        session.chunk_keys = "cache" if last == "cache" else "fresh"
        if last == "step":
            session.begin_step(t - 1)
        logits = model(input_ids=ids[:, t - 1 :], position_ids=pos[:, t - 1 :], use_cache=False).logits[:, -1]
    return logits


def test_decode_step_after_an_engine_prefill_reads_its_own_key_from_the_cache(v3):
    model, adapter, ids = v3
    step = _engine_prefill_then_last(model, adapter, ids, "step")
    from_cache = _engine_prefill_then_last(model, adapter, ids, "cache")
    fresh = _engine_prefill_then_last(model, adapter, ids, "fresh")
    assert torch.allclose(step, from_cache, atol=1e-6, rtol=0)  # decode = every key, its own included, from the cache
    assert not torch.allclose(step, fresh, atol=1e-4)  # a prefill chunk would have read its own key fresh


# ------------------------------------------------------------------ one chunk = no cache read
def test_one_chunk_covering_the_window_gives_exactly_zero_kld_for_every_format():
    formats = "nvfp4,nvfp4+s_l,fp8_ds_mla,mxfp4,fp8_e4m3"
    common = dict(formats=formats, samples=2, sample_len=48, device="cpu", layer_stats=False)
    result = api.evaluate_kld(api.KldSettings(**common, semantics="cache,engine:48,engine:4096"))
    for fmt in ("nvfp4", "nvfp4+s_l", "fp8_ds_mla", "mxfp4", "fp8_e4m3"):
        assert result.formats[fmt]["kld_mean"] > 0  # the cache semantics see the storage error
        for sem in ("engine:48", "engine:4096"):
            row = result.formats[row_label(fmt, sem, "bf16")]
            assert row["kld_mean"] == 0.0 and row["kld_max"] == 0.0 and row["same_top1_pct"] == 100.0
            assert (row["semantics"], row["math"], row["chunk"]) == (sem, "bf16", int(sem.split(":")[1]))
    assert len(result.notes) == 2 and all("exactly 0" in n and "no position reads the cache" in n for n in result.notes)
    doc = result.to_document()
    assert doc["notes"] == result.notes
    assert [s["semantics"] for s in doc["settings"]["semantics"]] == ["cache", "engine:48", "engine:4096"]


def test_shorter_chunks_see_part_of_the_storage_error():
    result = api.evaluate_kld(api.KldSettings(formats="nvfp4", samples=2, sample_len=64, device="cpu", layer_stats=False,
                                              semantics="cache,engine:16"))
    cache, engine = result.mean_kld("nvfp4"), result.mean_kld(row_label("nvfp4", "engine:16", "bf16"))
    assert 0 < engine < cache  # the own chunk is exact, earlier chunks are read through the cache
    assert result.notes == []


# ------------------------------------------------------------------ chunk 1: only the own key differs
def _paged(fmt, latent, rope, block=4):
    spec = get_format(fmt)
    t = latent.shape[0]
    cache = torch.zeros(-(-t // block), block, spec.record_bytes, dtype=torch.uint8)
    reference.write_cache(spec, latent, rope, torch.arange(t), cache)
    return spec, cache, torch.arange(cache.shape[0], dtype=torch.int32).view(1, -1)


def test_chunk_1_differs_from_cache_semantics_only_in_the_own_key():
    g = torch.Generator().manual_seed(11)
    t, h = 9, 3
    latent, rope = torch.randn(t, 512, generator=g) * 3, torch.randn(t, 64, generator=g)
    q = torch.randn(t, h, 576, generator=g) * 0.05
    spec, cache, table = _paged("nvfp4", latent, rope)
    lat_q, rope_q = decode(spec, encode(spec, latent, rope))
    stored = torch.cat([lat_q, rope_q], -1)
    fresh = torch.cat([latent, rope], -1).to(torch.bfloat16).float()
    for p in range(t):
        eng, _ = dispatch.mla_attention_chunk(spec, q[p : p + 1], cache, softmax_scale=0.1, block_table=table, prefix_len=p,
                                              chunk_keys=fresh[p : p + 1].view(1, 1, 576), backend="reference")
        cac, _ = dispatch.mla_attention_dense(spec, q[p : p + 1], cache, table, torch.tensor([p + 1], dtype=torch.int32), 0.1,
                                              backend="reference")
        # an independent float64 attention over the stored keys with only key p (the query's own) made fresh
        keys = stored[: p + 1].double().clone()
        keys[p] = fresh[p].double()
        w = torch.softmax(torch.einsum("hd,ld->hl", q[p].double(), keys) * 0.1, -1)
        want = torch.einsum("hl,ld->hd", w, keys[:, :512])
        assert torch.allclose(eng[0].double(), want, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(cac[0], eng[0], atol=1e-4)  # the own key matters at every position


# ------------------------------------------------------------------ fp8 math
def test_fp8_q_codes_are_e4m3_values_and_saturate():
    q = torch.tensor([0.0, 1.0, 1.0625, 1.1875, -3.3, 500.0, -1e4, 2.0 ** -10])
    codes, scale = quantize_q(q, FP8_Q)
    assert scale == 1.0
    # E4M3: 3 mantissa bits; 1.0625 ties to 1.0 (even), 1.1875 ties to 1.25; +-448 saturation; 2^-10 underflows to 0
    assert codes.tolist() == [0.0, 1.0, 1.0, 1.25, -3.25, E4M3_MAX, -E4M3_MAX, 0.0]
    assert torch.equal(codes.to(torch.bfloat16).float(), codes)  # exact in bf16: what the kernel is fed
    same, one = quantize_q(q, BF16)
    assert one == 1.0 and torch.equal(same, q)


def test_fp8_math_changes_attention_on_a_bf16_cache():
    g = torch.Generator().manual_seed(2)
    latent, rope = torch.randn(20, 512, generator=g), torch.randn(20, 64, generator=g)
    q = torch.randn(5, 4, 576, generator=g) * 0.3
    spec, cache, table = _paged("bf16", latent, rope)
    lens = torch.tensor([4, 8, 12, 16, 20], dtype=torch.int32)
    rows = table.repeat(5, 1)
    outs = {m: dispatch.mla_attention_dense(spec, q, cache, rows, lens, 0.07, backend="reference", math=m)[0]
            for m in ("bf16", "fp8-q", "fp8-qp")}
    assert not torch.allclose(outs["bf16"], outs["fp8-q"], atol=1e-4)
    assert not torch.allclose(outs["fp8-q"], outs["fp8-qp"], atol=1e-4)
    # fp8-q is bf16 math on the E4M3-rounded query (the rounding done independently through torch's float8 type)
    q8 = q.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    want, _ = dispatch.mla_attention_dense(spec, q8, cache, rows, lens, 0.07, backend="reference")
    assert torch.equal(outs["fp8-q"], want)


def test_fp8_math_on_a_bf16_cache_moves_the_kld():
    result = api.evaluate_kld(api.KldSettings(formats="bf16", samples=2, sample_len=48, device="cpu", layer_stats=False,
                                              math="bf16,fp8-q,fp8-qp"))
    assert result.mean_kld("bf16") == 0.0  # bf16 cache + bf16 math is the reference itself
    q_only, qp = result.mean_kld("bf16 (cache, fp8-q)"), result.mean_kld("bf16 (cache, fp8-qp)")
    assert q_only > 0 and qp > 0 and qp != q_only


def test_fp8_qp_is_refused_on_the_kernel_backend():
    with pytest.raises(UserError, match="torch reference only"):
        api.KldSettings(math="fp8-qp", backend="kernel")
    api.KldSettings(math="fp8-q", backend="reference")  # fp8-q runs on either path


def test_explain_breakdown_adds_the_storage_and_compute_rows():
    result = api.evaluate_kld(api.KldSettings(formats="fp8_ds_mla", samples=2, sample_len=48, device="cpu",
                                              layer_stats=False, semantics="cache,engine:16", explain="nvfp4"))
    ex = result.explain
    assert ex["format"] == "nvfp4" and list(ex["semantics"]) == ["cache", "engine:16"]
    for sem, row in ex["semantics"].items():
        assert row["storage_only"] == result.mean_kld(row_label("nvfp4", sem, "bf16"))
        assert row["compute_only"]["fp8-q"] == result.mean_kld(row_label("bf16", sem, "fp8-q"))
        assert row["both"]["fp8-q"] == result.mean_kld(row_label("nvfp4", sem, "fp8-q"))
        parts = row["storage_only"] + row["compute_only"]["fp8-q"]
        assert math.isclose(row["interaction"]["fp8-q"], row["both"]["fp8-q"] - parts)
        assert row["storage_only"] > 0 and row["compute_only"]["fp8-q"] > 0
    assert result.to_document()["explain"] == ex


# ------------------------------------------------------------------ DSA: the sparse path reads the cache
def test_dsa_engine_semantics_read_the_cache_like_cache_semantics(tmp_path):
    from tiny_models import tiny_checkpoint

    ckpt = tiny_checkpoint(tmp_path / "dsa", "deepseek_v32")
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"The {w} river runs by the mill and the {w} bridge." for w in ["north", "south"] * 8))
    result = api.evaluate_kld(api.KldSettings(model=ckpt, text=text, formats="nvfp4", ctx=32, stride=16, scales="none",
                                              device="cpu", layer_stats=False, semantics="cache,engine:64",
                                              prefill="auto"))
    engine = result.mean_kld(row_label("nvfp4", "engine:64", "bf16"))
    assert engine > 0  # one chunk covers the window, yet the sparse path still reads the quantised cache
    assert engine == result.mean_kld("nvfp4")
    assert len(result.notes) == 2 and "DSA" in result.notes[0] and "equal cache semantics" in result.notes[0]
    # --prefill auto, asked for by name: a DSA model keeps the absorbed (sparse) path, and says so
    assert result.settings["prefill"] == "absorbed" and "DSA model" in result.notes[1]
    assert result.settings["prefill_reason"] in result.notes[1]
    # the default (auto, not asked): the same path and reason, recorded without a note
    quiet = api.evaluate_kld(api.KldSettings(model=ckpt, text=text, formats="nvfp4", ctx=32, stride=16, scales="none",
                                             device="cpu", layer_stats=False, semantics="cache,engine:64"))
    assert quiet.settings["prefill"] == "absorbed" and quiet.settings["prefill_reason"] == result.settings["prefill_reason"]
    assert quiet.notes == result.notes[:1] and quiet.formats == result.formats


# ------------------------------------------------------------------ gate: semantics and math are identity
def _doc(rows: dict, schema="mla-eval/kld/v1") -> dict:
    return {"schema": schema, "formats": rows}


def test_gate_never_compares_across_semantics_or_math():
    base = _doc({"nvfp4": {"kld_mean": 0.10}})
    engine = _doc({"nvfp4 (engine:512, bf16)": {"kld_mean": 0.01, "format": "nvfp4", "semantics": "engine:512",
                                                "math": "bf16"}})
    checks = compare({"k.json": engine}, {"k.json": base})
    # the cache row is missing from the results, the engine row from the baseline: neither is compared with the other
    assert [(c.name, c.ok, c.why) for c in checks] == [
        ("nvfp4", False, "row missing in results"), ("nvfp4 (engine:512, bf16)", False, "row not in the baseline")
    ]
    # same semantics and math: compared, whatever the row key
    same = _doc({"nvfp4": {"kld_mean": 0.10, "format": "nvfp4", "semantics": "cache", "math": "bf16"}})
    assert all(c.ok for c in compare({"k.json": same}, {"k.json": base}))
    # a needle document names them in its settings
    needle = {"schema": "mla-eval/needle/v1", "settings": {"semantics": {"semantics": "engine:8192"}, "math": "fp8-q"},
              "formats": {"nvfp4": {"mean_accuracy": 1.0}}}
    assert identity("nvfp4", needle["formats"]["nvfp4"], needle) == "nvfp4 (engine:8192, fp8-q)"


# ------------------------------------------------------------------ needle under engine semantics
def test_needle_engine_prefill_with_bf16_cache_decodes_the_same_answers():
    common = dict(formats="nvfp4", lengths="160", depths="50", scales="none", device="cpu")
    cache = api.evaluate_needle(api.NeedleSettings(**common))
    engine = api.evaluate_needle(api.NeedleSettings(**common, semantics="engine:64", math="bf16"))
    out = {r["format"]: r["output"] for r in cache.records}
    eng = {r["format"]: r["output"] for r in engine.records}
    assert eng["bf16"] == out["bf16"]
    assert engine.settings["semantics"]["semantics"] == "engine:64"


# ------------------------------------------------------------------ report: title, note, breakdown
def test_report_shows_semantics_notes_and_the_breakdown(tmp_path):
    from mla_eval.report.page import build_report
    from mla_eval.results import write_result

    result = api.evaluate_kld(api.KldSettings(formats="nvfp4", samples=1, sample_len=32, device="cpu", layer_stats=False,
                                              semantics="cache,engine:32", explain="nvfp4"))
    write_result(tmp_path / "kld.json", result.to_document())
    md = build_report(tmp_path).markdown()
    assert "semantics cache, engine:32; math bf16" in md
    assert "no position reads the cache" in md
    assert "storage only (KLD)" in md and "| engine:32 | fp8-q | 0.00000 |" in md
