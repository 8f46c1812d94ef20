"""Regression gate: compare result documents metric by metric against a baseline.

The metrics are those the registered evaluations declare (mla_eval.evaluation.Metric). Every metric
has a direction (KLD may not rise, retrieval may not fall, pool tokens must match) and a tolerance:
a change against the good direction is a regression only when it exceeds max(abs, rel * |baseline|).
A metric present in the baseline and missing from the results is a regression too (a format silently
dropped must not pass). A row's identity includes the attention semantics and math it ran under
(`identity`): a figure is only ever compared with one of the same.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from xml.sax.saxutils import escape

from mla_eval.atomic_io import write_text_atomic
from mla_eval.errors import UserError
from mla_eval.evaluation import evaluation_for_schema, evaluations, gate_metrics
from mla_eval.protocol import Evaluation
from mla_eval.result_schemas import validate
from mla_eval.results import check_writable_folder, fulfil_output, is_our_document, load_json, promise_output, read_result

JUNIT_SUITE = "mla-eval gate"  # the testsuite name of our JUnit files: how --junit recognises one it may replace


@dataclasses.dataclass
class Check:
    doc: str
    name: str  # e.g. "nvfp4.kld_mean"
    metric: str
    baseline: float | None
    value: float | None
    ok: bool
    why: str


def _gated() -> list[Evaluation]:
    return [ev for ev in evaluations() if ev.metrics]


def _either(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _metrics(doc: dict) -> dict[str, tuple[str, float | None]]:
    """'<row identity>.<metric>' -> (metric, value) for a document of a gated evaluation."""
    schema = doc.get("schema", "")
    ev = evaluation_for_schema(schema)
    if ev is None or not ev.metrics:
        raise UserError(f"unknown result schema {str(schema)!r}; gate reads {_either([e.name for e in _gated()])} results")
    out: dict[str, tuple[str, float | None]] = {}
    for key, row in ev.rows(doc):
        for m in ev.metrics:
            if m.name in row:
                out[f"{key}.{m.name}"] = (m.name, row[m.name])
    return out


def load_docs(path: Path) -> dict[str, dict]:
    """A result JSON file, or every result *.json of a results directory (those with an mla-eval
    `schema`; environment.json has none), keyed by file name; each validated against its schema."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path} does not exist")
    if not path.is_dir():
        return {path.name: read_result(path)}
    docs = {}
    for f in sorted(path.glob("*.json")):
        doc = load_json(f)
        if isinstance(doc, dict) and str(doc.get("schema", "")).startswith("mla-eval"):
            validate(doc, str(f))
            docs[f.name] = doc
    if not docs:
        raise UserError(f"{path} holds no mla-eval result JSON")
    return docs


def compare(results: dict[str, dict], baseline: dict[str, dict], tolerances: dict | None = None) -> list[Check]:
    tolerances = tolerances or {}
    checks: list[Check] = []
    if len(results) == 1 and len(baseline) == 1:  # two single files: pair them whatever their names
        results = {next(iter(baseline)): next(iter(results.values()))}
    for name, bdoc in baseline.items():
        rdoc = results.get(name)
        if rdoc is None:
            checks.append(Check(name, "*", "*", None, None, False, "result document missing"))
            continue
        if rdoc.get("schema") != bdoc.get("schema"):
            raise UserError(f"{name}: schema {rdoc.get('schema')!r} vs baseline {bdoc.get('schema')!r}")
        ev = evaluation_for_schema(bdoc.get("schema"))
        if ev is not None and ev.comparable is not None:  # e.g. kld: both ran the same window path
            ev.comparable(rdoc, bdoc, name)
        rm = _metrics(rdoc)
        known = gate_metrics()
        for key, (metric, base) in _metrics(bdoc).items():
            direction = known[metric].direction
            tol = tolerances.get(metric, {})
            abs_tol, rel_tol = float(tol.get("abs", known[metric].abs_tol)), float(tol.get("rel", known[metric].rel_tol))
            value = rm.get(key, (metric, None))[1]
            if value is None or base is None:
                ok = value == base
                if value is None and base is not None:
                    why = "missing in results"
                else:
                    why = "ok" if ok else "new value where baseline had none"
            else:
                allowed = max(abs_tol, rel_tol * abs(base))
                delta = value - base
                if direction == "exact":
                    ok = value == base
                elif direction == "lower":
                    ok = delta <= allowed or math.isclose(value, base)
                else:
                    ok = -delta <= allowed or math.isclose(value, base)
                moved = "rose" if delta > 0 else "fell"
                why = "ok" if ok else f"{moved} by {abs(delta):.6g} (allowed {allowed:.3g}, {direction} is better)"
            checks.append(Check(name, key, metric, base, value, ok, why))
    return checks


def markdown(checks: list[Check]) -> str:
    bad = [c for c in checks if not c.ok]
    head = f"**mla-eval gate: {'FAIL' if bad else 'PASS'}** — {len(checks) - len(bad)}/{len(checks)} metrics within tolerance"
    lines = [head, "", "| result | metric | baseline | now | verdict |", "|---|---|---|---|---|"]
    for c in sorted(checks, key=lambda c: c.ok):
        fmt = lambda v: "-" if v is None else f"{v:.6g}"  # noqa: E731
        lines.append(f"| {c.doc} | {c.name} | {fmt(c.baseline)} | {fmt(c.value)} | {'ok' if c.ok else 'REGRESSION: ' + c.why} |")
    return "\n".join(lines)


