"""Every command, fed bad input, answers with one line and exit code 2 (issue 13).

The contract, for every case below:
- `mla_eval.cli.main(argv)` returns 2;
- stderr is exactly one line, and it starts with `error: ` (usage errors too: Click's message on
  one line followed by `(see 'mla-eval COMMAND --help')`);
- the line contains the case's expected words (what is wrong, or the option at fault);
- "Traceback" appears nowhere in stdout or stderr.
Nothing a user made is lost: the cases that point --out / --junit / --plot at a user's own file
check that the file is unchanged afterwards.

The CLI runs in-process (fast); environment variables are set with monkeypatch. Model-loading
cases use a tiny checkpoint, a short text and --out under tmp, so that even a command that wrongly
accepts its input costs seconds and writes nowhere else. A subprocess runs only where a real
process matters: a SIGTERM in the middle of `mla-eval kld`, and the bare command.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_models import tiny_checkpoint

from mla_eval.cli import main

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "results" / "baselines" / "ci-smoke"
TEXT = " ".join(f"The river {w} flows past the old mill near the {w} bridge." for w in ["north", "south", "east", "west"] * 30)
USER_TEXT = "my own notes, not a result\n"


class World:
    """Files the cases point at, made once per module."""

    def _config_variant(self, name: str, edit) -> Path:
        """A copy of the tiny checkpoint whose config.json went through `edit`."""
        folder = self.root / name
        shutil.copytree(self.ckpt, folder)
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(edit(cfg)))
        return folder

    def __init__(self, root: Path):
        self.root = root
        self.ckpt = tiny_checkpoint(root / "ckpt")
        self.text = root / "text.txt"
        self.text.write_text(TEXT)
        self.binary = root / "random.bin"
        self.binary.write_bytes(bytes((i * 7919 + 13) % 256 for i in range(60000)))
        self.no_rank = root / "no-rank"
        shutil.copytree(self.ckpt, self.no_rank)
        cfg = json.loads((self.no_rank / "config.json").read_text())
        del cfg["kv_lora_rank"]
        (self.no_rank / "config.json").write_text(json.dumps(cfg))
        self.llama = self._config_variant("llama", lambda c: {**c, "model_type": "llama"})
        self.dsa_no_indexer = self._config_variant(
            "dsa-no-indexer",
            lambda c: {k: v for k, v in {**c, "model_type": "deepseek_v32"}.items() if not k.startswith("index_")},
        )
        self.user_file = root / "mine.json"
        self.user_file.write_text(USER_TEXT)
        self.user_dir = root / "my-folder"
        self.user_dir.mkdir()
        (self.user_dir / "thesis.txt").write_text(USER_TEXT)
        self.results = root / "results-dir"
        shutil.copytree(BASELINE, self.results)
        self.empty = root / "empty"
        self.empty.mkdir()
        self.kld_doc = BASELINE / "kld.json"
        self.locked = root / "locked"
        self.locked.mkdir()
        self._unlock = _lock(self.locked)

    def recipe(self, name: str, text: str) -> Path:
        path = self.root / name
        path.write_text(text)
        return path

    def close(self) -> None:
        if self._unlock is not None:
            self._unlock()


def _lock(folder: Path):
    """Make `folder` unwritable (mode 0555; as root, which ignores modes, the immutable attribute)."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return lambda: folder.chmod(0o755)
    if shutil.which("chattr") and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0:
        return lambda: subprocess.run(["chattr", "-i", str(folder)], check=True)
    return None


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = World(tmp_path_factory.mktemp("bad-input"))
    yield w
    w.close()


def _kld(w: World, *extra: str) -> list[str]:
    """A cheap kld run on the tiny checkpoint; the case's options come last and win."""
    return ["kld", "--model", str(w.ckpt), "--text", str(w.text), "--formats", "nvfp4", "--scales", "none",
            "--no-layer-stats", "--ctx", "64", "--stride", "32", "--device", "cpu", "--out", str(w.root / "out" / "k.json"),
            *extra]


def _calibrate(w: World, *extra: str) -> list[str]:
    return ["calibrate", "--model", str(w.ckpt), "--text", str(w.text), "--ctx", "64", "--device", "cpu",
            "--out", str(w.root / "out" / "s.json"), *extra]


def _needle(w: World, *extra: str) -> list[str]:
    return ["needle", "--model", str(w.ckpt), "--formats", "nvfp4", "--scales", "none", "--lengths", "128", "--depths", "50",
            "--device", "cpu", "--out", str(w.root / "out" / "n.json"), *extra]


def _gate(w: World, *extra: str) -> list[str]:
    return ["gate", str(w.kld_doc), "--baseline", str(w.kld_doc), *extra]


