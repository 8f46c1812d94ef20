"""Provenance of a number: which mla-eval code, on which software and GPUs, computed it.

The commit is taken from the imported package itself, never from whatever git repository encloses
the working directory (a copied tree with an older `.git`, a venv inside another checkout):
1. source checkout (editable install, PYTHONPATH): git is read only when the package folder's
   parent is the top of that work tree AND the package's own files are tracked there. The commit is
   then HEAD, `dirty` when a tracked file differs from it or an untracked file sits inside the
   package's folders (the commit is then a lower bound only);
2. built package (wheel, `pip install .`): the commit stamped at build time into
   `mla_eval/_build_info.json` by the setuptools `build_py` hook in `build_stamp.py` (generated into
   the build, never committed), read with the same rules from the checkout it was built from;
3. anything else: "unknown".
`source_digest` hashes the package's source files as loaded, so two results can be compared even
when the commit is unknown or dirty.

This module imports only the standard library at load time: the build hook loads it by path.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
from pathlib import Path
from typing import Any

UNKNOWN = "unknown"
BUILD_INFO = "_build_info.json"
CUTLASS_DSL_DIST = "nvidia-cutlass-dsl"
_SOURCE_SUFFIXES = (".py", ".json")  # the code and data that compute numbers (not helper scripts)


def _git(args: list[str], cwd: Path) -> str | None:
    """stdout of a git command in `cwd`, or None if git is missing or fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}  # no inherited GIT_DIR
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=20, env=env)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def git_commit(package_dir: Path, extra_dirs: tuple[Path, ...] = ()) -> dict[str, Any] | None:
    """{"commit", "dirty", "source"} of the checkout whose top holds `package_dir`, or None when
    `package_dir` is not a tracked top-level package of a git work tree.

    `extra_dirs`: other folders of the same distribution (the kernels); untracked files inside
    them make the checkout dirty too.
    """
    package_dir = Path(package_dir).resolve()
    top = _git(["rev-parse", "--show-toplevel"], package_dir)
    if top is None or Path(top.strip()).resolve() != package_dir.parent:
        return None
    root = package_dir.parent
    tracked = _git(["ls-files", "--", f"{package_dir.name}/__init__.py"], root)
    if not tracked or not tracked.strip():
        return None  # the package's files are not this repository's: its HEAD says nothing about them
    commit = _git(["rev-parse", "--short=12", "HEAD"], root)
    if commit is None:
        return None
    status = _git(["status", "--porcelain", "--untracked-files=all"], root)
    dirty = None if status is None else _dirty(status, root, (package_dir, *extra_dirs))
    return {"commit": commit.strip(), "dirty": dirty, "source": f"git checkout {root}"}


def _dirty(porcelain: str, root: Path, dirs: tuple[Path, ...]) -> bool:
    """Tracked changes anywhere, or untracked files inside the package folders."""
    inside = [str(Path(d).resolve().relative_to(root)) + "/" for d in dirs if Path(d).resolve().is_relative_to(root)]
    for line in porcelain.splitlines():
        if not line.startswith("?? "):
            return True
        if any(line[3:].startswith(prefix) for prefix in inside):
            return True
    return False


def build_stamp(package_dir: Path) -> dict[str, Any] | None:
    """The commit stamped into a built package, or None when there is no (readable) stamp."""
    try:
        info = json.loads((Path(package_dir) / BUILD_INFO).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not isinstance(info.get("commit"), str):
        return None
    return {"commit": info["commit"], "dirty": info.get("dirty"), "source": "build stamp"}


def package_commit(package_dir: Path, extra_dirs: tuple[Path, ...] = ()) -> dict[str, Any]:
    """{"commit", "dirty", "source"} of the code in `package_dir`; commit "unknown" when unknown."""
    found = git_commit(package_dir, extra_dirs) or build_stamp(package_dir)
    return found or {"commit": UNKNOWN, "dirty": None, "source": UNKNOWN}


def source_digest(packages: dict[str, Path]) -> str:
    """'sha256:<16 hex>' over the source files (.py, .json) of `packages` (import name ->
    folder), by import name, relative path and content, so a checkout and a wheel of the same code
    agree (the kernels' folder is `kernels/` in one and `mla_eval_kernels/` in the other); the build
    stamp and caches are left out."""
    h = hashlib.sha256()
    for name, base in sorted(packages.items()):
        base = Path(base)
        files = sorted(p for p in base.rglob("*") if p.is_file() and p.suffix in _SOURCE_SUFFIXES)
        for path in files:
            rel = path.relative_to(base)
            if path.name == BUILD_INFO or "__pycache__" in rel.parts:
                continue
            h.update(f"{name}/{rel.as_posix()}\0".encode())
            h.update(path.read_bytes())
            h.update(b"\0")
    return "sha256:" + h.hexdigest()[:16]


def installed_packages() -> dict[str, Path]:
    """Import name -> folder (resolved) of the imported `mla_eval` and of `mla_eval_kernels`."""
    found = {"mla_eval": Path(__file__).resolve().parent}  # this module's own package (not imported: no import cycle)
    spec = importlib.util.find_spec("mla_eval_kernels")  # finds the folder without importing cutlass
    if spec is not None and spec.submodule_search_locations:
        folders = [Path(p).resolve() for p in spec.submodule_search_locations if Path(p).is_dir()]
        if folders:
            found["mla_eval_kernels"] = folders[0]
    return found


@functools.lru_cache(maxsize=1)
def code_identity() -> dict[str, Any]:
    """Commit, dirty state, where the commit came from, and the source digest of the imported code.

    Cached: the code of a running process does not change.
    """
    packages = installed_packages()
    kernels = (packages["mla_eval_kernels"],) if "mla_eval_kernels" in packages else ()
    found = package_commit(packages["mla_eval"], kernels)
    return {
        "git_commit": found["commit"],
        "git_dirty": found["dirty"],
        "git_commit_source": found["source"],
        "source_digest": source_digest(packages),
    }


def cutlass_dsl_version() -> str:
    """The installed nvidia-cutlass-dsl version, or 'not installed'."""
    try:
        return importlib.metadata.version(CUTLASS_DSL_DIST)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def gpus(devices=None) -> list[dict[str, Any]]:
    """Name, compute capability ('sm_90') and opt-in shared memory per block of each CUDA device
    in `devices` (default: every visible one); [] without CUDA."""
    import torch  # noqa: PLC0415 - only the build hook loads this module, without torch

    if not torch.cuda.is_available():
        return []
    try:
        from mla_eval_kernels.plan.device_limits import arch_name, smem_per_block  # noqa: PLC0415 - torch only
    except ImportError:
        # A source checkout run as `python -m mla_eval` without installing has no `mla_eval_kernels`; the
        # evaluation itself falls back to the torch reference, and its result must not be lost at the last
        # step for want of two device facts that torch gives directly.
        def arch_name(i: int) -> str:
            return "sm_{}{}".format(*torch.cuda.get_device_capability(i))

        def smem_per_block(i: int) -> int:
            return torch.cuda.get_device_properties(i).shared_memory_per_block_optin

    if devices is None:
        devices = range(torch.cuda.device_count())
    used = set()
    for d in devices:
        d = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
        if d.type == "cuda":
            used.add(d.index if d.index is not None else torch.cuda.current_device())
    return [
        {
            "device": f"cuda:{i}",
            "name": torch.cuda.get_device_name(i),
            "capability": arch_name(i),
            "shared_memory_per_block_optin": smem_per_block(i),
        }
        for i in sorted(used)
    ]
