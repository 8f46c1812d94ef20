"""`mla-eval gate`: block quality regressions in CI (exit 1), 0 when within tolerance, 2 on bad input.

Parses the options, calls `mla_eval.report.gate.run_gate` (or `update_baseline`), prints.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import typer

from mla_eval.evaluation import gate_metrics
from mla_eval.report import gate as g


def gate(
    results: Path = typer.Argument(..., help="A result JSON, or a results directory of them."),
    baseline: Path = typer.Option(..., "--baseline", "-b", help="Baseline JSON or directory (e.g. results/baselines/ci-smoke)."),
    tolerances: Path = typer.Option(
        None, "--tolerances",
        help=r"TOML with a \[gate] table (a recipe's works): <metric> = {abs = .., rel = ..} per metric, and optional = "
        r'\["needle.json", "mxfp4", "effective_length", ...]: documents, format rows (bare or "fmt (semantics, math)", '
        "globs allowed) or metrics that may be missing on either side.",
    ),
    junit: Path = typer.Option(None, "--junit", help="Also write JUnit XML here."),
    update: bool = typer.Option(False, "--update", help="Replace the baseline with these results (explicit refresh) and exit 0."),
) -> None:
    """Compare results with a baseline metric by metric; exit 1 on any regression.

    Nothing passes by omission: a document, a format row (each semantics and math variant) or a metric that
    one side has and the other lacks fails the gate, unless the --tolerances file lists it as optional."""
    if update:
        g.update_baseline(results, baseline)
        typer.echo(f"baseline {baseline} updated from {results}")
        return
    if junit is not None:
        g.check_junit_path(junit)  # before the comparison: a bad --junit never costs the verdict
    verdict = g.run_gate(g.GateSettings(results=results, baseline=baseline, tolerances=tolerances))
    typer.echo(verdict.markdown())
    if junit is not None:
        g.write_junit(verdict, junit)
    if not verdict.ok:
        raise typer.Exit(verdict.exit_code)


def metrics_help() -> str:
    """Each metric of the registered evaluations with its direction and default tolerance."""
    parts = []
    for m in gate_metrics().values():
        if m.direction == "exact":
            parts.append(f"{m.name} must match")
            continue
        worse = "rise" if m.direction == "lower" else "fall"
        if m.abs_tol == m.rel_tol == 0:
            parts.append(f"{m.name} may not {worse}")
            continue
        rel = f"{m.rel_tol:.0%} of the baseline"
        allowed = f"{m.abs_tol:g}" if m.rel_tol == 0 else rel if m.abs_tol == 0 else f"max({m.abs_tol:g}, {rel})"
        parts.append(f"{m.name} may not {worse} by more than {allowed}")
    return "Defaults (a --tolerances file overrides them): " + "; ".join(parts) + "."


def register(app: typer.Typer) -> None:
    app.command("gate", help=f"{inspect.cleandoc(gate.__doc__)}\n\n{metrics_help()}")(gate)
