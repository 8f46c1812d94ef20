"""`mla-eval needle`: prompts of exact length, scoring, bad input, and the bf16 baseline retrieving."""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from mla_eval.cli import main
from mla_eval.evals import needle as nd
from mla_eval.evals.needle_tasks import TASKS, PromptBuilder, load_haystack

ROOT = Path(__file__).resolve().parents[1]
HAYSTACKS = ROOT.parent / "shared" / "data" / "haystacks"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(ROOT / "mla_eval" / "default_model")


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("values", ["number", "word", "uuid"])
def test_prompts_have_exact_length_and_contain_the_needle(tok, task, values, tmp_path):
    text = tmp_path / "hay.txt"
    text.write_text("The old mill stood by the river. Its wheel turned all day.\n" * 200)
    ids, noise, _ = load_haystack(tok, None if task == "passkey" else text)
    b = PromptBuilder(tok, ids, noise)
    for length, depth in ((400, 0.0), (533, 50.0), (700, 100.0)):
        p = b.build(task, values, length, depth, 0, seed=length)
        assert len(p.ids) == length
        decoded = tok.decode(p.ids)
        assert all(e in decoded for e in p.expected)
        assert decoded.rstrip().endswith(("is", "is:", "are:"))
    assert len(b.build(task, values, 300, 10.0, 0, seed=1).expected) == {"multivalue": 3, "vt": 5}.get(task, 1)


def test_depth_moves_the_needle(tok):
    ids, noise, _ = load_haystack(tok, None)
    b = PromptBuilder(tok, ids, noise)
    pos = [b.build("passkey", "number", 1000, d, 0, seed=3).needle_pos for d in (0, 25, 50, 75, 100)]
    assert pos == sorted(pos) and pos[0] < 40 and pos[-1] > 900


def test_scoring_and_effective_length():
    recs = [
        {"format": "bf16", "length": 4, "depth": 0, "trial": 0, "correct": True},
        {"format": "bf16", "length": 8, "depth": 0, "trial": 0, "correct": True},
        {"format": "nvfp4", "length": 4, "depth": 0, "trial": 0, "correct": True},
        {"format": "nvfp4", "length": 8, "depth": 0, "trial": 0, "correct": False},
    ]
    acc = nd.grid(recs, "nvfp4", [4, 8], [0])
    assert acc == [[1.0], [0.0]]
    assert nd.effective_length(acc, [4, 8], 0.9) == 4
    assert nd.effective_length(nd.grid(recs, "bf16", [4, 8], [0]), [4, 8], 0.9) == 8
    assert [(r["format"], r["length"]) for r in nd.format_failures(recs, "bf16")] == [("nvfp4", 8)]


def _err(args, capsys):
    code = main(args)
    err = capsys.readouterr().err
    last = err.rstrip("\n").split("\n")[-1]
    assert code == 2 and "Traceback" not in err, err
    return last


def test_bad_input(capsys, tmp_path):
    assert "unknown task 'haystack'" in _err(["needle", "--task", "haystack"], capsys)
    assert "--depths must lie in 0..100" in _err(["needle", "--depths", "0,150"], capsys)
    assert "--prefill 'flash'" in _err(["needle", "--prefill", "flash"], capsys)
    assert "exceeds the model's" in _err(["needle", "--lengths", "10000K"], capsys)
    short = tmp_path / "short.txt"
    short.write_text("Only a short text. Nothing more.")
    assert "haystack has" in _err(["needle", "--task", "single", "--haystack", str(short), "--lengths", "512"], capsys)


def test_tiny_grid_end_to_end_bf16_retrieves(tmp_path, capsys):
    out = tmp_path / "n.json"
    code = main(
        [
            "needle", "--lengths", "256,512", "--depths", "10,50,90", "--formats", "nvfp4", "--scales", "none", "--out", str(out),
            "--plot", str(tmp_path / "p"),
        ]
    )
    assert code == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["schema"] == "mla-eval/needle/v1"
    assert doc["formats"]["bf16"]["mean_accuracy"] == 1.0
    assert len(doc["records"]) == 2 * 3 * 2
    assert {p.name for p in (tmp_path / "p").iterdir()} == {"needle_bf16.png", "needle_nvfp4.png", "needle_nvfp4_vs_bf16.png"}


def test_prefill_modes_give_the_same_answers(tmp_path, capsys):
    """mha and absorbed prefill read the same cache bytes; on the embedded model they retrieve the
    same needles and decode the same text."""
    docs = {}
    for mode in ("mha", "absorbed"):
        out = tmp_path / f"{mode}.json"
        args = [
            "needle", "--lengths", "384", "--depths", "0,60", "--formats", "nvfp4", "--scales", "none", "--prefill", mode,
            "--out", str(out),
        ]
        assert main(args) == 0, capsys.readouterr().err
        docs[mode] = json.loads(out.read_text())
    assert docs["mha"]["settings"]["prefill"] == "mha"
    assert [r["output"] for r in docs["mha"]["records"]] == [r["output"] for r in docs["absorbed"]["records"]]


def test_stop_at_answer_keeps_every_score_and_shortens_only_found_answers(tmp_path, capsys):
    docs = {}
    for name, extra in (("stop", []), ("full", ["--full-answers"])):
        out = tmp_path / f"{name}.json"
        args = [
            "needle", "--lengths", "256,512", "--depths", "0,50,100", "--formats", "nvfp4,mxfp4", "--scales", "none",
            "--out", str(out), *extra,
        ]
        assert main(args) == 0, capsys.readouterr().err
        docs[name] = json.loads(out.read_text())
    stop, full = docs["stop"]["records"], docs["full"]["records"]
    budget = docs["full"]["settings"]["max_new_tokens"]
    assert docs["stop"]["settings"]["stop_at_answer"] and not docs["full"]["settings"]["stop_at_answer"]
    assert [r["correct"] for r in stop] == [r["correct"] for r in full]
    assert all(r["answer_tokens"] == budget for r in full)
    for s, f in zip(stop, full):
        assert f["output"].startswith(s["output"])
        assert (s["answer_tokens"] < budget) == (s["correct"] and s["answer_tokens"] < budget)
    assert any(r["correct"] and r["answer_tokens"] < budget for r in stop)  # it does stop early


def test_a_prompt_without_its_answer_decodes_the_full_budget():
    from mla_eval.evals.variants import parse_variants
    from mla_eval.model.loader import load_model

    lm = load_model(None, "cpu")
    hay, noise, _ = load_haystack(lm.tokenizer, None)
    builder = PromptBuilder(lm.tokenizer, hay, noise)
    found = builder.build("passkey", "number", 240, 50.0, 0, 7)
    missing = builder.build("passkey", "number", 240, 50.0, 0, 8)
    missing.expected = ["never-in-any-output"]
    v = parse_variants("bf16")[0]
    a, b = nd.generate(lm, v, [found, missing], nd.DecodeOptions(10, stop_at_answer=True)).tokens
    assert len(b) == 10  # never found: the whole budget, although its batch-mate stopped early
    assert len(a) < 10 and all(e in lm.tokenizer.decode(a, skip_special_tokens=True) for e in found.expected)
    full = nd.generate(lm, v, [found], nd.DecodeOptions(10, stop_at_answer=False)).tokens[0]
    assert len(full) == 10 and full[: len(a)] == a
