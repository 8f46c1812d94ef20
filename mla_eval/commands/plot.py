"""`mla-eval plot RESULT.json`: the heatmaps of a saved needle result, without rerunning it.

A needle document holds every cell's accuracy (pooled and per task), so its plots can be drawn on
any machine later, e.g. from a GPU run whose plot folder did not come back. kld plots need the run's
per-token data, which a document does not keep: draw those with `kld --plot`.
"""

from __future__ import annotations

from pathlib import Path

import typer

from mla_eval.errors import UserError
from mla_eval.report.plots import check_plot_folder, needle_document_plots
from mla_eval.result_schemas import NEEDLE_SCHEMA
from mla_eval.results import load_json, read_result


def plot(
    result: Path = typer.Argument(..., help="A needle result JSON written by `mla-eval needle` or `mla-eval run`."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder for the PNG files (created if missing)."),
) -> None:
    """Heatmaps of a saved needle result (accuracy by length x depth, per format, per task, minus bf16).

    Draws what `needle --plot` would have, from the JSON alone (a GPU run's lost plots, an old result).
    """
    check_plot_folder(out, option="--out")  # before reading: a bad --out fails first
    if not result.exists():
        raise UserError(f"{result}: no such file; give a needle result JSON")
    first = load_json(result)
    schema = first.get("schema") if isinstance(first, dict) else None
    if schema != NEEDLE_SCHEMA:
        raise UserError(f"{result}: plot draws needle results ({NEEDLE_SCHEMA}), not {schema or 'this file'}; "
                        "kld plots need the run's per-token data: use kld --plot")
    doc = read_result(result, NEEDLE_SCHEMA)
    for p in needle_document_plots(doc, out):
        typer.echo(f"wrote {p}")


def register(app: typer.Typer) -> None:
    app.command("plot")(plot)
