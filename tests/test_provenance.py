"""Provenance: the commit comes from the imported package (never an enclosing repository), the
build stamp, the source digest, versions and GPUs, and the environment block that carries them."""

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import mla_eval
from mla_eval import provenance
from mla_eval.attention import dispatch
from mla_eval.result_schemas import ENVIRONMENT_SCHEMA, validate
from mla_eval.results import environment

ROOT = Path(__file__).resolve().parents[1]
PKG = Path(mla_eval.__file__).resolve().parent


def git(cwd: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "init.defaultBranch=main", *args]
    return subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True, env=env).stdout.strip()


def fake_package(parent: Path) -> Path:
    """A small package folder named mla_eval (two files) under `parent`."""
    pkg = parent / "mla_eval"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "0.0"\n')
    (pkg / "mod.py").write_text("X = 1\n")
    return pkg


def test_package_without_git_is_unknown(tmp_path):
    pkg = fake_package(tmp_path)
    assert provenance.package_commit(pkg) == {"commit": "unknown", "dirty": None, "source": "unknown"}


def test_fresh_repository_whose_head_lacks_the_package_is_not_its_commit(tmp_path):
    pkg = fake_package(tmp_path)
    (tmp_path / "README").write_text("other project\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "README")
    git(tmp_path, "commit", "-q", "-m", "unrelated")
    assert provenance.git_commit(pkg) is None
    assert provenance.package_commit(pkg)["commit"] == "unknown"


def test_repository_enclosing_the_package_from_above_is_not_its_commit(tmp_path):
    pkg = fake_package(tmp_path / "copy")  # tracked, but the checkout's top is not the package's parent
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "a tree that merely contains a copy")
    assert provenance.git_commit(pkg) is None


def test_checkout_with_the_package_at_its_top_gives_head_and_dirty_state(tmp_path):
    pkg = fake_package(tmp_path)
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "k.py").write_text("K = 1\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "package")
    head = git(tmp_path, "rev-parse", "--short=12", "HEAD")
    clean = provenance.git_commit(pkg, (kernels,))
    assert clean == {"commit": head, "dirty": False, "source": f"git checkout {tmp_path.resolve()}"}

    (tmp_path / "notes.txt").write_text("untracked outside the package: not the code\n")
    assert provenance.git_commit(pkg, (kernels,))["dirty"] is False
    (kernels / "new_kernel.py").write_text("untracked inside the kernels folder\n")
    assert provenance.git_commit(pkg, (kernels,))["dirty"] is True
    (kernels / "new_kernel.py").unlink()
    (pkg / "mod.py").write_text("X = 2  # edited after the commit (a stale .git looks like this)\n")
    edited = provenance.git_commit(pkg, (kernels,))
    assert edited["commit"] == head and edited["dirty"] is True


def test_build_stamp_is_read_when_there_is_no_checkout(tmp_path):
    pkg = fake_package(tmp_path)
    (pkg / provenance.BUILD_INFO).write_text(json.dumps({"commit": "abc123def456", "dirty": False}))
    assert provenance.package_commit(pkg) == {"commit": "abc123def456", "dirty": False, "source": "build stamp"}
    (pkg / provenance.BUILD_INFO).write_text("{not json")
    assert provenance.package_commit(pkg)["commit"] == "unknown"


def _checkout_head() -> str:
    try:
        return git(ROOT, "rev-parse", "--short=12", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("the tests do not run from a git checkout")


def test_the_real_checkout_reports_its_own_commit():
    head = _checkout_head()
    if provenance.git_commit(PKG) is None:
        pytest.skip("mla_eval is imported from an installed copy, not from this checkout")
    ident = provenance.code_identity()
    assert ident["git_commit"] == head
    assert ident["git_commit_source"] == f"git checkout {ROOT}"
    dirty = bool(git(ROOT, "status", "--porcelain", "--untracked-files=no"))
    assert ident["git_dirty"] is True or not dirty


def test_build_hook_stamps_the_commit_of_this_checkout(tmp_path):
    head = _checkout_head()
    from setuptools import Distribution

    sys.path.insert(0, str(ROOT))
    try:
        import build_stamp
    finally:
        sys.path.remove(str(ROOT))
    cmd = build_stamp.BuildPyWithCommit(Distribution({"name": "x", "packages": []}))
    cmd.build_lib = str(tmp_path)
    cmd.ensure_finalized()
    cmd.run()
    stamp = json.loads((tmp_path / "mla_eval" / provenance.BUILD_INFO).read_text())
    assert stamp["commit"] == head and isinstance(stamp["dirty"], bool)
    assert not (PKG / provenance.BUILD_INFO).exists()  # the stamp lives in the build, not in the source


def test_copied_package_outside_any_checkout_reports_unknown(tmp_path):
    """The H200 case: a copy of the package run from a folder whose git knows nothing of it."""
    shutil.copytree(PKG, tmp_path / "mla_eval", ignore=shutil.ignore_patterns("default_model", "__pycache__", "*.json"))
    code = "import json; from mla_eval import provenance as p; print(json.dumps([p.__file__, p.code_identity()]))"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    where, ident = json.loads(out.stdout)
    assert Path(where).resolve().is_relative_to(tmp_path.resolve())
    assert ident["git_commit"] == "unknown" and ident["git_dirty"] is None and ident["git_commit_source"] == "unknown"


def test_source_digest_follows_content_only(tmp_path):
    a, b = fake_package(tmp_path / "a"), fake_package(tmp_path / "b")
    kernels = tmp_path / "a" / "kernels"  # as in a checkout; a wheel names the folder mla_eval_kernels
    kernels.mkdir()
    (kernels / "k.py").write_text("K = 1\n")
    shutil.copytree(kernels, tmp_path / "b" / "mla_eval_kernels")
    digest_a = provenance.source_digest({"mla_eval": a, "mla_eval_kernels": kernels})

    def digest_b():
        return provenance.source_digest({"mla_eval": b, "mla_eval_kernels": tmp_path / "b" / "mla_eval_kernels"})

    assert digest_a == digest_b()
    (b / "__pycache__").mkdir()
    (b / "__pycache__" / "mod.py").write_text("cache")
    (b / provenance.BUILD_INFO).write_text('{"commit": "x"}')
    (b / "NOTES.md").write_text("not source")
    assert digest_a == digest_b()
    (b / "mod.py").write_text("X = 2\n")
    assert digest_a != digest_b()
    (b / "mod.py").write_text("X = 1\n")
    (b / "mod.py").rename(b / "renamed.py")
    assert digest_a != digest_b()
    assert digest_a.startswith("sha256:") and len(digest_a) == 23


def test_installed_packages_are_the_imported_ones():
    import mla_eval_kernels

    found = provenance.installed_packages()
    assert found["mla_eval"] == PKG
    assert found["mla_eval_kernels"] == Path(list(mla_eval_kernels.__path__)[0]).resolve()


def test_cutlass_dsl_version_or_not_installed(monkeypatch):
    versions = {"nvidia-cutlass-dsl": "4.8.1"}

    def version(name):
        if name in versions:
            return versions[name]
        raise provenance.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(provenance.importlib.metadata, "version", version)
    assert provenance.cutlass_dsl_version() == "4.8.1"
    versions.clear()
    assert provenance.cutlass_dsl_version() == "not installed"


def test_gpus_lists_the_used_devices_with_capability(monkeypatch):
    caps = {0: (9, 0), 1: (10, 0)}
    props = {i: types.SimpleNamespace(shared_memory_per_block_optin=232448 if i == 0 else 232448 - 1024) for i in caps}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"GPU{i}")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: caps[i])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props[d])
    assert [g["device"] for g in provenance.gpus()] == ["cuda:0", "cuda:1"]
    used = provenance.gpus(["cuda:1", "cpu", "cuda:1"])
    assert used == [{"device": "cuda:1", "name": "GPU1", "capability": "sm_100", "shared_memory_per_block_optin": 231424}]
    assert [g["device"] for g in provenance.gpus(["cuda"])] == ["cuda:0"]


