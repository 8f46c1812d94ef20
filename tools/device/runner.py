"""What every device step shares: the output folder, commands under a time limit with their logs, the text files
the campaigns read (carried under .devdata/, never committed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
TEXT = ".devdata/wiki.test.raw"  # wikitext-2 test (../shared/data/wikitext-2/wiki.test.raw, copied)
LONG_TEXT = ".devdata/wiki-long.txt"  # held-out Wikipedia (python -m tools.make_wiki_long)
_T0 = time.time()
# progress-bar and table-frame lines that would flood a log tail
_NOISE = re.compile(r"━|^\s*[│┃┏┡└╭╰]|scoring|prompts +[0-9]")


def out_dir(step: str) -> Path:
    """$OUT/runs/<step>/ (created): where a step writes its logs and documents."""
    d = Path(os.environ.get("OUT", "/tmp/out")) / "runs" / step
    d.mkdir(parents=True, exist_ok=True)
    return d


def say(msg: str) -> None:
    print(f"=== [{time.time() - _T0:.0f}s] {msg}", flush=True)


def run(name: str, argv: list[str], log_dir: Path, limit_s: float, env: dict | None = None, tail: int = 30,
        keep: str | None = None) -> int:
    """Run `argv` from the repository root under `limit_s` seconds, its whole output into `log_dir/<name>.log`; print
    the exit status (124: the limit) and the log's last `tail` lines without progress bars (`keep`: only lines
    matching this regular expression). Returns the exit status."""
    log = log_dir / f"{name}.log"
    say(f"{name}: {' '.join(argv)}")
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    with open(log, "w") as fh:
        try:
            rc = subprocess.run(argv, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=full_env, timeout=limit_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if not _NOISE.search(ln)]
    if keep:
        lines = [ln for ln in lines if re.search(keep, ln)]
    for ln in lines[-tail:]:
        print(ln)
    print(f"{name}: exit {rc}{' (time limit)' if rc == 124 else ''}; log {log}", flush=True)
    return rc


def mla_eval(*args: str) -> list[str]:
    return [sys.executable, "-m", "mla_eval", *args]


def module(name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", name, *args]


def need(path: str, how: str) -> bool:
    """Whether a carried input exists; says how to bring it when it does not."""
    if (ROOT / path).exists():
        return True
    print(f"missing {path}: {how}", flush=True)
    return False


def cuobjdump() -> str | None:
    """The CUDA toolkit's cuobjdump, or the copy triton ships, or None."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton

        return str(next(Path(triton.__file__).parent.rglob("cuobjdump")))
    except (ImportError, StopIteration):
        return None
