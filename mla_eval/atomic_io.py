"""Atomic file writes: a temporary file in the target's folder, then one rename (or one hard link).

A reader (or a crash, or a signal) never sees a half-written result, plot or page; the target is
either absent / the old file or the complete new one, and the temporary file is removed on any
failure. Files get the usual permissions (0666 less the umask: 0644 normally), as `open` gives.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
from pathlib import Path
from typing import Any

from mla_eval.errors import UserError
from mla_eval.user_paths import check_output_target


class TargetExistsError(UserError, FileExistsError):
    """The target appeared while we wrote (another run finished first); nothing was replaced."""


def _temp_file(path: Path) -> tuple[int, Path]:
    """A new, exclusively created temporary file beside `path` (mode 0666 & ~umask)."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
    raise UserError(f"cannot create a temporary file beside {path}")


def _publish_no_replace(tmp: Path, path: Path) -> None:
    """Give the finished `tmp` the name `path` only if no file has that name: a hard link fails
    atomically when the name exists, so two writers racing for one name can never overwrite each
    other. Where hard links are impossible (some network / FAT file systems) the name is reserved
    with an exclusive create first and then replaced by our own complete file: still never another
    writer's file, though a reader may briefly see an empty one."""
    exists = TargetExistsError(f"{path} exists (written by another run meanwhile); nothing was replaced")
    try:
        os.link(tmp, path)
        return
    except FileExistsError:
        raise exists from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS):
            raise
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except FileExistsError:
        raise exists from None
    os.replace(tmp, path)


def write_bytes_atomic(path: Path, data: bytes, replace: bool = True) -> None:
    """Write `data` to `path`, creating its folder.

    replace=False: refuse (TargetExistsError) if `path` exists, even when another process creates it
    while this one writes.
    """
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path} is a folder; give a file path to write")
    check_output_target(path, "output")  # the rename below would replace a device node, not write into it
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _temp_file(path)
    except OSError as exc:  # found here only when no pre-flight check ran; nothing was written
        raise UserError(f"cannot write {path}: {exc.strerror or exc}; choose another place") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if replace:
            os.replace(tmp, path)
        else:
            _publish_no_replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # after a link (or on any failure) the temporary name goes


def write_text_atomic(path: Path, text: str, replace: bool = True) -> None:
    """Write `text` (UTF-8) to `path`; see `write_bytes_atomic`."""
    write_bytes_atomic(path, text.encode("utf-8"), replace=replace)


def write_json_atomic(path: Path, doc: Any, replace: bool = True) -> None:
    """Write `doc` as indented JSON to `path`."""
    write_text_atomic(path, json.dumps(doc, indent=2) + "\n", replace=replace)