def _toml(w: World, name: str, text: str) -> str:
    return str(w.recipe(f"{name}.toml", text))


# case name -> (argv builder, environment, expected words in the error line)
CASES = {
    # the top level
    "bare mla-eval": (lambda w: [], {}, "no command given"),
    "unknown command": (lambda w: ["frobnicate"], {}, "No such command 'frobnicate'"),
    "unknown top-level option": (lambda w: ["--frobnicate"], {}, "No such option: --frobnicate"),
    # formats
    "formats: unknown format": (lambda w: ["formats", "--formats", "int3"], {}, "int3"),
    "formats: empty list": (lambda w: ["formats", "--formats", ","], {}, "--formats is empty"),
    "formats: ambiguous engine name": (lambda w: ["formats", "--formats", "nvfp4_ds_mla"], {}, "is ambiguous"),
    "formats: name shared by SGLang versions": (lambda w: ["formats", "--formats", "fp4_e2m1"], {}, "416 B"),
    "formats: retired engine alias": (lambda w: ["formats", "--formats", "vllm:nvfp4_fp8_ds_mla"], {}, "nvfp4_ds_mla"),
    "formats: unknown option": (lambda w: ["formats", "--bogus"], {}, "No such option: --bogus"),
    # capacity
    "capacity: --tp 0 names --tp": (lambda w: ["capacity", "--tp", "0"], {}, "--tp must be >= 1"),
    "capacity: --tp abc": (lambda w: ["capacity", "--tp", "abc"], {}, "'--tp'"),
    "capacity: zero KV bytes": (lambda w: ["capacity", "--kv-cache-memory-bytes", "0"], {}, "must be positive"),
    "capacity: NaN KV memory": (lambda w: ["capacity", "--kv-memory-gib", "nan"], {}, "--kv-memory-gib must be positive"),
    "capacity: unknown GPU": (lambda w: ["capacity", "--gpu", "a100"], {}, "unknown GPU"),
    "capacity: --dcp not dividing --tp": (lambda w: ["capacity", "--dcp", "3"], {}, "must divide --tp"),
    "capacity: missing --config": (lambda w: ["capacity", "--config", str(w.root / "nope.json")], {}, "does not exist"),
    "capacity: --plot not PNG": (lambda w: ["capacity", "--plot", str(w.root / "p.svg")], {}, "plots are PNG"),
    "capacity: --plot over a user's file": (lambda w: ["capacity", "--plot", str(w.user_file.with_suffix(".png"))], {},
                                            "not a plot mla-eval wrote"),
    "capacity: --plot in a locked folder": (lambda w: ["capacity", "--plot", str(w.locked / "c.png")], {}, "not writable"),
    # kld
    "kld: unknown option": (lambda w: ["kld", "--bogus-option", "3"], {}, "No such option: --bogus-option"),
    "kld: ambiguous engine name": (lambda w: ["kld", "--formats", "nvfp4_ds_mla"], {}, "304 B, not built in"),
    "kld: --ctx abc": (lambda w: ["kld", "--ctx", "abc"], {}, "'--ctx'"),
    "kld: --ctx 0": (lambda w: _kld(w, "--ctx", "0"), {}, "--ctx"),
    "kld: --ctx -5 names --ctx": (lambda w: _kld(w, "--ctx", "-5"), {}, "--ctx"),
    "kld: --max-tokens 0": (lambda w: _kld(w, "--max-tokens", "0"), {}, "--max-tokens"),
    "kld: --stride larger than --ctx": (lambda w: _kld(w, "--stride", "512"), {}, "--stride"),
    "kld: binary text": (lambda w: _kld(w, "--text", str(w.binary)), {}, "text"),
    "kld: missing text file": (lambda w: _kld(w, "--text", str(w.root / "nope.txt")), {}, "nope.txt"),
    "kld: config without kv_lora_rank": (lambda w: _kld(w, "--model", str(w.no_rank)), {}, "kv_lora_rank"),
    "kld: --device tpu": (lambda w: _kld(w, "--device", "tpu"), {}, "tpu"),
    "kld: unsupported architecture": (lambda w: _kld(w, "--model", str(w.llama)), {}, "llama"),
    "kld: DSA config without indexer fields": (lambda w: _kld(w, "--model", str(w.dsa_no_indexer)), {}, "index_topk"),
    "kld: --model a file": (lambda w: _kld(w, "--model", str(w.user_file)), {}, "is a file, not a checkpoint folder"),
    "kld: unknown control format": (lambda w: _kld(w, "--formats", "control:int1"), {}, "the controls are"),
    "needle: --power-drop 2": (lambda w: _needle(w, "--power-drop", "2", "--power"), {}, "--power-drop is an accuracy drop"),
    "needle: --power-drop without --power": (lambda w: _needle(w, "--power-drop", "0.2"), {},
                                             "--power-drop sets the drop --power reports, and --power was not given"),
    "kld: unknown random preset": (lambda w: _kld(w, "--model", "random:glm-9"), {}, "glm-9"),
    "kld: random preset with bad layers": (lambda w: _kld(w, "--model", "random:glm-5:layers=0"), {}, "layers"),
    "kld: --semantics engine:0": (lambda w: _kld(w, "--semantics", "engine:0"), {}, "at least 1 token"),
    "kld: --semantics engine:-4": (lambda w: _kld(w, "--semantics", "engine:-4"), {}, "--semantics"),
    "kld: --semantics engine without a chunk": (lambda w: _kld(w, "--semantics", "engine"), {}, "engine:C"),
    "kld: --semantics engine:abc": (lambda w: _kld(w, "--semantics", "engine:abc"), {}, "whole number"),
    "kld: unknown --semantics": (lambda w: _kld(w, "--semantics", "cache,trtllm"), {}, "trtllm"),
    "kld: --semantics chunk beyond the positions": (lambda w: _kld(w, "--semantics", "engine:4096"), {}, "256 positions"),
    "kld: unknown --math": (lambda w: _kld(w, "--math", "fp4"), {}, "fp4"),
    "kld: --math fp8-qp with --backend kernel": (lambda w: _kld(w, "--math", "bf16,fp8-qp", "--backend", "kernel"), {},
                                                 "torch reference only"),
    "kld: MLA_EVAL_ATTENTION_KERNEL=v9": (lambda w: _kld(w), {"MLA_EVAL_ATTENTION_KERNEL": "v9"}, "names no kernel generation"),
    "kld: --math fp8-qp with MLA_EVAL_BACKEND=kernel": (lambda w: _kld(w, "--math", "fp8-qp"), {"MLA_EVAL_BACKEND": "kernel"},
                                                        "MLA_EVAL_BACKEND=kernel"),
    "kld: --explain bf16": (lambda w: _kld(w, "--explain", "bf16"), {}, "--explain"),
    "kld: --explain unknown format": (lambda w: _kld(w, "--explain", "int3"), {}, "int3"),
    "kld: --backend kernel on a CPU": (lambda w: _kld(w, "--backend", "kernel"), {}, "kernel"),
    "needle: --backend bogus": (lambda w: _needle(w, "--backend", "bogus"), {}, "bogus"),
    "kld: unknown format": (lambda w: _kld(w, "--formats", "int3"), {}, "int3"),
    "kld: unknown format option": (lambda w: _kld(w, "--formats", "nvfp4+foo"), {}, "+foo"),
    "kld: --max-memory without --device-map auto": (lambda w: _kld(w, "--max-memory", "40GiB"), {},
                                                    "--max-memory caps what --device-map auto plans"),
    "kld: bad --max-memory": (lambda w: _kld(w, "--device-map", "auto", "--max-memory", "lots"), {},
                              "--max-memory 'lots': give a positive size"),
    "kld: --out is a folder": (lambda w: _kld(w, "--out", str(w.empty)), {}, "is a folder"),
    "kld: --out in a locked folder": (lambda w: _kld(w, "--out", str(w.locked / "k.json")), {}, "not writable"),
    "kld: --force over a user's file": (lambda w: _kld(w, "--out", str(w.user_file), "--force"), {}, "not an mla-eval result"),
    "kld: missing --scales file": (lambda w: _kld(w, "--formats", "nvfp4+s_l", "--scales", str(w.root / "nope.json")), {},
                                   "nope.json"),
    "kld: MLA_EVAL_BACKEND=bogus": (lambda w: _kld(w), {"MLA_EVAL_BACKEND": "bogus"}, "bogus"),
    "kld: MLA_EVAL_BACKEND=kernel on a CPU": (lambda w: _kld(w), {"MLA_EVAL_BACKEND": "kernel"}, "kernel"),
    # calibrate
    "calibrate: no --out": (lambda w: ["calibrate"], {}, "Missing option '--out'"),
    "calibrate: --ctx 0": (lambda w: _calibrate(w, "--ctx", "0"), {}, "--ctx"),
    "calibrate: --max-tokens 0": (lambda w: _calibrate(w, "--max-tokens", "0"), {}, "--max-tokens"),
    "calibrate: --semantics engine:0": (lambda w: _calibrate(w, "--semantics", "engine:0"), {}, "--semantics"),
    "calibrate: --semantics beyond the positions": (lambda w: _calibrate(w, "--semantics", "vllm"), {}, "256 positions"),
    "calibrate: --math fp8-qp with --backend kernel": (lambda w: _calibrate(w, "--math", "fp8-qp", "--backend", "kernel"), {},
                                                       "fp8-qp"),
    "calibrate: --out in a locked folder": (lambda w: _calibrate(w, "--out", str(w.locked / "s.json")), {}, "not writable"),
    "calibrate: --force over a user's file": (lambda w: _calibrate(w, "--out", str(w.user_file), "--force"), {},
                                              "not an mla-eval result"),
    # needle
    "needle: bad --lengths": (lambda w: _needle(w, "--lengths", "abc"), {}, "--lengths"),
    "needle: unknown --task": (lambda w: _needle(w, "--task", "bogus"), {}, "bogus"),
    "needle: bad --max-memory": (lambda w: _needle(w, "--device-map", "auto", "--max-memory", "0GiB"), {},
                                 "--max-memory '0GiB'"),
    "needle: depth over 100": (lambda w: _needle(w, "--depths", "150"), {}, "150"),
    "needle: --trials 0": (lambda w: _needle(w, "--trials", "0"), {}, "--trials"),
    "needle: --semantics engine:0": (lambda w: _needle(w, "--semantics", "engine:0"), {}, "--semantics"),
    "needle: --semantics beyond the positions": (lambda w: _needle(w, "--semantics", "sglang"), {}, "256 positions"),
    "needle: unknown --math": (lambda w: _needle(w, "--math", "int8"), {}, "int8"),
    "needle: --math fp8-qp with --backend kernel": (lambda w: _needle(w, "--math", "fp8-qp", "--backend", "kernel"), {},
                                                    "fp8-qp"),
    "needle: --device tpu": (lambda w: _needle(w, "--device", "tpu"), {}, "tpu"),
    "needle: --out in a locked folder": (lambda w: _needle(w, "--out", str(w.locked / "n.json")), {}, "not writable"),
    "needle: unknown task in a task list": (lambda w: _needle(w, "--task", "single,niah"), {}, "niah"),
    "needle: more needles than the prompt holds": (lambda w: _needle(w, "--task", "multikey", "--needles", "12"), {},
                                                   "--needles"),
    "needle: more multikey needles than keys": (lambda w: _needle(w, "--task", "multikey", "--needles", "13"), {},
                                                "distinct keys"),
    "needle: --rope-scaling factor not a number": (lambda w: _needle(w, "--rope-scaling", "yarn:abc"), {}, "not a number"),
    "needle: --rope-scaling factor below 1": (lambda w: _needle(w, "--rope-scaling", "yarn:0.5"), {}, ">= 1"),
    "kld: --rope-scaling factor not a number": (lambda w: _kld(w, "--rope-scaling", "yarn:four"), {}, "not a number"),
    "kld: --rope-scaling unknown kind": (lambda w: _kld(w, "--rope-scaling", "linear:2"), {}, "yarn:FACTOR"),
    # gate
    "gate: no arguments": (lambda w: ["gate"], {}, "Missing argument 'results'"),
    "gate: no --baseline": (lambda w: ["gate", str(w.kld_doc)], {}, "Missing option '--baseline'"),
    "gate: missing results": (lambda w: ["gate", str(w.root / "nope.json"), "--baseline", str(w.kld_doc)], {}, "does not exist"),
    "gate: --junit in a locked folder": (lambda w: _gate(w, "--junit", str(w.locked / "g.xml")), {}, "not writable"),
    "gate: --junit over a user's file": (lambda w: _gate(w, "--junit", str(w.user_file)), {}, "not a gate report"),
    "gate: --junit is a folder": (lambda w: _gate(w, "--junit", str(w.empty)), {}, "is a folder"),
    "gate: unknown tolerance metric": (lambda w: _gate(w, "--tolerances", _toml(w, "tol", "[gate]\nspeed = {abs = 1}\n")),
                                       {}, "unknown metric"),
    "gate: negative tolerance": (lambda w: _gate(w, "--tolerances", _toml(w, "neg", "[gate]\nkld_mean = {abs = -1}\n")),
                                 {}, "kld_mean.abs"),
    # run
    "run: missing recipe": (lambda w: ["run", str(w.root / "nope.toml")], {}, "does not exist"),
    "run: unknown table": (lambda w: ["run", str(w.recipe("t.toml", "[kld]\n[frob]\n"))], {}, "unknown table"),
    "run: unknown [kld] key": (lambda w: ["run", str(w.recipe("k.toml", f'model = "{w.ckpt}"\n[kld]\nbogus_key = 3\n')),
                                          "--out", str(w.root / "run-k")], {}, "bogus"),
    "run: [kld] ctx = 0": (lambda w: ["run", str(w.recipe("c.toml", f'model = "{w.ckpt}"\ndevice = "cpu"\n[kld]\nctx = 0\n'
                                                               f'text = "{w.text}"\nformats = "nvfp4"\nscales = "none"\n')),
                                      "--out", str(w.root / "run-c")], {}, "ctx"),
    # --force may add our documents beside a user's files (tests/test_run_recipe.py), never replace one of theirs
    "run: --force over a user's file of the same name": (
        lambda w: ["run", str(w.recipe("cap.toml", '[capacity]\npreset = "glm-5"\n')),
                   "--out", str(_user_file_named(w, "capacity.json")), "--force"], {}, "capacity.json"),
    # issue 29: recipe types, undecodable files, absurd scales, limits, self-overwrites
    "run: [capacity] tp is not a number": (lambda w: ["run", _toml(w, "tp", '[capacity]\ntp = "eight"\n'),
                                                      "--out", str(w.root / "run-tp")], {}, 'tp = \'eight\' has the wrong type'),
    "run: [[capacity]] preset is not a string": (lambda w: ["run", _toml(w, "preset", "[[capacity]]\npreset = 7\n"),
                                                            "--out", str(w.root / "run-p")], {}, "preset = 7 has the wrong type"),
    "run: recipe is not UTF-8": (lambda w: ["run", str(_bytes(w, "latin.toml", b'[capacity]\npreset = "glm-5" # \xe9t\xe9\n')),
                                            "--out", str(w.root / "run-u")], {}, "is not UTF-8 text"),
    "run: model is not a string": (lambda w: ["run", _toml(w, "m7", "model = 7\n[capacity]\n"), "--out", str(w.root / "run-m")],
                                   {}, "model = 7 must be a string"),
    "kld: --scales file is not UTF-8": (lambda w: _kld(w, "--formats", "nvfp4+s_l", "--scales",
                                                       str(_bytes(w, "latin.json", b'{"format": "\xe9"}'))), {},
                                        "is not UTF-8 text"),
    "kld: --scales 1e300": (lambda w: _kld(w, "--formats", "nvfp4+s_l", "--scales", _scales(w, "huge.json", "1e300")), {},
                            "huge.json: scale of layer 1 is 1e+300"),
    "kld: --scales Infinity": (lambda w: _kld(w, "--formats", "nvfp4+s_l", "--scales", _scales(w, "inf.json", "Infinity")), {},
                               "inf.json is not readable JSON (Infinity is not JSON)"),
    "kld: --scales NaN": (lambda w: _kld(w, "--formats", "nvfp4+s_l", "--scales", _scales(w, "nan.json", "NaN")), {},
                          "nan.json is not readable JSON (NaN is not JSON)"),
    "kld: --scales negative": (lambda w: _kld(w, "--formats", "nvfp4+s_l", "--scales", _scales(w, "neg.json", "-0.5")), {},
                               "neg.json: scale of layer 1 is -0.5"),
    "needle: --scales 1e300": (lambda w: _needle(w, "--formats", "nvfp4+s_l", "--scales", _scales(w, "huge.json", "1e300")),
                               {}, "huge.json: scale of layer 1 is 1e+300"),
    "kld: --sample-len beyond the positions": (
        lambda w: ["kld", "--model", str(w.ckpt), "--formats", "nvfp4", "--scales", "none", "--samples", "1",
                   "--sample-len", "100000", "--device", "cpu", "--out", str(w.root / "out" / "k.json")], {},
        "--sample-len 100000 is beyond the model's 256 positions"),
    "kld: --out is its own --scales input": (
        lambda w: _kld(w, "--formats", "nvfp4+s_l", "--scales", _scales(w, "mine-scales.json", "0.01"), "--out",
                       str(w.root / "mine-scales.json"), "--force"), {}, "is also the --scales input"),
    "needle: --haystack is not UTF-8": (lambda w: _needle(w, "--haystack", str(w.binary)), {}, "--haystack"),
    "needle: --haystack folder with a non-UTF-8 file": (lambda w: _needle(w, "--haystack", str(_hay_folder(w))), {},
                                                        "is not UTF-8 text"),
    "kld: truncated safetensors": (lambda w: _kld(w, "--model", str(_truncated(w))), {}, "truncated"),
    "kld: --out ''": (lambda w: _kld(w, "--out", ""), {}, "--out is empty"),
    # report
    "report: not a directory": (lambda w: ["report", str(w.kld_doc)], {}, "not a results directory"),
    "report: empty directory": (lambda w: ["report", str(w.empty)], {}, "holds no kld.json"),
    "report: --out in a locked folder": (lambda w: ["report", str(w.results), "--out", str(w.locked / "r.html")], {},
                                         "not writable"),
    "report: --out over a user's file": (lambda w: ["report", str(w.results), "--out", str(w.user_file.with_suffix(".html"))],
                                         {}, "not a report mla-eval wrote"),
}


