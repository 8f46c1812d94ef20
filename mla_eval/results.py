"""Versioned result documents: written atomically, never silently over an existing file."""

from __future__ import annotations

import datetime as _dt
import math
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from mla_eval import __version__
from mla_eval.errors import UserError
from mla_eval.formats.outer_scale import write_json_atomic


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


def default_result_path(kind: str, model_name: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in model_name)
    return Path("results") / f"{kind}-{safe}-{stamp}.json"


def write_result(path: Path, doc: dict, force: bool = False) -> Path:
    if path.exists() and not force:
        raise UserError(f"{path} exists; choose another --out or pass --force to replace it")
    write_json_atomic(path, _clean(doc))
    return path
