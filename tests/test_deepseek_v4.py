"""DeepSeek-V4 as a model: its three kinds of cache entries through our records, on the CPU.

The session is the cache argument of transformers' own V4 attention (mla_eval.model.deepseek_v4): with the bf16
record on a bf16 model it must change nothing (the stock forward, bit for bit); each kind of entry must go through
its own record (a configuration that differs only in the compressed record changes nothing before the first
compressed entry exists); and the command runs a random model of the published geometry end to end."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from mla_eval.cli import main
from mla_eval.errors import UserError
from mla_eval.evals.variants import Variant
from mla_eval.formats import get_format
from mla_eval.formats.v4 import v4_config
from mla_eval.model.deepseek_v4 import V4Adapter, V4Decode, V4Session, V4Stack, check_variant, window_forward
from mla_eval.model.executor import WindowForward

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


def _tiny(dtype=torch.bfloat16, layer_types=LAYER_TYPES, rate_hca: int = 8, index_topk: int = 3):
    """A small DeepSeek-V4 (the 448 + 64 head kept: the records' geometry), small everything else."""
    import transformers

    config = transformers.DeepseekV4Config(
        vocab_size=64, hidden_size=64, num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=1,
        head_dim=512, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8, index_n_heads=2, index_head_dim=128,
        index_topk=index_topk, layer_types=list(layer_types),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": rate_hca},
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        mlp_layer_types=["hash_moe"] + ["moe"] * (len(layer_types) - 1), max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(config).to(dtype).eval()
    with torch.no_grad():  # transformers initialises these to 0 / 1: random values make the test mean something
        for module in model.modules():
            for name in ("position_bias", "sinks"):
                p = getattr(module, name, None)
                if isinstance(p, torch.nn.Parameter):
                    p.normal_(0.0, 0.5)

    class _Lm:  # the LoadedModel surface the stack reads
        pass

    lm = _Lm()
    lm.model, lm.adapter, lm.device = model, V4Adapter(model), torch.device("cpu")
    return lm


def _hidden(lm, name: str, ids: torch.Tensor) -> tuple[torch.Tensor, V4Session]:
    fwd = window_forward(lm, Variant(get_format("bf16") if name == "bf16" else _spec(name)), ids, 0)
    out = V4Stack(lm).run_resident(WindowForward(fwd.ids, fwd.session, fwd.chunk, slice(0, ids.shape[1])))
    return out, fwd.session


def _spec(name: str):
    from mla_eval.formats.registry import get_format as lookup

    return lookup(name) if name != "nvfp4" else get_format("nvfp4")


def test_the_bf16_record_on_a_bf16_model_is_the_stock_forward_bit_for_bit():
    lm = _tiny()
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    ours, session = _hidden(lm, "bf16", ids)
    with torch.no_grad():
        stock = lm.model.model(input_ids=ids).last_hidden_state
    assert torch.equal(ours.view_as(stock), stock)
    # every kind of entry went through the session: 24 sliding heads per layer, 6 compressed-sparse, 3 heavily
    assert session.entries == {"sliding": 3 * 2 * 24, "compressed_csa": 2 * 6, "compressed_hca": 2 * 3, "indexer": 2 * 6}


def test_each_kind_of_entry_goes_through_its_own_record():
    """dsv41_nvfp4 and dsv41_mxfp8 share the sliding-window record and differ in the compressed one: the same forward
    before any compressed entry exists (3 tokens), different once they do; and quantising changes the output."""
    lm = _tiny(torch.float32)
    short = torch.randint(0, 64, (1, 3), generator=torch.Generator().manual_seed(2))
    assert torch.equal(_hidden(lm, "dsv41_nvfp4", short)[0], _hidden(lm, "dsv41_mxfp8", short)[0])
    ids = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(2))
    ref = _hidden(lm, "bf16", ids)[0]
    nv, mx = _hidden(lm, "dsv41_nvfp4", ids)[0], _hidden(lm, "dsv41_mxfp8", ids)[0]
    assert not torch.equal(nv, mx)
    assert (nv - ref).abs().max() > (mx - ref).abs().max() > 0  # 4 bits of the compressed entries cost more than 8
    fork = _hidden(lm, "nvfp4", ids)[0]
    assert not torch.equal(fork, ref)


def test_rows_that_are_not_v4_configurations_are_refused():
    assert check_variant(Variant(get_format("dsv4_fp8_ds_mla"))).name == "dsv4_fp8_ds_mla"
    assert check_variant(Variant(get_format("nvfp4"))) is v4_config("nvfp4")
    with pytest.raises(UserError, match="512 \\+ 64 MLA record; DeepSeek-V4 caches 448 \\+ 64"):
        check_variant(Variant(get_format("fp8_ds_mla")))
    with pytest.raises(UserError, match="no per-layer outer scale"):
        check_variant(Variant(get_format("nvfp4"), outer=True))


def test_random_v4_models_have_the_published_attention_geometry():
    from mla_eval.model.random_models import parse_random_spec, random_config

    config, cls = random_config(parse_random_spec("random:deepseek-v4:layers=5"), 1000)
    assert cls.__name__ == "DeepseekV4ForCausalLM"
    assert (config.hidden_size, config.num_attention_heads, config.head_dim, config.q_lora_rank) == (4096, 64, 512, 1024)
    assert (config.o_groups, config.o_lora_rank, config.sliding_window, config.index_topk) == (8, 1024, 128, 512)
    assert config.layer_types == ["sliding_attention"] * 2 + ["compressed_sparse_attention",
                                                             "heavily_compressed_attention", "compressed_sparse_attention"]
    assert config.qk_rope_head_dim == 64 and config.mlp_layer_types[:3] == ["hash_moe"] * 3
    with pytest.raises(UserError, match="deepseek-v4-pro: the preset does not carry"):
        random_config(parse_random_spec("random:deepseek-v4-pro"), 1000)


def test_kld_command_runs_a_random_v4_model_on_the_cpu(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    out = tmp_path / "kld.json"
    args = ["kld", "--model", "random:deepseek-v4:layers=3:hidden=64", "--text", str(text), "--ctx", "40",
            "--max-tokens", "44", "--device", "cpu", "--out", str(out)]
    assert main(args) == 0
    doc = json.loads(out.read_text())
    assert set(doc["formats"]) == {"dsv4_fp8_ds_mla", "dsv41_mxfp8", "dsv41_nvfp4", "nvfp4"}
    assert all(row["kld_mean"] >= 0 for row in doc["formats"].values())
    assert "DeepSeek-V4" in " ".join(doc["notes"])
    capsys.readouterr()
    assert main(args[:-2] + ["--formats", "fp8_ds_mla", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "DeepSeek-V4 caches 448 + 64" in err and err.count("\n") == 1


def test_v4_heads_are_served_by_the_reference_and_said_so():
    from mla_eval.attention import dispatch

    session = V4Session(v4_config("dsv4_fp8_ds_mla"), ["sliding_attention"], {})
    heads = torch.randn(1, 1, 5, 512)
    with dispatch.use_backend("auto") as log:
        back = session.update(heads, heads, 0)[0]
    assert back.shape == heads.shape and not torch.equal(back, heads)
    assert log.paths == {"write dsv4_fp8_ds_mla on cpu": "reference (DeepSeek-V4 runs the model's own attention over "
                         "the decoded heads (the kernels serve the 512 + 64 MLA attention))"}
    with dispatch.use_backend("kernel"), pytest.raises(UserError, match="--backend kernel, but the CuTe kernels cannot"):
        session.update(heads, heads, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_bf16_record_is_the_stock_forward_and_kld_runs_the_published_geometry(tmp_path, capsys):
    lm = _tiny()
    lm.model.cuda()
    lm.device = torch.device("cuda")
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1)).cuda()
    ours, _ = _hidden(lm, "bf16", ids)
    with torch.no_grad():
        stock = lm.model.model(input_ids=ids).last_hidden_state
    assert torch.equal(ours.view_as(stock), stock)
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200, encoding="utf-8")
    out = tmp_path / "kld.json"
    assert main(["kld", "--model", "random:deepseek-v4:layers=4", "--text", str(text), "--ctx", "512",
                 "--max-tokens", "1100", "--device", "cuda", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["formats"]) == {"dsv4_fp8_ds_mla", "dsv41_mxfp8", "dsv41_nvfp4", "nvfp4"}
    paths = doc["environment"]["attention"]["paths"]
    assert paths and all(p.startswith("reference (DeepSeek-V4") for p in paths.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_decode_is_the_stock_decode_and_needle_runs_the_published_geometry(tmp_path):
    lm = _tiny()
    lm.model.cuda()
    lm.device = torch.device("cuda")
    ids = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(3)).cuda()
    ours, _ = _decode(lm, "bf16", ids, 13)
    assert torch.equal(ours, _stock_decode(lm, ids, 13))
    haystack = tmp_path / "h.txt"
    haystack.write_text("Some prose to hide a needle in. " * 400, encoding="utf-8")
    out = tmp_path / "n.json"
    assert main(["needle", "--model", "random:deepseek-v4:layers=4", "--device", "cuda", "--haystack", str(haystack),
                 "--lengths", "1024", "--depths", "0,50,100", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert list(doc["formats"]) == ["bf16", "dsv4_fp8_ds_mla", "dsv41_mxfp8", "dsv41_nvfp4", "nvfp4"]
    assert len(doc["records"]) == 15 and all(r["answer_tokens"] > 0 for r in doc["records"])
    paths = doc["environment"]["attention"]["paths"]
    assert paths and all(p.startswith("reference (DeepSeek-V4") for p in paths.values())


def _stock_decode(lm, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """transformers' own incremental decode (its DynamicCache of V4 layers), as `_decode` runs it."""
    from transformers import DynamicCache

    kw = {"cache": DynamicCache(config=lm.model.config), "use_cache": True, "logits_to_keep": 1}
    if "cache" not in inspect.signature(type(lm.model).forward).parameters:  # transformers 5.17
        kw["past_key_values"] = kw.pop("cache")
    b = ids.shape[0]
    with torch.no_grad():
        out = [lm.model(input_ids=ids[:, :prompt], **kw).logits[:, -1]]
        out += [lm.model(input_ids=ids[:, t : t + 1], position_ids=torch.full((b, 1), t, device=ids.device), **kw)
                .logits[:, -1] for t in range(prompt, ids.shape[1] - 1)]
    return torch.stack(out, 1)


def _decode(lm, name: str, ids: torch.Tensor, prompt: int) -> tuple[torch.Tensor, V4Decode]:
    """Logits [b, t - prompt, vocab] of positions prompt-1 .. t-2: a prefill of `prompt` tokens, then one step per
    token of `ids` (teacher-forced), through `name`'s configuration."""
    steps = V4Decode(lm, v4_config(name))
    out = [steps.prefill(ids[:, :prompt])] + [steps(ids[:, t], t) for t in range(prompt, ids.shape[1] - 1)]
    return torch.stack(out, 1), steps


def test_decode_with_the_bf16_record_on_a_bf16_model_is_the_stock_incremental_decode_bit_for_bit():
    lm = _tiny()
    ids = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(3))
    ours, steps = _decode(lm, "bf16", ids, 13)
    assert torch.equal(ours, _stock_decode(lm, ids, 13))
    # every head was written once: 29 sliding heads per layer and sequence, 7 closed windows of 4, 3 of 8
    assert steps.session.entries == {"sliding": 3 * 2 * 29, "compressed_csa": 2 * 7, "compressed_hca": 2 * 3,
                                     "indexer": 2 * 7}


@pytest.mark.parametrize("name", ["dsv4_fp8_ds_mla", "dsv41_nvfp4", "nvfp4"])
def test_decode_through_a_configuration_is_its_whole_window_forward(name):
    """Prefill 13 tokens then decode 16 (the sliding window of 8 and windows of 4 and 8 closing on both sides of the
    prefill): the logits of each position are the whole-window forward's through the same records. index_topk covers
    every entry: the indexer's ReLU scores tie at 0, and transformers breaks ties differently for different numbers of
    entries (its own incremental and whole forwards differ there too)."""
    lm = _tiny(torch.float32, index_topk=64)
    ids = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(3))
    whole = lm.model.lm_head(_hidden(lm, name, ids)[0].view(2, 30, -1))[:, 12:29]
    ours, _ = _decode(lm, name, ids, 13)
    assert (ours - whole).abs().max() < 1e-4
    bf16 = lm.model.lm_head(_hidden(lm, "bf16", ids)[0].view(2, 30, -1))[:, 12:29]
    assert (ours - bf16).abs().max() > 1e-3  # the records changed what decode read: the tolerance can tell


def test_a_cache_without_v4_compressed_layers_is_refused_in_one_line():
    from transformers.cache_utils import DynamicSlidingWindowLayer

    class _Cache:
        layers = [DynamicSlidingWindowLayer(sliding_window=8)]

    session = V4Session(v4_config("bf16"), ["compressed_sparse_attention"], {"compressed_sparse_attention": 4})
    with pytest.raises(UserError, match="layer 0 \\(compressed_sparse_attention\\) a DynamicSlidingWindowLayer"):
        session.recording(_Cache())


@pytest.mark.slow
def test_needle_command_runs_a_random_v4_model_on_the_cpu(tmp_path):
    haystack = tmp_path / "h.txt"
    haystack.write_text("Some prose to hide a needle in. " * 50, encoding="utf-8")
    out = tmp_path / "n.json"
    assert main(["needle", "--model", "random:deepseek-v4:layers=3:hidden=64", "--device", "cpu", "--haystack",
                 str(haystack), "--lengths", "96", "--depths", "50", "--formats", "dsv41_nvfp4", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert list(doc["formats"]) == ["bf16", "dsv41_nvfp4"]
    assert all(row["decode_steps"].startswith("eager (DeepSeek-V4") for row in doc["formats"].values())
    assert "DeepSeek-V4" in doc["settings"]["deepseek_v4"] and len(doc["records"]) == 2
    assert all(r["answer_tokens"] > 0 for r in doc["records"])


def test_needle_on_a_v4_model_defaults_to_its_configurations():
    from mla_eval.evals.needle_evaluation import NeedleSettings, v4_rows

    lm = _tiny()
    st = NeedleSettings(model="random:deepseek-v4")
    rows, note = v4_rows(st, lm, st.variants())
    assert [v.name for v in rows] == ["bf16", "dsv4_fp8_ds_mla", "dsv41_mxfp8", "dsv41_nvfp4", "nvfp4"]
    assert note.startswith("DeepSeek-V4")


@pytest.mark.parametrize("extra, message", [
    (["--formats", "fp8_ds_mla"], "DeepSeek-V4 caches 448 + 64"),
    (["--prefill", "absorbed"], "drop --semantics engine:*, --math fp8-* and --prefill absorbed"),
    (["--latent-profile", "glm-5.2"], "no DeepSeek-V4 profile is published"),
])
def test_needle_refuses_what_v4_cannot_run_in_one_line(capsys, tmp_path, extra, message):
    haystack = tmp_path / "h.txt"
    haystack.write_text("Some prose to hide a needle in. " * 50, encoding="utf-8")
    assert main(["needle", "--model", "random:deepseek-v4:layers=1:hidden=64", "--device", "cpu", "--haystack",
                 str(haystack), "--lengths", "96", "--depths", "50", *extra, "--out", str(tmp_path / "n.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_plan_on_a_v4_model_is_one_line(capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    assert main(["plan", "--model", "random:deepseek-v4:layers=1:hidden=64", "--device", "cpu", "--text", str(text),
                 "--ctx", "40", "--max-tokens", "44", "--budget-bytes-per-token", "500", "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "mla-eval plan does not run on DeepSeek-V4: a V4 session takes one cache configuration" in err
    assert err.count("\n") == 1


def test_an_mla_model_refuses_v4_records():
    from mla_eval.model.deepseek_v4 import check_mla_rows

    class _Mla:
        class adapter:  # noqa: N801 - a stand-in with MlaAdapter's flag
            is_v4 = False

    check_mla_rows(_Mla, [Variant(get_format("nvfp4"))])
    with pytest.raises(UserError, match="'dsv41_nvfp4' is a DeepSeek-V4 record \\(448 \\+ 64\\)"):
        check_mla_rows(_Mla, [Variant(get_format("dsv41_nvfp4"))])