def test_gpus_is_empty_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert provenance.gpus() == [] and provenance.gpus(["cuda:0"]) == []


def test_environment_carries_every_provenance_field_and_validates():
    with dispatch.use_backend("reference") as log:
        log.record("attend", "nvfp4", torch.device("cpu"), "reference (asked for)")
    env = environment(attention=log)
    validate(env, "environment", ENVIRONMENT_SCHEMA)
    assert env["torch"] == torch.__version__ and env["mla_eval"] == mla_eval.__version__
    assert env["cutlass_dsl"] == provenance.cutlass_dsl_version()
    assert env["git_commit"] and env["git_commit_source"] and env["source_digest"].startswith("sha256:")
    assert env["attention"] == {
        "backend": "reference", "backend_from": "--backend",
        "paths": {"attend nvfp4 on cpu": "reference (asked for)"}, "fallbacks": [],
    }
    if not torch.cuda.is_available():
        assert env["gpus"] == []


def test_environment_schema_rejects_a_malformed_capability():
    env = environment()
    env["gpus"] = [{"device": "cuda:0", "name": "H200", "capability": "9.0"}]
    with pytest.raises(Exception, match="capability"):
        validate(env, "environment", ENVIRONMENT_SCHEMA)


def test_peak_gpu_memory_is_recorded_per_used_device_and_printed(monkeypatch):
    """environment() reports torch's peak allocation for each CUDA device the attention ran on (a CPU
    run has none), and the commands print it in one line."""
    import torch

    from mla_eval.attention import dispatch
    from mla_eval.commands.progress import peak_memory_line
    from mla_eval.results import environment

    log = dispatch.PathLog("auto")
    log.record("attend", "nvfp4", torch.device("cpu"), "reference (cpu tensors)")
    env = environment(attention=log)
    assert "gpu_peak_memory_gib" not in env and peak_memory_line(env) is None

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 3 * 2**30 if str(d) == "cuda:1" else 2**29)
    monkeypatch.setattr("mla_eval.provenance.gpus", lambda used=None: [])
    log.record("attend", "nvfp4", torch.device("cuda:1"), "kernel")
    log.record("write", "nvfp4", torch.device("cuda:0"), "kernel")
    env = environment(attention=log)
    assert env["gpu_peak_memory_gib"] == {"cuda:0": 0.5, "cuda:1": 3.0}
    assert peak_memory_line(env) == "peak GPU memory (torch allocated): cuda:0 0.5 GiB, cuda:1 3.0 GiB"


def test_gpus_are_described_without_the_kernels_package(monkeypatch):
    """A checkout run without installing cannot import mla_eval_kernels: the device facts still come back
    (a 64K needle run on the H200 once lost its whole result to this import at the environment step)."""
    import sys
    import types

    import torch

    from mla_eval import provenance

    props = types.SimpleNamespace(shared_memory_per_block_optin=232448)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"Fake GPU {i}")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setitem(sys.modules, "mla_eval_kernels.plan.device_limits", None)  # import -> ImportError
    assert provenance.gpus(["cuda:1"]) == [
        {"device": "cuda:1", "name": "Fake GPU 1", "capability": "sm_90", "shared_memory_per_block_optin": 232448}
    ]
