"""The needle grid: length x depth x trials, every format on identical prompts.

Each prompt is prefilled through the model with the format's cache (writer + attention over what
the cache stores), then the answer is greedy-decoded token by token reading the same quantised
cache. A cell is correct when
every expected string appears in the output (RULER's string-match-all).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from mla_eval.evals.needle_tasks import Prompt, PromptBuilder
from mla_eval.evals.kld import Variant
from mla_eval.model.decode_steps import DecodeSteps, steps_label
from mla_eval.model.session import CacheSession


@dataclasses.dataclass
class NeedleSettings:
    variants: list[Variant]  # bf16 first: the baseline
    lengths: list[int]
    depths: list[float]
    trials: int
    task: str
    values: str
    seed: int = 0
    batch: int = 1
    max_new_tokens: int = 0  # 0: by value kind
    outer_scales: object = None
    prefill: str = "mha"  # session.PREFILL_MODES
    stop_at_answer: bool = True  # end a prompt's decode once its answer is complete (exact for the score)
    cuda_graphs: bool = True  # decode steps replay as one CUDA graph where they can (model.decode_steps)


def new_tokens_for(values: str, task: str) -> int:
    per = {"number": 6, "word": 4, "uuid": 24}[values if task != "passkey" else "number"]
    return per * (3 if task == "multivalue" else 1) + 4


def make_prompts(builder: PromptBuilder, st: NeedleSettings) -> list[Prompt]:
    """A cell of length L holds L tokens in all: the prompt plus the answer tokens decoded."""
    max_new = st.max_new_tokens or new_tokens_for(st.values, st.task)
    prompts = []
    for li, length in enumerate(st.lengths):
        for di, depth in enumerate(st.depths):
            for t in range(st.trials):
                seed = st.seed * 1_000_003 + li * 10_007 + di * 101 + t  # a distinct needle per cell and trial
                p = builder.build(st.task, st.values, length - max_new, depth, t, seed)
                p.length = length
                prompts.append(p)
    return prompts


@torch.no_grad()
def generate(
    lm,
    variant: Variant,
    prompts: list[Prompt],
    max_new: int,
    outer_scales,
    prefill: str = "mha",
    stop_at_answer: bool = False,
    graphs: bool = True,
    info: dict | None = None,
    reuse: dict | None = None,
) -> list[list[int]]:
    """Greedy answers of a batch of equal-length prompts, through the variant's cache.

    The prefill reads the quantised cache in `prefill` mode (see session.PREFILL_MODES); every
    decode step runs the absorbed attention (our kernel on CUDA) over the same cache, replayed as
    a CUDA graph where it can be (see model.decode_steps; `graphs=False` keeps steps eager).
    `info`, when given, receives how the steps ran ({"decode_steps": "cuda_graph" | "eager", "why_eager"}).
    `reuse`, a dict the caller keeps across calls, holds the last call's session and decode steps:
    a call of the same format and shape (batch, prompt length, budget) resets and reuses them,
    so its steps replay the graph captured before instead of capturing a new one.

    With `stop_at_answer`, a prompt stops growing once its decoded text holds every expected
    string, and decoding ends when every prompt of the batch has stopped (or at `max_new`).
    The score (string-match-all) cannot change by that: appending tokens never removes a
    substring, so a cell correct at the stop is correct at `max_new`, and a cell that never
    holds its answer decodes all `max_new` tokens as before.
    """
    ids = torch.tensor([p.ids for p in prompts], device=lm.device)
    b, t = ids.shape
    outer = outer_scales if variant.outer else None
    key = (variant.name, id(outer), b, t + max_new, prefill, graphs)
    if reuse is not None and reuse.get("key") == key:
        session, steps = reuse["session"], reuse["steps"]
        session.reset()
    else:
        if reuse is not None:
            reuse.clear()  # frees the previous shape's caches and graph first
        session = CacheSession(variant.spec, lm.num_layers, b, t + max_new, lm.layer_devices, outer_scales=outer, prefill=prefill)
        steps = DecodeSteps(lm, session, graphs=graphs)
        if reuse is not None:
            reuse.update(key=key, session=session, steps=steps)
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    with lm.adapter.session(session):
        # only the last position's logits: a 64K prompt's full logits would be 64K x vocab
        logits = lm.model(
            input_ids=ids, position_ids=torch.arange(t, device=lm.device).expand(b, -1), use_cache=False, logits_to_keep=1
        ).logits[:, -1]
        for step in range(max_new):
            nxt = logits.float().argmax(-1)
            for i, tok in enumerate(nxt.tolist()):
                if done[i]:
                    continue
                out[i].append(tok)
                if stop_at_answer:
                    text = lm.tokenizer.decode(out[i], skip_special_tokens=True)
                    done[i] = all(e in text for e in prompts[i].expected)
            if step == max_new - 1 or all(done):
                break
            logits = steps(nxt, t + step)
    if info is not None:
        info.update({"decode_steps": steps.mode, "why_eager": steps.blocker})
    return out


def run_needle(lm, builder: PromptBuilder, st: NeedleSettings, progress: Callable[[int, int], None] | None = None) -> dict:
    prompts = make_prompts(builder, st)
    max_new = st.max_new_tokens or new_tokens_for(st.values, st.task)
    records = []
    total = len(prompts) * len(st.variants)
    done = 0
    t0 = time.perf_counter()
    seconds: dict[str, float] = {}
    decode_steps: dict[str, str] = {}
    for v in st.variants:
        tv = time.perf_counter()
        reuse: dict = {}  # one session (and decode graph) per prompt shape, kept across its cells
        for length in st.lengths:
            group = [p for p in prompts if p.length == length]
            for i in range(0, len(group), st.batch):
                chunk = group[i : i + st.batch]
                info: dict = {}
                answers = generate(lm, v, chunk, max_new, st.outer_scales, st.prefill, st.stop_at_answer, st.cuda_graphs, info, reuse)
                decode_steps[v.name] = steps_label(info)
                for p, a in zip(chunk, answers):
                    text = lm.tokenizer.decode(a, skip_special_tokens=True)
                    records.append(
                        {
                            "format": v.name, "task": p.task, "length": p.length, "depth": p.depth, "trial": p.trial,
                            "seed": p.seed, "prompt_tokens": len(p.ids), "needle_pos": p.needle_pos, "expected": p.expected, "output": text,
                            "answer_tokens": len(a),
                            "correct": all(e in text for e in p.expected),
                        }
                    )
                done += len(chunk)
                if progress:
                    progress(done, total)
        seconds[v.name] = time.perf_counter() - tv
    return {"records": records, "seconds": seconds, "decode_steps": decode_steps, "total_seconds": time.perf_counter() - t0, "max_new_tokens": max_new}


def grid(records: list[dict], fmt: str, lengths: list[int], depths: list[float]) -> list[list[float]]:
    """Accuracy [length][depth] of one format."""
    out = []
    for length in lengths:
        row = []
        for d in depths:
            cell = [r["correct"] for r in records if r["format"] == fmt and r["length"] == length and r["depth"] == d]
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
    """Prompts the baseline retrieves and a format does not: what the format itself broke."""
    base = {(r["length"], r["depth"], r["trial"]): r["correct"] for r in records if r["format"] == baseline}
    return [r for r in records if r["format"] != baseline and not r["correct"] and base.get((r["length"], r["depth"], r["trial"]))]
