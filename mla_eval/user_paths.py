"""Files a user names (options, recipe keys, arguments): inputs are regular files read with a size bound,
outputs are never devices or pipes. Every refusal is one UserError line naming the option and the fix,
said before any work.

Why each rule: a device or a pipe given as an input (`--scales /dev/zero`) is read until memory runs out;
an output that exists is first read to see whether it is one of our documents (the only kind --force
replaces), and reading `/dev/stdout` on a pipe waits forever; and results are written atomically (a
temporary file renamed into place), which would replace a device node rather than write into it. So a
character device, FIFO, socket or block device is refused as an output: a result is a file (`capacity
--json` prints its document to stdout for a stream).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from mla_eval.errors import UserError

MIB = 1 << 20
GIB = 1 << 30

# size bounds of what mla-eval reads whole (far above any real file of the kind; a bound, not a budget)
TOML_LIMIT = 4 * MIB  # recipes, tolerances
SMALL_JSON_LIMIT = 64 * MIB  # outer scales, configs
RESULT_LIMIT = 1 * GIB  # result documents
TEXT_LIMIT = 4 * GIB  # --text, --haystack files


def _size(n: int) -> str:
    for unit, div in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n} B"


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _stat(path: Path, what: str) -> os.stat_result | None:
    """The path's status (links followed), None when nothing is there."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise UserError(f"{what} {path}: {exc.strerror or exc}") from None


def is_special(path: Path) -> bool:
    """Whether something other than a regular file or a folder (a device, FIFO, socket) is at `path`."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def check_input_file(path: Path, what: str, limit: int) -> int:
    """`path` must be an existing regular file of at most `limit` bytes; returns its size."""
    st = _stat(Path(path), what)
    if st is None:
        raise UserError(f"{what} {path} does not exist")
    if stat.S_ISDIR(st.st_mode):
        raise UserError(f"{what} {path} is a folder; give a file")
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{what} {path} is {_kind(st.st_mode)}, not a regular file; give a file")
    if st.st_size > limit:
        raise UserError(f"{what} {path} is {_size(st.st_size)}, over the {_size(limit)} a {what} file may hold; "
                        "give the right file (or a smaller one)")
    return st.st_size


def read_input_bytes(path: Path, what: str, limit: int) -> bytes:
    """A regular file's bytes, at most `limit` of them (checked again on the open file: it may have been
    swapped for a pipe, or grown, since it was named)."""
    check_input_file(path, what, limit)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # never blocks, even if a FIFO took the name meanwhile
    except OSError as exc:
        raise UserError(f"{what} {path} is not readable ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{what} {path} is not a regular file; give a file")
        chunk = min(limit + 1, max(st.st_size + 1, 1 << 16))  # read(n) allocates n: never the whole limit at once
        parts, total = [], 0
        try:
            while part := f.read(min(chunk, limit + 1 - total)):
                parts.append(part)
                total += len(part)
                if total > limit:
                    raise UserError(f"{what} {path} is over the {_size(limit)} a {what} file may hold; give the right file")
        except OSError as exc:
            raise UserError(f"{what} {path} is not readable ({exc.strerror or exc})") from None
    return b"".join(parts)


def read_input_text(path: Path, what: str, limit: int) -> str:
    """A regular file's UTF-8 text, at most `limit` bytes."""
    data = read_input_bytes(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{what} {path} is not UTF-8 text (bad byte at offset {exc.start}); save it as UTF-8") from None


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


def read_small_json(path: Path, what: str, remake: str, limit: int = SMALL_JSON_LIMIT):
    """A small JSON file mla-eval wrote (scales, plans): a regular UTF-8 file of bounded size with no NaN / Infinity
    literals. Every failure is one UserError line naming the file and `remake` (how to make it again)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{what} {path} does not exist; {remake}")
    text = read_input_text(path, what, limit)
    try:
        return json.loads(text, parse_constant=_not_json)
    except ValueError as exc:
        raise UserError(f"{what} {path} is not readable JSON ({exc}); {remake}") from None


def check_not_special(path: Path, what: str) -> None:
    """An input that may be a file or a folder: refused when it is a device, FIFO or socket (read without end)."""
    st = _stat(Path(path), what)
    if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise UserError(f"{what} {path} is {_kind(st.st_mode)}, not a regular file or folder; give a file")


def check_output_target(path: Path, what: str) -> None:
    """Before any work: an output may be a new path, a regular file or a folder, never a device, FIFO or
    socket (module docstring: why); nothing is opened or read."""
    st = _stat(Path(path), what)
    if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise UserError(f"{what} {path} is {_kind(st.st_mode)}; mla-eval writes its outputs as regular files "
                        "(atomically), not into devices or pipes: give a file path")


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one existing file (links and relative paths resolved)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()
