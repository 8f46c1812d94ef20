"""Versioned result documents: read and written through their JSON Schema
(`mla_eval.result_schemas`), written atomically, never silently over an existing file.

Every result document names its schema in its `schema` key (e.g. "mla-eval/kld/v1").
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import platform
import tempfile
import threading
import time
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch

from mla_eval import provenance
from mla_eval.atomic_io import write_json_atomic
from mla_eval.errors import UserError
from mla_eval.formats.spec import OUTER_SCALE_SCHEMA
from mla_eval.result_schemas import require_validator, schema_files, validate
from mla_eval.user_paths import RESULT_LIMIT, check_output_target, read_input_text
from mla_eval.version import __version__


def environment(attention=None) -> dict[str, Any]:
    """Versions, devices, the code's commit and the attention paths: enough to reproduce or question a number.

    `attention`: the `dispatch.PathLog` of the run (which path computed each format, and the
    kernel fallbacks), if any; its CUDA devices are the GPUs listed (else every visible GPU).
    The commit comes from the imported package (`mla_eval.provenance`), "unknown" when unknown.
    """
    env: dict[str, Any] = {
        "mla_eval": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.machine()})",
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    env["cutlass_dsl"] = provenance.cutlass_dsl_version()
    used = [d for d in attention.devices() if d.startswith("cuda")] if attention is not None else []
    env["gpus"] = provenance.gpus(used or None)
    env.update(provenance.code_identity())
    if used:  # since the run's backend scope reset the peaks (dispatch.use_backend)
        env["gpu_peak_memory_gib"] = {d: round(torch.cuda.max_memory_allocated(d) / 2**30, 3) for d in used}
    if attention is not None:
        env["attention"] = attention.as_dict()
    return env


def _clean(x: Any) -> Any:
    """JSON has no NaN/Infinity: write them as null / strings so every reader can parse the file."""
    if isinstance(x, float):
        if math.isnan(x):
            return None
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON; mla-eval writes NaN as null and infinity as \"inf\"")


def load_json(path: Path, what: str = "result") -> Any:
    """A JSON file as written by mla-eval (no NaN/Infinity literals), read as a regular file of bounded
    size (never a device or a pipe); every failure is one UserError line naming the file."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path} is a directory, not a {what} JSON file")
    text = read_input_text(path, what, RESULT_LIMIT)
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg})") from None
    except ValueError as exc:
        raise UserError(f"{path} is not valid JSON ({exc})") from None


def read_result(path: Path, schema: str | None = None) -> dict:
    """Load a result JSON and validate it against its schema (or `schema`)."""
    doc = load_json(path)
    validate(doc, str(path), schema)
    return doc


DEFAULT_OUTPUT_DIR = Path("mla-eval-out")  # where runs go unless told (relative to the working directory)


def default_result_path(kind: str, model_name: str | None = None) -> Path:
    """./mla-eval-out/<kind>-<model>-<date>-<time>-<microseconds>-p<pid>.json: unique per run, so two runs
    finishing in the same second never share a name (and the no-replace write catches the rest)."""
    now = _dt.datetime.fromtimestamp(_unique_microseconds() / 1e6)
    safe = ("".join(c if c.isalnum() or c in "-_." else "-" for c in model_name) + "-") if model_name else ""
    return DEFAULT_OUTPUT_DIR / f"{kind}-{safe}{now:%Y%m%d-%H%M%S-%f}-p{os.getpid()}.json"


def default_out_help(kind: str) -> str:
    """The --out help of a command whose result goes to default_result_path."""
    return f"Result JSON path (default ./{DEFAULT_OUTPUT_DIR}/{kind}-<model>-<time>.json in the current directory)."


_last_stamp = 0
_stamp_lock = threading.Lock()


