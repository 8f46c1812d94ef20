"""Capacity arithmetic, with every expected number worked out by hand in the test."""

from __future__ import annotations

import json

import pytest

from mla_eval.capacity import (
    GIB,
    KvBudget,
    Parallelism,
    blocks_per_request,
    bytes_per_token,
    format_capacity,
    kv_budget_from_memory,
    kv_budget_given,
    max_concurrency,
    num_blocks,
    pool_tokens,
)
from mla_eval.errors import UserError
from mla_eval.formats import get_format
from mla_eval.gpu_presets import GPU_PRESETS, get_gpu
from mla_eval.model_presets import (
    MODEL_PRESETS,
    checkpoint_weights,
    geometry_from_config,
    get_preset,
    load_config,
)

# DeepSeek-V3-shaped config: 61 backbone layers + 1 MTP layer, no indexer.
DSV3 = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "max_position_embeddings": 163840,
}

# A small DSA config: 4 backbone layers (layers 1 and 2 share layer 0's indexer) + 1 MTP layer.
DSA_SHARED = {
    "model_type": "glm_moe_dsa",
    "num_hidden_layers": 4,
    "num_nextn_predict_layers": 1,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "max_position_embeddings": 4096,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "indexer_types": ["full", "shared", "shared", "full"],
}


def geom(cfg: dict):
    return geometry_from_config(cfg, name="test-config", source="test")


# ---------------------------------------------------------------------------------------------
# bytes per token


@pytest.mark.parametrize(
    ("fmt", "record"),
    [("bf16", 1152), ("fp8_ds_mla", 656), ("nvfp4", 432), ("nvfp4_fp8rope", 368), ("nvfp4_fp8_ds_mla", 352),
     ("sglang_fp4_e2m1", 288 + 36),  # SGLang: a 288 B data buffer and a 36 B scale buffer per token
     ("trtllm_nvfp4_dsa", 288 + 36),  # TensorRT-LLM: a 288 B data pool and a 36 B block-scale pool per token
     ("trtllm_nvfp4_dsa_r64", 320 + 40)],  # with the residual rope: 320 B data, 40 B block scales
)
def test_record_bytes_and_whole_model_bytes_without_indexer(fmt, record):
    spec = get_format(fmt)
    assert spec.record_bytes == record
    g = geom(DSV3)
    assert g.cache_layers() == 62  # 61 + 1 MTP
    assert bytes_per_token(spec, g) == record * 62
    assert bytes_per_token(spec, g, include_mtp=False) == record * 61


def test_whole_model_bytes_written_out():
    g = geom(DSV3)
    assert bytes_per_token(get_format("bf16"), g) == 1152 * 61 + 1152 * 1 == 71424
    assert bytes_per_token(get_format("fp8_ds_mla"), g) == 656 * 62 == 40672
    assert bytes_per_token(get_format("nvfp4"), g) == 432 * 62 == 26784
    assert bytes_per_token(get_format("nvfp4_fp8rope"), g) == 368 * 62 == 22816


def test_whole_model_bytes_with_indexer_every_layer():
    # DeepSeek-V3.2 shape: no index_topk_freq, so every layer (and the MTP layer) owns an indexer.
    g = geom({**DSV3, "model_type": "deepseek_v32", "index_topk": 2048, "index_head_dim": 128})
    assert g.indexer.bytes_per_token == 128 + 4 == 132  # fp8 keys + one fp32 scale per 128 values
    assert g.indexed_layers() == 62
    assert bytes_per_token(get_format("fp8_ds_mla"), g) == 62 * 656 + 62 * 132 == 48856
    assert bytes_per_token(get_format("nvfp4_fp8rope"), g) == 62 * 368 + 62 * 132 == 31000
    assert bytes_per_token(get_format("fp8_ds_mla"), g, include_mtp=False) == 61 * (656 + 132) == 48068


