"""The default model's task curriculum (issue 17): training documents of the RULER-style tasks have the
exact length, the evaluation's templates, the answers the evaluation scores, and losses masked right."""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from mla_eval.evals import needle_tasks  # noqa: E402
from mla_eval.model_home import default_model_path  # noqa: E402
from tools.train.data import NeedleMaker  # noqa: E402
from tools.train.recipe import load_recipe  # noqa: E402

TOK = default_model_path() / "tokenizer.json"
TEXT = " ".join(f"Sentence number {i} tells of the {w} near the river." for i, w in enumerate(["hill", "town", "lake"] * 400))
WORDS = ["amber", "basin", "cedar", "delta", "ember", "fjord", "grove", "heron", "inlet", "jetty"]


@pytest.fixture(scope="module")
def maker():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOK))
    hay = np.asarray(tok.encode(TEXT, add_special_tokens=False).ids, dtype=np.uint16)
    return NeedleMaker(TOK, hay, WORDS, seed=3)


def _decode(maker, ids) -> str:
    return maker.tok.decode([int(i) for i in ids], skip_special_tokens=False)


@pytest.mark.parametrize("style", NeedleMaker.TASK_STYLES)
def test_task_documents(maker, style):
    for _ in range(6):
        ids, w, spans = maker.document(2048, style=style)
        assert len(ids) == len(w) == 2049 and len(spans) == 1
        text = _decode(maker, ids)
        s, e = spans[0]
        answer = _decode(maker, ids[s:e])
        assert np.all(w[s:e] == 0)  # the answer has its own loss term
        question = _decode(maker, ids[:s]).rsplit("\n", 1)[1]
        if style == "multikey":
            key, kind = re.search(r"special magic (\w+) for (\S+)\?", question).group(2, 1)
            value = re.search(re.escape(f" The special magic {kind} for {key} is: ") + r"(\S+)\.", text).group(1)
            assert answer == f" {value}"
            assert question + answer == needle_tasks.magic_question(kind, key)[1:] + f" {value}"
        elif style == "multivalue":
            kind, key = re.search(r"special magic (\w+)s for (\S+)\?", question).groups()
            found = re.findall(re.escape(f" One of the special magic {kind}s for {key} is: ") + r"(\S+)\.", text)
            assert 2 <= len(found) <= 4
            assert answer == " " + ", ".join(found) + "."  # document order
            assert "\n" + question == needle_tasks.multivalue_question(kind, key)
        else:
            value = re.search(r"assigned the value (\d+),", question).group(1)
            names = [re.search(r" VAR (\w+) = " + value + r"\.", text).group(1)]
            while m := re.search(r" VAR (\w+) = VAR " + names[-1] + r"\.", text):
                names.append(m.group(1))
            assert 3 <= len(names) <= 6
            assert answer == " " + ", ".join(names) + "."
            assert "\n" + question == needle_tasks.vt_question(value)


def test_task_values_are_masked_from_the_lm_loss(maker):
    ids, w, spans = maker.document(1024, style="vt")
    text_ids = [int(i) for i in ids]
    value = re.search(r"assigned the value (\d+),", _decode(maker, ids)).group(1)
    vid = maker.ids(" " + value)
    first = next(i for i in range(len(text_ids)) if text_ids[i : i + len(vid)] == vid)
    assert np.all(w[first : first + len(vid)] == 0) and w[first - 1] == 1


def test_original_styles_unchanged_by_default(maker):
    """Without `styles`, documents draw only the first run's styles (pass key, magic, note)."""
    rng_state = maker.rng.getstate()
    for _ in range(20):
        ids, _, spans = maker.document(1024)
        text = _decode(maker, ids)
        assert "VAR " not in text and "One of the special magic" not in text
    maker.rng.setstate(rng_state)


def test_batch_takes_styles(maker):
    b = maker.batch(3, 1024, styles=["vt"])
    assert b.input_ids.shape == (3, 1024) and int(b.answer_id.max()) == 3
    assert all("VAR " in _decode(maker, row) for row in b.input_ids)


@pytest.mark.parametrize("task", ["multikey", "multivalue", "vt"])
def test_eval_prompts_end_with_the_training_question(maker, task):
    """The evaluation's prompt of each task ends with the question the training documents ask (one
    definition of the templates in needle_tasks, read by both)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path())
    hay = np.asarray(tok(TEXT, add_special_tokens=False)["input_ids"], dtype=np.int64)
    p = needle_tasks.PromptBuilder(tok, hay, noise=False).build(task, "number", 1024, 50.0, 0, seed=5)
    text = tok.decode(p.ids)
    if task == "vt":
        value = re.search(r" VAR \w+ = (\d+)\.", text).group(1)
        assert text.endswith(needle_tasks.vt_question(value))
    elif task == "multivalue":
        key = re.search(r"One of the special magic numbers for (\S+) is", text).group(1)
        assert text.endswith(needle_tasks.multivalue_question("number", key))
    else:
        key = re.search(r"What is the special magic number for (\S+)\?", text).group(1)
        assert text.endswith(needle_tasks.magic_question("number", key))
        assert needle_tasks.magic_sentence("number", key, p.expected[0]) in text


def test_tasks_recipe_loads():
    r = load_recipe("recipes/train-default-model-tasks.toml")
    base = load_recipe("recipes/train-default-model.toml")
    assert r["model"] == base["model"] and r["tokenizer"] == base["tokenizer"]  # same model: a continuation
    styles = {s for ph in r["phase"] for m in ph["micro"] for s in m.get("styles", [])}
    assert set(NeedleMaker.TASK_STYLES) <= styles and {"passkey", "magic", "note"} <= styles


def test_edge_depths_put_a_needle_right_after_the_head(maker):
    """edge_depths (1, 0): the first needle sits right after the head (BOS), as the evaluation's depth 0
    places it; (0, 1): the last needle ends right before the question."""
    for style in ("multikey", "vt", "magic"):
        ids, _, spans = maker.document(1024, style=style, edge_depths=(1.0, 0.0), intro=False)
        text = _decode(maker, ids[1:])
        assert text.startswith(" The special magic") or text.startswith(" VAR ")
        ids, _, spans = maker.document(1024, style=style, edge_depths=(0.0, 1.0))
        before_question = _decode(maker, ids[: spans[0][0]]).rsplit("\n", 1)[0]
        assert re.search(r"(is: \S+\.|VAR \w+ = (VAR \w+|\d+)\.)$", before_question), before_question[-80:]

