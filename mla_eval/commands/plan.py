"""`mla-eval plan`: the options are PlanSettings' (mla_eval.commands.evaluation builds them); the command prints the
sensitivity table and the plan, and writes the plan file (`mla-eval/plan/v1`)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mla_eval.commands.evaluation import (
    EvaluationCommand,
    dry_run,
    dry_run_option,
    force_option,
    out_option,
    write_document,
)
from mla_eval.evals.plan_evaluation import PlanResult


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    out: Path | None = out_option("plan")
    force: bool = force_option()
    dry_run: bool = dry_run_option("sensitivity sweep")


def plan_body(ev, settings, opts: PlanOptions) -> None:
    """--dry-run: the sweep's plan alone; otherwise the plan file."""
    if not opts.dry_run:
        write_document(ev, settings, opts)
        return
    from mla_eval.evals.plan_evaluation import plan_plan

    dry_run(plan_plan, settings)


def _num(x: float | None, fmt: str = ".5f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def show_plan(result: PlanResult) -> None:
    sens, plan = result.sensitivity, result.plan
    con = Console()
    table = Table(title=f"Per-layer KLD with only that layer in the format (others bf16), {sens.tokens} tokens; "
                        "attention-output error in brackets")
    table.add_column("layer", justify="right")
    for c in sens.candidates:
        table.add_column(f"{c.name} ({c.spec.record_bytes} B)", justify="right")
    for i in range(sens.num_layers):
        cells = []
        for c in sens.candidates:
            err = "" if sens.attn_rel_l2 is None else f" [{sens.attn_rel_l2[c.name][i]:.3f}]"
            mark = " *" if plan.layers[i] == c else ""
            cells.append(f"{sens.kld[c.name][i]:.5f}{err}{mark}")
        table.add_row(str(i), *cells)
    table.add_row("sum", *[f"{sum(sens.kld[c.name]):.5f}" for c in sens.candidates])
    if sens.uniform_kld is not None:
        table.add_row("uniform", *[f"{sens.uniform_kld[c.name]:.5f}" for c in sens.candidates])
        table.add_row("spearman", *[_num(sens.spearman_per_format().get(c.name), ".2f") for c in sens.candidates])
    con.print(table)
    if sens.attn_rel_l2 is not None:
        con.print(f"rank agreement of attn_rel_l2 with the single-layer KLD over every (format, layer): Spearman "
                  f"{_num(sens.spearman_all(), '.2f')}")
    b = plan.budget or {}
    con.print(f"plan ({b.get('kind')} {b.get('value')}): {plan.summary()}")
    con.print(f"bytes per token: {plan.bytes_per_token} ({plan.bytes_per_token / plan.num_layers:.0f} per layer); "
              f"predicted KLD {_num(plan.predicted_kld)} (the sum of its layers' costs)")


COMMAND = EvaluationCommand(
    options=PlanOptions,
    body=plan_body,
    show=show_plan,
    details="Writes the plan file; measure it with `mla-eval kld --formats plan:FILE`, size it with "
    "`mla-eval capacity --plan FILE`.",
    order=("model", "text", "dataset", "max_tokens", "candidates", "budget_bytes_per_token", "max_kld", "pool_gain",
           "ctx", "out", "force"),
)
