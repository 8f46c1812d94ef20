"""Needle-in-a-haystack prompts of exact token length.

Tasks (the task family of RULER, NVIDIA/RULER `scripts/data/synthetic/niah.py` and
`variable_tracking.py`: facts only, our own phrasing, which follows what the default model was
trained on, see tools/train/data.py):
- passkey:    a pass key in a noise haystack of repeated filler sentences (data-free default)
- single:     one "special magic" value in a text haystack (--haystack FILE|DIR)
- multikey:   N key-value needles (default 4); the question asks for one key, the other N-1 are
              distractors with the same phrasing and value kind (RULER niah_multikey)
- multivalue: one key given N distinct values (default 3); all must be returned (RULER niah_multivalue)
- vt:         variable tracking: a chain of N variables (default 5, i.e. 4 hops), "VAR A = 12345",
              "VAR B = VAR A", ... spread through the haystack in order; the question asks for every
              variable that holds the value (RULER vt, one chain). Not in the shipped model's training (the
              task-curriculum recipes, recipes/train-default-model-tasks*.toml, train it).
Values are numbers, words or UUID-like strings (`--values`). A needle goes in right after a
sentence end at or after the requested depth, so the tokens are those of the natural text.
The needle the question is about (multikey: the asked key; multivalue, vt: the first) sits at the
requested depth; the others at seeded random depths (vt: in chain order after it).
Scoring (needle.py): string-match-all, a prompt is correct when its greedy answer contains every
expected string.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np

from mla_eval.errors import UserError
from mla_eval.evals.text_sources import quiet_long_text
from mla_eval.user_paths import TEXT_LIMIT, read_input_text

TASKS = ("passkey", "single", "multikey", "multivalue", "vt")
DEFAULT_NEEDLES = {"passkey": 1, "single": 1, "multikey": 4, "multivalue": 3, "vt": 5}
MULTI_NEEDLE_TASKS = ("multikey", "multivalue", "vt")  # the tasks whose needle count --needles sets
VALUE_KINDS = ("number", "word", "uuid")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
INTRO = "There is important info hidden inside a lot of irrelevant text. Find it and memorize it."
WORDS = (
    "apple", "river", "candle", "falcon", "marble", "harbor", "violet", "copper", "meadow", "lantern",
    "glacier", "thunder", "saffron", "willow", "ember", "orchid", "granite", "sparrow", "velvet", "compass",
)
KEYS = ("alpha", "cobalt", "juniper", "quartz", "nimbus", "tundra", "ivory", "zephyr", "basalt", "lotus", "onyx", "prairie")
VAR_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def distinct(draw, n: int) -> list:
    """n distinct values of `draw()`, in draw order (a repeat is drawn again)."""
    out: list = []
    while len(out) < n:
        v = draw()
        if v not in out:
            out.append(v)
    return out


def vt_name(r: random.Random) -> str:
    """A variable-tracking name: 5 random capitals."""
    return "".join(r.choice(VAR_LETTERS) for _ in range(5))


# The sentence templates of the tasks, defined once: the prompts here and the default model's training
# documents (tools/train/data.py NeedleMaker.task_plan) both read them.
def magic_sentence(kind: str, key: str, value: str) -> str:
    return f" The special magic {kind} for {key} is: {value}."


def magic_question(kind: str, key: str) -> str:
    return f"\nWhat is the special magic {kind} for {key}? The special magic {kind} for {key} is:"


def multivalue_sentence(kind: str, key: str, value: str) -> str:
    return f" One of the special magic {kind}s for {key} is: {value}."


def multivalue_question(kind: str, key: str) -> str:
    return f"\nWhat are all the special magic {kind}s for {key}? The special magic {kind}s for {key} are:"


def vt_sentences(names: list[str], value: str) -> list[str]:
    """The chain: the first variable gets the value, each next one the previous variable."""
    return [f" VAR {names[0]} = {value}."] + [f" VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]


def vt_question(value: str) -> str:
    return (
        f"\nQuestion: which variables are assigned the value {value}, directly or through other variables? "
        f"Answer: the variables assigned {value} are:"
    )


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One task of a grid: its name, value kind and needle count (see the module docstring)."""

    name: str
    values: str = "number"
    needles: int = 0  # 0: the task's default (DEFAULT_NEEDLES)

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise UserError(f"unknown task {self.name!r}; choose one of {', '.join(TASKS)}")
        if self.values not in VALUE_KINDS:
            raise UserError(f"--values {self.values!r}: choose one of {', '.join(VALUE_KINDS)}")
        n = self.count
        if n < 1:
            raise UserError(f"--needles must be at least 1, got {n}")
        if self.name == "multikey" and n > len(KEYS):
            raise UserError(f"--needles {n}: multikey has {len(KEYS)} distinct keys; use --needles <= {len(KEYS)}")
        if self.name == "multivalue" and self.values == "word" and n > len(WORDS):
            raise UserError(f"--needles {n}: multivalue word has {len(WORDS)} distinct words; use --needles <= {len(WORDS)}")

    @property
    def count(self) -> int:
        return self.needles or DEFAULT_NEEDLES[self.name]

    @property
    def kind(self) -> str:
        """The value kind actually used: passkey and vt always use numbers."""
        return "number" if self.name in ("passkey", "vt") else self.values

    @property
    def label(self) -> str:
        """How results name the task: 'multikey:uuid', 'vt', 'passkey'."""
        return self.name if self.name in ("passkey", "vt") else f"{self.name}:{self.kind}"


