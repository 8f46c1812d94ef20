"""Atomic file writes: a temporary file in the target's folder, then one rename.

A reader (or a crash) never sees a half-written result, plot or page; the target is either the
old file or the complete new one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from mla_eval.errors import UserError


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path`, creating its folder."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path} is a folder; give a file path to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, doc: Any) -> None:
    """Write `doc` as indented JSON to `path`."""
    write_text_atomic(path, json.dumps(doc, indent=2) + "\n")