def _bytes(w: World, name: str, data: bytes) -> Path:
    path = w.root / name
    path.write_bytes(data)
    return path


def _scales(w: World, name: str, second: str) -> str:
    """An outer-scale file for the tiny model (3 layers) whose second scale is written as `second`."""
    path = w.root / name
    path.write_text('{"format": "nvfp4_ds_mla_outer_scale_v1", "num_layers": 3, "latent_dim": 512, '
                    f'"denominator": 2688, "scales": [0.01, {second}, 0.01]}}')
    return str(path)


def _hay_folder(w: World) -> Path:
    folder = w.root / "hay"
    folder.mkdir(exist_ok=True)
    (folder / "a.txt").write_text(TEXT)
    (folder / "b.txt").write_bytes(b"caf\xe9 " * 40)
    return folder


def _truncated(w: World) -> Path:
    folder = w.root / "truncated"
    if not folder.exists():
        shutil.copytree(w.ckpt, folder)
        weights = folder / "model.safetensors"
        os.truncate(weights, weights.stat().st_size // 2)
    return folder


def _user_files(w: World) -> dict[Path, str]:
    """The user's own files the cases aim at (re-made if an earlier case lost them)."""
    w.user_dir.mkdir(exist_ok=True)
    for path in (w.user_file.with_suffix(".png"), w.user_file.with_suffix(".html"), w.user_dir / "thesis.txt"):
        path.write_text(USER_TEXT)
    return {p: p.read_text() for p in [w.user_file, w.user_file.with_suffix(".png"), w.user_file.with_suffix(".html"),
                                         w.user_dir / "thesis.txt"]}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case, world, capsys, monkeypatch, tmp_path):
    build, env, expected = CASES[case]
    monkeypatch.chdir(tmp_path)  # a command that wrongly runs writes its default output here
    monkeypatch.delenv("MLA_EVAL_BACKEND", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    before = _user_files(world)
    argv = build(world)
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert code == 2, f"exit {code}; stderr: {err[-500:]}"
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), lines[0]
    assert expected in lines[0], lines[0]
    assert {p: p.read_text() for p in before} == before  # nothing a user made was touched


