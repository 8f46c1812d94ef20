"""Long-context pieces (issue 17): RULER-style tasks, the grid statistics, YaRN rope scaling, the chunked KLD loss."""

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from mla_eval.errors import UserError
from mla_eval.evals import needle as nd
from mla_eval.evals import needle_stats
from mla_eval.evals.needle_tasks import DEFAULT_NEEDLES, PromptBuilder, TaskSpec, load_haystack, parse_tasks
from mla_eval.model.rope_scaling import parse_rope_scaling

ROOT = Path(__file__).resolve().parents[1]
PROSE = ROOT.parent / "shared" / "data" / "haystacks" / "austen_novels.txt"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(ROOT / "mla_eval" / "default_model")


@pytest.fixture(scope="module")
def prose_builder(tok, tmp_path_factory):
    if PROSE.is_file():
        path = PROSE
    else:  # without ../shared: a made-up prose haystack, same code path
        path = tmp_path_factory.mktemp("hay") / "hay.txt"
        path.write_text("The old mill stood by the river. Its wheel turned all day, and the miller sang.\n" * 3000)
    ids, noise, _ = load_haystack(tok, path)
    return PromptBuilder(tok, ids, noise)


# --- tasks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["single:uuid", "multikey:word", "multikey:uuid", "multivalue:number", "multivalue:word", "vt"])
@pytest.mark.parametrize("length", [1000, 4096])
def test_exact_length_and_expected_answers(prose_builder, tok, spec, length):
    t = parse_tasks(spec)[0]
    p = prose_builder.build(t.name, t.kind, length, 37.0, 0, seed=11, needles=t.count)
    assert len(p.ids) == length
    text = tok.decode(p.ids)
    body, question = text.rsplit("\n", 1)
    assert all(e in body for e in p.expected)
    if t.name == "multikey":
        # the asked key's needle is in the text, and so are count - 1 distractor needles of other keys
        assert len(p.expected) == 1 and body.count("The special magic") == t.count
        asked = question.split(" for ")[1].split("?")[0]
        assert f"for {asked} is: {p.expected[0]}." in body
    if t.name == "multivalue":
        assert len(set(p.expected)) == t.count == 3 and body.count("One of the special magic") == 3
    if t.name == "vt":
        names = p.expected
        assert len(names) == DEFAULT_NEEDLES["vt"] == 5
        value = question.split("the value ")[1].split(",")[0]
        assert f"VAR {names[0]} = {value}." in body
        # the chain appears in order: each variable is assigned from the one before it
        where = [body.index(f"VAR {b} = VAR {a}.") for a, b in zip(names, names[1:])]
        assert where == sorted(where) and body.index(f"VAR {names[0]} =") < where[0]


def test_the_asked_needle_sits_at_the_depth(prose_builder, tok):
    for depth in (0.0, 50.0, 100.0):
        p = prose_builder.build("multikey", "number", 3000, depth, 0, seed=5)
        at = tok.decode(p.ids[p.needle_pos : p.needle_pos + 40])
        assert at.startswith(" The special magic number for") and p.expected[0] in at
        assert abs(p.needle_pos / 3000 - depth / 100) < 0.1


def test_needle_counts_and_their_limits(prose_builder):
    p = prose_builder.build("multikey", "number", 2000, 50.0, 0, seed=1, needles=8)
    assert len(p.ids) == 2000
    assert len(prose_builder.build("multivalue", "uuid", 2000, 50.0, 0, seed=1, needles=5).expected) == 5
    with pytest.raises(UserError, match="cannot hold"):  # more needles than the prompt can hold
        prose_builder.build("vt", "number", 120, 50.0, 0, seed=1, needles=12)
    with pytest.raises(UserError, match="distinct keys"):
        TaskSpec("multikey", "number", 13)
    with pytest.raises(UserError, match="unknown task 'niah'"):
        parse_tasks("single,niah")


def test_task_list_parsing():
    specs = parse_tasks("single:word, multikey:uuid,vt,passkey,vt", values="number", needles=6)
    assert [s.label for s in specs] == ["single:word", "multikey:uuid", "vt", "passkey"]
    assert [s.count for s in specs] == [1, 6, 6, 1]  # --needles only sets the multi-needle tasks
    assert parse_tasks(["multivalue"], values="word")[0].label == "multivalue:word"


