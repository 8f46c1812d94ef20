"""`mla-eval calibrate`: the options are CalibrateSettings' (mla_eval.commands.evaluation builds them);
the command writes the published outer-scale JSON and prints the scales."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mla_eval.commands.evaluation import (
    EvaluationCommand,
    check_inputs_and_outputs,
    dry_run,
    dry_run_option,
    force_option,
)
from mla_eval.commands.progress import progress_bars
from mla_eval.evals.calibrate import CalibrateSettings, CalibrationResult
from mla_eval.protocol import REQUIRED, Evaluation, option
from mla_eval.results import check_output_path

console = Console(stderr=True)


@dataclasses.dataclass(frozen=True)
class CalibrateOptions:
    out: Path = option(REQUIRED, "--out", "-o", path="write",
                       help="Where to write the nvfp4_ds_mla_outer_scale_v1 JSON (--dry-run writes nothing there).")
    force: bool = force_option()
    dry_run: bool = dry_run_option("calibration")


def run_calibrate(ev: Evaluation, settings: CalibrateSettings, opts: CalibrateOptions) -> None:
    from mla_eval.atomic_io import write_json_atomic

    if opts.dry_run:
        from mla_eval.evals.calibrate import plan_calibration

        dry_run(plan_calibration, settings)
        return

    check_output_path(opts.out, opts.force)
    check_inputs_and_outputs(settings, [("--out", opts.out)])  # e.g. --text t.json --out t.json
    with progress_bars(console) as progress:
        result = ev.run(settings, progress)
    write_json_atomic(opts.out, result.to_document())
    show_scales(result)
    console.print(f"wrote {opts.out}", soft_wrap=True)  # a path is never wrapped: users copy it


def show_scales(result: CalibrationResult) -> None:
    table = Table(title=f"Per-layer outer scales — {result.source_label}")
    table.add_column("layer", justify="right")
    table.add_column("max |c_kv|", justify="right")
    table.add_column("s_l", justify="right")
    for i, (a, s) in enumerate(zip(result.scales.provenance["max_abs_c_kv"], result.scales.scales)):
        table.add_row(str(i), f"{a:.4g}", f"{s:.6g}")
    Console().print(table)


COMMAND = EvaluationCommand(
    options=CalibrateOptions,
    body=run_calibrate,
    show=show_scales,
    order=("model", "text", "dataset", "max_tokens", "samples", "sample_len", "seed", "ctx", "out", "force", "device",
           "device_map", "backend", "semantics", "math"),
)
