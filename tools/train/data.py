"""Training data for the default model: Wikipedia text, the tokenizer, and synthetic needle documents.

Text side (CPU, `prepare`): WikiExtractor archives -> documents (the article "Nero", which is also
in wikitext-2 test, is dropped) -> shuffled -> a held-out evaluation set plus xz-compressed shards
of documents joined by `DOC_SEP`. A byte-level BPE tokenizer is trained on a sample of the shards.

Token side (GPU machine, `TokenStream`): shards are tokenised into one uint16 stream with the
end-of-text id after every document. `NeedleMaker` cuts haystacks out of such a stream and splices
retrieval needles (pass keys, "special magic" numbers / words / UUID-like strings, key-value notes)
in at sentence boundaries, with the questions and answers at the end of the document.
"""

from __future__ import annotations

import json
import lzma
import random
import re
import subprocess
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mla_eval.evals.needle_tasks import (
    distinct,
    magic_question,
    magic_sentence,
    multivalue_question,
    multivalue_sentence,
    vt_name,
    vt_question,
    vt_sentences,
)

DOC_SEP = "\x00"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
HELD_OUT_TITLES = frozenset({"Nero"})  # also an article of wikitext-2 test

_DOC_OPEN = re.compile(r'^<doc id="[^"]*" url="[^"]*" title="([^"]*)">$')

# The classic pass-key filler (Mohtashami & Jaggi, 2023); our own wording of the same idea.
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it later.\n"
)


# ----------------------------------------------------------------------------------------------
# Wikipedia extraction


def iter_wikiextractor(stream: Iterable[str]) -> Iterator[tuple[str, str]]:
    """Yields (title, text) for every `<doc ...>` ... `</doc>` block of WikiExtractor output."""
    title, lines = None, []
    for line in stream:
        line = line.rstrip("\n")
        if title is None:
            m = _DOC_OPEN.match(line)
            if m:
                title, lines = m.group(1), []
            continue
        if line == "</doc>":
            text = "\n".join(ln.rstrip() for ln in lines).strip()
            yield title, text
            title = None
        else:
            lines.append(line)


def read_archive(path: Path) -> Iterator[tuple[str, str]]:
    """Documents of one `wiki_XX.tar.zst` archive (decompressed through `tar --zstd -xO`)."""
    proc = subprocess.Popen(
        ["tar", "--zstd", "-xOf", str(path)], stdout=subprocess.PIPE, text=True, encoding="utf-8"
    )
    assert proc.stdout is not None
    yield from iter_wikiextractor(proc.stdout)
    if proc.wait() != 0:
        raise RuntimeError(f"tar failed on {path}")


def prepare_text(wiki_dir: Path, out_dir: Path, *, shard_chars: int, eval_docs: int, seed: int) -> dict:
    """Writes `train_NN.txt.xz` shards and `eval_docs.txt.xz` under out_dir; returns the manifest.

    Documents shorter than 200 characters (lists, stubs) are dropped. The evaluation documents are
    the first `eval_docs` of the shuffled order and never appear in a training shard.
    """
    docs, dropped = [], []
    for archive in sorted(wiki_dir.glob("wiki_*.tar.zst")):
        for title, text in read_archive(archive):
            if title in HELD_OUT_TITLES:
                dropped.append(title)
                continue
            if len(text) >= 200:
                docs.append(text)
    random.Random(seed).shuffle(docs)
    out_dir.mkdir(parents=True, exist_ok=True)
    held, rest = docs[:eval_docs], docs[eval_docs:]
    _write_xz(out_dir / "eval_docs.txt.xz", held)
    shards, cur, cur_chars = [], [], 0
    for d in rest:
        cur.append(d)
        cur_chars += len(d)
        if cur_chars >= shard_chars:
            shards.append(cur)
            cur, cur_chars = [], 0
    if cur:
        shards.append(cur)
    manifest = {"documents": len(docs), "dropped_titles": dropped, "eval_docs": len(held), "shards": []}
    for i, shard in enumerate(shards):
        path = out_dir / f"train_{i:02d}.txt.xz"
        _write_xz(path, shard)
        manifest["shards"].append(
            {"file": path.name, "docs": len(shard), "chars": sum(map(len, shard)), "bytes": path.stat().st_size}
        )
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def _write_xz(path: Path, docs: list[str]) -> None:
    with lzma.open(path, "wt", encoding="utf-8", preset=6) as f:
        f.write(DOC_SEP.join(docs))


