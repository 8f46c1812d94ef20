"""`mla-eval report RESULTS_DIR`: one self-contained HTML page (and markdown) of a results directory."""

from __future__ import annotations

from pathlib import Path

import typer

from mla_eval.atomic_io import write_text_atomic
from mla_eval.errors import UserError
from mla_eval.report import page


def report(
    results: Path = typer.Argument(..., help="A results directory written by `mla-eval run`."),
    out: Path = typer.Option(None, "--out", "-o", help="HTML file, or a folder to hold report.html (default RESULTS/report.html; report.md beside it)."),
) -> None:
    """Tables of every evaluation side by side across formats, with the plots embedded."""
    if not results.is_dir():
        raise UserError(f"{results} is not a results directory (make one with `mla-eval run RECIPE`)")
    docs = page.load_results_dir(results)
    if not docs:
        raise UserError(f"{results} holds no kld.json, needle.json or capacity.json")
    out = out or results / "report.html"
    if out.is_dir():
        out = out / "report.html"
    secs = page.sections(docs)
    images = sorted((results / "plots").glob("*.png")) if (results / "plots").is_dir() else []
    title = f"mla-eval report — {results.name}"
    write_text_atomic(out, page.render_html(title, secs, images))
    write_text_atomic(out.with_suffix(".md"), page.render_markdown(title, secs))
    typer.echo(f"wrote {out} and {out.with_suffix('.md')}")


def register(app: typer.Typer) -> None:
    app.command("report")(report)
