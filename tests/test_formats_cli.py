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
