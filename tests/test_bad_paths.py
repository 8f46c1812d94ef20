"""Every command x every path-like option x {missing, folder, FIFO, /dev/null, /dev/zero, /dev/full, read-only
folder, an unrelated file}: one `error:` line and exit 2, never a traceback, never a hang (issue 29).

The cases run in one child process (tests/cli_worker.py) under an address-space limit, each with a timeout: a
regression that reads /dev/zero to the end or waits on a FIFO fails its case and costs only that process (which
is then restarted). The device files are reached through symbolic links in the test's folder, so that even a
regression that renames a temporary file over an output replaces a link, never a node in /dev.

Where a kind is a valid value of an option (a folder for --plot, a new path for --out, a text file for --text)
the case is left out: the other suites run those.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest
from test_bad_input import _lock
from tiny_models import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "results" / "baselines" / "ci-smoke"
TEXT = " ".join(f"The river {w} flows past the old mill near the {w} bridge." for w in ["north", "south", "east", "west"] * 30)
USER_TEXT = "my own notes, not a result\n"
CASE_TIMEOUT = 60  # seconds; the refusals take well under one

KINDS = ("missing", "folder", "fifo", "null", "zero", "full", "locked", "unrelated")


class Worker:
    """The child process running the CLI; restarted after a case that hung or killed it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}", COLUMNS="120")
        env.pop("MLA_EVAL_BACKEND", None)
        return subprocess.Popen([sys.executable, str(ROOT / "tests" / "cli_worker.py")], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)

    def run(self, argv: list[str], cwd: Path) -> dict | None:
        """The reply, or None when the case ran past CASE_TIMEOUT or the process died (then it is replaced)."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        self.proc.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd)}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], CASE_TIMEOUT + 30)  # + the first call's imports
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            return None
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class World:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.ckpt = tiny_checkpoint(root / "ckpt")
        self.text = root / "text.txt"
        self.text.write_text(TEXT)
        self.kld_doc = BASELINE / "kld.json"
        self.paths = {
            "missing": root / "nope" / "missing.json",
            "folder": root / "empty-folder",
            "fifo": root / "pipe",
            "null": root / "null",
            "zero": root / "zero",
            "full": root / "full",
            "locked": root / "locked",
            "unrelated": root / "mine.txt",
        }
        self.paths["folder"].mkdir()
        os.mkfifo(self.paths["fifo"])
        for name in ("null", "zero", "full"):
            os.symlink(f"/dev/{name}", self.paths[name])
        self.paths["unrelated"].write_text(USER_TEXT)
        self.paths["locked"].mkdir()
        self._unlock = _lock(self.paths["locked"])

    def value(self, kind: str, output: bool) -> str:
        """The option's value for a kind: an output aims inside the read-only folder, an input at the folder."""
        if kind == "locked" and output:
            return str(self.paths["locked"] / "out.json")
        return str(self.paths[kind])

    def close(self) -> None:
        if self._unlock is not None:
            self._unlock()


def _kld(w: World, *extra: str) -> list[str]:
    return ["kld", "--model", str(w.ckpt), "--text", str(w.text), "--formats", "nvfp4", "--scales", "none",
            "--no-layer-stats", "--ctx", "64", "--stride", "32", "--device", "cpu", "--out", str(w.root / "out" / "k.json"),
            *extra]


def _needle(w: World, *extra: str) -> list[str]:
    return ["needle", "--model", str(w.ckpt), "--formats", "nvfp4", "--scales", "none", "--lengths", "128", "--depths", "50",
            "--device", "cpu", "--out", str(w.root / "out" / "n.json"), *extra]


def _calibrate(w: World, *extra: str) -> list[str]:
    return ["calibrate", "--model", str(w.ckpt), "--text", str(w.text), "--ctx", "64", "--device", "cpu",
            "--out", str(w.root / "out" / "s.json"), *extra]