def test_there_are_at_least_40_cases_over_every_command():
    commands = {c.split(":")[0] for c in CASES}
    assert len(CASES) >= 40
    assert {"formats", "capacity", "kld", "calibrate", "needle", "gate", "run", "report"} <= commands


def test_help_still_exits_0(capsys):
    assert main(["--help"]) == 0
    assert main(["kld", "--help"]) == 0
    assert "Usage" in capsys.readouterr().out


def test_bare_command_in_a_real_process_lists_the_commands():
    proc = subprocess.run([sys.executable, "-m", "mla_eval"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "capacity" in proc.stdout and "kld" in proc.stdout  # the command list, on stdout
    assert proc.stderr.strip().splitlines() == ["error: no command given; choose one of the commands above"]


def test_interrupt_names_the_result_not_written(world, capsys, monkeypatch, tmp_path):
    """Ctrl-C after the output was checked: exit 130, one line naming what was not written."""
    from mla_eval.report import page

    def interrupted(results):
        raise KeyboardInterrupt

    out = tmp_path / "r.html"
    monkeypatch.setattr(page, "build_report", interrupted)
    code = main(["report", str(world.results), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 130
    md = out.with_suffix(".md")
    assert err.strip().splitlines()[-1] == f"interrupted by SIGINT: no result written (would have been {out}, {md})"
    assert list(tmp_path.iterdir()) == []


def test_sigterm_during_kld_leaves_nothing_and_says_so(world, tmp_path):
    """A real process: SIGTERM while kld scores a long text. Exit 143, one line, no result or
    temporary file anywhere under --out's folder."""
    (tmp_path / "long.txt").write_text(TEXT * 40)
    out_dir = tmp_path / "out"
    cmd = [sys.executable, "-m", "mla_eval", "kld", "--model", str(world.ckpt), "--text", str(tmp_path / "long.txt"),
           "--formats", "nvfp4,fp8_ds_mla,mxfp4", "--scales", "none", "--ctx", "128", "--stride", "16", "--device", "cpu",
           "--out", str(out_dir / "k.json")]
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="100")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # wait until the command itself is running (it prints its first line to stderr), then stop it
        first = proc.stderr.readline()
        assert first, "kld printed nothing"
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-800:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("interrupted by SIGTERM: no result written")
    assert not out_dir.exists() or list(out_dir.iterdir()) == []
    assert [p.name for p in tmp_path.iterdir() if p.name != "long.txt"] in ([], ["out"])


def _user_file_named(w, name: str):
    """A user's folder holding a file (not an mla-eval document) with the name a run would write."""
    folder = w.root / "my-results"
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(USER_TEXT)
    return folder


def test_missing_jsonschema_is_one_line_before_the_work(tmp_path, monkeypatch):
    """A missing validator is found when --out is checked (before any model loads), in one line."""
    import builtins

    from mla_eval.errors import UserError
    from mla_eval.results import check_output_path

    real_import = builtins.__import__

    def no_jsonschema(name, *args, **kwargs):
        if name == "jsonschema" or name.startswith("jsonschema."):
            raise ImportError("No module named 'jsonschema'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_jsonschema)
    with pytest.raises(UserError, match="jsonschema package is missing.*pip install") as exc:
        check_output_path(tmp_path / "r.json")
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "r.json").exists()


def test_kernels_package_missing_is_a_stated_fallback(monkeypatch):
    """Without the mla_eval_kernels package (a source tree that was not installed), kernel_status says
    why instead of raising ModuleNotFoundError (it crashed `needle` on a GPU before)."""
    import importlib.util

    from mla_eval.attention import dispatch

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mla_eval_kernels" else real(name, *a))
    dispatch._kernels_package_reason.cache_clear()  # a process-wide constant, cached: recompute under the patch
    try:
        ok, why = dispatch.kernel_status("nvfp4", "cuda:0")
        assert not ok and "mla_eval_kernels package is not importable" in why
    finally:
        monkeypatch.undo()
        dispatch._kernels_package_reason.cache_clear()


def test_the_kernel_generation_is_recorded_whenever_a_kernel_served_a_path(monkeypatch):
    """Results record the generation MLA_EVAL_ATTENTION_KERNEL forces whenever a kernel served a path ("default" when
    it is unset: `attention_tuning.generation_for` picks per launch), and nothing for a CPU run."""
    from mla_eval.attention import dispatch

    monkeypatch.setenv("MLA_EVAL_ATTENTION_KERNEL", "v3")
    dispatch.preflight("reference", ["cuda:0"])  # a valid generation: no error
    log = dispatch.PathLog("auto")
    log.record("attend", "nvfp4", torch_device("cuda:0"), "kernel")
    assert log.as_dict()["kernel_version"] == "v3"
    cpu_log = dispatch.PathLog("auto")
    cpu_log.record("attend", "nvfp4", torch_device("cpu"), "reference (cpu tensors)")
    assert "kernel_version" not in cpu_log.as_dict()
    monkeypatch.delenv("MLA_EVAL_ATTENTION_KERNEL")
    assert log.as_dict()["kernel_version"] == "default"


def test_the_log_records_which_generation_each_attention_path_ran():
    """Each kernel-served attention path lists the generations its launches ran, once each, with why
    (a decode step on v3 and a prefill-as-decode launch on v2 both show); absent when none ran."""
    from mla_eval.attention import dispatch

    log = dispatch.PathLog("auto")
    cuda = torch_device("cuda:0")
    log.record("attend", "nvfp4", cuda, "kernel")
    log.record_generation("nvfp4", cuda, "v3", "default: v3 measured faster for nvfp4")
    log.record_generation("nvfp4", cuda, "v2", "default: v3 measured at one query per sequence, not 64")
    log.record_generation("nvfp4", cuda, "v3", "default: v3 measured faster for nvfp4")
    log.record_generation("fp8_ds_mla", cuda, "v2", "fp8_ds_mla: v3 needs more shared memory")
    doc = log.as_dict()
    assert doc["kernel_generations"] == {
        "attend nvfp4 on cuda:0": [
            "v3 (default: v3 measured faster for nvfp4)", "v2 (default: v3 measured at one query per sequence, not 64)"
        ],
        "attend fp8_ds_mla on cuda:0": ["v2 (fp8_ds_mla: v3 needs more shared memory)"],
    }
    assert "kernel_generations" not in dispatch.PathLog("auto").as_dict()


def torch_device(name):
    import torch

    return torch.device(name)


def test_a_bad_plot_path_fails_before_the_work(world, capsys, tmp_path):
    """kld --plot EXISTING_FILE ran the whole evaluation and wrote the JSON before dying: now it is refused
    first, and no result is written."""
    out = tmp_path / "k.json"
    code = main(_kld(world, "--out", str(out), "--plot", str(world.user_file)))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: --plot {world.user_file} is a file; give a folder for the PNG plots (it is created if missing)"
    ]
    assert not out.exists() and world.user_file.read_text() == USER_TEXT
    folder = tmp_path / "plots"
    folder.mkdir()
    (folder / "kld_cdf.png").write_text(USER_TEXT)  # a user's file with the name a plot would take
    assert main(_kld(world, "--out", str(out), "--plot", str(folder))) == 2
    assert "kld_cdf.png exists and is not a plot mla-eval wrote" in capsys.readouterr().err
    assert not out.exists() and (folder / "kld_cdf.png").read_text() == USER_TEXT


@pytest.mark.parametrize("argv", [["capacity", "--json"], ["formats"]])
def test_stdout_on_a_full_device_is_one_line(argv, tmp_path):
    """`mla-eval capacity --json > /dev/full` and `mla-eval formats > /dev/full`: one line, exit 2."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="100")
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "mla_eval", *argv], cwd=tmp_path, env=env, stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-800:]
    assert proc.stderr.strip().splitlines() == [
        "error: cannot write the output (standard output): No space left on device; free space there or send the output "
        "elsewhere"
    ]


# --------------------------------------------------------------------------------------- corrupted checkpoints (issue 44)

from corrupt_checkpoints import PATHS as BAD_CHECKPOINT_PATHS  # noqa: E402 - the sweep's paths, with its cases


@pytest.fixture(scope="module")
def written_checkpoints(tmp_path_factory):
    """kind -> a 2-layer checkpoint the project's writer wrote (bf16 too, for the reverse mislabelling)."""
    from corrupt_checkpoints import KINDS
    from test_checkpoint import TOKENIZER, small_config

    from mla_eval.model.checkpoint_writer import write_random_checkpoint

    root = tmp_path_factory.mktemp("written")
    return {kind: write_random_checkpoint(root / kind, small_config("deepseek_v3", vocab=12288, layers=2), kind,
                                          tokenizer_from=TOKENIZER).path for kind in ("bf16", *KINDS)}


def _bad_checkpoint(written, kind: str, corruption: str, root: Path) -> Path:
    from corrupt_checkpoints import corrupted, with_foreign_config

    folder = root / f"{kind}-{corruption.replace(' ', '-')}"
    if not folder.exists():
        if corruption == "config over unquantised shards":
            with_foreign_config(written["bf16"], kind, folder)
        else:
            corrupted(written[kind], kind, corruption, folder)
    return folder


def _sweep_cases():
    from corrupt_checkpoints import cases

    return [(k, c, p) for k, c in cases() for p in BAD_CHECKPOINT_PATHS]


@pytest.mark.parametrize("kind,corruption,path", _sweep_cases())
def test_a_corrupted_checkpoint_is_never_scored(kind, corruption, path, written_checkpoints, world, capsys, monkeypatch,
                                               tmp_path_factory):
    """Every kind of checkpoint the reader accepts, written by the project's writer and then corrupted (a scale
    missing, of the wrong shape or dtype, NaN, infinite, negative or zero; a config that does not describe its
    shards): resident, streamed and dry run alike exit 2 with one line naming the shard, the tensor and what is
    wrong; never a figure, never a traceback."""
    from corrupt_checkpoints import NAMES_SHARD, TARGET

    folder = _bad_checkpoint(written_checkpoints, kind, corruption, tmp_path_factory.getbasetemp() / "corrupted")
    out = world.root / "out" / f"bad-{kind}-{path}.json"
    monkeypatch.chdir(world.root)
    capsys.readouterr()
    code = main(_kld(world, "--model", str(folder), "--max-tokens", "128", "--no-layer-stats", "--out", str(out),
                     *BAD_CHECKPOINT_PATHS[path]))
    stdout, err = capsys.readouterr()
    assert "Traceback" not in stdout + err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), f"exit {code}: {err[-800:]}"
    assert not out.exists()
    if corruption in NAMES_SHARD:
        assert TARGET in lines[0] and ".safetensors" in lines[0], lines[0]
    else:
        assert "quantization_config" in lines[0] or "config" in lines[0], lines[0]


@pytest.mark.parametrize("weight_math", ["fp8", "dequant"])
@pytest.mark.parametrize("path", ["resident", "stream"])
def test_a_bad_scale_is_refused_in_either_weight_math(weight_math, path, written_checkpoints, world, capsys, monkeypatch,
                                                     tmp_path_factory):
    """An FP8 block checkpoint read with its codes kept as stored (--weight-math fp8, the default for it) goes through
    the same scale checks as one dequantised: a NaN scale is refused either way, naming the shard and tensor."""
    from corrupt_checkpoints import TARGET

    folder = _bad_checkpoint(written_checkpoints, "fp8-block", "scale NaN", tmp_path_factory.getbasetemp() / "corrupted")
    out = world.root / "out" / f"bad-fp8-{weight_math}-{path}.json"
    monkeypatch.chdir(world.root)
    capsys.readouterr()
    code = main(_kld(world, "--model", str(folder), "--max-tokens", "128", "--no-layer-stats", "--out", str(out),
                     "--weight-math", weight_math, *BAD_CHECKPOINT_PATHS[path]))
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), f"exit {code}: {err[-800:]}"
    assert TARGET in lines[0] and ".safetensors" in lines[0] and not out.exists(), lines[0]
