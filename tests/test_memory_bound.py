"""Memory grows linearly with the context: no forward path holds O(ctx^2) or O(heads x ctx^2) tensors.

Peak CPU memory is read from torch's own allocator events (torch.profiler with profile_memory: every
allocation and free inside the profiled call carries the running "Total Allocated"; see
benchmarks.memory_bench.cpu_peak_growth), so it counts exactly the tensors torch allocates during the call,
nothing else of the process. The chunked computations are also
held equal, bit for bit, to their whole-window form (the indexer's top-k: tests/test_indexer.py).
"""

import json
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model

import mla_eval.attention.reference as reference
import mla_eval.evals.layer_stats as layer_stats
import mla_eval.model.indexer as indexer
from benchmarks.memory_bench import cpu_peak_growth
from mla_eval.evals.kld import KldProtocol, run_kld
from mla_eval.evals.layer_stats import LayerStats, exact_attention
from mla_eval.evals.text_sources import TokenSource
from mla_eval.evals.variants import parse_variants
from mla_eval.formats import get_format
from mla_eval.model.adapter import MlaAdapter
from mla_eval.model.loader import LoadedModel
from mla_eval.model.session import CacheSession, LayerEvent

WHOLE = 1 << 62  # block bytes that make one block of the whole window


def cpu_peak_bytes(fn, trace: Path) -> int:
    """Most bytes torch's CPU allocator held at once during fn() above what it held when fn began."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    prof.export_chrome_trace(str(trace))
    return cpu_peak_growth(json.loads(trace.read_text()))


# ---------------------------------------------------------------- chunked == whole window, bit for bit

def _history(b, t, h, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, h, 576, generator=g), torch.randn(b, s, 512, generator=g), torch.randn(b, s, 64, generator=g)


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("sparse", [False, True])
def test_exact_attention_chunks_equal_the_whole_window(sparse, heads):
    """Query-row blocks of 1, 4 and 9 rows give exactly the whole-window reference: T < S (a history before the
    window), batch 2, and for the sparse form top-k lists holding -1 padding, future and repeated positions.

    Every output row is the same arithmetic in any block (one row's scores, mask and softmax), but the BLAS kernel
    a GEMM runs can depend on its size: with fewer than ~16 GEMM rows per block (heads x rows; 3 heads x 1 row here
    measured it) the last bit can move. Production blocks hold at least one row of 128 (DeepSeek) or 64 (GLM) heads."""
    b, t, s = 2, 23, 41
    q, lat, rope = _history(b, t, heads, s)
    topk = None
    if sparse:
        g = torch.Generator().manual_seed(1)
        topk = torch.randint(-1, s, (b, t, 12), generator=g)
        topk[..., 0] = torch.arange(s - t, s)  # every query keeps at least itself
    whole = exact_attention(q, lat, rope, 0.07, topk=topk, block_bytes=WHOLE)
    for rows in (1, 4, 9):
        blocked = exact_attention(q, lat, rope, 0.07, topk=topk, block_bytes=4 * b * heads * s * rows)
        assert torch.equal(blocked, whole), f"{rows} rows per block"


def test_layer_statistics_keep_their_sums(monkeypatch):
    """The observer's sums equal the whole-tensor formulas they replace (same reductions, same order), with the
    reference and the cosines computed in blocks."""
    b, t, h = 1, 30, 16
    q, lat, rope = _history(b, t, h, t, seed=2)
    out = exact_attention(q, lat, rope, 0.05) + 1e-3 * torch.randn(b, t, h, 512, generator=torch.Generator().manual_seed(3))

    class Session:  # what the observer reads of a cache session
        lengths, last_scale, exact = [t], [0.05], [(lat, rope)]

        def read_back(self, layer, start, count):
            return lat.round(decimals=1), rope.round(decimals=1)

    monkeypatch.setattr(layer_stats, "EXACT_BLOCK_BYTES", 4 * 16 * 30 * 7)  # 7-row blocks; cosines 105 rows at a time
    stats = LayerStats(1)
    stats.observers(get_format("bf16"))[0](LayerEvent(0, lat, rope, q, out, Session()))
    ref = exact_attention(q, lat, rope, 0.05, block_bytes=WHOLE)
    assert stats.err2[0] == float(((out - ref) ** 2).sum()) > 0
    assert stats.ref2[0] == float((ref * ref).sum())
    cos = torch.nn.functional.cosine_similarity(out.reshape(-1, 512), ref.reshape(-1, 512), dim=-1, eps=1e-30)
    assert stats.cos_sum[0] == float(cos.double().sum()) and stats.cos_n[0] == cos.numel()


# ---------------------------------------------------------------- the stock model's causal mask

@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_session_forward_skips_the_stock_causal_mask(model_type):
    """The stock DSA model builds a [B, 1, T, T] mask for its eager attention; inside a session our attention and
    indexer never read it, so the layers get None. Handing the model a padding mask (it then builds its T x T mask)
    gives the same bits, and the stock forward outside a session still gets its mask."""
    model = tiny_model(model_type)
    seen = []
    model.model.layers[0].register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True)
    ids = torch.randint(0, 320, (1, 24), generator=torch.Generator().manual_seed(4))
    adapter = MlaAdapter(model)

    def hidden(**kw):
        session = CacheSession(get_format("nvfp4"), adapter.num_layers, 1, 24, "cpu")
        with torch.no_grad(), adapter.session(session):
            return model.model(input_ids=ids, use_cache=False, **kw).last_hidden_state

    plain = hidden()
    assert seen[-1] is None
    masked = hidden(attention_mask=torch.ones_like(ids))
    assert isinstance(seen[-1], torch.Tensor) and seen[-1].shape[-2:] == (24, 24)
    assert torch.equal(plain, masked)
    with torch.no_grad():
        model.model(input_ids=ids, use_cache=False)
    assert isinstance(seen[-1], torch.Tensor) and seen[-1].shape[-2:] == (24, 24)


# ---------------------------------------------------------------- peak memory of whole kld runs vs ctx

def _dsa_model():
    """DeepSeek-V3.2 code with the production per-head dims, the indexer's head dim (128) and scaled-down counts
    (1 attention head, 4 indexer heads, top-k 64) so 4096-token windows run in seconds on a CPU."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.DeepseekV32Config(
        vocab_size=320, hidden_size=128, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=1,
        first_k_dense_replace=1, num_attention_heads=1, num_key_value_heads=1, q_lora_rank=64, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=8192, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, index_topk=64, index_head_dim=128, index_n_heads=4,
    )
    cfg._attn_implementation = "eager"  # as loaded DSA checkpoints run (adapter.stock_attention)
    return tf.DeepseekV32ForCausalLM(cfg).eval()