def _grid(tasks: str, trials: int = 3) -> nd.NeedleGrid:
    return nd.NeedleGrid((), (600, 900), (0.0, 50.0, 100.0), trials, tuple(parse_tasks(tasks)), seed=4)


def test_seeded_grid_reproduces_exactly_and_seeds_differ(prose_builder):
    a = nd.make_prompts(prose_builder, _grid("multikey:uuid,vt"))
    b = nd.make_prompts(prose_builder, _grid("multikey:uuid,vt"))
    assert [(p.ids, p.expected, p.task) for p in a] == [(p.ids, p.expected, p.task) for p in b]
    assert len(a) == 2 * 2 * 3 * 3 and len({tuple(p.ids) for p in a}) == len(a)  # every prompt distinct
    # each cell holds the prompt plus its own task's answer budget
    for p in a:
        t = parse_tasks(p.task)[0]
        assert len(p.ids) + nd.new_tokens_for(t.kind, t.name, t.count) == p.length
    other = nd.make_prompts(prose_builder, nd.NeedleGrid((), (600,), (50.0,), 1, tuple(parse_tasks("vt")), seed=5))
    assert other[0].ids != [p for p in a if p.task == "vt" and p.length == 600 and p.depth == 50.0][0].ids


def test_first_task_keeps_the_single_task_seeds(prose_builder):
    one = nd.make_prompts(prose_builder, _grid("multikey"))
    two = nd.make_prompts(prose_builder, _grid("multikey,vt"))
    assert [p.ids for p in one] == [p.ids for p in two if p.task == "multikey:number"]


def test_answer_budgets_fit_the_answers(tok):
    # the budget must hold every expected value as the model would write it (comma separated)
    for spec in ("single:uuid", "multivalue:number", "multivalue:uuid", "multikey:word", "vt"):
        t = parse_tasks(spec)[0]
        b = PromptBuilder(tok, *load_haystack(tok, None)[:2])
        p = b.build(t.name, t.kind, 900, 50.0, 0, seed=2, needles=t.count)
        answer = " " + ", ".join(p.expected) + "."
        assert len(tok(answer, add_special_tokens=False)["input_ids"]) <= nd.new_tokens_for(t.kind, t.name, t.count)


# --- grid statistics ----------------------------------------------------------------------------