def read_docs(path: Path) -> list[str]:
    """Documents of one shard written by `prepare_text`."""
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return f.read().split(DOC_SEP)


def word_pool(docs: Iterable[str], size: int = 4000) -> list[str]:
    """The `size` most frequent lowercase alphabetic words of 4-10 letters: keys and word values."""
    counts: Counter[str] = Counter()
    for d in docs:
        counts.update(re.findall(r"\b[a-z]{4,10}\b", d))
    return [w for w, _ in counts.most_common(size)]


# ----------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(docs: Iterable[str], vocab_size: int, out_dir: Path) -> None:
    """Trains a byte-level BPE (digits split one per token) and saves it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out_dir))


# ----------------------------------------------------------------------------------------------
# Token streams


def tokenize_docs(tokenizer_file: Path, docs: list[str], eos_id: int) -> np.ndarray:
    """One uint16 stream: each document's ids followed by eos_id (parallel in the Rust tokenizer)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    parts = []
    for i in range(0, len(docs), 4096):
        for enc in encode(docs[i : i + 4096], add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=np.uint16))
            parts.append(np.array([eos_id], dtype=np.uint16))
    return np.concatenate(parts)


@dataclass
class Batch:
    """One micro-batch. input/target ids [B, T] int64; lm_weight [B, T] float32 (1 = LM loss);
    answer_id [B, T] int32: 0 outside answers, k > 0 for the k-th answer span of the batch."""

    input_ids: np.ndarray
    target_ids: np.ndarray
    lm_weight: np.ndarray
    answer_id: np.ndarray


def lm_batch(stream: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator) -> Batch:
    """Random windows of seq_len + 1 tokens from a packed stream."""
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
    win = np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    zeros = np.zeros((batch, seq_len), dtype=np.int32)
    inp, tgt = np.ascontiguousarray(win[:, :-1]), np.ascontiguousarray(win[:, 1:])
    return Batch(inp, tgt, np.ones((batch, seq_len), dtype=np.float32), zeros)


@dataclass
class Needle:
    """One retrieval fact: the sentence put into the haystack, and the question whose answer is it.
    `text` contains `value` once or more; `question` ends where `answer` (= " " + value) begins."""

    text: str
    question: str
    answer: str