def _dense_model():
    """DeepSeek-V3 code with the production per-head dims (q/k 192, v 128: unequal, as in every MLA model) and 4 heads."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.DeepseekV3Config(
        vocab_size=320, hidden_size=128, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=1,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=8192, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1,
    )
    cfg._attn_implementation = "sdpa"
    return tf.DeepseekV3ForCausalLM(cfg).eval()


@pytest.fixture
def one_thread():
    """One intra-op thread: these long windows run many small ops, which contend badly on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _kld_peaks(model, ctxs, tmp_path, **protocol) -> list[int]:
    lm = LoadedModel(model=model, tokenizer=None, adapter=MlaAdapter(model), path=Path("memory-test"), name="memory-test",
                     device=torch.device("cpu"), is_default=False)
    peaks = []
    for ctx in ctxs:
        seq = torch.randint(0, 320, (ctx,), generator=torch.Generator().manual_seed(ctx))
        source = TokenSource("text", "random tokens", [seq], "test")
        st = KldProtocol(tuple(parse_variants("nvfp4")), parse_variants("bf16")[0], ctx, ctx // 2, ctx // 2, **protocol)
        peaks.append(cpu_peak_bytes(lambda: run_kld(lm, source, st), tmp_path / f"trace{ctx}.json"))
    return peaks


def _assert_linear(ctxs, peaks, per_token_bytes):
    """Each doubling of ctx adds at most ~2x what the previous one added (quadratic terms add 4x), and the peak
    stays under `per_token_bytes` per token (the whole-window forms held far more: see each test)."""
    steps = [b - a for a, b in zip(peaks, peaks[1:])]
    report = ", ".join(f"ctx {c}: {p / 2**20:.1f} MiB" for c, p in zip(ctxs, peaks))
    assert all(0 < s for s in steps), report
    assert steps[1] < 2.6 * steps[0], report
    assert peaks[-1] < per_token_bytes * ctxs[-1], report


@pytest.mark.slow
def test_dsa_kld_peak_memory_is_linear_in_ctx(tmp_path, monkeypatch, capsys, one_thread):
    """A kld run (bf16 reference + nvfp4 with layer statistics, sparse DSA attention, indexer, loss) at ctx 1024,
    2048, 4096. Every block bound is 2 MiB here (production: 256 MiB each) so the bounds, not the window, size the
    blocks at this scale. Before the chunking the layer statistics held [B, H, T, T] fp32 three times over
    (1 head x 4096^2 x 4 B x 3 = 192 MiB at 4096) and the stock model a [1, 1, T, T] mask (64 MiB fp32)."""
    for module, name in ((indexer, "SCORE_BLOCK_BYTES"), (layer_stats, "EXACT_BLOCK_BYTES"), (reference, "_GATHERED_KEY_BYTES")):
        monkeypatch.setattr(module, name, 1 << 21)
    ctxs = [1024, 2048, 4096]
    peaks = _kld_peaks(_dsa_model(), ctxs, tmp_path, layer_stats=True, prefill="absorbed")
    with capsys.disabled():
        print("\nDSA kld peak CPU allocation:", ", ".join(f"ctx {c}: {p / 2**20:.1f} MiB" for c, p in zip(ctxs, peaks)))
    _assert_linear(ctxs, peaks, per_token_bytes=32 << 10)


@pytest.mark.slow
def test_mha_prefill_peak_memory_is_linear_in_ctx(tmp_path, capsys, one_thread):
    """A kld run through the mha prefill (decoded cache, causal SDPA) at ctx 1024, 2048, 4096 with q/k 192 and
    v 128: without padding v, torch's CPU SDPA takes its math path and holds [B, H, T, T] fp32 scores
    (4 heads x 4096^2 x 4 B = 256 MiB per copy at 4096)."""
    ctxs = [1024, 2048, 4096]
    peaks = _kld_peaks(_dense_model(), ctxs, tmp_path, layer_stats=False, prefill="mha")
    with capsys.disabled():
        print("\nmha kld peak CPU allocation:", ", ".join(f"ctx {c}: {p / 2**20:.1f} MiB" for c, p in zip(ctxs, peaks)))
    _assert_linear(ctxs, peaks, per_token_bytes=40 << 10)
