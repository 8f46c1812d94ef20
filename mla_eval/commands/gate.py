"""`mla-eval gate`: block quality regressions in CI (exit 1), 0 when within tolerance, 2 on bad input."""

from __future__ import annotations

from pathlib import Path

import typer

from mla_eval.atomic_io import write_text_atomic
from mla_eval.errors import UserError
from mla_eval.report import gate as g


def _tolerances(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"--tolerances {path}: {exc}") from None
    tol = doc.get("gate", doc)
    unknown = [k for k in tol if k not in g.METRICS]
    if unknown:
        raise UserError(f"--tolerances {path}: unknown metric(s) {', '.join(unknown)}; known: {', '.join(g.METRICS)}")
    return tol


def gate(
    results: Path = typer.Argument(..., help="A result JSON, or a results directory of them."),
    baseline: Path = typer.Option(..., "--baseline", "-b", help="Baseline JSON or directory (e.g. results/baselines/ci-smoke)."),
    tolerances: Path = typer.Option(None, "--tolerances", help="TOML with [gate.<metric>] abs = .., rel = .. (a recipe's [gate] table works)."),
    junit: Path = typer.Option(None, "--junit", help="Also write JUnit XML here."),
    update: bool = typer.Option(False, "--update", help="Replace the baseline with these results (explicit refresh) and exit 0."),
) -> None:
    """Compare results with a baseline metric by metric; exit 1 on any regression.

    Directions: KLD may not rise, same-top-1 and retrieval may not fall, pool tokens and bytes
    must match exactly. Defaults: kld_mean abs 1e-4 / rel 5 %, kld_p99 abs 1e-3 / rel 10 %,
    same_top1_pct 0.5 points, retrieval and capacity exact.
    """
    if update:
        _update(results, baseline)
        typer.echo(f"baseline {baseline} updated from {results}")
        return
    checks = g.compare(g.load_docs(results), g.load_docs(baseline), _tolerances(tolerances))
    typer.echo(g.markdown(checks))
    if junit:
        junit.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(junit, g.junit(checks))
    if any(not c.ok for c in checks):
        raise typer.Exit(1)


def _update(results: Path, baseline: Path) -> None:
    """Make the baseline hold exactly the results' documents (validated first, so an unusable
    result never becomes a baseline), plus the recipe and environment that produced them.
    Plots and reports are not baseline material and are not copied."""
    docs = g.load_docs(results)
    if not results.is_dir():
        write_text_atomic(baseline, results.read_text(encoding="utf-8"))
        return
    keep = [*docs, *(n for n in ("environment.json", "recipe.toml") if (results / n).is_file())]
    for name in keep:
        write_text_atomic(baseline / name, (results / name).read_text(encoding="utf-8"))
    for stale in baseline.glob("*.json"):  # a document the new results no longer have
        if stale.name not in keep:
            stale.unlink()


def register(app: typer.Typer) -> None:
    app.command("gate")(gate)