def junit(checks: list[Check]) -> str:
    fails = sum(not c.ok for c in checks)
    cases = []
    for c in checks:
        why = escape(c.why, {chr(34): "&quot;"})
        body = "" if c.ok else f'<failure message="{why}">baseline {c.baseline} now {c.value}</failure>'
        cases.append(f'  <testcase classname="mla_eval.gate.{escape(c.doc)}" name="{escape(c.name)}">{body}</testcase>')
    head = f'<?xml version="1.0" encoding="utf-8"?>\n<testsuite name="{JUNIT_SUITE}" tests="{len(checks)}" failures="{fails}">\n'
    return head + "\n".join(cases) + "\n</testsuite>\n"


# --- the gate as one call: settings in, a result out ------------------------------------------------


def load_tolerances(path: Path | None) -> dict:
    """Tolerances from a TOML file: its [gate] table (a recipe works) or the top level, each
    `<metric> = {abs = .., rel = ..}`; unknown metrics are a one-line UserError."""
    if path is None:
        return {}
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    try:
        doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"--tolerances {path}: {' '.join(str(exc).split())}") from None
    tol = doc.get("gate", doc)
    if not isinstance(tol, dict):
        raise UserError(f"--tolerances {path}: [gate] must be a table of metrics")
    known = gate_metrics()
    unknown = [k for k in tol if k not in known]
    if unknown:
        raise UserError(f"--tolerances {path}: unknown metric(s) {', '.join(unknown)}; known: {', '.join(known)}")
    for metric, limits in tol.items():
        if not isinstance(limits, dict) or any(k not in ("abs", "rel") for k in limits):
            raise UserError(f"--tolerances {path}: {metric} must be a table with abs and/or rel, e.g. {metric} = {{abs = 1e-4}}")
        for k, v in limits.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise UserError(f"--tolerances {path}: {metric}.{k} must be a number >= 0, got {v!r}")
    return tol


@dataclasses.dataclass(frozen=True)
class GateSettings:
    """Compare `results` (a result JSON or a results directory) with `baseline`; `tolerances` is
    a TOML file (see load_tolerances) or None for each metric's default tolerances."""

    results: Path
    baseline: Path
    tolerances: Path | None = None


@dataclasses.dataclass(frozen=True)
class GateResult:
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def exit_code(self) -> int:
        """0 within tolerance, 1 on any regression (what CI reads)."""
        return 0 if self.ok else 1

    def markdown(self) -> str:
        return markdown(list(self.checks))

    def junit(self) -> str:
        return junit(list(self.checks))


def run_gate(settings: GateSettings) -> GateResult:
    tolerances = load_tolerances(settings.tolerances)
    return GateResult(tuple(compare(load_docs(settings.results), load_docs(settings.baseline), tolerances)))


def check_junit_path(path: Path) -> Path:
    """Before the work: can the JUnit file be written? An existing file is replaced only when it
    is a gate report we wrote."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"--junit {path} is a folder; give a file path (e.g. {path / 'gate.xml'})")
    if path.exists():
        try:
            head = path.read_text(encoding="utf-8")[:400]
        except (OSError, UnicodeDecodeError):
            head = ""
        if f'<testsuite name="{JUNIT_SUITE}"' not in head:
            raise UserError(f"--junit {path} exists and is not a gate report mla-eval wrote; choose another path")
    check_writable_folder(path)
    promise_output(path)
    return path


def write_junit(result: GateResult, path: Path) -> None:
    write_text_atomic(path, result.junit())
    fulfil_output(path)


def update_baseline(results: Path, baseline: Path) -> list[str]:
    """Make the baseline hold exactly the results' documents (validated first, so an unusable
    result never becomes a baseline), plus the recipe and environment that produced them; returns
    the file names written. Plots and reports are not baseline material and are not copied; a
    stale baseline document is removed only if it is one of ours."""
    results, baseline = Path(results), Path(baseline)
    docs = load_docs(results)
    if not results.is_dir():
        if baseline.is_dir():
            raise UserError(f"--baseline {baseline} is a folder but {results} is one file; give a baseline file")
        if baseline.exists() and not is_our_document(baseline):
            raise UserError(f"--baseline {baseline} exists and is not an mla-eval result; it is not replaced")
        write_text_atomic(baseline, results.read_text(encoding="utf-8"))
        return [baseline.name]
    if baseline.exists() and not baseline.is_dir():
        raise UserError(f"--baseline {baseline} is a file but {results} is a results directory; give a folder")
    keep = [*docs, *(n for n in ("environment.json", "recipe.toml") if (results / n).is_file())]
    for name in keep:
        write_text_atomic(baseline / name, (results / name).read_text(encoding="utf-8"))
    for stale in baseline.glob("*.json"):  # a document the new results no longer have
        if stale.name not in keep and is_our_document(stale):
            stale.unlink()
    return keep