def test_shared_indexer_layers_add_no_indexer_cache():
    g = geom(DSA_SHARED)
    assert g.indexer.full_main_layers == 2
    assert g.indexer.shared_main_layers == 2
    # latent: 4 backbone + 1 MTP layers; indexer: 2 full backbone layers + the MTP layer (always full in vLLM)
    assert g.cache_layers() == 5
    assert g.indexed_layers() == 3
    assert bytes_per_token(get_format("fp8_ds_mla"), g) == 5 * 656 + 3 * 132 == 3676
    assert bytes_per_token(get_format("nvfp4"), g) == 5 * 432 + 3 * 132 == 2556
    # without MTP: 4 latent, 2 indexer
    assert bytes_per_token(get_format("fp8_ds_mla"), g, include_mtp=False) == 4 * 656 + 2 * 132 == 2888


def test_mtp_layers_count_as_cache_layers_and_are_optional():
    g = geom({**DSV3, "num_nextn_predict_layers": 3})
    assert g.cache_layers() == 64
    assert g.cache_layers(include_mtp=False) == 61
    no_field = {k: v for k, v in DSV3.items() if k != "num_nextn_predict_layers"}
    assert geom(no_field).cache_layers() == 61  # absent field: no MTP layers


def test_vllm_freq_offset_rule_marks_shared_layers():
    # GLM-5.2 style: index_topk_freq=4, index_skip_topk_offset=3 over 78 layers.
    # vLLM: layer i skips its indexer when max(i - 3 + 1, 0) % 4 != 0 -> full at 0, 1, 2, 6, 10, ..., 74.
    cfg = {**DSA_SHARED, "num_hidden_layers": 78, "index_topk_freq": 4, "index_skip_topk_offset": 3}
    del cfg["indexer_types"]
    g = geom(cfg)
    full = [i for i, kind in enumerate(g.indexer.main_layer_kinds) if kind == "full"]
    assert full == [0, 1, 2] + list(range(6, 78, 4))
    assert g.indexer.full_main_layers == 21
    assert g.indexed_layers() == 21 + 1
    assert bytes_per_token(get_format("fp8_ds_mla"), g) == 79 * 656 + 22 * 132 == 54728


def test_index_topk_pattern_and_default_offset():
    cfg = {**DSA_SHARED}
    del cfg["indexer_types"]
    g = geom({**cfg, "index_topk_pattern": "FSSF"})
    assert g.indexer.main_layer_kinds == ("full", "shared", "shared", "full")
    # freq 2 with vLLM's default offset 2: max(i - 1, 0) % 2 -> layers 0, 1, 3 full, layer 2 shared
    g = geom({**cfg, "index_topk_freq": 2})
    assert g.indexer.main_layer_kinds == ("full", "full", "shared", "full")


def test_indexer_types_disagreeing_with_vllm_rule_is_noted():
    g = geom({**DSA_SHARED, "index_topk_freq": 1})
    assert g.indexer.rule == "indexer_types"
    assert any("vLLM" in note for note in g.notes)


# ---------------------------------------------------------------------------------------------
# pool arithmetic


def test_pool_tokens_for_given_budget_block_size_and_dcp():
    g = geom(DSA_SHARED)  # 3676 B per token with fp8_ds_mla (see above)
    budget = kv_budget_given(1 * GIB, "test")
    row = format_capacity(get_format("fp8_ds_mla"), g, budget, Parallelism(gpus=2, tp=2, dcp=2), block_size=64)
    # block = 64 x 3676 = 235264 B; 1073741824 // 235264 = 4563 blocks (4563 x 235264 = 1073509632)
    assert row.block_bytes == 235264
    assert row.num_blocks == 4563
    # pool = blocks x block size x DCP = 4563 x 64 x 2; requests can use all but vLLM's null block
    assert row.pool_tokens == 584064
    assert row.schedulable_tokens == 4562 * 64 * 2 == 583936
    # model max 4096 < pool: context limited by the model
    assert (row.max_context, row.max_context_limited_by) == (4096, "model")
    # concurrency at 4096: each DCP rank holds cdiv(4096, 2) = 2048 tokens = 32 blocks -> 4563 / 32
    assert row.max_concurrency == pytest.approx(4563 / 32)
    assert row.full_length_requests == 142


