"""Nothing a user made is lost: unique default names, no-replace writes (even racing), --force only
over our own documents, a real write probe, normal file modes, no temporary files left behind."""

import errno
import json
import os
import shutil
import stat
import subprocess
import threading
from pathlib import Path

import pytest

from mla_eval import atomic_io, results
from mla_eval.errors import UserError
from mla_eval.results import check_output_path, default_result_path, pending_outputs, write_result

BASELINE = Path(__file__).resolve().parents[1] / "results" / "baselines" / "ci-smoke"


def _doc() -> dict:
    return json.loads((BASELINE / "kld.json").read_text())


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp") or p.name.startswith(".mla-eval-probe"))


def test_default_names_never_collide_in_one_second():
    names = [default_result_path("kld", "tiny/model") for _ in range(2000)]
    assert len(set(names)) == len(names)
    assert all(n.parent == Path("mla-eval-out") and n.name.startswith("kld-tiny-model-") for n in names)
    assert f"-p{os.getpid()}.json" in str(names[0])


def test_two_writers_racing_for_one_name_never_overwrite(tmp_path):
    """Both pass the exists-check, then both publish: exactly one wins, the other gets a one-line
    error, and the file holds the winner's complete document."""
    path = tmp_path / "kld.json"
    docs = []
    for i in range(2):
        d = _doc()
        d["seconds"] = 1000.0 + i
        docs.append(d)
    barrier, outcome = threading.Barrier(2), {}

    def writer(i):
        barrier.wait()
        try:
            write_result(path, docs[i])
            outcome[i] = "wrote"
        except UserError as exc:
            outcome[i] = str(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(v == "wrote" for v in outcome.values()) == [False, True], outcome
    loser = next(v for v in outcome.values() if v != "wrote")
    assert "exists" in loser and "\n" not in loser
    winner = next(i for i, v in outcome.items() if v == "wrote")
    assert json.loads(path.read_text())["seconds"] == 1000.0 + winner
    assert _leftovers(tmp_path) == []


def test_a_file_appearing_while_we_write_is_not_replaced(tmp_path, monkeypatch):
    path = tmp_path / "kld.json"
    real_open = atomic_io._temp_file

    def open_then_someone_else_writes(target):
        out = real_open(target)
        target.write_text("another run's result")
        return out

    monkeypatch.setattr(atomic_io, "_temp_file", open_then_someone_else_writes)
    with pytest.raises(UserError, match="exists"):
        write_result(path, _doc())
    assert path.read_text() == "another run's result"
    assert _leftovers(tmp_path) == []


def test_without_hard_links_the_write_is_still_no_replace(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    path = write_result(tmp_path / "kld.json", _doc())
    assert json.loads(path.read_text())["schema"] == "mla-eval/kld/v1"
    with pytest.raises(UserError, match="exists"):
        atomic_io.write_text_atomic(path, "x", replace=False)
    assert json.loads(path.read_text())["schema"] == "mla-eval/kld/v1"
    assert _leftovers(tmp_path) == []


def test_force_replaces_only_our_documents(tmp_path):
    mine = tmp_path / "notes.json"
    mine.write_text('{"my": "notes"}')
    for target in (mine, tmp_path / "plain.txt"):
        if not target.exists():
            target.write_text("a user's text")
        before = target.read_text()
        for check in (lambda: check_output_path(target, force=True), lambda: write_result(target, _doc(), force=True)):
            with pytest.raises(UserError) as exc:
                check()
            assert "not an mla-eval result" in str(exc.value) and "\n" not in str(exc.value)
        assert target.read_text() == before
    ours = write_result(tmp_path / "kld.json", _doc())
    with pytest.raises(UserError, match="pass --force"):
        check_output_path(ours)
    doc = _doc()
    doc["seconds"] = 7.0
    assert check_output_path(ours, force=True) == ours
    write_result(ours, doc, force=True)
    assert json.loads(ours.read_text())["seconds"] == 7.0


def test_files_get_the_usual_mode(tmp_path):
    old = os.umask(0o022)
    try:
        path = write_result(tmp_path / "kld.json", _doc())
        atomic_io.write_text_atomic(tmp_path / "page.html", "<html>")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "page.html").stat().st_mode) == 0o644


def test_the_write_probe_is_real_not_permission_bits(tmp_path, monkeypatch):
    """Root passes os.access everywhere: the check must try to create a file."""
    monkeypatch.setattr(os, "access", lambda *a, **k: True)

    def refuse(*a, **k):
        raise PermissionError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(results.tempfile, "mkstemp", refuse)
    with pytest.raises(UserError) as exc:
        check_output_path(tmp_path / "new" / "kld.json")
    msg = str(exc.value)
    assert "not writable" in msg and "Read-only file system" in msg and "\n" not in msg


def _lock_folder(folder: Path):
    """Make `folder` unwritable for this user: mode 0555, or (root ignores modes) the immutable
    attribute. Returns the undo, or None where neither is possible here."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return lambda: folder.chmod(0o755)
    locked = subprocess.run(["chattr", "+i", str(folder)], capture_output=True) if shutil.which("chattr") else None
    if locked is None or locked.returncode != 0:
        return None
    return lambda: subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_unwritable_folder_is_found_before_the_work(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    undo = _lock_folder(locked)
    if undo is None:
        pytest.skip("running as root without chattr support: the probe test above covers this path")
    try:
        with pytest.raises(UserError, match="not writable"):
            check_output_path(locked / "kld.json")
        with pytest.raises(UserError, match="not writable"):
            check_output_path(locked / "sub" / "kld.json")
    finally:
        undo()


def test_check_output_path_refuses_folders_and_files_as_folders(tmp_path):
    with pytest.raises(UserError, match="is a folder"):
        check_output_path(tmp_path)
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is a file, not a folder"):
        check_output_path(tmp_path / "f" / "kld.json")
    assert check_output_path(tmp_path / "a" / "b" / "kld.json") == tmp_path / "a" / "b" / "kld.json"
    assert not (tmp_path / "a").exists()  # the check creates nothing
    assert _leftovers(tmp_path) == []


def test_an_interrupted_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "link", interrupted)
    monkeypatch.setattr(os, "replace", interrupted)
    for replace in (False, True):
        with pytest.raises(KeyboardInterrupt):
            atomic_io.write_text_atomic(tmp_path / "kld.json", "{}", replace=replace)
    assert list(tmp_path.iterdir()) == []


def test_pending_outputs_name_what_was_checked_and_not_written(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    with pending_outputs() as pending:
        check_output_path(a)
        check_output_path(b)
        write_result(a, _doc())
        assert pending.paths == [b]
    check_output_path(tmp_path / "c.json")  # outside a ledger: nothing recorded, nothing fails