def _unique_microseconds() -> int:
    """Wall-clock microseconds, strictly increasing within this process (two threads asking in the
    same microsecond get different stamps; other processes differ by pid)."""
    global _last_stamp
    with _stamp_lock:
        _last_stamp = max(time.time_ns() // 1000, _last_stamp + 1)
        return _last_stamp


class _PendingOutputs:
    """Result paths checked by `check_output_path` and not yet written, during one CLI call: what an
    interrupted run names as "not written"."""

    def __init__(self) -> None:
        self.paths: list[Path] = []


_pending: ContextVar[_PendingOutputs | None] = ContextVar("mla_eval_pending_outputs", default=None)


@contextlib.contextmanager
def pending_outputs():
    """Track the result paths promised (checked) and not yet written inside this block."""
    ledger = _PendingOutputs()
    token = _pending.set(ledger)
    try:
        yield ledger
    finally:
        _pending.reset(token)


def promise_output(path: Path) -> None:
    """Record that this call will write `path` (an interrupted run then names it as not written)."""
    ledger = _pending.get()
    if ledger is not None and path not in ledger.paths:
        ledger.paths.append(path)


def fulfil_output(path: Path) -> None:
    """`path` has been written."""
    ledger = _pending.get()
    if ledger is not None and path in ledger.paths:
        ledger.paths.remove(path)


def is_our_document(path: Path, schema: str | None = None) -> bool:
    """Is the file at `path` a document mla-eval writes (valid JSON naming one of our schema ids,
    an outer-scale file, or valid against `schema`)? Only such files may be replaced by --force."""
    try:
        doc = json.loads(read_input_text(Path(path), "output", RESULT_LIMIT))
    except (UserError, ValueError):  # not a regular file, too large, not UTF-8, not JSON: not ours
        return False
    if not isinstance(doc, dict):
        return False
    if doc.get("schema") in schema_files() or doc.get("format") == OUTER_SCALE_SCHEMA:
        return True
    if schema is not None:
        try:
            validate(doc, str(path), schema)
        except UserError:
            return False
        return True
    return False


def check_replaceable(path: Path, force: bool, schema: str | None = None, option: str = "--out") -> None:
    """An existing `path` may be replaced only with --force and only when it is a document we wrote
    (and never when it is a device or a pipe: user_paths.check_output_target)."""
    check_output_target(path, option)
    if not path.exists():
        return
    if not force:
        raise UserError(f"{path} exists; choose another {option} or pass --force to replace it")
    if not is_our_document(path, schema):
        raise UserError(f"{path} exists and is not an mla-eval result (--force replaces only those); choose another {option}")


def check_writable_folder(path: Path) -> None:
    """Can a file be created beside `path`? Tried for real (a temporary file made and removed in the
    nearest existing folder), because permission bits lie: root passes `os.access` in a read-only or
    immutable folder, and a read-only mount has writable bits. One-line UserError if not."""
    probe = path.parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"cannot write {path}: {probe} is a file, not a folder")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".mla-eval-probe.", dir=probe)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {probe} is not writable ({exc.strerror or exc}); choose another place") from None
    os.close(fd)
    os.unlink(tmp)


def check_output_path(path: Path, force: bool = False, schema: str | None = None, option: str = "--out") -> Path:
    """Before any long work: can a result document be written at `path`? One-line UserError if not
    (exists without --force, exists and is not ours, is a folder, its folder cannot be created or
    written).

    Commands call this on --out (or the default path) first, so a bad --out never costs a run. Inside
    `pending_outputs()` the path is remembered until it is written (an interrupted run names it).
    """
    path = Path(path)
    if str(path) in ("", "."):
        raise UserError(f"{option} is empty; give a file path (e.g. {option} result.json)")
    check_output_target(path, option)
    if path.is_dir():
        raise UserError(f"{path} is a folder; give a file path (e.g. {path / 'result.json'})")
    require_validator()  # the document is validated when written: a missing validator must not cost the run
    check_replaceable(path, force, schema, option)
    check_writable_folder(path)
    promise_output(path)
    return path


def write_result(path: Path, doc: dict, force: bool = False, schema: str | None = None) -> Path:
    """Validate (as it will be written: NaN -> null, inf -> "inf") and write atomically.

    Without `force` the write never replaces a file, even one another run creates meanwhile; with
    `force` it replaces only a document we wrote. A document that does not match its schema is a bug
    in its writer: it is refused with a one-line UserError and nothing is written.
    """
    path = Path(path)
    check_replaceable(path, force, schema)
    cleaned = _clean(doc)
    validate(cleaned, str(path), schema)
    write_json_atomic(path, cleaned, replace=force)
    fulfil_output(path)
    return path
