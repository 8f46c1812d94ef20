"""The needle grid: length x depth x trials, every format on identical prompts.

Each prompt is prefilled through the model with the format's cache (writer + attention over what
the cache stores), then the answer is greedy-decoded token by token reading the same quantised
cache (DeepSeek-V4: its own attention and cache layers, `model.deepseek_v4.V4Decode`). A cell is correct when
every expected string appears in the output (RULER's string-match-all).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from mla_eval.attention.semantics import BF16, CACHE, AttentionMath, Semantics
from mla_eval.evals.needle_tasks import DEFAULT_NEEDLES, Prompt, PromptBuilder, TaskSpec
from mla_eval.evals.variants import Variant, session_formats
from mla_eval.formats import OuterScales
from mla_eval.model.decode_steps import DecodeSteps, steps_label
from mla_eval.model.deepseek_v4 import V4Decode, check_variant
from mla_eval.model.session import CacheSession
from mla_eval.protocol import ProgressCallback, no_progress


@dataclasses.dataclass(frozen=True)
class NeedleGrid:
    """The resolved grid of one needle run (every default applied)."""

    variants: tuple[Variant, ...]  # bf16 first: the baseline
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    trials: int
    tasks: tuple[TaskSpec, ...]
    seed: int = 0
    batch: int = 1
    max_new_tokens: int = 0  # 0: by task (new_tokens_for)
    outer_scales: OuterScales | None = None
    prefill: str = "mha"  # session.PREFILL_MODES
    stop_at_answer: bool = True  # end a prompt's decode once its answer is complete (exact for the score)
    cuda_graphs: bool = True  # decode steps replay as one CUDA graph where they can (model.decode_steps)
    semantics: Semantics = CACHE  # mla_eval.attention.semantics: how the prompt's prefill reads the cache
    math: AttentionMath = BF16  # the attention math of every absorbed read (decode steps included)


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """How `generate` decodes: the answer budget, the prefill mode, early stop, CUDA graphs, and the
    attention semantics (the prompt prefills in chunks under engine semantics) and math."""

    max_new: int
    prefill: str = "mha"
    stop_at_answer: bool = False
    graphs: bool = True
    semantics: Semantics = CACHE
    math: AttentionMath = BF16


@dataclasses.dataclass
class Decoded:
    """Greedy answers (token ids per prompt) and how the decode steps ran."""

    tokens: list[list[int]]
    steps_mode: str  # "cuda_graph" | "eager"
    why_eager: str | None

    @property
    def steps_label(self) -> str:
        return steps_label({"decode_steps": self.steps_mode, "why_eager": self.why_eager})


class SessionReuse:
    """The last `generate` call's cache session and decode steps, kept across the cells of a grid:
    a call of the same format, scales, shape (batch, prompt length, budget) and options resets and
    reuses them, so its steps replay the graph captured before instead of capturing a new one."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.session: CacheSession | None = None
        self.steps: DecodeSteps | None = None

    def get(self, key: tuple, build):
        if key != self.key:
            self.key = self.session = self.steps = None  # frees the previous shape's caches and graph first
            self.session, self.steps = build()
            self.key = key
        else:
            self.session.reset()
        return self.session, self.steps


# Answer tokens per value with the embedded tokenizer (one token per digit): " 1234567," is 9,
# " apple," at most 4, a UUID 34 plus its separator; a vt variable " QWERT," 5 to 7.
TOKENS_PER_VALUE = {"number": 9, "word": 4, "uuid": 36, "variable": 7}


def new_tokens_for(values: str, task: str, needles: int = 0) -> int:
    """The greedy answer budget of a task: every expected value fits, plus 4 tokens of slack."""
    if task == "passkey":
        return 10  # a 5-digit key: 6 tokens
    answers = (needles or DEFAULT_NEEDLES[task]) if task in ("multivalue", "vt") else 1
    return TOKENS_PER_VALUE["variable" if task == "vt" else values] * answers + 4


def budget(st: NeedleGrid, task: TaskSpec) -> int:
    return st.max_new_tokens or new_tokens_for(task.kind, task.name, task.count)