def test_budget_from_gpu_memory_weights_and_reserve():
    budget = kv_budget_from_memory(
        total_bytes_per_gpu=80 * GIB,
        gpu_memory_utilization=0.9,
        weights_bytes_total=400 * GIB,
        gpus=8,
        reserve_bytes_per_gpu=4 * GIB,
    )
    # ceil(80 GiB x 0.9) = 72 GiB; weights 400 / 8 = 50 GiB per GPU; 72 - 50 - 4 = 18 GiB
    assert budget.requested_bytes_per_gpu == 72 * GIB
    assert budget.weights_bytes_per_gpu == 50 * GIB
    assert budget.bytes_per_gpu == 18 * GIB == 19327352832
    row = format_capacity(get_format("fp8_ds_mla"), geom(DSV3), budget, Parallelism(gpus=8, tp=8), block_size=64)
    # 19327352832 // (64 x 40672 = 2603008) = 7425 blocks -> 7425 x 64 = 475200 tokens
    assert row.num_blocks == 7425
    assert row.pool_tokens == 475200
    assert row.max_context == 163840
    # concurrency at 163840 tokens: 163840 / 64 = 2560 blocks per request
    assert row.max_concurrency == pytest.approx(7425 / 2560)


def test_block_count_equals_vllm_uniform_spec_double_floor():
    # Without an indexer vLLM's get_num_blocks computes available // page_size // num_layers.
    g = geom(DSV3)
    for available in (1, 10**9, 41 * GIB + 12345, 2**37 - 1):
        for fmt in ("bf16", "fp8_ds_mla", "nvfp4", "nvfp4_fp8rope"):
            page = 64 * get_format(fmt).record_bytes
            assert num_blocks(available, 64, bytes_per_token(get_format(fmt), g)) == available // page // 62


def test_latent_is_not_split_by_tp_but_weights_are():
    g = geom(DSV3)
    spec = get_format("fp8_ds_mla")
    budget = kv_budget_given(10 * GIB, "test")
    tp1 = format_capacity(spec, g, budget, Parallelism(gpus=1, tp=1))
    tp8 = format_capacity(spec, g, budget, Parallelism(gpus=8, tp=8))
    assert tp1.pool_tokens == tp8.pool_tokens  # same per-GPU budget, same pool: the latent is replicated
    dp = format_capacity(spec, g, budget, Parallelism(gpus=16, tp=8))
    assert dp.pool_tokens_all_engines == 2 * dp.pool_tokens
    w1 = kv_budget_from_memory(total_bytes_per_gpu=80 * GIB, gpu_memory_utilization=1.0, weights_bytes_total=64 * GIB,
                               gpus=1, reserve_bytes_per_gpu=0)
    w8 = kv_budget_from_memory(total_bytes_per_gpu=80 * GIB, gpu_memory_utilization=1.0, weights_bytes_total=64 * GIB,
                               gpus=8, reserve_bytes_per_gpu=0)
    assert (w1.bytes_per_gpu, w8.bytes_per_gpu) == (16 * GIB, 72 * GIB)


def test_ratio_vs_fp8_ds_mla():
    g = geom(DSV3)
    budget = kv_budget_given(18 * GIB, "test")
    row = format_capacity(get_format("bf16"), g, budget, Parallelism())
    # bf16: 19327352832 // (64 x 71424) = 4228 blocks; fp8_ds_mla: 7425 blocks (above)
    assert row.num_blocks == 4228
    assert row.ratio_vs_fp8_ds_mla == pytest.approx(4228 / 7425)


def test_helpers():
    assert pool_tokens(10, 64, 4) == 2560
    assert blocks_per_request(163840, 64, 1) == 2560
    assert blocks_per_request(100, 64, 3) == 1  # cdiv(100, 3) = 34 tokens per rank -> 1 block
    assert max_concurrency(100, 6400, 64) == 1.0
    assert num_blocks(64 * 656 - 1, 64, 656) == 0