# (command: option, input or output, argv builder from the value, kinds that are valid values and left out)
OPTIONS = {
    "kld: --model": (False, lambda w, v: _kld(w, "--model", v), ()),
    "kld: --text": (False, lambda w, v: _kld(w, "--text", v), ("unrelated",)),
    "kld: --scales": (False, lambda w, v: _kld(w, "--formats", "nvfp4+s_l", "--scales", v), ()),
    "kld: --ref-file": (False, lambda w, v: _kld(w, "--ref-file", v), ()),
    "kld: --out": (True, lambda w, v: _kld(w, "--out", v), ("missing",)),
    "kld: --out --force": (True, lambda w, v: _kld(w, "--out", v, "--force"), ("missing",)),
    "kld: --plot": (True, lambda w, v: _kld(w, "--plot", v), ("missing", "folder")),
    "kld: --save-ref": (True, lambda w, v: _kld(w, "--save-ref", v), ("missing",)),
    "calibrate: --text": (False, lambda w, v: _calibrate(w, "--text", v), ("unrelated",)),
    "calibrate: --out --force": (True, lambda w, v: _calibrate(w, "--out", v, "--force"), ("missing",)),
    "needle: --haystack": (False, lambda w, v: _needle(w, "--haystack", v), ("unrelated",)),
    "needle: --scales": (False, lambda w, v: _needle(w, "--formats", "nvfp4+s_l", "--scales", v), ()),
    "needle: --out": (True, lambda w, v: _needle(w, "--out", v), ("missing",)),
    "needle: --plot": (True, lambda w, v: _needle(w, "--plot", v), ("missing", "folder")),
    "capacity: --config": (False, lambda w, v: ["capacity", "--config", v], ()),
    "capacity: --plot": (True, lambda w, v: ["capacity", "--plot", v], ("missing", "folder")),
    "gate: RESULTS": (False, lambda w, v: ["gate", v, "--baseline", str(w.kld_doc)], ()),
    "gate: --baseline": (False, lambda w, v: ["gate", str(w.kld_doc), "--baseline", v], ()),
    "gate: --tolerances": (False, lambda w, v: ["gate", str(w.kld_doc), "--baseline", str(w.kld_doc), "--tolerances", v], ()),
    "gate: --junit": (True, lambda w, v: ["gate", str(w.kld_doc), "--baseline", str(w.kld_doc), "--junit", v], ("missing",)),
    "gate: --update --baseline": (True, lambda w, v: ["gate", str(w.kld_doc), "--baseline", v, "--update"],
                                  ("missing", "folder")),
    "run: RECIPE": (False, lambda w, v: ["run", v, "--out", str(w.root / "run-out")], ()),
    "run: --out": (True, lambda w, v: ["run", str(ROOT / "recipes" / "glm5-capacity.toml"), "--out", v],
                   ("missing", "folder")),
    "report: RESULTS": (False, lambda w, v: ["report", v, "--out", str(w.root / "r.html")], ()),
    "report: --out": (True, lambda w, v: ["report", str(BASELINE), "--out", v], ("missing", "folder")),
    "plot: RESULT": (False, lambda w, v: ["plot", v, "--out", str(w.root / "heatmaps")], ()),
    "plot: --out": (True, lambda w, v: ["plot", str(BASELINE / "needle.json"), "--out", v], ("missing", "folder")),
}
CASES = [(opt, kind) for opt, (_, _, valid) in OPTIONS.items() for kind in KINDS if kind not in valid]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = World(tmp_path_factory.mktemp("bad-paths"))
    yield w
    w.close()


@pytest.fixture(scope="module")
def worker():
    wk = Worker()
    yield wk
    wk.close()


@pytest.mark.parametrize("option,kind", CASES, ids=[f"{o} = {k}" for o, k in CASES])
def test_a_bad_path_is_one_error_line(option, kind, world, worker, tmp_path):
    output, build, _ = OPTIONS[option]
    if kind == "locked" and world._unlock is None:
        pytest.skip("no way to make a folder read-only here (root without chattr)")
    before = world.paths["unrelated"].read_text()
    reply = worker.run(build(world, world.value(kind, output)), tmp_path)
    assert reply is not None, f"no answer within {CASE_TIMEOUT} s, or the process died (memory limit?)"
    err = reply["err"]
    assert "Traceback" not in reply["out"] + err, err[-2000:]
    assert reply["code"] == 2, f"exit {reply['code']}; stderr: {err[-800:]}"
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err[-800:]
    assert world.paths["unrelated"].read_text() == before  # nothing a user made was touched
    for name in ("null", "zero", "full"):  # the links to the devices are still links to them
        assert os.readlink(world.paths[name]) == f"/dev/{name}"
    assert list(tmp_path.iterdir()) == []  # nothing written where the command ran


def test_the_sweep_covers_every_command_and_kind():
    commands = {o.split(":")[0] for o in OPTIONS}
    assert {"kld", "calibrate", "needle", "capacity", "gate", "run", "report", "plot"} <= commands
    assert {k for _, k in CASES} == set(KINDS)
    assert len(CASES) >= 150