def _records(fmt: str, outcomes: list[bool], task: str = "vt", length: int = 4096) -> list[dict]:
    return [{"format": fmt, "task": task, "length": length, "depth": float(i % 5), "trial": i // 5, "correct": c}
            for i, c in enumerate(outcomes)]


def test_paired_tests_decide_failures_not_single_misses():
    base = [True] * 50
    one_miss = [True] * 49 + [False]
    many = [True] * 40 + [False] * 10  # 10 discordant, all against the format: p = 2 / 2^10
    recs = _records("bf16", base) + _records("nvfp4", one_miss) + _records("mxfp4", many)
    rows = needle_stats.paired_tests(recs, "bf16", ["bf16", "nvfp4", "mxfp4"], ["vt"], [4096])
    by = {r["format"]: r for r in rows}
    assert by["nvfp4"]["base_only"] == 1 and by["nvfp4"]["p_value"] == 1.0 and not by["nvfp4"]["format_induced_failure"]
    assert by["mxfp4"]["p_value"] == pytest.approx(2 / 1024)
    assert by["mxfp4"]["holm_rejected"] and by["mxfp4"]["format_induced_failure"]


def test_holm_family_spans_every_test_and_a_win_is_not_a_failure():
    base = [False] * 10 + [True] * 40
    better = [True] * 50  # the format wins 10 prompts: significant, but not a failure
    recs = _records("bf16", base) + _records("fp8", better)
    rows = needle_stats.paired_tests(recs, "bf16", ["bf16", "fp8"], ["vt"], [4096])
    assert rows[0]["holm_rejected"] and not rows[0]["format_induced_failure"]
    # 6 discordant losses give p = 2/64 = 0.03125: alone it is significant, in a family of 3 it is not
    loss6 = [True] * 44 + [False] * 6
    recs = _records("bf16", [True] * 50) + _records("a", loss6)
    assert needle_stats.paired_tests(recs, "bf16", ["bf16", "a"], ["vt"], [4096])[0]["format_induced_failure"]
    recs += _records("b", [True] * 50) + _records("c", [True] * 50)
    rows = needle_stats.paired_tests(recs, "bf16", ["bf16", "a", "b", "c"], ["vt"], [4096])
    assert not any(r["format_induced_failure"] for r in rows)  # 0.03125 > 0.05 / 3


def test_cell_intervals_pool_depths_and_trials():
    recs = _records("bf16", [True] * 45 + [False] * 5)
    cell = needle_stats.cell_intervals(recs, ["bf16"], ["vt"], [4096, 8192])["vt"]["bf16"]
    assert (cell[0]["n"], cell[0]["correct"], cell[0]["accuracy"]) == (50, 45, 0.9)
    assert cell[0]["wilson_lo"] == pytest.approx(0.786398, abs=3e-6)
    assert cell[1] == {"length": 8192, "n": 0, "correct": 0, "accuracy": None, "wilson_lo": 0.0, "wilson_hi": 1.0}


# --- rope scaling -------------------------------------------------------------------------------


def test_rope_scaling_parse():
    assert parse_rope_scaling(None) is None and parse_rope_scaling("none") is None
    assert parse_rope_scaling("yarn:4") == 4.0 and parse_rope_scaling("YaRN:1.5") == 1.5
    for bad, why in (("yarn:abc", "not a number"), ("yarn:0.5", ">= 1"), ("yarn:nan", ">= 1"), ("linear:2", "yarn:FACTOR"),
                     ("yarn", "yarn:FACTOR")):
        with pytest.raises(UserError, match=why):
            parse_rope_scaling(bad)


def test_yarn_option_extends_positions_and_changes_the_rope():
    from mla_eval.model.loader import load_model

    plain = load_model(None, "cpu")
    yarn = load_model(None, "cpu", rope_scaling="yarn:2")
    assert plain.rope_scaling is None and plain.max_positions == 65536
    assert yarn.max_positions == 131072
    assert yarn.rope_scaling == {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 65536,
                                 "source": "--rope-scaling"}
    # DeepSeek's YaRN: softmax scale times mscale(2)^2 = (0.1 ln 2 + 1)^2; low frequencies interpolated by 2
    m0, m1 = plain.adapter.modules[0], yarn.adapter.modules[0]
    assert m1.scaling == pytest.approx(m0.scaling * (0.1 * torch.log(torch.tensor(2.0)).item() + 1) ** 2, rel=1e-6)
    f0, f1 = plain.model.model.rotary_emb.inv_freq, yarn.model.model.rotary_emb.inv_freq
    assert torch.allclose(f1[0], f0[0]) and torch.allclose(f1[-1], f0[-1] / 2)


# --- chunked KLD loss ---------------------------------------------------------------------------


def test_chunked_loss_equals_the_full_logits():
    from tiny_models import tiny_model

    from mla_eval.evals import kld
    from mla_eval.evals.kld_stats import token_metrics
    from mla_eval.evals.text_sources import TokenSource
    from mla_eval.evals.variants import parse_variants
    from mla_eval.model.adapter import MlaAdapter
    from mla_eval.model.loader import LoadedModel
    from mla_eval.model.session import CacheSession

    hf = tiny_model("deepseek_v3", vocab_size=300, max_position_embeddings=256).eval()
    lm = LoadedModel(hf, None, MlaAdapter(hf), Path("tiny"), "tiny", torch.device("cpu"), False)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 300, (200,), generator=g)
    source = TokenSource("text", "random ids", [seq], "d")
    ref, fmt = parse_variants("bf16")[0], parse_variants("nvfp4")[0]
    runs = {}
    for rows in (7, 0):  # 7: many chunks with a ragged last one; 0: the default (one chunk here)
        st = kld.KldProtocol((fmt,), ref, ctx=128, stride=64, min_context=32, layer_stats=False, loss_chunk=rows)
        runs[rows] = kld.run_kld(lm, source, st).stats["nvfp4"].arrays()
    # the output head's GEMM rounds differently per row count: fp32 log-probs differ by a few ulps (4.8e-7 at 6.3),
    # which is the KL's own floor (a sum of p * (difference of two log-probs of magnitude ~6))
    for k in ("kld", "nll_ref", "nll_fmt", "same_top1"):
        assert torch.allclose(torch.tensor(runs[7][k]), torch.tensor(runs[0][k]), rtol=1e-5, atol=2e-6), k
    # and both equal the metrics from the model's own full logits of the first window
    ids = seq[:128].view(1, -1)

    def full_logp(variant):
        session = CacheSession(variant.spec, lm.num_layers, 1, 128, lm.layer_devices)
        with torch.no_grad(), lm.adapter.session(session):
            return torch.log_softmax(hf(input_ids=ids, use_cache=False).logits[0, 32:127].float(), -1)

    m = token_metrics(full_logp(ref), full_logp(fmt), ids[0, 33:128])
    assert torch.allclose(torch.tensor(runs[7]["kld"][:95]), m["kld"], rtol=1e-5, atol=2e-6)
    assert torch.allclose(torch.tensor(runs[7]["nll_fmt"][:95]), m["nll_fmt"], rtol=1e-6, atol=1e-6)
    assert kld.loss_chunk_rows(12288) == (1 << 26) // 12288 and kld.loss_chunk_rows(129280, 100) == 100