def test_zero_blocks_when_budget_below_one_block():
    row = format_capacity(get_format("bf16"), geom(DSV3), KvBudget(1000, "test"), Parallelism())
    assert (row.num_blocks, row.pool_tokens, row.schedulable_tokens, row.max_context_limited_by) == (0, 0, 0, "pool")


def test_pool_limited_context_leaves_out_the_null_block():
    # 10 blocks of 64 x 40672 B: pool 640 tokens, one request can hold 9 blocks = 576 tokens
    row = format_capacity(get_format("fp8_ds_mla"), geom(DSV3), KvBudget(10 * 64 * 40672, "test"), Parallelism())
    assert (row.num_blocks, row.pool_tokens) == (10, 640)
    assert (row.max_context, row.max_context_limited_by, row.max_context_model) == (576, "pool", 163840)


# ---------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        ({"model_type": "llama", "num_hidden_layers": 32, "num_key_value_heads": 8}, "not an MLA model"),
        ({"model_type": "deepseek_v3", "kv_lora_rank": 512, "qk_rope_head_dim": 64}, "num_hidden_layers"),
        ({"model_type": "deepseek_v3", "kv_lora_rank": 512, "num_hidden_layers": 61}, "qk_rope_head_dim"),
        ({**DSV3, "kv_lora_rank": 256}, "512 latent + 64 rope"),
        ({**DSV3, "qk_rope_head_dim": 32}, "512 latent + 64 rope"),
        ({**DSV3, "num_hidden_layers": "61"}, "must be an integer"),
        ({**DSV3, "num_hidden_layers": 0}, "must be >= 1"),
        ({**DSV3, "index_topk": 2048}, "index_head_dim"),
        ({**DSV3, "index_topk": 2048, "index_head_dim": 96}, "multiple of 128"),
        ({**DSA_SHARED, "indexer_types": ["full", "shared"]}, "each of the 4 layers"),
        ({**DSA_SHARED, "indexer_types": ["shared", "full", "full", "full"]}, "indexer_types[0]"),
        ({**DSA_SHARED, "indexer_types": None, "index_topk_pattern": "FXSF"}, "'F' and 'S'"),
        ({**DSA_SHARED, "indexer_types": None, "index_topk_freq": 0}, "index_topk_freq must be >= 1"),
    ],
)
def test_bad_configs_raise_one_line_user_errors(cfg, needle):
    with pytest.raises(UserError) as info:
        geom(cfg)
    message = str(info.value)
    assert needle in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "kwargs",
    [
        {"total_bytes_per_gpu": 0},
        {"total_bytes_per_gpu": -GIB},
        {"gpu_memory_utilization": 0.0},
        {"gpu_memory_utilization": 1.5},
        {"weights_bytes_total": 0},
        {"weights_bytes_total": 2000 * GIB},  # weights larger than memory
        {"reserve_bytes_per_gpu": -1},
    ],
)
def test_bad_memory_inputs(kwargs):
    args = dict(total_bytes_per_gpu=80 * GIB, gpu_memory_utilization=0.9, weights_bytes_total=100 * GIB, gpus=8,
                reserve_bytes_per_gpu=GIB)
    args.update(kwargs)
    with pytest.raises(UserError) as info:
        kv_budget_from_memory(**args)
    assert "\n" not in str(info.value)


def test_weights_larger_than_memory_message_names_the_fix():
    with pytest.raises(UserError, match="do not fit.*--kv-memory-gib"):
        kv_budget_from_memory(total_bytes_per_gpu=80 * GIB, gpu_memory_utilization=0.9, weights_bytes_total=700 * GIB,
                              gpus=8, reserve_bytes_per_gpu=0)


@pytest.mark.parametrize("bad", [0, -1])
def test_non_positive_kv_budget(bad):
    with pytest.raises(UserError):
        kv_budget_given(bad, "test")


@pytest.mark.parametrize(("kwargs", "needle"), [({"gpus": 0}, "--gpus"), ({"gpus": 12, "tp": 8}, "multiple of --tp"),
                                                 ({"tp": 8, "gpus": 8, "dcp": 3}, "must divide --tp")])