def parse_tasks(text: str | list, values: str = "number", needles: int = 0) -> list[TaskSpec]:
    """'single:word,multikey:uuid,vt' (or a list) -> TaskSpecs; a task without ':kind' takes `values`.
    `needles` (0: each task's default) applies to the multi-needle tasks only."""
    items = text.split(",") if isinstance(text, str) else [str(t) for t in text]
    out = []
    for item in (t.strip() for t in items if t.strip()):
        name, _, kind = item.partition(":")
        spec = TaskSpec(name.strip(), kind.strip() or values, needles if name.strip() in MULTI_NEEDLE_TASKS else 0)
        if spec.label not in {t.label for t in out}:
            out.append(spec)
    if not out:
        raise UserError(f"--task needs at least one of {', '.join(TASKS)}")
    return out


@dataclasses.dataclass
class Prompt:
    ids: list[int]
    expected: list[str]
    task: str
    length: int
    depth: float  # percent
    trial: int
    seed: int
    needle_pos: int  # token index where the (first) needle starts


class PromptBuilder:
    def __init__(self, tokenizer, haystack_ids: np.ndarray, noise: bool) -> None:
        self.tok = tokenizer
        self.hay = haystack_ids
        self.noise = noise
        vocab_size = len(tokenizer)
        self.boundary = np.zeros(vocab_size + 1, dtype=bool)
        for i in range(vocab_size):
            text = tokenizer.decode([i])
            self.boundary[i] = text.endswith(".") or text.endswith("\n")
        self.bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _value(self, kind: str, r: random.Random) -> str:
        if kind == "number":
            return str(r.randint(100000, 9999999))
        if kind == "word":
            return r.choice(WORDS)
        h = "".join(r.choice("0123456789abcdef") for _ in range(32))
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    def _needles(self, task: str, kind: str, r: random.Random, n: int = 0) -> tuple[list[str], str, list[str]]:
        """(needle sentences, question, expected answers); the first sentence is the one at the asked depth."""
        n = n or DEFAULT_NEEDLES.get(task, 1)
        if task == "passkey":
            v = str(r.randint(10000, 99999))
            return [f" The pass key is {v}. Remember it. {v} is the pass key."], "\nWhat is the pass key? The pass key is", [v]
        if task == "single":
            k, v = r.choice(KEYS), self._value(kind, r)
            return [magic_sentence(kind, k, v)], magic_question(kind, k), [v]
        if task == "multikey":
            keys = r.sample(KEYS, n)
            vals = [self._value(kind, r) for _ in keys]
            ask = r.randrange(n)
            sentences = [magic_sentence(kind, k, v) for k, v in zip(keys, vals)]
            sentences.insert(0, sentences.pop(ask))  # the asked needle goes at the requested depth
            return sentences, magic_question(kind, keys[ask]), [vals[ask]]
        if task == "multivalue":
            k = r.choice(KEYS)
            vals = distinct(lambda: self._value(kind, r), n)
            return [multivalue_sentence(kind, k, v) for v in vals], multivalue_question(kind, k), vals
        if task == "vt":
            v = str(r.randint(10000, 99999))
            names = distinct(lambda: vt_name(r), n)
            return vt_sentences(names, v), vt_question(v), names
        raise UserError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")

    def build(self, task: str, kind: str, length: int, depth: float, trial: int, seed: int, needles: int = 0) -> Prompt:
        r = random.Random(seed)
        sentences, question, expected = self._needles(task, kind, r, needles)
        head = [self.bos] + (self.ids(INTRO) if self.noise else [])
        needle_ids = [self.ids(s) for s in sentences]
        q_ids = self.ids(question)
        hay_len = length - len(head) - sum(map(len, needle_ids)) - len(q_ids)
        if hay_len < 16:
            raise UserError(
                f"a {length}-token prompt cannot hold the {task} task's {len(sentences)} needles and question "
                f"({length - hay_len} tokens, and at least 16 of haystack): use fewer --needles or longer --lengths"
            )
        hay = self._haystack(hay_len, r)
        # the first needle goes at `depth`; the others at random depths (vt: in chain order, after it)
        rest = [r.random() for _ in needle_ids[1:]]
        if task == "vt":
            rest = sorted(depth / 100 + (1 - depth / 100) * x for x in rest)
        depths = [depth / 100] + rest
        cuts = [self._cut(hay, d) for d in depths]
        order = np.argsort(cuts, kind="stable")
        ids = list(head)
        prev = 0
        first_pos = 0
        for j in order:
            ids += hay[prev : cuts[j]].tolist()
            if j == 0:
                first_pos = len(ids)
            ids += needle_ids[j]
            prev = cuts[j]
        ids += hay[prev:].tolist() + q_ids
        assert len(ids) == length
        return Prompt(ids, expected, task, length, depth, trial, seed, first_pos)

    def _haystack(self, n: int, r: random.Random) -> np.ndarray:
        if self.noise:
            reps = n // len(self.hay) + 1
            return np.tile(self.hay, reps)[:n]
        if len(self.hay) < n:
            raise UserError(
                f"the haystack has {len(self.hay)} tokens but a prompt needs {n}; give a longer --haystack or shorter --lengths"
            )
        start = r.randrange(0, len(self.hay) - n + 1)
        return self.hay[start : start + n]

    def _cut(self, hay: np.ndarray, d: float) -> int:
        target = int(round(d * len(hay)))
        if target <= 0:
            return 0
        ends = np.flatnonzero(self.boundary[hay]) + 1
        k = np.searchsorted(ends, target)
        return int(ends[k]) if k < len(ends) else len(hay)


