"""Regression gate: compare result documents metric by metric against a baseline.

The metrics are those the registered evaluations declare (mla_eval.evaluation.Metric). Every metric
has a direction (KLD may not rise, retrieval may not fall, pool tokens must match) and a tolerance:
a change against the good direction is a regression only when it exceeds max(abs, rel * |baseline|).
Nothing passes by omission: a document, a format row (with its semantics and math) or a metric that
one side has and the other lacks is a regression (a format silently dropped, or a document the
baseline never had, must not pass), unless the tolerances file lists it in `optional = [...]`. A
row's identity includes the attention semantics and math it ran under (`identity`): a figure is only
ever compared with one of the same.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import warnings
from pathlib import Path
from xml.sax.saxutils import escape

from mla_eval.atomic_io import write_text_atomic
from mla_eval.errors import UserError
from mla_eval.evaluation import evaluation_for_schema, evaluations, gate_metrics
from mla_eval.protocol import Evaluation
from mla_eval.result_schemas import validate
from mla_eval.results import check_writable_folder, fulfil_output, is_our_document, load_json, promise_output, read_result
from mla_eval.user_paths import RESULT_LIMIT, TOML_LIMIT, check_output_target, read_input_text

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


def _rows(doc: dict) -> dict[str, dict[str, float | None]]:
    """'<row identity>' -> {metric: value} for a document of a gated evaluation (only the metrics the row holds)."""
    schema = doc.get("schema", "")
    ev = evaluation_for_schema(schema)
    if ev is None or not ev.metrics:
        raise UserError(f"unknown result schema {str(schema)!r}; gate reads {_either([e.name for e in _gated()])} results")
    return {key: {m.name: row[m.name] for m in ev.metrics if m.name in row} for key, row in ev.rows(doc)}


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


OPTIONAL_KEY = "optional"  # the [gate] key listing what may be missing on either side (not a metric)


class OptionalAbsences:
    """The `optional = [...]` list of a tolerances file: shell-style patterns (fnmatch) naming what may be
    missing on one side without failing the gate. A pattern matches a document by file name or stem
    ("needle.json", "needle"), a row by its identity or bare format ("nvfp4 (engine:512, bf16)", "nvfp4",
    "* (engine:512, *)"), a metric by name or as "<row>.<metric>" ("effective_length", "mxfp4.kld_p99")."""

    def __init__(self, patterns: list[str]) -> None:
        self.patterns = list(patterns)
        self.seen: set[str] = set()  # every name the comparison offered (what a pattern could have matched)

    def allows(self, *names: str) -> bool:
        return any(fnmatch.fnmatchcase(n, p) for p in self.patterns for n in names)

    def offer(self, *names: str) -> None:
        """Names present on either side (documents, rows, metrics), whether or not absent on the other."""
        self.seen.update(names)

    def unmatched(self) -> list[str]:
        """Patterns that match no name on either side: a typo that would allow nothing, said as a warning."""
        return [p for p in self.patterns if not any(fnmatch.fnmatchcase(n, p) for n in self.seen)]


def _row_names(row: str) -> tuple[str, str]:
    return row, row.split(" (", 1)[0]  # identity and bare format ("nvfp4 (engine:512, bf16)" -> "nvfp4")


_ABSENT = ("result document missing", "document not in the baseline", "row missing in results", "row not in the baseline",
           "missing in results", "not in the baseline")


def _absent(doc: str, name: str, metric: str, optional: bool, why: str) -> Check:
    """A check for something one side lacks: a failure unless the tolerances mark it optional."""
    return Check(doc, name, metric, None, None, optional, f"{why} (optional)" if optional else why)


def _compare_value(doc: str, key: str, metric: str, base, value, tol: dict) -> Check:
    known = gate_metrics()[metric]
    if value is None or base is None:
        ok = value == base
        if value is None and base is not None:
            why = "missing in results"
        else:
            why = "ok" if ok else "new value where baseline had none"
        return Check(doc, key, metric, base, value, ok, why)
    abs_tol, rel_tol = float(tol.get("abs", known.abs_tol)), float(tol.get("rel", known.rel_tol))
    allowed = max(abs_tol, rel_tol * abs(base))
    delta = value - base
    if known.direction == "exact":
        ok = value == base
    elif known.direction == "lower":
        ok = delta <= allowed or math.isclose(value, base)
    else:
        ok = -delta <= allowed or math.isclose(value, base)
    moved = "rose" if delta > 0 else "fell"
    why = "ok" if ok else f"{moved} by {abs(delta):.6g} (allowed {allowed:.3g}, {known.direction} is better)"
    return Check(doc, key, metric, base, value, ok, why)


def _compare_rows(name: str, rrows: dict, brows: dict, tolerances: dict, optional: OptionalAbsences) -> list[Check]:
    checks: list[Check] = []
    for row in [*brows, *(r for r in rrows if r not in brows)]:
        optional.offer(*_row_names(row))
        for metric in {**brows.get(row, {}), **rrows.get(row, {})}:
            optional.offer(metric, f"{row}.{metric}", f"{_row_names(row)[1]}.{metric}")
        if row not in rrows or row not in brows:
            side = "row missing in results" if row not in rrows else "row not in the baseline"
            checks.append(_absent(name, row, "*", optional.allows(*_row_names(row)), side))
            continue
        bmetrics, rmetrics = brows[row], rrows[row]
        for metric in [*bmetrics, *(m for m in rmetrics if m not in bmetrics)]:
            key = f"{row}.{metric}"
            if metric not in rmetrics or metric not in bmetrics:
                side = "missing in results" if metric not in rmetrics else "not in the baseline"
                checks.append(_absent(name, key, metric, optional.allows(*_row_names(row), metric, key), side))
                continue
            checks.append(_compare_value(name, key, metric, bmetrics[metric], rmetrics[metric], tolerances.get(metric, {})))
    return checks


def compare(results: dict[str, dict], baseline: dict[str, dict], tolerances: dict | None = None) -> list[Check]:
    """Every row and metric of either side, compared. Nothing passes by omission: a document, format row
    (with its semantics and math) or metric that one side has and the other lacks is a failure, unless the
    tolerances' `optional` list names it (then it is listed as an allowed absence)."""
    tolerances = tolerances or {}
    optional = OptionalAbsences(tolerances.get(OPTIONAL_KEY, []))
    checks: list[Check] = []
    if len(results) == 1 and len(baseline) == 1:  # two single files: pair them whatever their names
        results = {next(iter(baseline)): next(iter(results.values()))}
    for name in [*baseline, *(n for n in results if n not in baseline)]:
        optional.offer(name, Path(name).stem)
        bdoc, rdoc = baseline.get(name), results.get(name)
        if rdoc is None or bdoc is None:
            side = "result document missing" if rdoc is None else "document not in the baseline"
            checks.append(_absent(name, "*", "*", optional.allows(name, Path(name).stem), side))
            continue
        if rdoc.get("schema") != bdoc.get("schema"):
            raise UserError(f"{name}: schema {rdoc.get('schema')!r} vs baseline {bdoc.get('schema')!r}")
        ev = evaluation_for_schema(bdoc.get("schema"))
        if ev is not None and ev.comparable is not None:  # e.g. kld: both ran the same window path
            ev.comparable(rdoc, bdoc, name)
        checks.extend(_compare_rows(name, _rows(rdoc), _rows(bdoc), tolerances, optional))
    for pattern in optional.unmatched():
        warnings.warn(f"the tolerances' optional entry {pattern!r} matches no document, row or metric on either side: "
                      "it allows nothing (a typo?)", stacklevel=2)
    return checks


