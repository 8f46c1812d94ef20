"""The layering of docs/ARCHITECTURE.md is a checked contract (`[tool.importlinter]` in pyproject.toml, `lint-imports`
in .ci/run): the tree keeps it, and a deliberately added back-edge breaks it (so the check can fail)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
pytestmark = pytest.mark.skipif(lint_imports is None, reason="import-linter is not installed (the lint extra)")


def _lint(src: Path) -> subprocess.CompletedProcess:
    # a copy on PYTHONPATH comes before the editable install's finder, which sits at the end of sys.meta_path
    env = dict(os.environ, PYTHONPATH=str(src))
    return subprocess.run(
        [lint_imports, "--no-cache", "--no-logo", str(ROOT / "pyproject.toml")],
        capture_output=True, text=True, env=env, cwd=src, timeout=120,
    )


def _copy_sources(dst: Path) -> Path:
    """The two packages' Python files only (not the 48 MB default model)."""
    for package, folder in (("mla_eval", ROOT / "mla_eval"), ("mla_eval_kernels", ROOT / "kernels" / "mla_eval_kernels")):
        for path in folder.rglob("*.py"):
            target = dst / package / path.relative_to(folder)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    return dst


def test_the_tree_keeps_every_contract(tmp_path):
    out = _lint(_copy_sources(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


@pytest.mark.parametrize(
    "module, back_edge, contract",
    [
        ("mla_eval_kernels/plan/record_plan.py", "import mla_eval.attention.dispatch", "Layers"),
        ("mla_eval_kernels/cute/mla_attention.py", "from mla_eval_kernels.cute import mla_attention_v3", "import each other"),
        ("mla_eval_kernels/cute/mla_attention_v3.py", "from mla_eval_kernels.cute import mla_attention", "import each other"),
        ("mla_eval/formats/codec.py", "from mla_eval.evals import kld", "Layers"),
        ("mla_eval/evals/kld.py", "from mla_eval.commands import kld", "Layers"),
    ],
)
def test_a_back_edge_breaks_the_contract(tmp_path, module, back_edge, contract):
    src = _copy_sources(tmp_path)
    path = src / module
    path.write_text(path.read_text(encoding="utf-8") + f"\n{back_edge}  # a deliberate back-edge\n", encoding="utf-8")
    out = _lint(src)
    assert out.returncode != 0, out.stdout
    text = " ".join(out.stdout.split())  # lint-imports wraps long contract names at 80 columns
    assert "BROKEN" in text and contract in text