def prompt_seed(seed: int, task_index: int, length_index: int, depth_index: int, trial: int) -> int:
    """A distinct needle per task, cell and trial; task 0 keeps the seeds of single-task runs."""
    return seed * 1_000_003 + task_index * 1_000_000_007 + length_index * 10_007 + depth_index * 101 + trial


def make_prompts(builder: PromptBuilder, st: NeedleGrid) -> list[Prompt]:
    """A cell of length L holds L tokens in all: the prompt plus the answer tokens decoded.
    Prompts do not depend on the formats: every format reads exactly these."""
    prompts = []
    for ti, task in enumerate(st.tasks):
        max_new = budget(st, task)
        for li, length in enumerate(st.lengths):
            for di, depth in enumerate(st.depths):
                for t in range(st.trials):
                    seed = prompt_seed(st.seed, ti, li, di, t)
                    p = builder.build(task.name, task.kind, length - max_new, depth, t, seed, task.count)
                    p.length = length
                    p.task = task.label
                    prompts.append(p)
    return prompts


@torch.no_grad()
def generate(
    lm,
    variant: Variant,
    prompts: list[Prompt],
    opts: DecodeOptions,
    outer_scales: OuterScales | None = None,
    reuse: SessionReuse | None = None,
) -> Decoded:
    """Greedy answers of a batch of equal-length prompts, through the variant's cache.

    The prefill reads the quantised cache in `opts.prefill` mode (see session.PREFILL_MODES); every
    decode step runs the absorbed attention (our kernel on CUDA) over the same cache, replayed as
    a CUDA graph where it can be (see model.decode_steps; `opts.graphs=False` keeps steps eager).
    `reuse` keeps the session and decode graph for the next call of the same shape.

    With `opts.stop_at_answer`, a prompt stops growing once its decoded text holds every expected
    string, and decoding ends when every prompt of the batch has stopped (or at `max_new`).
    The score (string-match-all) cannot change by that: appending tokens never removes a
    substring, so a cell correct at the stop is correct at `max_new`, and a cell that never
    holds its answer decodes all `max_new` tokens as before.
    """
    ids = torch.tensor([p.ids for p in prompts], device=lm.device)
    if getattr(lm.adapter, "is_v4", False):
        steps = V4Decode(lm, check_variant(variant))  # a fresh cache per batch (nothing to replay)
        return _greedy(lm, prompts, opts, steps.prefill(ids), steps, ids.shape[1])
    b, t = ids.shape
    max_new = opts.max_new
    specs, outer = session_formats(variant, outer_scales)  # a plan row: one format and s_l per layer

    def build():
        session = CacheSession(
            specs, lm.num_layers, b, t + max_new, lm.layer_devices, outer_scales=outer, prefill=opts.prefill,
            semantics=opts.semantics, attn_math=opts.math,
        )
        return session, DecodeSteps(lm, session, graphs=opts.graphs)

    scales = getattr(outer, "scales", outer)  # OuterScales, a plan's per-layer tuple, or None
    key = (variant.name, None if scales is None else tuple(scales), b, t + max_new, opts.prefill, opts.graphs,
           opts.semantics, opts.math)
    session, steps = (reuse or SessionReuse()).get(key, build)
    with lm.adapter.session(session):
        # only the last position's logits: a 64K prompt's full logits would be 64K x vocab; under
        # engine semantics the prompt prefills in chunks (the last chunk's last logits answer)
        pos = torch.arange(t, device=lm.device).expand(b, -1)
        chunk = opts.semantics.forward_chunk(t, lm.adapter.is_dsa)
        for a in range(0, t, chunk):
            logits = lm.model(
                input_ids=ids[:, a : a + chunk], position_ids=pos[:, a : a + chunk], use_cache=False, logits_to_keep=1
            ).logits[:, -1]
        return _greedy(lm, prompts, opts, logits, steps, t)


def _greedy(lm, prompts: list[Prompt], opts: DecodeOptions, logits: torch.Tensor, steps, t: int) -> Decoded:
    """Greedy answers from the prompts' last logits, `steps(tokens, position)` giving each next step's logits."""
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for step in range(opts.max_new):
        nxt = logits.float().argmax(-1)
        for i, tok in enumerate(nxt.tolist()):
            if done[i]:
                continue
            out[i].append(tok)
            if opts.stop_at_answer:
                text = lm.tokenizer.decode(out[i], skip_special_tokens=True)
                done[i] = all(e in text for e in prompts[i].expected)
        if step == opts.max_new - 1 or all(done):
            break
        logits = steps(nxt, t + step)
    return Decoded(out, steps.mode, steps.blocker)


