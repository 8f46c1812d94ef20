"""Packaging invariants: kernels/ never shadows Hugging Face's `kernels`; the CLI entry works."""

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_folder_is_not_a_regular_top_level_package():
    assert not (ROOT / "kernels" / "__init__.py").exists()
    spec = importlib.util.find_spec("kernels")
    if spec is not None:  # Hugging Face's package, or at most an empty namespace portion of ours
        assert spec.origin is None or not Path(spec.origin).is_relative_to(ROOT / "kernels")


def test_transformers_does_not_mistake_our_folder_for_hf_kernels():
    from transformers.utils import import_utils

    try:
        importlib.metadata.version("kernels")
        hf_kernels_installed = True
    except importlib.metadata.PackageNotFoundError:
        hf_kernels_installed = False
    if not hf_kernels_installed:
        assert not import_utils.is_kernels_available()


def test_kernel_package_importable_under_its_own_name():
    """A regular package whose folder has its import name (kernels/mla_eval_kernels), so import-graph tools map it."""
    import mla_eval_kernels

    assert Path(mla_eval_kernels.__file__).resolve() == (ROOT / "kernels" / "mla_eval_kernels" / "__init__.py").resolve()


def test_training_and_benchmarks_are_not_installed():
    """The default model's training, the benchmarks and the tools run from a checkout; the wheel holds the runtime."""
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert not [p for p in packages if p.split(".")[0] in ("tools", "benchmarks") or p.endswith(".train")]


def test_version_flag():
    out = subprocess.run([sys.executable, "-m", "mla_eval", "--version"], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0 and out.stdout.startswith("mla-eval ")
