"""The needle evaluation as a library call: `evaluate_needle(NeedleSettings(...)) -> NeedleResult`.

Settings are validated when built; the result serialises to the `mla-eval/needle/v1` document.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from mla_eval.attention import dispatch
from mla_eval.errors import UserError
from mla_eval.evals import needle as nd
from mla_eval.evals.calibrate import calibrate
from mla_eval.evals.needle_tasks import TASKS, VALUE_KINDS, PromptBuilder, load_haystack
from mla_eval.evals.settings import ModelSettings, ProgressCallback, no_progress
from mla_eval.evals.text_sources import TokenSource
from mla_eval.evals.variants import Variant, parse_variants
from mla_eval.formats import OuterScales
from mla_eval.model.session import PREFILL_MODES
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


@dataclasses.dataclass(frozen=True)
class NeedleSettings(ModelSettings):
    """Everything `mla-eval needle` takes (the same names as its long options)."""

    formats: str | list[str] = DEFAULT_FORMATS
    lengths: str | list[int] = DEFAULT_LENGTHS
    depths: str | list[float] | None = None
    depth_steps: int = 11
    trials: int = 1
    task: str = "passkey"
    values: str = "number"
    haystack: Path | None = None
    scales: str = "auto"
    batch: int = 1
    prefill: str = "mha"
    full_answers: bool = False
    cuda_graphs: bool = True
    threshold: float = 0.9
    seed: int = 0

    def __post_init__(self) -> None:
        ModelSettings.__post_init__(self)
        if self.task not in TASKS:
            raise UserError(f"unknown task {self.task!r}; choose one of {', '.join(TASKS)}")
        if self.values not in VALUE_KINDS:
            raise UserError(f"--values {self.values!r}: choose one of {', '.join(VALUE_KINDS)}")
        if self.prefill not in PREFILL_MODES:
            raise UserError(f"--prefill {self.prefill!r}: choose one of {', '.join(PREFILL_MODES)}")
        if self.trials < 1 or self.batch < 1:
            raise UserError("--trials and --batch must be at least 1")
        if not 0 <= self.threshold <= 1:
            raise UserError(f"--threshold is an accuracy in 0..1, got {self.threshold}")
        if min(self.length_list()) <= self.max_new_tokens() + 16:
            raise UserError(
                f"--lengths {min(self.length_list())} is too short: a cell holds the prompt and "
                f"{self.max_new_tokens()} answer tokens"
            )
        self.depth_list()
        self.variants()

    def variants(self) -> list[Variant]:
        """bf16 first (the baseline every failure is measured against), then the asked formats."""
        formats = self.formats.split(",") if isinstance(self.formats, str) else list(self.formats)
        return parse_variants([BASELINE, *formats])

    def length_list(self) -> list[int]:
        return parse_lengths(self.lengths)

    def depth_list(self) -> list[float]:
        return parse_depths(self.depths, self.depth_steps)

    def max_new_tokens(self) -> int:
        return nd.new_tokens_for(self.values, self.task)

    @property
    def cells(self) -> int:
        """Prompts per format: lengths x depths x trials."""
        return len(self.length_list()) * len(self.depth_list()) * self.trials


@dataclasses.dataclass
class NeedleResult:
    model: dict[str, Any]
    settings: dict[str, Any]
    outer_scales: OuterScales | None
    environment: dict[str, Any]
    formats: dict[str, dict]  # per format: accuracy [length][depth], mean_accuracy, effective_length, ...
    format_induced_failures: list[dict]
    records: list[dict]
    total_seconds: float

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
        }


def evaluate_needle(st: NeedleSettings, progress: ProgressCallback = no_progress) -> NeedleResult:
    """Needle-in-a-haystack retrieval per format on identical prompts; `progress("prompts", done, total)`."""
    variants, lens, deps = st.variants(), st.length_list(), st.depth_list()
    needs_outer = any(v.outer for v in variants)
    if needs_outer and st.scales == "none":
        raise UserError("--scales none, but +s_l formats were asked for; drop them or give --scales FILE")
    with dispatch.use_backend(st.backend) as log:
        lm = st.load()
        max_new = st.max_new_tokens()
        if lm.max_positions and max(lens) > lm.max_positions:
            raise UserError(
                f"--lengths {max(lens)} exceeds the model's {lm.max_positions} positions; "
                "use shorter lengths (context extension such as YaRN must be set in the checkpoint's config)"
            )
        hay_ids, noise, hay_label = load_haystack(lm.tokenizer, st.haystack)
        builder = PromptBuilder(lm.tokenizer, hay_ids, noise)
        builder.build(st.task, st.values, max(lens) - max_new, deps[-1], 0, st.seed)  # fails early if the haystack is too short
        outer = None
        if needs_outer:
            if st.scales == "auto":
                calib = builder.build(st.task, st.values, min(lens), 50.0, 0, st.seed + 99_991)
                source = TokenSource("needle", "a separate needle prompt", [torch.tensor(calib.ids)], "calib")
                outer = calibrate(lm, source, min(lens), progress)
            else:
                outer = OuterScales.load(st.scales)
                outer.check_layers(lm.num_layers, source=st.scales)
        grid = nd.NeedleGrid(
            tuple(variants), tuple(lens), tuple(deps), st.trials, st.task, st.values, seed=st.seed, batch=st.batch,
            outer_scales=outer, prefill=st.prefill, stop_at_answer=not st.full_answers, cuda_graphs=st.cuda_graphs,
        )
        run = nd.run_needle(lm, builder, grid, progress=progress)
        env = environment(attention=log)
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
    return NeedleResult(
        model={"name": lm.name, "path": str(lm.path), "default": lm.is_default, "max_positions": lm.max_positions,
               "random": lm.is_random, "label": lm.label},
        settings={"task": st.task, "values": st.values, "haystack": hay_label, "lengths": lens, "depths": deps,
                  "trials": st.trials, "seed": st.seed, "threshold": st.threshold, "prefill": st.prefill,
                  "max_new_tokens": run.max_new_tokens, "stop_at_answer": not st.full_answers,
                  "cuda_graphs": st.cuda_graphs, "backend": log.backend, **st.placement(lm)},
        outer_scales=outer,
        environment=env,
        formats=summary,
        format_induced_failures=nd.format_failures(run.records, BASELINE),
        records=run.records,
        total_seconds=run.total_seconds,
    )