def test_bad_parallelism(kwargs, needle):
    with pytest.raises(UserError, match=needle):
        Parallelism(**kwargs)


# ---------------------------------------------------------------------------------------------
# config files, checkpoints, presets


def test_load_config_directory_reads_safetensors_index(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DSV3))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 123456789}}))
    g, weights = load_config(tmp_path)
    assert g.cache_layers() == 62
    assert weights.bytes == 123456789
    assert "total_size" in weights.source
    g, weights = load_config(tmp_path / "config.json")  # a file: no weights
    assert weights is None


def test_checkpoint_weights_without_index_sums_shards(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "b.safetensors").write_bytes(b"x" * 28)
    assert checkpoint_weights(tmp_path).bytes == 128
    empty = tmp_path / "empty"
    empty.mkdir()
    assert checkpoint_weights(empty) is None


def test_checkpoint_index_without_total_size_is_an_error(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0}}))
    with pytest.raises(UserError, match="total_size"):
        checkpoint_weights(tmp_path)


def test_nested_text_config_is_read():
    g = geom({"model_type": "kimi_k25", "text_config": {**DSV3, "model_type": "kimi_k2"}})
    assert g.model_type == "kimi_k2"
    assert g.cache_layers() == 62


def test_presets_build_and_cite_sources():
    expected = {
        # name: (cache layers incl. MTP, indexed layers, max positions)
        "deepseek-v3": (62, 0, 163840),
        "deepseek-v3.2": (62, 62, 163840),
        "kimi-k2": (61, 0, 131072),
        "glm-5": (79, 79, 202752),
        "glm-5.2": (79, 22, 1048576),
    }
    assert [p.name for p in MODEL_PRESETS] == [*expected, "deepseek-v4", "deepseek-v4-pro"]  # V4: test_capacity_v4.py
    for preset in MODEL_PRESETS[: len(expected)]:
        g = preset.geometry()
        assert (g.cache_layers(), g.indexed_layers(), g.max_position_embeddings) == expected[preset.name]
        assert preset.sources and all(what and where for what, where in preset.sources)
        assert preset.weights().bytes > 0
    assert get_preset("DeepSeek-V3.2").name == "deepseek-v3.2"
    assert get_preset("deepseek-ai/DeepSeek-V3").name == "deepseek-v3"
    assert get_preset("deepseek-v3").weights("bf16").bytes == 2 * 685_000_000_000
    with pytest.raises(UserError, match="unknown model preset"):
        get_preset("llama-3")


def test_gpu_presets():
    assert get_gpu("h200").memory_bytes == 150_109_880_320  # measured total_memory on an H200
    assert get_gpu("H100").memory_bytes == round(79.19 * GIB)
    assert {g.name for g in GPU_PRESETS} >= {"h100", "h200", "b200", "b300", "rtx-pro-6000"}
    assert all(g.source for g in GPU_PRESETS)
    with pytest.raises(UserError, match="unknown GPU"):
        get_gpu("a100")


def test_capacity_settings_from_recipe_options():
    from mla_eval.capacity import CapacitySettings, evaluate_capacity

    s = CapacitySettings.from_options({"preset": "glm-5", "kv-memory-gib": 40, "formats": ["nvfp4", "fp8_ds_mla"], "tp": 8})
    assert s.kv_memory_gib == 40 and s.formats == "nvfp4,fp8_ds_mla"
    result = evaluate_capacity(s)
    assert [r.name for r in result.rows] == ["nvfp4", "fp8_ds_mla"]
    assert result.to_document()["setup"]["kv_budget_source"] == "--kv-memory-gib"
    with pytest.raises(UserError) as exc:
        CapacitySettings.from_options({"preset": "glm-5", "tpp": 8}, where="recipe r.toml [capacity]")
    assert str(exc.value).startswith("recipe r.toml [capacity]: unknown capacity option(s) tpp; known: ")
