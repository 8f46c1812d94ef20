"""Versioned result documents: read and written through their JSON Schema
(`mla_eval.result_schemas`), written atomically, never silently over an existing file.

Every result document names its schema in its `schema` key (e.g. "mla-eval/kld/v1").
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
from pathlib import Path
from typing import Any

import torch

from mla_eval import __version__, provenance
from mla_eval.errors import UserError
from mla_eval.atomic_io import write_json_atomic
from mla_eval.result_schemas import validate


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


def load_json(path: Path) -> Any:
    """A JSON file as written by mla-eval (no NaN/Infinity literals); every failure is one
    UserError line naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path} does not exist") from None
    except IsADirectoryError:
        raise UserError(f"{path} is a directory, not a result JSON file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not readable ({exc})") from None
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


def default_result_path(kind: str, model_name: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in model_name)
    return Path("results") / f"{kind}-{safe}-{stamp}.json"


def check_output_path(path: Path, force: bool = False) -> Path:
    """Before any long work: can a result document be written at `path`? One-line UserError if not
    (exists without --force, is a folder, its folder cannot be created or written).

    Commands call this on --out (or the default path) first, so a bad --out never costs a run.
    """
    path = Path(path)
    if path.is_dir():
        raise UserError(f"--out {path} is a folder; give a file path (e.g. {path / 'result.json'})")
    if path.exists() and not force:
        raise UserError(f"{path} exists; choose another --out or pass --force to replace it")
    parent = path.parent
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"cannot write {path}: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"cannot write {path}: no write permission in {probe}")
    return path


def write_result(path: Path, doc: dict, force: bool = False, schema: str | None = None) -> Path:
    """Validate (as it will be written: NaN -> null, inf -> "inf") and write atomically.

    A document that does not match its schema is a bug in its writer: it is refused with a
    one-line UserError and nothing is written.
    """
    path = Path(path)
    if path.exists() and not force:
        raise UserError(f"{path} exists; choose another --out or pass --force to replace it")
    cleaned = _clean(doc)
    validate(cleaned, str(path), schema)
    write_json_atomic(path, cleaned)
    return path
