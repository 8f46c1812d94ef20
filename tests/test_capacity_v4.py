"""DeepSeek-V4 capacity: every kind of entry (sliding window, compressed at rate 4 and 128, indexer keys), with the
byte figures worked out by hand here from the records, the compress rates and vLLM's page rules."""

from __future__ import annotations

import json

import pytest

from mla_eval.capacity import CapacitySettings, evaluate_capacity
from mla_eval.cli import main
from mla_eval.errors import UserError
from mla_eval.model_presets import geometry_from_config, get_preset
from mla_eval.result_schemas import validate

GIB = 1 << 30


def test_v4_presets_count_each_kind_of_layer():
    flash, pro = get_preset("deepseek-v4").geometry(), get_preset("deepseek-v4-pro").geometry()
    assert get_preset("DeepSeek-V4-Flash").name == "deepseek-v4"
    kinds = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
    assert [flash.layers_of(k, False) for k in kinds] == [2, 21, 20]
    assert [flash.layers_of(k) for k in kinds] == [3, 21, 20]  # the MTP layer: sliding window only
    assert [pro.layers_of(k, False) for k in kinds] == [0, 30, 31]
    assert (flash.kv_lora_rank, flash.qk_rope_head_dim, flash.sliding_window) == (448, 64, 128)
    assert dict(flash.compress_rates) == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def test_v4_config_fields_are_read_or_refused():
    base = {"model_type": "deepseek_v4", "num_hidden_layers": 3, "layer_types": [
        "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]}
    g = geometry_from_config(base, name="t", source="t")
    assert g.layers_of("compressed_sparse_attention") == 1 and g.mtp_layer_types == ()
    g = geometry_from_config({**base, "layer_types": None, "compress_ratios": [0, 4, 4, 128],
                              "num_nextn_predict_layers": 1, "compress_rates": {"compressed_sparse_attention": 8}},
                             name="t", source="t")
    assert g.layer_types[1:] == ("compressed_sparse_attention",) * 2 and g.mtp_layer_types == ("heavily_compressed_attention",)
    assert g.rate("compressed_sparse_attention") == 8
    with pytest.raises(UserError, match="layer_types or compress_ratios"):
        geometry_from_config({"model_type": "deepseek_v4", "num_hidden_layers": 3}, name="t", source="t")
    with pytest.raises(UserError, match="compress_ratios must give 0, 4 or 128"):
        geometry_from_config({**base, "layer_types": None, "compress_ratios": [0, 5, 4]}, name="t", source="t")
    with pytest.raises(UserError, match="head of 576 values with 64 rotated"):
        geometry_from_config({**base, "head_dim": 576}, name="t", source="t")


def _doc(**kw) -> dict:
    result = evaluate_capacity(CapacitySettings(preset="deepseek-v4", **kw))
    doc = result.to_document()
    validate(doc, "capacity")
    return doc


def test_v4_bytes_of_each_kind_of_entry_by_hand():
    """V4-Flash, the 584 B record, blocks of 256 tokens: a compressed-sparse page holds 64 entries (37376 B, rounded up
    to 65 x 576), a heavily-compressed page 2 (1168 B -> 3 x 576); indexer keys 64 x 132 per compressed-sparse layer;
    the window 3 blocks of 64 tokens (192 x 584 = 112128 -> 195 x 576) in each of the 44 layers."""
    doc = _doc(kv_memory_gib=10.0, formats="dsv4_fp8_ds_mla")
    (row,) = doc["formats"]
    e = row["entries"]
    assert e["bytes_per_block"] == {"compressed_csa": 21 * 65 * 576, "compressed_hca": 20 * 3 * 576,
                                    "indexer": 21 * 64 * 132}
    assert e["sliding_bytes_per_request"] == 44 * 195 * 576
    block = 21 * 65 * 576 + 20 * 3 * 576 + 21 * 64 * 132
    assert row["block_bytes"] == block and row["bytes_per_token"] == -(-block // 256)
    blocks = (10 * GIB - 44 * 195 * 576) // block
    assert row["num_blocks"] == blocks and row["max_context_pool"] == (blocks - 1) * 256
    length = 1048576  # the model's max_position_embeddings
    assert row["max_concurrency"] == pytest.approx(10 * GIB / (44 * 195 * 576 + (length // 256) * block))
    assert doc["setup"]["block_size"] == 256 and doc["model"]["indexer"]["bytes_per_token_per_layer"] == 33
    assert doc["model"]["deepseek_v4"]["layers"] == {"sliding_attention": 3, "compressed_sparse_attention": 21,
                                                     "heavily_compressed_attention": 20}


def test_v4_nvfp4_configuration_keeps_an_mxfp8_window():
    doc = _doc(kv_memory_gib=10.0, formats="dsv41_nvfp4,dsv4_fp8_ds_mla")
    nv = doc["formats"][0]["entries"]
    assert nv["records"]["sliding"] == "dsv41_mxfp8" and nv["records"]["compressed"] == "dsv41_nvfp4"
    assert nv["bytes_per_block"]["compressed_csa"] == 21 * 64 * 288  # 18432 B per page: a multiple of 512
    assert nv["sliding_bytes_per_request"] == 44 * 192 * 528
    assert doc["formats"][1]["ratio_vs_fp8_ds_mla"] == 1.0 and doc["formats"][0]["ratio_vs_fp8_ds_mla"] > 1.5


def test_v4_capacity_refusals_are_one_line():
    for kw, match in (({"formats": "fp8_ds_mla"}, "DeepSeek-V4 caches other records"),
                      ({"block_size": 64}, "multiple of 128 tokens"),
                      ({"formats": "dsv4_fp8_ds_mla", "plan": "x.json"}, "--plan holds a per-layer plan")):
        with pytest.raises(UserError, match=match):
            evaluate_capacity(CapacitySettings(preset="deepseek-v4", kv_memory_gib=10.0,
                                               **{k: (__import__("pathlib").Path(v) if k == "plan" else v)
                                                  for k, v in kw.items()}))


def test_v4_capacity_command_prints_the_breakdown(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["capacity", "--preset", "deepseek-v4", "--kv-memory-gib", "10"]) == 0
    out = capsys.readouterr().out
    assert "DeepSeek-V4 entries" in out and "dsv41_nvfp4" in out and "window" in out
    assert main(["capacity", "--preset", "deepseek-v4-pro", "--json", "--kv-memory-gib", "10"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["deepseek_v4"]["layers"]["heavily_compressed_attention"] == 31


def test_v4_per_token_bytes_agree_with_the_technical_reports_ratios():
    """The DeepSeek-V4 report (Figure 1, as huggingface/blog PR 3363 quotes it): at 1M tokens V4-Pro needs 10 % and
    V4-Flash 7 % of DeepSeek-V3.2's KV cache. With the 584 B record, the lightning indexer's keys in MXFP4 (68 B, vLLM
    PR 48993; the report runs the indexer in FP4) and V3.2 at fp8_ds_mla + its FP8 indexer, our bytes give 10.5 % and
    7.3 %: the published ratios to their rounding. With FP8 indexer keys (132 B) they would be 11.5 % and 8.0 %."""
    import dataclasses

    from mla_eval.capacity import bytes_per_token, v4_entry_bytes
    from mla_eval.formats import get_format
    from mla_eval.formats.v4 import v4_config

    v32 = bytes_per_token(get_format("fp8_ds_mla"), get_preset("deepseek-v3.2").geometry())
    length = 1 << 20

    def ratio(preset: str, indexer_bytes: int) -> float:
        config = dataclasses.replace(v4_config("dsv4_fp8_ds_mla"), indexer_bytes=indexer_bytes)
        e = v4_entry_bytes(config, get_preset(preset).geometry(), 256)
        return (sum(e["bytes_per_block"].values()) * length / 256 + e["sliding_bytes_per_request"]) / (v32 * length)

    assert round(100 * ratio("deepseek-v4-pro", 68)) == 10 and round(100 * ratio("deepseek-v4", 68)) == 7
    assert round(100 * ratio("deepseek-v4-pro", 132)) == 11 and round(100 * ratio("deepseek-v4", 132)) == 8


def test_a_v4_record_for_an_mla_model_is_refused():
    with pytest.raises(UserError, match="'dsv4_fp8_ds_mla' is a DeepSeek-V4 record; deepseek-v3 caches 512 \\+ 64"):
        evaluate_capacity(CapacitySettings(preset="deepseek-v3", kv_memory_gib=10.0, formats="dsv4_fp8_ds_mla"))
