"""`mla-eval gate`: block quality regressions in CI (exit 1), 0 when within tolerance, 2 on bad input.

Parses the options, calls `mla_eval.report.gate.run_gate` (or `update_baseline`), prints.
"""

from __future__ import annotations

from pathlib import Path

import typer

from mla_eval.report import gate as g


def gate(
    results: Path = typer.Argument(..., help="A result JSON, or a results directory of them."),
    baseline: Path = typer.Option(..., "--baseline", "-b", help="Baseline JSON or directory (e.g. results/baselines/ci-smoke)."),
    tolerances: Path = typer.Option(
        None, "--tolerances", help="TOML with [gate.<metric>] abs = .., rel = .. (a recipe's [gate] table works)."
    ),
    junit: Path = typer.Option(None, "--junit", help="Also write JUnit XML here."),
    update: bool = typer.Option(False, "--update", help="Replace the baseline with these results (explicit refresh) and exit 0."),
) -> None:
    """Compare results with a baseline metric by metric; exit 1 on any regression.

    Directions: KLD may not rise, same-top-1 and retrieval may not fall, pool tokens and bytes
    must match exactly. Defaults: kld_mean abs 1e-4 / rel 5 %, kld_p99 abs 1e-3 / rel 10 %,
    same_top1_pct 0.5 points, retrieval and capacity exact.
    """
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


def register(app: typer.Typer) -> None:
    app.command("gate")(gate)