def haystack_text(haystack: Path) -> str:
    """The text of a --haystack file, or of every .txt file under a folder: regular files of UTF-8 text, as
    kld --text takes (undecodable bytes would be retrieved through as noise)."""
    if haystack.is_dir():
        files = sorted(p for p in haystack.rglob("*.txt") if p.is_file())
        if not files:
            raise UserError(f"--haystack {haystack} holds no .txt files")
    else:
        files = [haystack]
    text = "\n".join(read_input_text(p, "--haystack", TEXT_LIMIT) for p in files)
    if "\x00" in text:
        raise UserError(f"--haystack {haystack} holds NUL bytes (binary data?); give plain-text files")
    if not text.strip():
        raise UserError(f"--haystack {haystack} is empty")
    return text


def load_haystack(tokenizer, haystack: Path | None) -> tuple[np.ndarray, bool, str]:
    """(token ids, is_noise, label). No path: the filler-sentence noise haystack."""
    if haystack is None:
        ids = np.asarray(tokenizer(" " + FILLER, add_special_tokens=False)["input_ids"])
        return ids, True, "noise (repeated filler sentences)"
    haystack = Path(haystack)
    text = haystack_text(haystack)
    quiet_long_text(tokenizer)  # a haystack is cut into prompts here, never fed whole
    ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"])
    eos = tokenizer.eos_token_id
    if eos is not None:
        ids[ids == eos] = tokenizer("\n", add_special_tokens=False)["input_ids"][0]
    return ids, False, f"{haystack.name} ({len(ids)} tokens)"
