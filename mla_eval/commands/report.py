"""`mla-eval report RESULTS_DIR`: one self-contained HTML page (and markdown) of a results directory.

Parses the options, calls `mla_eval.report.page.build_report`, writes, prints where.
"""

from __future__ import annotations

from pathlib import Path

import typer

from mla_eval.report import page


def report(
    results: Path = typer.Argument(..., help="A results directory written by `mla-eval run`."),
    out: Path = typer.Option(
        None, "--out", "-o", help="HTML file, or a folder to hold report.html (default RESULTS/report.html; report.md beside it)."
    ),
) -> None:
    """Tables of every evaluation side by side across formats, with the plots embedded."""
    if not results.is_dir():  # named first: the default --out lives inside it
        page.build_report(results)
    html_path, md_path = page.report_paths(results, out)  # before reading: a bad --out fails first
    page.write_report(page.build_report(results), html_path, md_path)
    typer.echo(f"wrote {html_path} and {md_path}")


def register(app: typer.Typer) -> None:
    app.command("report")(report)