def _absence_kind(c: Check) -> str:
    return "document" if c.name == "*" else "row" if c.metric == "*" else "metric"


def headline(checks: list[Check], optional: list[str] | None = None) -> str:
    """The verdict and what it counted: metrics compared within tolerance, and, apart, whatever was absent on one side
    and allowed by the optional list (an absent document is never counted as a metric that passed)."""
    bad = [c for c in checks if not c.ok]
    allowed = [c for c in checks if c.ok and c.why.endswith("(optional)")]
    compared = [c for c in checks if c not in allowed]
    head = (f"**mla-eval gate: {'FAIL' if bad else 'PASS'}** — {len(compared) - len(bad)}/{len(compared)} metrics "
            "within tolerance")
    if allowed:
        kinds = {}
        for c in allowed:
            kinds.setdefault(_absence_kind(c), []).append(c.doc if c.name == "*" else c.name)
        parts = [f"{len(v)} {k}{'s' if len(v) > 1 else ''} ({', '.join(v[:4])}{' ...' if len(v) > 4 else ''})"
                 for k, v in kinds.items()]
        head += f"; absent on one side, allowed as optional: {'; '.join(parts)}"
    if bad:
        if optional:
            head += (f"\n\nThe tolerances' optional list ({', '.join(optional)}) allows none of the failures; an absence "
                     "that is expected goes there")
        elif any(c.why in _ABSENT for c in bad):
            head += ("\n\nAn expected absence (a document, row or metric one side lacks) may be listed in the tolerances "
                     "file: [gate] optional = [\"needle.json\", \"mxfp4\", ...]")
    return head