class NeedleMaker:
    """Builds synthetic long-context retrieval documents at the token level.

    A document is: [eos] [optional pass-key intro] haystack-with-needles [questions + answers],
    exactly `length + 1` tokens. Needles go in just after a haystack token that ends a sentence
    ("." or a newline), so the token sequence is what tokenising the whole string would give.
    """

    def __init__(self, tokenizer_file: Path, haystack: np.ndarray, words: list[str], seed: int):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(tokenizer_file))
        self.eos = self.tok.token_to_id(EOS_TOKEN)
        self.newline = self.tok.encode("\n", add_special_tokens=False).ids[0]
        vocab = self.tok.get_vocab()
        self.boundary = np.zeros(len(vocab) + 8, dtype=bool)
        for token, i in vocab.items():
            text = self.tok.decode([i])
            if text.endswith(".") or text.endswith("\n"):
                self.boundary[i] = True
        self.boundary[self.eos] = False
        self.haystack = haystack
        self.filler = np.asarray(self.tok.encode(" " + FILLER, add_special_tokens=False).ids, dtype=np.uint16)
        self.words = words
        self.rng = random.Random(seed)

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    # -- values and keys ---------------------------------------------------------------------
    def _value(self, kind: str) -> str:
        r = self.rng
        if kind == "number":
            return str(r.randint(10 ** (n := r.randint(4, 7)), 10 ** (n + 1) - 1))
        if kind == "word":
            return r.choice(self.words)
        if kind == "uuid":
            h = "".join(r.choice("0123456789abcdef") for _ in range(32))
            return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
        raise ValueError(kind)

    def _key(self) -> str:
        r = self.rng
        return r.choice(self.words) if r.random() < 0.6 else f"{r.choice(self.words)}-{r.choice(self.words)}"

    def needles(self, style: str, n: int) -> list[Needle]:
        """n needles of one style with distinct keys."""
        r = self.rng
        if style == "passkey":
            v = self._value("number")
            return [
                Needle(
                    f" The pass key is {v}. Remember it. {v} is the pass key.",
                    "\nWhat is the pass key? The pass key is",
                    f" {v}",
                )
            ]
        keys = distinct(self._key, n)
        kind = r.choice(["number", "number", "word", "uuid"])
        out = []
        for k in keys:
            v = self._value(kind)
            if style == "magic":
                out.append(Needle(magic_sentence(kind, k, v), magic_question(kind, k), f" {v}"))
            else:  # "note": plainer key-value phrasing
                out.append(Needle(f" Note that the {kind} of {k} is {v}.", f"\nThe {kind} of {k} is", f" {v}"))
        return out

    # -- the RULER-style tasks of `mla-eval needle` (mla_eval/evals/needle_tasks.py) -----------
    # The same sentence templates as the evaluation's multikey, multivalue and vt tasks (so that the
    # model learns those tasks, the point of the issue-17 curriculum), with keys from the training word
    # pool, other value draws and training haystacks; the evaluation's prompts are never generated here.
    TASK_STYLES = ("multikey", "multivalue", "vt")

    def task_plan(self, style: str) -> tuple[list[str], list[list[str]], list[tuple[str, str]], bool]:
        """(needle sentences, per needle the strings masked from the LM loss, [(question, answer)],
        ordered): `ordered` means the sentences must appear in list order (multivalue's answer lists the
        values in document order; vt's chain is defined in order)."""
        r = self.rng
        if style == "multikey":
            n = r.choice([2, 3, 4, 4, 5, 6, 8])
            keys = distinct(self._key, n)
            kind = r.choice(["number", "number", "word", "uuid"])
            vals = [self._value(kind) for _ in keys]
            ask = r.randrange(n)
            texts = [magic_sentence(kind, k, v) for k, v in zip(keys, vals)]
            return texts, [[v] for v in vals], [(magic_question(kind, keys[ask]), f" {vals[ask]}")], False
        if style == "multivalue":
            n = r.choice([2, 3, 3, 4])
            k = self._key()
            kind = r.choice(["number", "number", "word", "uuid"])
            vals = distinct(lambda: self._value(kind), n)
            texts = [multivalue_sentence(kind, k, v) for v in vals]
            return texts, [[v] for v in vals], [(multivalue_question(kind, k), " " + ", ".join(vals) + ".")], True
        if style == "vt":
            n = r.choice([3, 4, 5, 5, 6])
            v = str(r.randint(10000, 99999))
            names = distinct(lambda: vt_name(r), n)
            masks = [[v, names[0]]] + [[b] for b in names[1:]]
            return vt_sentences(names, v), masks, [(vt_question(v), " " + ", ".join(names) + ".")], True
        raise ValueError(f"unknown needle style {style!r}")

    # -- documents -----------------------------------------------------------------------------
    def document(
        self,
        length: int,
        style: str | None = None,
        n_needles: int | None = None,
        depths: list[float] | None = None,
        filler: bool | None = None,
        intro: bool | None = None,
        haystack: np.ndarray | None = None,
        styles: list[str] | None = None,
        edge_depths: tuple[float, float] = (0.0, 0.0),
    ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
        """Returns (ids [length+1] int64, lm_weight [length+1] float32, answer spans [(start, end)]).

        lm_weight is 0 on the needles' value tokens (random, unpredictable) and on answers (they
        get their own loss term); spans index into ids (an answer's tokens are ids[start:end]).
        `styles`: the styles to draw from when `style` is None (default: the original mix).
        `edge_depths` (p0, p1): with probability p0 the first needle goes at depth 0 exactly (right after
        the head: the evaluation's depth 0, which uniform depths never produce), with p1 the last at depth 1.
        """
        r = self.rng
        style = style or r.choice(styles or ["passkey", "magic", "magic", "note"])
        if style in self.TASK_STYLES:
            texts, masks, qa_text, ordered = self.task_plan(style)
            intro = False if intro is None else intro
            filler = False if filler is None else filler
        else:
            if n_needles is None:
                n_needles = 1 if style == "passkey" else r.choice([1, 1, 2, 3, 4, 6])
            needles = self.needles(style, n_needles)
            queried = list(range(len(needles)))
            r.shuffle(queried)
            queried = queried[: r.choice([1, 2, 3]) if len(needles) > 1 else 1]
            texts = [n.text for n in needles]
            masks = [[n.answer.strip()] for n in needles]
            qa_text = [(needles[i].question, needles[i].answer) for i in queried]
            ordered = False
            if depths is None:  # drawn here, before intro/filler: the original styles' random sequence
                depths = [r.random() for _ in texts]
            intro = (style == "passkey" and r.random() < 0.5) if intro is None else intro
            filler = (style == "passkey" and r.random() < 0.15) if filler is None else filler
        if depths is None:
            depths = [r.random() for _ in texts]
            if ordered:
                depths.sort()
        if any(edge_depths):  # drawn only when asked: recipes without it keep their random sequence
            u = r.random()
            if u < edge_depths[0]:
                depths[int(np.argmin(depths))] = 0.0
            elif u < edge_depths[0] + edge_depths[1]:
                depths[int(np.argmax(depths))] = 1.0

        head = [self.eos] + (self.ids(PASSKEY_INTRO) if intro else [])
        needle_ids = [self.ids(t) for t in texts]
        qa = [(self.ids(q), self.ids(a)) for q, a in qa_text]
        fixed = len(head) + sum(map(len, needle_ids)) + sum(len(q) + len(a) for q, a in qa)
        hay_len = length + 1 - fixed
        if hay_len < 16:
            raise ValueError(f"length {length} too short for {fixed} tokens of needles and questions")
        hay = self._haystack(hay_len, filler, haystack)

        cuts = self._cut_points(hay, depths)
        order = np.argsort(cuts, kind="stable")
        ids: list[int] = list(head)
        w: list[float] = [1.0] * len(head)
        prev = 0
        for j in order:
            c = cuts[j]
            ids += hay[prev:c].tolist()
            w += [1.0] * (c - prev)
            nid = needle_ids[j]
            nw = [1.0] * len(nid)
            for value in masks[j]:
                nw = [min(a, b) for a, b in zip(nw, _mask_value(nid, self.ids(" " + value)))]
            ids += nid
            w += nw
            prev = c
        ids += hay[prev:].tolist()
        w += [1.0] * (len(hay) - prev)
        spans = []
        for q, a in qa:
            ids += q
            w += [1.0] * len(q)
            spans.append((len(ids), len(ids) + len(a)))
            ids += a
            w += [0.0] * len(a)
        assert len(ids) == length + 1, (len(ids), length)
        return np.asarray(ids, dtype=np.int64), np.asarray(w, dtype=np.float32), spans

    def _haystack(self, n: int, filler: bool, haystack: np.ndarray | None) -> np.ndarray:
        if filler:
            reps = n // len(self.filler) + 1
            return np.tile(self.filler, reps)[:n].astype(np.int64)
        src = self.haystack if haystack is None else haystack
        s = self.rng.randrange(0, len(src) - n - 1)
        hay = src[s : s + n].astype(np.int64)
        hay[hay == self.eos] = self.newline
        return hay

    def _cut_points(self, hay: np.ndarray, depths: list[float]) -> list[int]:
        """For each depth in [0, 1]: the haystack index just after the first sentence end at or
        after depth * len (0 for depth 0, len for depth 1)."""
        ends = np.flatnonzero(self.boundary[hay]) + 1
        cuts = []
        for d in depths:
            target = int(round(d * len(hay)))
            if target <= 0:
                cuts.append(0)
                continue
            k = np.searchsorted(ends, target)
            cuts.append(int(ends[k]) if k < len(ends) else len(hay))
        return cuts

    def batch(
        self, batch: int, seq_len: int, styles: list[str] | None = None, edge_depths: tuple[float, float] = (0.0, 0.0)
    ) -> Batch:
        """A micro-batch of `batch` needle documents of seq_len tokens each (styles: see `document`)."""
        inp = np.empty((batch, seq_len), dtype=np.int64)
        tgt = np.empty((batch, seq_len), dtype=np.int64)
        lw = np.empty((batch, seq_len), dtype=np.float32)
        aid = np.zeros((batch, seq_len), dtype=np.int32)
        k = 0
        for b in range(batch):
            ids, w, spans = self.document(seq_len, styles=styles, edge_depths=edge_depths)
            inp[b], tgt[b], lw[b] = ids[:-1], ids[1:], w[1:]
            for s, e in spans:
                k += 1
                aid[b, s - 1 : e - 1] = k  # target position t predicts ids[t + 1]
        return Batch(inp, tgt, lw, aid)


def _mask_value(needle_ids: list[int], value_ids: list[int]) -> list[float]:
    """LM weights for a needle: 0 on every occurrence of the value's tokens, else 1."""
    w = [1.0] * len(needle_ids)
    n = len(value_ids)
    for i in range(len(needle_ids) - n + 1):
        if needle_ids[i : i + n] == value_ids:
            for j in range(i, i + n):
                w[j] = 0.0
    return w