# --- end to end ---------------------------------------------------------------------------------


def test_multi_task_run_document_and_printout(tmp_path, capsys):
    from mla_eval.cli import main
    from mla_eval.result_schemas import validate

    out = tmp_path / "n.json"
    # short answers (passkey, multikey numbers) keep the CPU decode short; vt's prompts are tested above
    code = main(["needle", "--task", "multikey,passkey", "--lengths", "300", "--depths", "20,80", "--trials", "1", "--formats",
                 "nvfp4", "--scales", "none", "--device", "cpu", "--out", str(out), "--plot", str(tmp_path / "plots")])
    assert code == 0
    import json

    doc = json.loads(out.read_text())
    validate(doc, str(out))
    assert doc["settings"]["tasks"] == ["multikey:number", "passkey"] and doc["settings"]["samples_per_cell"] == 2
    assert doc["model"]["rope_scaling"] is None
    assert set(doc["tasks"]) == {"multikey:number", "passkey"}
    for label, per in doc["tasks"].items():
        for fmt in ("bf16", "nvfp4"):
            cell = per[fmt]["cells"][0]
            got = [r["correct"] for r in doc["records"] if r["task"] == label and r["format"] == fmt]
            assert cell["n"] == 2 == len(got) and cell["correct"] == sum(got)
    assert len(doc["paired_tests"]) == 2 and doc["statistics"]["alpha"] == 0.05
    assert len(doc["records"]) == 2 * 2 * 2
    printed = capsys.readouterr().out
    assert "Wilson" in printed and "McNemar" in printed  # (rich wraps the titles at the console width)
    assert (tmp_path / "plots" / "multikey_number" / "needle_nvfp4.png").is_file()


def test_kld_depth_plot_across_windows(tmp_path):
    from mla_eval.report.plots import kld_depth_across_windows

    def doc(ctx):
        rows = [{"depth_lo": lo, "depth_hi": lo * 2, "tokens": 10, "kld_mean": 0.01, "kld_se": 0.001}
                for lo in (512, 1024, ctx // 2)]
        return {"settings": {"ctx": ctx}, "formats": {"nvfp4": {"kld_by_depth": rows}, "mxfp4": {"kld_by_depth": rows}}}

    path = kld_depth_across_windows([doc(65536), doc(16384)], tmp_path / "depth.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"



def test_a_long_text_does_not_warn_about_indexing_errors(capfd, caplog, tmp_path):
    """Windows are cut by mla-eval: transformers' "longer than the specified maximum ... indexing errors" is noise."""
    from transformers import AutoTokenizer

    from mla_eval.evals.needle_tasks import load_haystack
    from mla_eval.evals.text_sources import _tokenize

    def tokenizer():
        tok = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[1] / "mla_eval" / "default_model")
        tok.model_max_length = 64
        return tok

    text = "The mill stood by the river and its wheel turned all day. " * 40
    hay = tmp_path / "hay.txt"
    hay.write_text(text)

    def warned() -> bool:
        printed = capfd.readouterr()
        return "indexing errors" in printed.err + printed.out + caplog.text

    assert _tokenize(tokenizer(), text).numel() > 64 and not warned()
    load_haystack(tokenizer(), hay)
    assert not warned()
    tokenizer()(text, add_special_tokens=False)  # the check can fail: the same call without the guard warns
    assert warned()
