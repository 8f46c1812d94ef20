"""The needle evaluation as a library call: `evaluate_needle(NeedleSettings(...)) -> NeedleResult`.

Settings are validated when built; the result serialises to the `mla-eval/needle/v1` document.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from mla_eval.attention import dispatch
from mla_eval.attention.semantics import get_math, parse_semantics
from mla_eval.errors import UserError
from mla_eval.evals import needle as nd
from mla_eval.evals import needle_power, needle_stats
from mla_eval.evals.calibrate import calibrate
from mla_eval.evals.needle_tasks import TASKS, VALUE_KINDS, PromptBuilder, TaskSpec, haystack_text, load_haystack, parse_tasks
from mla_eval.evals.settings import SCALES_MODES, ModelSettings, check_math_backend
from mla_eval.evals.text_sources import TokenSource
from mla_eval.evals.variants import PlanVariant, Variant, check_plan_model, parse_variants
from mla_eval.formats import OuterScales
from mla_eval.formats.v4 import V4_CONFIGS
from mla_eval.model.deepseek_v4 import check_mla_rows, check_variant
from mla_eval.model.session import PREFILL_MODES
from mla_eval.protocol import ProgressCallback, no_progress, option
from mla_eval.result_schemas import NEEDLE_SCHEMA
from mla_eval.results import environment

DEFAULT_FORMATS = "fp8_ds_mla,nvfp4,nvfp4+s_l,nvfp4_fp8rope,mxfp4"
DEFAULT_LENGTHS = "4K,8K,16K,32K,64K"
BASELINE = "bf16"


def parse_lengths(text: str | list) -> list[int]:
    """'4K,8K' or [4096, 8192] -> sorted distinct lengths in tokens (4K = 4096)."""
    tokens = text.split(",") if isinstance(text, str) else [str(t) for t in text]
    out = []
    for tok in (t.strip().upper() for t in tokens if t.strip()):
        try:
            out.append(int(float(tok[:-1]) * 1024) if tok.endswith("K") else int(tok))
        except ValueError:
            raise UserError(f"--lengths: {tok!r} is not a length (use e.g. 4K,8K or 4096)") from None
    if not out or min(out) <= 0:
        raise UserError("--lengths needs positive lengths, e.g. 4K,8K,16K,32K,64K")
    return sorted(set(out))


def parse_depths(text: str | list | None, steps: int) -> list[float]:
    """Depths in percent: given ('0,50,100' or a list), else `steps` evenly spaced from 0 to 100."""
    if text is None:
        if steps < 1:
            raise UserError(f"--depth-steps must be at least 1, got {steps}")
        return [round(100 * i / (steps - 1), 4) for i in range(steps)] if steps > 1 else [50.0]
    tokens = text.split(",") if isinstance(text, str) else [str(t) for t in text]
    try:
        vals = [float(t) for t in tokens if t.strip()]
    except ValueError:
        raise UserError(f"--depths {text!r}: give percentages such as 0,25,50,75,100") from None
    bad = [v for v in vals if not 0 <= v <= 100]
    if bad or not vals:
        raise UserError(f"--depths must lie in 0..100 (percent of the haystack), got {bad or text}")
    return sorted(set(vals))


DEFAULT_POWER_DROP = 0.1  # --power: the accuracy drop whose prompts-needed is reported


@dataclasses.dataclass(frozen=True)
class NeedleSettings(ModelSettings):
    """Everything `mla-eval needle` takes: each field is one of its options (and a recipe's [needle] key)."""

    formats: str | list[str] = option(
        DEFAULT_FORMATS, "--formats", "-f",
        help="Formats to compare with the bf16 baseline (always run first); +s_l uses outer scales.",
    )
    lengths: str | list[int] = option(DEFAULT_LENGTHS, "--lengths", help="Prompt lengths in tokens (4K = 4096).")
    depths: str | list[float] | None = option(
        None, "--depths", help="Needle depths in percent (default: 0..100 in --depth-steps steps)."
    )
    depth_steps: int = option(11, "--depth-steps", help="Number of evenly spaced depths when --depths is not given.")
    trials: int = option(1, "--trials", help="Prompts per cell, each with a different needle and seed.")
    task: str | list[str] = option(  # one task or a comma list, each `name[:values]` (needle_tasks.parse_tasks)
        "passkey", "--task",
        help=f"One task or a comma list, each NAME[:VALUES], NAME one of {', '.join(TASKS)} (e.g. "
        "single:word,multikey:uuid,multivalue,vt): every task runs the whole length x depth x trials grid.",
    )
    values: str = option(
        "number", "--values",
        help=f"Needle values of tasks without ':VALUES': {', '.join(VALUE_KINDS)} (passkey and vt always use numbers).",
    )
    needles: int = option(  # multikey / multivalue / vt needle count; 0: each task's default
        0, "--needles",
        help="Needles of the multi-needle tasks: multikey keys (1 asked + distractors, default 4), multivalue values "
        "(default 3), vt chain variables (default 5); 0: those defaults. Single-needle tasks ignore it.",
    )
    haystack: Path | None = option(
        None, "--haystack", path="read", help="Text file or folder of .txt files (default: noise of repeated filler sentences)."
    )
    scales: str = option(
        "auto", "--scales", help="Outer scales for +s_l: JSON file, 'auto' (calibrate on a separate prompt), or 'none'."
    )
    batch: int = option(1, "--batch", help="Prompts of one length per forward.")
    prefill: str = option(
        "mha", "--prefill",
        help="How the prompt's prefill reads the quantised cache: 'mha' decodes it, up-projects through kv_b_proj and runs "
        "causal SDPA (how serving engines prefill MLA; fast), 'absorbed' runs every prompt token through the absorbed "
        "MLA attention that decode uses (our kernel on CUDA; slow at 64K). Decode steps are always absorbed.",
    )
    full_answers: bool = option(
        False, "--full-answers",
        help="Decode every answer to its full token budget. By default a prompt stops once its output holds every "
        "expected string: the score cannot change by that (appending never removes a match); "
        "only the recorded output is shorter.",
    )
    cuda_graphs: bool = option(
        True, "--cuda-graphs/--no-cuda-graphs",
        help="On a GPU, capture the decode step once per prompt shape as a CUDA graph and replay it for every step of "
        "every cell of that shape (a step is host-bound otherwise). The arithmetic is identical; --no-cuda-graphs runs "
        "every step eagerly (for debugging).",
    )
    threshold: float = option(
        0.9, "--threshold", help="Accuracy that a length must keep to count toward the effective length."
    )
    seed: int = option(0, "--seed", help="Seed of the needles and haystack offsets.")
    power: bool = option(
        False, "--power",
        help="Report what the grid can detect: per task and length, the smallest accuracy drop its paired test flags "
        "with 80 % probability given the prompts, the prompts needed to flag a drop of --power-drop, and which "
        "control formats (--formats control:*) it flagged.",
    )
    power_drop: float | None = option(  # None: DEFAULT_POWER_DROP with --power; given without --power: refused
        None, "--power-drop", show_default=False,
        help=f"With --power: the accuracy drop (0..1) whose prompts-needed it reports (default {DEFAULT_POWER_DROP}).",
    )
    semantics: str = option(  # mla_eval.attention.semantics (one value): how the prompt's prefill reads the cache
        "cache", "--semantics",
        help="How the prompt's prefill reads the cache: cache (default), engine:C (chunked prefill: earlier chunks "
        "through the cache, the own chunk fresh) or a preset (vllm, vllm-offline, sglang). Decode steps read the cache.",
    )
    math: str = option(  # attention math of every absorbed read (decode steps included)
        "bf16", "--math", help="Attention math of the absorbed reads (decode steps): bf16, fp8-q, fp8-qp."
    )

    def __post_init__(self) -> None:
        ModelSettings.__post_init__(self)
        parse_semantics(self.semantics)
        check_math_backend([get_math(self.math)], self.backend)
        if self.needles < 0:
            raise UserError(f"--needles must be at least 1 (or 0 for each task's default), got {self.needles}")
        self.task_list()
        if self.values not in VALUE_KINDS:
            raise UserError(f"--values {self.values!r}: choose one of {', '.join(VALUE_KINDS)}")
        if self.prefill not in PREFILL_MODES:
            raise UserError(f"--prefill {self.prefill!r}: choose one of {', '.join(PREFILL_MODES)}")
        if self.trials < 1 or self.batch < 1:
            raise UserError("--trials and --batch must be at least 1")
        if self.power_drop is not None and not 0 < self.power_drop < 1:
            raise UserError(f"--power-drop is an accuracy drop in (0, 1), e.g. 0.1, got {self.power_drop}")
        if self.power_drop is not None and not self.power:
            raise UserError("--power-drop sets the drop --power reports, and --power was not given: add --power, or "
                            "drop --power-drop")
        if not 0 <= self.threshold <= 1:
            raise UserError(f"--threshold is an accuracy in 0..1, got {self.threshold}")
        if min(self.length_list()) <= self.max_new_tokens() + 16:
            raise UserError(
                f"--lengths {min(self.length_list())} is too short: a cell holds the prompt and "
                f"{self.max_new_tokens()} answer tokens"
            )
        self.depth_list()
        self.variants()
        if self.haystack is not None:
            haystack_text(Path(self.haystack))  # a missing, binary or endless file fails before any model loads

    def variants(self) -> list[Variant]:
        """bf16 first (the baseline every failure is measured against), then the asked formats."""
        formats = self.formats.split(",") if isinstance(self.formats, str) else list(self.formats)
        return parse_variants([BASELINE, *formats], plans=True)

    def length_list(self) -> list[int]:
        return parse_lengths(self.lengths)

    def depth_list(self) -> list[float]:
        return parse_depths(self.depths, self.depth_steps)

    def task_list(self) -> list[TaskSpec]:
        return parse_tasks(self.task, self.values, self.needles)

    def max_new_tokens(self) -> int:
        """The largest answer budget of the asked tasks."""
        return max(nd.new_tokens_for(t.kind, t.name, t.count) for t in self.task_list())

    @property
    def cells(self) -> int:
        """Prompts per format: tasks x lengths x depths x trials."""
        return len(self.task_list()) * len(self.length_list()) * len(self.depth_list()) * self.trials


@dataclasses.dataclass
class NeedleResult:
    model: dict[str, Any]
    settings: dict[str, Any]
    outer_scales: OuterScales | None
    environment: dict[str, Any]
    formats: dict[str, dict]  # per format: accuracy [length][depth] pooled over tasks, mean_accuracy, effective_length, ...
    format_induced_failures: list[dict]  # prompts bf16 retrieves and the format does not (discordant, not a verdict)
    records: list[dict]
    total_seconds: float
    tasks: dict[str, dict] = dataclasses.field(default_factory=dict)  # per task label: per format accuracy + intervals
    paired_tests: list[dict] = dataclasses.field(default_factory=list)  # needle_stats.paired_tests
    statistics: dict[str, Any] = dataclasses.field(default_factory=dict)  # needle_stats.METHOD
    power: dict[str, Any] | None = None  # needle_power.power_report, with --power

    @property
    def significant_failures(self) -> list[dict]:
        """The paired tests that decide a format-induced failure (needle_stats.METHOD['failure_rule'])."""
        return [t for t in self.paired_tests if t["format_induced_failure"]]

    def to_document(self) -> dict[str, Any]:
        return {
            "schema": NEEDLE_SCHEMA,
            "model": self.model,
            "settings": self.settings,
            "outer_scales": None if self.outer_scales is None else self.outer_scales.to_json(),
            "environment": self.environment,
            "formats": self.formats,
            "format_induced_failures": self.format_induced_failures,
            "records": self.records,
            "total_seconds": self.total_seconds,
            "tasks": self.tasks,
            "paired_tests": self.paired_tests,
            "statistics": self.statistics,
            **({"power": self.power} if self.power is not None else {}),
        }


# Needle decodes each answer token by token: every step runs every layer, so the whole model stays in memory. Scoring
# forced answers (teacher-forced, issue 40) needs only forwards: such a run passes no reason here and hands its
# forwards to `ExecutionStrategy.runner.forwards` (mla_eval.model.strategy), which streams them where the plan says.
GENERATES = ("needle decodes each answer token by token through every layer",
             "use --offload none or auto (the model must fit the device)")


def request(st: NeedleSettings):
    return st.execution_request(st.whole_model() or GENERATES)


def needle_workload(lm, st: NeedleSettings):
    """The prompt forwards of the grid (each prompt prefilled through every format's cache), for the run plan; the
    decode steps after each prefill are not in it (each is one token through every layer)."""
    from mla_eval.model.run_plan import Workload

    variants, lens = st.variants(), st.length_list()
    prompts = st.cells // len(lens)  # per length
    return Workload(batches=len(lens) * -(-prompts // st.batch), forwards_per_batch=len(variants),
                    tokens=st.batch * max(lens), hidden=int(lm.model.config.hidden_size),
                    dtype_bytes=torch.finfo(lm.model.dtype).bits // 8,
                    record_bytes=max(v.spec.record_bytes for v in variants), kept=st.batch, exact=False)


def plan_needle(st: NeedleSettings, progress: ProgressCallback = no_progress, measure: bool = True):
    """`mla-eval needle --dry-run`: where the grid would run (resident: it generates) and its memory; the prompts'
    prefill forwards timed on one layer of each build where `measure` (decode steps are not projected)."""
    from mla_eval.model.strategy import ExecutionStrategy

    with dispatch.use_backend(st.backend), ExecutionStrategy.open(request(st), dry_run=True) as ex:
        work = needle_workload(ex.lm, st)
        plan = ex.decide(work)
        if not measure:
            return plan
        from mla_eval.model.executor import WindowForward
        from mla_eval.model.session import CacheSession

        t = max(st.length_list())
        ids = torch.zeros(st.batch, t, dtype=torch.long, device=ex.lm.device)
        fwd = WindowForward(ids, CacheSession(st.variants()[0].spec, ex.lm.num_layers, st.batch, t, ex.lm.layer_devices,
                                              prefill=st.prefill, lazy=True), t, slice(t - 1, t))
        cost, bps, src = ex.measure([(fwd, 1.0)], 0.0, ex.planning_input(st.batch, t),
                                    describe=f"one prompt batch of {st.batch} x {t} tokens (prefill; decode not projected)")
        return ex.decide(work, cost, bps, src)


V4_NOTE = ("DeepSeek-V4: each row is a cache configuration (sliding-window and compressed heads through their records "
           "as they are written, indexer keys exact); prefill and decode steps run the model's own attention (transformers' "
           "eager) through its own cache layers, eagerly; --prefill, --semantics and --math do not apply")


def v4_rows(st: NeedleSettings, lm, variants: list[Variant]) -> tuple[list[Variant], str | None]:
    """The rows a loaded model runs and, for DeepSeek-V4, the note that says how: its default --formats become its
    cache configurations, and options that read an MLA latent are refused (one line). An MLA model's rows must be
    MLA records."""
    if not getattr(lm.adapter, "is_v4", False):
        check_mla_rows(lm, variants)
        return variants, None
    if st.latent_profile != "none":
        raise UserError("--latent-profile reparametrises an MLA latent; no DeepSeek-V4 profile is published: drop it")
    if parse_semantics(st.semantics).is_engine or st.math != "bf16" or st.prefill != "mha":
        raise UserError("DeepSeek-V4 prefills and decodes through its own attention over the heads as the records read "
                        "them: drop --semantics engine:*, --math fp8-* and --prefill absorbed")
    if st.formats == DEFAULT_FORMATS:
        variants = parse_variants([BASELINE, *(c.name for c in V4_CONFIGS if c.name != BASELINE)])
    for v in variants:
        check_variant(v)
    return variants, V4_NOTE


def evaluate_needle(st: NeedleSettings, progress: ProgressCallback = no_progress) -> NeedleResult:
    """Needle-in-a-haystack retrieval per format on identical prompts; `progress("prompts", done, total)`."""
    from mla_eval.model.strategy import ExecutionStrategy

    variants, lens, deps, tasks = st.variants(), st.length_list(), st.depth_list(), st.task_list()
    needs_outer = any(v.outer for v in variants)
    if needs_outer and st.scales == "none":
        raise UserError("--scales none, but +s_l formats were asked for; drop them or give --scales FILE")
    given = OuterScales.load(st.scales) if needs_outer and st.scales not in SCALES_MODES else None  # before the load
    with dispatch.use_backend(st.backend) as log, ExecutionStrategy.open(request(st)) as ex:
        ex.decide(needle_workload(ex.lm, st))  # resident: a model that cannot fit is refused here
        lm = ex.realise()
        variants, v4_note = v4_rows(st, lm, variants)
        needs_outer = any(v.outer for v in variants)
        check_plan_model(variants, lm, st.latent_profile)  # a plan for another model fails before any prompt runs
        if lm.max_positions and max(lens) > lm.max_positions:
            raise UserError(
                f"--lengths {max(lens)} exceeds the model's {lm.max_positions} positions; "
                "use shorter lengths or extend the context with --rope-scaling yarn:FACTOR"
            )
        hay_ids, noise, hay_label = load_haystack(lm.tokenizer, st.haystack)
        profile = st.apply_profile(lm, torch.as_tensor(hay_ids), hay_label, progress)
        builder = PromptBuilder(lm.tokenizer, hay_ids, noise)
        for t in tasks:  # fail early: a haystack too short for the longest prompt, needles too many for the shortest
            budget = nd.new_tokens_for(t.kind, t.name, t.count)
            for length in (min(lens), max(lens)):
                builder.build(t.name, t.kind, length - budget, deps[-1], 0, st.seed, t.count)
        first = tasks[0]
        outer = None
        if needs_outer:
            if st.scales == "auto":
                calib = builder.build(first.name, first.kind, min(lens), 50.0, 0, st.seed + 99_991, first.count)
                source = TokenSource("needle", "a separate needle prompt", [torch.tensor(calib.ids)], "calib")
                outer = calibrate(lm, source, min(lens), progress, runner=ex.runner)
            else:
                outer = given
                outer.check_layers(lm.num_layers, source=st.scales)
        semantics = parse_semantics(st.semantics)
        semantics.check_positions(lm.max_positions)
        grid = nd.NeedleGrid(
            tuple(variants), tuple(lens), tuple(deps), st.trials, tuple(tasks), seed=st.seed, batch=st.batch,
            outer_scales=outer, prefill=st.prefill, stop_at_answer=not st.full_answers, cuda_graphs=st.cuda_graphs,
            semantics=semantics, math=get_math(st.math),
        )
        run = nd.run_needle(lm, builder, grid, progress=progress)
        env = environment(attention=log)
    names, labels = [v.name for v in variants], [t.label for t in tasks]
    intervals = needle_stats.cell_intervals(run.records, names, labels, lens)
    per_task = {
        label: {
            name: {"accuracy": nd.grid(run.records, name, lens, deps, task=label), "cells": intervals[label][name]}
            for name in names
        }
        for label in labels
    }
    summary = {}
    for v in variants:
        acc = nd.grid(run.records, v.name, lens, deps)
        summary[v.name] = {
            "accuracy": acc,
            "mean_accuracy": sum(map(sum, acc)) / (len(lens) * len(deps)),
            "effective_length": nd.effective_length(acc, lens, st.threshold),
            "seconds": run.seconds[v.name],
            "decode_steps": run.decode_steps[v.name],
        }
    paired = needle_stats.paired_tests(run.records, BASELINE, names, labels, lens)
    controls = [v.name for v in variants if v.spec.control]
    return NeedleResult(
        model={"name": lm.name, "path": str(lm.path), "default": lm.is_default, "max_positions": lm.max_positions,
               "random": lm.is_random, "label": lm.label, "rope_scaling": lm.rope_scaling, **lm.compute(),
               **({"latent_profile": profile} if profile is not None else {})},
        settings={"task": ",".join(labels), "values": st.values, "haystack": hay_label, "lengths": lens, "depths": deps,
                  "trials": st.trials, "seed": st.seed, "threshold": st.threshold, "prefill": st.prefill,
                  "max_new_tokens": run.max_new_tokens, "stop_at_answer": not st.full_answers,
                  "cuda_graphs": st.cuda_graphs, "backend": log.backend, "semantics": semantics.as_dict(),
                  "math": st.math, "tasks": labels, "controls": controls,
                  "plans": {v.name: v.source for v in variants if isinstance(v, PlanVariant)},
                  "needles": {t.label: t.count for t in tasks}, "answer_budgets": run.budgets,
                  "samples_per_cell": len(deps) * st.trials, "offload": st.offload, "execution": ex.mode,
                  **st.placement(lm), **({"deepseek_v4": v4_note} if v4_note else {})},
        outer_scales=outer,
        environment=env,
        formats=summary,
        format_induced_failures=nd.format_failures(run.records, BASELINE),
        records=run.records,
        total_seconds=run.total_seconds,
        tasks=per_task,
        paired_tests=paired,
        statistics=dict(needle_stats.METHOD),
        power=needle_power.power_report(paired, controls, st.power_drop or DEFAULT_POWER_DROP) if st.power else None,
    )
