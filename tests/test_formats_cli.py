"""`mla-eval formats`: table, JSON and errors."""

import json

from mla_eval.cli import main


def test_json_lists_every_format_with_ratios(capsys):
    assert main(["formats", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in doc["formats"]}
    assert rows["nvfp4"]["bytes_per_token_per_layer"] == 432
    assert rows["nvfp4"]["tokens_per_byte_vs_bf16"] == round(1152 / 432, 4)
    assert rows["nvfp4_fp8rope"]["tokens_per_byte_vs_fp8_ds_mla"] == round(656 / 368, 4)
    assert rows["fp8_ds_mla"]["bits_per_value"] == round(656 * 8 / 576, 4)
    assert [f["offset"] for f in rows["nvfp4"]["fields"]] == [0, 256, 288, 304]


def test_table_and_subset(capsys):
    assert main(["formats", "--formats", "nvfp4,mxfp4"]) == 0
    out = capsys.readouterr().out
    assert "nvfp4" in out and "mxfp4" in out and "fp8_ds_mla_pow2" not in out
    assert "[304,432) rope bf16x64" in out


def test_unknown_format_is_one_line_exit_2(capsys):
    assert main(["formats", "--formats", "nvfp9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: unknown cache format 'nvfp9'")
    assert "Traceback" not in err


def test_json_and_table_name_the_defining_engine(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # one row per format, unwrapped
    assert main(["formats", "--json", "--formats", "fp8_ds_mla,nvfp4_fp8rope_st"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["formats"]}
    eng = rows["fp8_ds_mla"]["engine"]
    assert eng["flag"] == "--kv-cache-dtype fp8_ds_mla" and eng["repository"] == "vllm-project/vllm"
    assert eng["commit"] == "37cb21c1695d11baba8e369b071d2f44c1561c8f"
    assert rows["fp8_ds_mla"]["arithmetic"]["latent_apply"] == "x / s"
    assert rows["nvfp4_fp8rope_st"]["engine"] is None
    assert main(["formats", "--formats", "fp8_ds_mla_pow2", "--no-layout"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-ai/FlashMLA@520fec6a7fd9" in out and "V32_FP8Sparse" in out


def test_trtllm_nvfp4_dsa_row_shows_engine_pools_and_global_scale(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["formats", "--json", "--formats", "trtllm:nvfp4"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["formats"]
    assert row["name"] == "trtllm_nvfp4_dsa" and row["bytes_per_token_per_layer"] == 324
    assert row["engine"]["repository"] == "NVIDIA/TensorRT-LLM" and row["aliases"] == ["trtllm:nvfp4"]
    assert [(b["name"], b["start"], b["end"]) for b in row["buffers"]] == [("kv_pool", 0, 288), ("block_scale_pool", 288, 324)]
    assert row["global_scale"]["amax"] == 100.0 and row["reader_e4m3"] is True
    assert [(f["name"], f["offset"]) for f in row["fields"]] == [("latent", 0), ("rope", 256), ("latent_scale", 288),
                                                                 ("rope_scale", 320)]
    assert main(["formats", "--formats", "trtllm_nvfp4_dsa,sglang_fp4_e2m1"]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA/TensorRT-LLM@727f68b662aa" in out and "global S=26.88" in out and "read as e4m3" in out


def test_engine_names_per_engine_and_version_and_known_records(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["formats", "--json", "--formats", "nvfp4_fp8_ds_mla,llamacpp_q4_0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in doc["formats"]}
    (vllm,) = rows["nvfp4_fp8_ds_mla"]["engine_names"]
    assert (vllm["engine"], vllm["name"], vllm["record_bytes"]) == ("vLLM", "nvfp4_ds_mla", 352)
    assert "002f10e0cfa1" in vllm["version"]
    assert rows["llamacpp_q4_0"]["engine_names"][0]["name"] == "q4_0"
    known = {(k["name"], k["record_bytes"]) for k in doc["known_not_built_in"]}
    assert {("nvfp4_ds_mla", 304), ("kvarn_mla_k5_g64", 482)} <= known
    assert main(["formats", "--no-layout"]) == 0
    out = capsys.readouterr().out
    assert "'nvfp4_ds_mla' alone is ambiguous (352 B, 432 B, 368 B, 368 B, 304 B, 288 B, 432 B)" in out
    assert main(["formats", "--help"]) == 0
    helptext = " ".join(capsys.readouterr().out.split())
    assert "Known, not built in: GLM-5.3-Flash's rope-less records" in helptext and "cold-page compression" in helptext


def test_formats_table_fits_80_columns_without_cut_headers():
    """At 80 columns the bits and x fp8 columns give way (said below the table); no header or cell is cut short."""
    import subprocess
    import sys

    env = {**__import__("os").environ, "COLUMNS": "80"}
    out = subprocess.run([sys.executable, "-m", "mla_eval", "formats", "--no-layout"], capture_output=True, text=True,
                         env=env, check=True).stdout
    table = out.split("Not shown below")[0]
    assert "…" not in table and max(len(line) for line in table.splitlines()) <= 80
    assert "latent" in table and "scales" in table and "Not shown below 110 columns: bits, x fp8" in out


def test_deepseek_v4_records_are_listed_apart_from_the_mla_formats(capsys, monkeypatch):
    """DeepSeek-V4's 448 + 64 records sit in their own section (never in the MLA list or a default --formats), with
    what each engine configuration writes to each kind of entry; --formats selects one by name."""
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["formats", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert all(r["geometry"] == "mla" for r in doc["formats"])
    v4 = doc["deepseek_v4"]
    assert [f["name"] for f in v4["formats"]] == ["dsv4_bf16", "dsv4_fp8_ds_mla", "dsv41_mxfp8", "dsv41_nvfp4"]
    assert all(f["geometry"] == "deepseek_v4" for f in v4["formats"])
    by_name = {c["name"]: c for c in v4["configurations"]}
    assert (by_name["dsv41_nvfp4"]["bytes"]["sliding"], by_name["dsv41_nvfp4"]["bytes"]["compressed"]) == (528, 288)
    assert by_name["nvfp4"]["binding"] == "whole_head" and by_name["nvfp4"]["bytes"]["sliding"] == 432
    assert main(["formats", "--json", "--formats", "dsv4_fp8_ds_mla"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["formats"]
    assert (row["bytes_per_token_per_layer"], row["tokens_per_byte_vs_bf16"]) == (584, round(1024 / 584, 4))