@dataclasses.dataclass
class NeedleRun:
    records: list[dict]  # one per prompt and format (see the needle/v1 schema's records)
    seconds: dict[str, float]  # per format
    decode_steps: dict[str, str]  # per format: how its decode steps ran (steps_label)
    total_seconds: float
    max_new_tokens: int  # the largest answer budget of the run's tasks
    budgets: dict[str, int] = dataclasses.field(default_factory=dict)  # per task label


def run_needle(lm, builder: PromptBuilder, st: NeedleGrid, progress: ProgressCallback = no_progress) -> NeedleRun:
    prompts = make_prompts(builder, st)
    budgets = {task.label: budget(st, task) for task in st.tasks}
    records = []
    total = len(prompts) * len(st.variants)
    done = 0
    t0 = time.perf_counter()
    seconds: dict[str, float] = {}
    decode_steps: dict[str, str] = {}
    progress("prompts", 0, total)
    for v in st.variants:
        tv = time.perf_counter()
        reuse = SessionReuse()  # one session (and decode graph) per prompt shape, kept across its cells
        for task, length in ((task, length) for task in st.tasks for length in st.lengths):
            opts = DecodeOptions(budgets[task.label], st.prefill, st.stop_at_answer, st.cuda_graphs, st.semantics, st.math)
            group = [p for p in prompts if p.length == length and p.task == task.label]
            for i in range(0, len(group), st.batch):
                chunk = group[i : i + st.batch]
                decoded = generate(lm, v, chunk, opts, st.outer_scales, reuse)
                decode_steps[v.name] = decoded.steps_label
                for p, a in zip(chunk, decoded.tokens):
                    text = lm.tokenizer.decode(a, skip_special_tokens=True)
                    records.append(
                        {
                            "format": v.name, "task": p.task, "length": p.length, "depth": p.depth, "trial": p.trial,
                            "seed": p.seed, "prompt_tokens": len(p.ids), "needle_pos": p.needle_pos, "expected": p.expected,
                            "output": text,
                            "answer_tokens": len(a),
                            "correct": all(e in text for e in p.expected),
                        }
                    )
                done += len(chunk)
                progress("prompts", done, total)
        seconds[v.name] = time.perf_counter() - tv
    return NeedleRun(records, seconds, decode_steps, time.perf_counter() - t0, max(budgets.values()), budgets)


def grid(records: list[dict], fmt: str, lengths: list[int], depths: list[float], task: str | None = None) -> list[list[float]]:
    """Accuracy [length][depth] of one format (of one task label, or pooled over every task)."""
    mine = [r for r in records if r["format"] == fmt and (task is None or r["task"] == task)]
    out = []
    for length in lengths:
        row = []
        for d in depths:
            cell = [r["correct"] for r in mine if r["length"] == length and r["depth"] == d]
            row.append(sum(cell) / len(cell) if cell else float("nan"))
        out.append(row)
    return out


def effective_length(acc: list[list[float]], lengths: list[int], threshold: float) -> int | None:
    """Longest length such that it and every shorter one average >= threshold over depths."""
    best = None
    for length, row in sorted(zip(lengths, acc)):
        if sum(row) / len(row) >= threshold:
            best = length
        else:
            break
    return best


def format_failures(records: list[dict], baseline: str) -> list[dict]:
    """Prompts the baseline retrieves and a format does not (the discordant pairs b of the paired
    test; one such prompt is not a significant failure: see needle_stats.paired_tests)."""
    base = {prompt_key(r): r["correct"] for r in records if r["format"] == baseline}
    return [r for r in records if r["format"] != baseline and not r["correct"] and base.get(prompt_key(r))]


def prompt_key(record: dict) -> tuple:
    """What identifies a prompt across formats (every format reads the same prompts)."""
    return record.get("task"), record["length"], record["depth"], record["trial"]
