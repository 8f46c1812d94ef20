"""One self-contained page (HTML with embedded PNGs, and markdown) for a results directory.

Each registered evaluation (mla_eval.evaluation) contributes the tables of its documents: its own
`report` tables (kld_tables, needle_tables, capacity_tables below) or, without them, its gate metrics.
"""

from __future__ import annotations

import base64
import dataclasses
import html
from pathlib import Path

from mla_eval.atomic_io import write_text_atomic
from mla_eval.errors import UserError
from mla_eval.evals.report_tables import fmt
from mla_eval.evaluation import evaluations
from mla_eval.protocol import Evaluation, Table
from mla_eval.user_paths import check_output_target, is_special

GENERATOR = "mla-eval report"  # in every page we write: how --out recognises a page it may replace

def _of_kind(docs: dict[str, dict], kind: str) -> list[dict]:
    """The documents of one kind: `<kind>.json` and any `<kind>-<name>.json`, in name order."""
    return [docs[k] for k in sorted(docs) if k == kind or k.startswith(kind + "-")]


def metric_tables(ev: Evaluation, d: dict) -> list[Table]:
    """An evaluation without tables of its own: its gate metrics, one row per document row."""
    names = [m.name for m in ev.metrics]
    rows = [[key] + [fmt(row.get(m), "{:.6g}") for m in names] for key, row in ev.rows(d)] if ev.rows else []
    return [(ev.summary, ["row", *names], rows)]


def sections(docs: dict[str, dict]) -> list[Table]:
    """(title, header, rows) for every table the page shows: each evaluation's documents in registry order."""
    out = []
    for ev in results_dir_evaluations():
        for d in _of_kind(docs, ev.stem):
            out += ev.report(d) if ev.report is not None else metric_tables(ev, d)
    return out


def results_dir_evaluations() -> list[Evaluation]:
    """The evaluations whose documents a results directory holds."""
    return [ev for ev in evaluations() if ev.stem is not None]


def load_results_dir(folder: Path) -> dict[str, dict]:
    """The result documents of a results directory, keyed by file stem, each validated: for
    each evaluation (kld, needle, capacity, ...) `<stem>.json` and any `<stem>-<name>.json` (a recipe
    with several setups of one evaluation writes one per setup)."""
    from mla_eval.results import read_result

    docs = {}
    for ev in results_dir_evaluations():
        for p in sorted([*folder.glob(f"{ev.stem}.json"), *folder.glob(f"{ev.stem}-*.json")]):
            doc = read_result(p)
            if doc["schema"] != ev.schema:
                raise UserError(f"{p}: schema {doc['schema']!r}, but a results directory's {p.name} is {ev.schema}")
            docs[p.stem] = doc
    return docs


def render_markdown(title: str, secs) -> str:
    lines = [f"<!-- generator: {GENERATOR} -->", f"# {title}", ""]
    for t, head, rows in secs:
        if not head:  # a note: one line of text, no table
            lines += [f"> {t}", ""]
            continue
        lines += [f"## {t}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def render_html(title: str, secs, images: list[Path]) -> str:
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><meta name='generator' content='{GENERATOR}'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:0 0 1.5em}"
        "th,td{border:1px solid #ccc;padding:4px 10px;text-align:right}th{background:#f3f3f3}"
        "td:first-child,th:first-child{text-align:left}"
        ".grid{display:flex;flex-wrap:wrap;gap:12px}.grid figure{margin:0}"
        ".grid img{max-width:560px;border:1px solid #ddd}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    for t, head, rows in secs:
        if not head:  # a note: one line of text, no table
            parts.append(f"<p><strong>{html.escape(t)}</strong></p>")
            continue
        parts.append(f"<h2>{html.escape(t)}</h2><table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows]
        parts.append("</table>")
    if images:
        parts.append("<h2>Plots</h2><div class='grid'>")
        for img in images:
            data = base64.b64encode(img.read_bytes()).decode()
            name = html.escape(img.stem)
            parts.append(f"<figure><img alt='{name}' src='data:image/png;base64,{data}'><figcaption>{name}</figcaption></figure>")
        parts.append("</div>")
    parts.append("</body></html>")
    return "\n".join(parts)


# --- the report as one call: a results directory in, the page (and where it goes) out --------------


@dataclasses.dataclass(frozen=True)
class Report:
    """The tables of a results directory and its plots, renderable as HTML and markdown."""

    title: str
    sections: tuple
    images: tuple[Path, ...]

    def html(self) -> str:
        return render_html(self.title, self.sections, list(self.images))

    def markdown(self) -> str:
        return render_markdown(self.title, self.sections)


def build_report(results: Path) -> Report:
    """Read and validate the documents of a results directory (written by `mla-eval run`)."""
    results = Path(results)
    if not results.is_dir():
        raise UserError(f"{results} is not a results directory (make one with `mla-eval run RECIPE`)")
    docs = load_results_dir(results)
    if not docs:
        *first, last = [ev.result_file for ev in results_dir_evaluations()]
        raise UserError(f"{results} holds no {', '.join(first) + ' or ' if first else ''}{last}")
    images = tuple(sorted((results / "plots").glob("*.png"))) if (results / "plots").is_dir() else ()
    return Report(f"mla-eval report — {results.name}", tuple(sections(docs)), images)


def is_our_report(path: Path) -> bool:
    """A report page (html or markdown) mla-eval wrote: it names its generator near the top."""
    if is_special(path):  # never opened: a FIFO would wait for a writer
        return False
    try:
        with open(path, encoding="utf-8") as f:
            return GENERATOR in f.read(600)
    except (OSError, UnicodeDecodeError):
        return False


def report_paths(results: Path, out: Path | None) -> tuple[Path, Path]:
    """(html, markdown) paths for `--out` (a file, a folder to hold report.html, or None: inside
    `results`), checked before any work: writable, and an existing page replaced only if we wrote it."""
    from mla_eval.results import check_writable_folder, promise_output

    out = Path(out) if out is not None else Path(results) / "report.html"
    check_output_target(out, "--out")
    if out.is_dir():
        out = out / "report.html"
    if out.suffix.lower() == ".md":
        raise UserError(f"--out {out}: give the .html path; the markdown goes beside it")
    pair = (out, out.with_suffix(".md"))
    for path in pair:
        check_output_target(path, "--out")
        if path.is_dir():
            raise UserError(f"--out {out}: {path} is a folder")
        if path.exists() and not is_our_report(path):
            raise UserError(f"{path} exists and is not a report mla-eval wrote; choose another --out")
    check_writable_folder(out)
    for path in pair:
        promise_output(path)
    return pair


def write_report(report: Report, html_path: Path, md_path: Path) -> None:
    from mla_eval.results import fulfil_output

    for path, text in ((html_path, report.html()), (md_path, report.markdown())):
        write_text_atomic(path, text)
        fulfil_output(path)
