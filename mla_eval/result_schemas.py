"""Result-document schemas: the schema id of each document, its JSON Schema file in
mla_eval/schemas/ (draft 2020-12), and validation with one-line errors that name the JSON path
of the first problem.

Within one schema id documents only grow: readers ignore keys they do not know; removing,
renaming or retyping a key needs a new id and a new schema file.
"""

from __future__ import annotations

import functools
import json
import re
import reprlib
from importlib import resources
from pathlib import Path
from typing import Any

from mla_eval.errors import UserError
from mla_eval.version import __version__

# The schema id of each built-in result document (the writers stamp these; readers check them) and the JSON Schema
# file in mla_eval/schemas/ that checks it. An evaluation registered from outside adds its own (`register_schema`,
# which `mla_eval.evaluation.register_evaluation` calls).
KLD_SCHEMA = "mla-eval/kld/v1"
NEEDLE_SCHEMA = "mla-eval/needle/v1"
CAPACITY_SCHEMA = "mla-eval.capacity/1"
ENVIRONMENT_SCHEMA = "mla-eval/environment/v1"  # environment.json (has no "schema" key)
PLAN_SCHEMA = "mla-eval/plan/v1"  # a per-layer cache plan (mla_eval.layer_plan), `mla-eval plan`'s document
BUILTIN_SCHEMA_FILES: dict[str, str] = {
    KLD_SCHEMA: "kld-v1.schema.json",
    NEEDLE_SCHEMA: "needle-v1.schema.json",
    CAPACITY_SCHEMA: "capacity-v1.schema.json",
    ENVIRONMENT_SCHEMA: "environment-v1.schema.json",
    PLAN_SCHEMA: "plan-v1.schema.json",
}
_registered: dict[str, str | Path] = {}


def register_schema(schema_id: str, where: str | Path) -> None:
    """Add (or, for an evaluation registered again, replace) the JSON Schema of a document schema id: a file name in
    mla_eval/schemas/ or a path. A built-in id keeps its own file."""
    if schema_id in BUILTIN_SCHEMA_FILES and BUILTIN_SCHEMA_FILES[schema_id] != where:
        raise ValueError(f"schema {schema_id!r} is built in ({BUILTIN_SCHEMA_FILES[schema_id]}); a new id needs a new name")
    if schema_id not in BUILTIN_SCHEMA_FILES:
        _registered[schema_id] = where


def unregister_schema(schema_id: str) -> None:
    _registered.pop(schema_id, None)


def schema_files() -> dict[str, str | Path]:
    """Document schema id -> its JSON Schema: a file name in mla_eval/schemas/ or a path, the built-in documents' and
    every registered evaluation's."""
    return {**BUILTIN_SCHEMA_FILES, **_registered}


def load_schema(schema_id: str) -> dict:
    """The JSON Schema of a document schema id (KeyError when the id has none)."""
    return _read_schema(schema_files()[schema_id])


@functools.lru_cache(maxsize=None)
def _read_schema(where: str | Path) -> dict:
    """Cached by location, not id: an evaluation registered again may bring another file."""
    if isinstance(where, Path):
        return json.loads(where.read_text(encoding="utf-8"))
    return json.loads(resources.files("mla_eval").joinpath("schemas", where).read_text(encoding="utf-8"))


def require_validator() -> None:
    """One-line UserError when jsonschema (a dependency: every document is validated before it is
    written) cannot be imported. Commands check it before the work, so a run never ends unwritable."""
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        raise UserError(
            "the jsonschema package is missing (mla-eval validates every result before writing it); "
            "install it: pip install 'jsonschema>=4,<4.27'"
        ) from None


def _validator(schema_id: str):
    return _validator_at(schema_files()[schema_id])


@functools.lru_cache(maxsize=None)
def _validator_at(where: str | Path):
    from jsonschema import Draft202012Validator

    return Draft202012Validator(_read_schema(where))


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
    files = schema_files()
    known = ", ".join(sorted(files))
    if schema is None:
        if not isinstance(doc, dict):
            raise UserError(f"{where}: a result document is a JSON object, not {type(doc).__name__}")
        if "schema" not in doc:
            raise UserError(f"{where}: no \"schema\" key, so not an mla-eval result document (known schemas: {known})")
        schema = doc["schema"]
    if not isinstance(schema, str) or schema not in files:
        raise UserError(f"{where}: unknown result schema {schema!r}; this mla-eval {__version__} knows {known}")
    require_validator()
    from jsonschema.exceptions import best_match

    error = best_match(_validator(schema).iter_errors(doc))
    if error is not None:
        raise UserError(f"{where}: {json_path(error.absolute_path)}: {_short_message(error)} (schema {schema})")