def _figure(v) -> str:
    """A figure as read: counts whole (pool tokens 1019584, not 1.01958e+06), others to 6 significant digits."""
    if v is None:
        return "-"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 2**53):
        return str(int(v))
    return f"{v:.6g}"


def markdown(checks: list[Check], optional: list[str] | None = None) -> str:
    lines = [headline(checks, optional), "", "| result | metric | baseline | now | verdict |", "|---|---|---|---|---|"]
    for c in sorted(checks, key=lambda c: c.ok):
        fmt = _figure
        verdict = "ok" if c.why == "ok" else f"allowed: {c.why}" if c.ok else f"REGRESSION: {c.why}"
        lines.append(f"| {c.doc} | {c.name} | {fmt(c.baseline)} | {fmt(c.value)} | {verdict} |")
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
    `<metric> = {abs = .., rel = ..}`, and `optional = [...]`: what may be missing on either side
    (OptionalAbsences); unknown metrics are a one-line UserError."""
    if path is None:
        return {}
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    text = read_input_text(Path(path), "--tolerances", TOML_LIMIT)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"--tolerances {path}: {' '.join(str(exc).split())}") from None
    tol = doc.get("gate", doc)
    if not isinstance(tol, dict):
        raise UserError(f"--tolerances {path}: [gate] must be a table of metrics")
    tol = dict(tol)
    optional = tol.pop(OPTIONAL_KEY, [])
    if not isinstance(optional, list) or not all(isinstance(p, str) and p for p in optional):
        raise UserError(f"--tolerances {path}: {OPTIONAL_KEY} must be a list of names, e.g. "
                        f'{OPTIONAL_KEY} = ["needle.json", "mxfp4", "effective_length"]')
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
    return {**tol, OPTIONAL_KEY: optional} if optional else tol


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
    optional: tuple[str, ...] = ()  # the tolerances' optional list (named in a failing verdict)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def exit_code(self) -> int:
        """0 within tolerance, 1 on any regression (what CI reads)."""
        return 0 if self.ok else 1

    def markdown(self) -> str:
        return markdown(list(self.checks), list(self.optional))

    def junit(self) -> str:
        return junit(list(self.checks))


def run_gate(settings: GateSettings) -> GateResult:
    tolerances = load_tolerances(settings.tolerances)
    checks = compare(load_docs(settings.results), load_docs(settings.baseline), tolerances)
    return GateResult(tuple(checks), tuple(tolerances.get(OPTIONAL_KEY, [])))


def check_junit_path(path: Path) -> Path:
    """Before the work: can the JUnit file be written? An existing file is replaced only when it
    is a gate report we wrote."""
    path = Path(path)
    check_output_target(path, "--junit")
    if path.is_dir():
        raise UserError(f"--junit {path} is a folder; give a file path (e.g. {path / 'gate.xml'})")
    if path.exists():
        try:
            with open(path, "rb") as f:
                head = f.read(400).decode("utf-8", errors="replace")
        except OSError:
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
    check_output_target(baseline, "--baseline")
    docs = load_docs(results)
    if not results.is_dir():
        if baseline.is_dir():
            raise UserError(f"--baseline {baseline} is a folder but {results} is one file; give a baseline file")
        if baseline.exists() and not is_our_document(baseline):
            raise UserError(f"--baseline {baseline} exists and is not an mla-eval result; it is not replaced")
        write_text_atomic(baseline, read_input_text(results, "results", RESULT_LIMIT))
        return [baseline.name]
    if baseline.exists() and not baseline.is_dir():
        raise UserError(f"--baseline {baseline} is a file but {results} is a results directory; give a folder")
    keep = [*docs, *(n for n in ("environment.json", "recipe.toml") if (results / n).is_file())]
    for name in keep:
        write_text_atomic(baseline / name, read_input_text(results / name, "results", RESULT_LIMIT))
    for stale in baseline.glob("*.json"):  # a document the new results no longer have
        if stale.name not in keep and is_our_document(stale):
            stale.unlink()
    return keep
