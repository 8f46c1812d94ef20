"""`mla-eval capacity` end to end through `mla_eval.cli.main`: output, JSON, plot and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mla_eval.cli import main
from mla_eval.formats import format_names

GIB = 1 << 30
REPO = Path(__file__).resolve().parents[1]

DSA_SHARED = {
    "model_type": "glm_moe_dsa",
    "num_hidden_layers": 4,
    "num_nextn_predict_layers": 1,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "max_position_embeddings": 4096,
    "index_topk": 2048,
    "index_head_dim": 128,
    "indexer_types": ["full", "shared", "shared", "full"],
}


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["capacity", *args])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *args: str) -> dict:
    code, out, err = run(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)  # exactly one JSON document on stdout


def write_config(tmp_path: Path, cfg: dict, total_size: int | None = None) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if total_size is not None:
        (tmp_path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total_size}, "weight_map": {}})
        )
    return tmp_path


def test_json_has_inputs_and_a_row_per_format(capsys):
    doc = run_json(capsys, "--preset", "deepseek-v3.2")
    assert doc["schema"] == "mla-eval.capacity/1"
    assert [row["name"] for row in doc["formats"]] == format_names()
    assert doc["model"]["cache_layers"] == 62
    assert doc["model"]["indexer"]["indexed_layers"] == 62
    assert doc["setup"]["gpu"].startswith("H200")
    assert doc["setup"]["tp"] == 8
    fp8 = next(r for r in doc["formats"] if r["name"] == "fp8_ds_mla")
    assert fp8["bytes_per_token"] == 62 * 656 + 62 * 132
    assert fp8["ratio_vs_fp8_ds_mla"] == 1.0
    # the budget: ceil(150109880320 x 0.9) - 685e9 / 8 - 5 GiB
    assert doc["setup"]["kv_budget_bytes_per_gpu"] == 135098892288 - 85625000000 - 5 * GIB


def test_kv_budget_in_bytes_gives_vllm_block_count(capsys):
    doc = run_json(capsys, "--preset", "deepseek-v3", "--kv-cache-memory-bytes", str(18 * GIB), "--formats", "fp8_ds_mla,bf16")
    rows = {r["name"]: r for r in doc["formats"]}
    assert list(rows) == ["fp8_ds_mla", "bf16"]  # --formats narrows and keeps the order given
    # 19327352832 // (64 x 62 x 656) = 7425 blocks; bf16: // (64 x 62 x 1152) = 4228
    assert rows["fp8_ds_mla"]["num_blocks"] == 7425
    assert rows["fp8_ds_mla"]["pool_tokens"] == 7425 * 64
    assert rows["bf16"]["num_blocks"] == 4228
    assert doc["setup"]["kv_budget_source"] == "--kv-cache-memory-bytes"


def test_dcp_and_block_size_and_max_model_len(capsys, tmp_path):
    config = write_config(tmp_path, DSA_SHARED)
    doc = run_json(
        capsys, "--config", str(config), "--kv-memory-gib", "1", "--tp", "2", "--dcp", "2", "--block-size", "64",
        "--max-model-len", "4096", "-f", "fp8_ds_mla",
    )
    (row,) = doc["formats"]
    # 5 x 656 + 3 x 132 = 3676 B/token; 1 GiB // (64 x 3676) = 4563 blocks; x 64 x DCP 2
    assert row["bytes_per_token"] == 3676
    assert row["num_blocks"] == 4563
    assert row["pool_tokens"] == 584064
    assert row["max_concurrency"] == pytest.approx(4563 / 32)
    assert doc["model"]["indexer"]["shared_main_layers"] == 2


def test_config_directory_takes_weights_from_safetensors_index(capsys, tmp_path):
    config = write_config(tmp_path, DSA_SHARED, total_size=64 * GIB)
    doc = run_json(capsys, "--config", str(config), "--gpu-mem-gib", "80", "--tp", "8", "--reserve-gib", "4",
                   "-f", "nvfp4")
    setup = doc["setup"]
    assert setup["weights_bytes_total"] == 64 * GIB
    assert "total_size" in setup["weights_source"]
    # ceil(80 GiB x 0.9) - 64/8 GiB - 4 GiB = 60 GiB
    assert setup["kv_budget_bytes_per_gpu"] == 60 * GIB
    # nvfp4: 5 x 432 + 3 x 132 = 2556 B/token; 60 GiB // (64 x 2556)
    assert doc["formats"][0]["num_blocks"] == 60 * GIB // (64 * 2556) == 393831


def test_no_mtp_drops_mtp_layers(capsys):
    doc = run_json(capsys, "--preset", "deepseek-v3", "--no-mtp", "--kv-memory-gib", "10", "-f", "fp8_ds_mla")
    assert doc["model"]["include_mtp"] is False
    assert doc["model"]["cache_layers"] == 61
    assert doc["formats"][0]["bytes_per_token"] == 61 * 656


def test_table_output(capsys):
    code, out, err = run(capsys, "--preset", "glm-5.2", "--gpu", "b200")
    assert code == 0, err
    for name in format_names():
        assert name in out
    assert "21 full, 57 shared, 1 MTP" in out
    assert "B200" in out


def test_plot_writes_png(capsys, tmp_path):
    png = tmp_path / "capacity.png"
    code, out, err = run(capsys, "--preset", "kimi-k2", "--gpus", "16", "--plot", str(png), "--json")
    assert code == 0, err
    json.loads(out)  # --plot keeps stdout a single JSON document
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_help_and_list_presets(capsys):
    assert main(["capacity", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--gpu-mem-gib", "--kv-memory-gib", "--dcp", "--mtp", "--plot", "--json", "GiB"):
        assert option in out
    doc = run_json(capsys, "--list-presets")
    assert {m["name"] for m in doc["models"]} == {"deepseek-v3", "deepseek-v3.2", "kimi-k2", "glm-5", "glm-5.2",
                                                  "deepseek-v4", "deepseek-v4-pro"}
    assert all(m["sources"] for m in doc["models"])
    assert {g["name"] for g in doc["gpus"]} >= {"h100", "h200", "b200", "rtx-pro-6000"}


# ---------------------------------------------------------------------------------------------
# bad input: exit code 2, one line on stderr, no traceback


def _bad(tmp_path: Path, name: str, cfg) -> str:
    path = tmp_path / name
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return str(path)


BAD_CASES = {
    "non-MLA config": (lambda t: ["--config", _bad(t, "llama.json", {"model_type": "llama", "num_hidden_layers": 32})],
                       "not an MLA model"),
    "missing fields": (lambda t: ["--config", _bad(t, "partial.json", {"model_type": "deepseek_v3", "kv_lora_rank": 512})],
                       "missing required field"),
    "other MLA widths": (lambda t: ["--config", _bad(t, "v2lite.json", {"kv_lora_rank": 256, "qk_rope_head_dim": 64,
                                                                         "num_hidden_layers": 27})], "512 latent + 64 rope"),
    "invalid JSON": (lambda t: ["--config", _bad(t, "broken.json", "{not json")], "not valid JSON"),
    "missing config file": (lambda t: ["--config", str(t / "nope.json")], "does not exist"),
    "zero GPU memory": (lambda t: ["--preset", "deepseek-v3", "--gpu-mem-gib", "0"], "--gpu-mem-gib must be positive"),
    "negative GPU memory": (lambda t: ["--preset", "deepseek-v3", "--gpu-mem-gib", "-80"], "--gpu-mem-gib must be positive"),
    "zero KV memory": (lambda t: ["--preset", "deepseek-v3", "--kv-memory-gib", "0"], "--kv-memory-gib must be positive"),
    "negative KV bytes": (lambda t: ["--preset", "deepseek-v3", "--kv-cache-memory-bytes", "-5"], "must be positive"),
    "negative weights": (lambda t: ["--preset", "deepseek-v3", "--weights-gib", "-1"], "--weights-gib must be positive"),
    "weights larger than memory": (lambda t: ["--preset", "deepseek-v3", "--gpu", "h100", "--tp", "1"], "do not fit"),
    "unknown format": (lambda t: ["--preset", "deepseek-v3", "--formats", "fp8_ds_mla,int3"], "unknown cache format"),
    "unknown preset": (lambda t: ["--preset", "llama-3-70b"], "unknown model preset"),
    "unknown GPU": (lambda t: ["--preset", "deepseek-v3", "--gpu", "a100"], "unknown GPU"),
    "zero tp names --tp": (lambda t: ["--preset", "deepseek-v3", "--tp", "0"], "--tp must be >= 1, got 0"),
    "infinite KV memory": (lambda t: ["--preset", "deepseek-v3", "--kv-memory-gib", "inf"], "--kv-memory-gib must be positive"),
    "plot with another suffix": (lambda t: ["--preset", "deepseek-v3", "--plot", str(t / "p.pdf")], "plots are PNG"),
    "plot over a user's file": (lambda t: ["--preset", "deepseek-v3", "--plot", _bad(t, "mine.png", "my picture")],
                                "not a plot mla-eval wrote"),
    "preset and config": (lambda t: ["--preset", "deepseek-v3", "--config", "x.json"], "not both"),
    "config without weights": (lambda t: ["--config", _bad(t, "v3.json", {"kv_lora_rank": 512, "qk_rope_head_dim": 64,
                                                                           "num_hidden_layers": 61})], "--weights-gib"),
    "dcp not dividing tp": (lambda t: ["--preset", "deepseek-v3", "--dcp", "3"], "must divide --tp"),
    "bad utilization": (lambda t: ["--preset", "deepseek-v3", "--gpu-memory-utilization", "1.2"], "(0, 1]"),
    "bad weights dtype": (lambda t: ["--preset", "deepseek-v3", "--weights-dtype", "int2"], "unknown weights dtype"),
    "bad max model len": (lambda t: ["--preset", "deepseek-v3", "--max-model-len", "0"], "--max-model-len"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_exit_2_one_line_no_traceback(case, capsys, tmp_path):
    make_args, needle = BAD_CASES[case]
    code, out, err = run(capsys, *make_args(tmp_path))
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert needle in lines[0]
    assert "Traceback" not in err


def test_bare_capacity_prints_the_default_preset(capsys):
    code, out, err = run(capsys)
    assert code == 0 and err == ""
    assert out.startswith("deepseek-v3 (deepseek_v3)")
    assert "no --preset or --config given: showing deepseek-v3" in out


def test_huge_budget_prints_whole_numbers(capsys):
    """A table wider than the terminal is printed at its own width: no number is cut to '…'."""
    code, out, _ = run(capsys, "--preset", "glm-5", "--kv-memory-gib", "1e30", "--json")
    assert code == 0
    pool = json.loads(out)["formats"][0]["pool_tokens"]
    code, out, _ = run(capsys, "--preset", "glm-5", "--kv-memory-gib", "1e30")
    assert code == 0
    assert f"{pool:,}" in out and "…" not in out


def test_plot_into_a_folder_or_without_suffix_says_the_real_name(capsys, tmp_path):
    code, out, _ = run(capsys, "--preset", "glm-5", "--plot", str(tmp_path))
    assert code == 0 and f"wrote {tmp_path / 'capacity.png'}" in out
    assert (tmp_path / "capacity.png").read_bytes().startswith(b"\x89PNG")
    code, out, _ = run(capsys, "--preset", "glm-5", "--plot", str(tmp_path / "pool"))
    assert code == 0 and f"wrote {tmp_path / 'pool.png'}" in out and (tmp_path / "pool.png").is_file()
    assert not (tmp_path / "pool").exists()
    # a plot we wrote may be rewritten
    assert run(capsys, "--preset", "glm-5", "--plot", str(tmp_path / "pool.png"))[0] == 0


def test_bad_input_in_a_real_process_has_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "mla_eval", "capacity", "--preset", "no-such-model"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: unknown model preset 'no-such-model'")


def test_readme_capacity_library_example_runs(capsys):
    """The README's Python expression (the Capacity section's `api.evaluate_capacity(...)`) runs as written and gives
    the document the CLI's --json prints for the same settings."""
    import re

    from mla_eval import api

    readme = (REPO / "README.md").read_text()
    expr = re.search(r"### Capacity.*?`(api\.evaluate_capacity\(.*?\)\.to_document\(\))`", readme, re.S).group(1)
    doc = eval(compile(expr, "README.md", "eval"), {"api": api})
    cli = run_json(capsys, "--preset", "glm-5", "--gpu", "h200", "--tp", "8", "--formats", "fp8_ds_mla,nvfp4")
    assert doc == cli and doc["formats"]
