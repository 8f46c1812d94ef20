"""Versioned result documents: validated against their JSON Schema, written atomically, never
silently over an existing file.

Every result document names its schema in its `schema` key (e.g. "mla-eval/kld/v1"); the JSON
Schema (draft 2020-12) of each id ships in mla_eval/schemas/. Within one id documents only grow:
readers ignore keys they do not know; removing, renaming or retyping a key needs a new id.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import math
import platform
import re
import reprlib
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from mla_eval import __version__
from mla_eval.errors import UserError
from mla_eval.atomic_io import write_json_atomic


def environment() -> dict[str, Any]:
    """Versions, device and git commit: enough to reproduce or question a number."""
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
    try:
        here = Path(__file__).resolve().parent
        env["git_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        ).stdout.strip() or None
        # A commit id alone can lie: edited files, or a copied tree whose .git is older than its
        # files. Tracked changes make the id a lower bound only.
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True, timeout=10
        )
        env["git_dirty"] = bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
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


# The schema id of each result document (the writers stamp these; readers check them).
KLD_SCHEMA = "mla-eval/kld/v1"
NEEDLE_SCHEMA = "mla-eval/needle/v1"
CAPACITY_SCHEMA = "mla-eval.capacity/1"
ENVIRONMENT_SCHEMA = "mla-eval/environment/v1"  # environment.json (has no "schema" key)

# document schema id -> its JSON Schema file in mla_eval/schemas/
SCHEMA_FILES = {
    KLD_SCHEMA: "kld-v1.schema.json",
    NEEDLE_SCHEMA: "needle-v1.schema.json",
    CAPACITY_SCHEMA: "capacity-v1.schema.json",
    ENVIRONMENT_SCHEMA: "environment-v1.schema.json",
}
# a results directory's file stem -> the schema its document must have
RESULTS_DIR_FILES = {"kld": KLD_SCHEMA, "needle": NEEDLE_SCHEMA, "capacity": CAPACITY_SCHEMA}


@functools.lru_cache(maxsize=None)
def load_schema(schema_id: str) -> dict:
    """The JSON Schema of a document schema id (KeyError when the id has none)."""
    name = SCHEMA_FILES[schema_id]
    return json.loads(resources.files("mla_eval").joinpath("schemas", name).read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=None)
def _validator(schema_id: str):
    from jsonschema import Draft202012Validator

    return Draft202012Validator(load_schema(schema_id))


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def json_path(parts) -> str:
    """['formats', 'nvfp4+s_l', 'layers', 2, 'kld_mean'] -> formats["nvfp4+s_l"].layers[2].kld_mean"""
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif _IDENT.match(p):
            out += f".{p}" if out else p
        else:
            out += f"[{json.dumps(p)}]"
    return out or "(top level)"


def _short_repr(x: Any) -> str:
    r = reprlib.Repr()
    r.maxstring, r.maxother, r.maxdict, r.maxlist, r.maxlevel = 40, 40, 3, 3, 2
    return r.repr(x)


def _alternatives(subschemas: list) -> str:
    """anyOf [{"type": "number"}, {"type": "null"}, {"enum": [...]}] -> "of type 'number' or 'null', nor one of [...]"."""
    parts: list[str] = []
    types: list[str] = []
    for sub in subschemas:
        if isinstance(sub, dict) and set(sub) <= {"type", "description"} and "type" in sub:
            types += [repr(t) for t in (sub["type"] if isinstance(sub["type"], list) else [sub["type"]])]
        elif isinstance(sub, dict) and "enum" in sub:
            parts.append(f"one of {sub['enum']!r}")
        elif isinstance(sub, dict) and "const" in sub:
            parts.append(f"equal to {sub['const']!r}")
        elif isinstance(sub, dict) and sub.get("type"):
            t = sub["type"]
            parts.append("a valid " + " or ".join(t if isinstance(t, list) else [t]))
        else:
            parts.append("valid under the other alternatives")
    if types:
        parts.insert(0, "of type " + " or ".join(types))
    return ", nor ".join(parts)


def _short_message(error) -> str:
    """jsonschema's message, one line, a long instance repr (a whole sub-document) shortened and
    an anyOf failure spelled out ("'abc' is not of type 'number' or 'null', nor one of [...]")."""
    msg = error.message
    full = repr(error.instance)
    if error.validator in ("anyOf", "oneOf") and isinstance(error.validator_value, list):
        msg = f"{_short_repr(error.instance)} is not {_alternatives(error.validator_value)}"
    elif len(full) > 80 and msg.startswith(full):
        msg = _short_repr(error.instance) + msg[len(full):]
    msg = " ".join(msg.split())
    return msg if len(msg) <= 300 else msg[:297] + "..."


def validate(doc: Any, where: str, schema: str | None = None) -> None:
    """Check a result document against the JSON Schema its `schema` key names (or `schema`).

    Raises UserError with one line: `<where>: <JSON path of the first problem>: <message>`.
    Validate the document as written: NaN as null, infinities as "inf"/"-inf" (see _clean).
    """
    known = ", ".join(sorted(SCHEMA_FILES))
    if schema is None:
        if not isinstance(doc, dict):
            raise UserError(f"{where}: a result document is a JSON object, not {type(doc).__name__}")
        if "schema" not in doc:
            raise UserError(f"{where}: no \"schema\" key, so not an mla-eval result document (known schemas: {known})")
        schema = doc["schema"]
    if not isinstance(schema, str) or schema not in SCHEMA_FILES:
        raise UserError(f"{where}: unknown result schema {schema!r}; this mla-eval {__version__} knows {known}")
    from jsonschema.exceptions import best_match

    error = best_match(_validator(schema).iter_errors(doc))
    if error is not None:
        raise UserError(f"{where}: {json_path(error.absolute_path)}: {_short_message(error)} (schema {schema})")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON; mla-eval writes NaN as null and infinity as \"inf\"")


def read_result(path: Path, schema: str | None = None) -> dict:
    """Load a result JSON and validate it; every failure is one UserError line naming the file."""
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
        doc = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg})") from None
    except ValueError as exc:
        raise UserError(f"{path} is not valid JSON ({exc})") from None
    validate(doc, str(path), schema)
    return doc


def default_result_path(kind: str, model_name: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in model_name)
    return Path("results") / f"{kind}-{safe}-{stamp}.json"


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
