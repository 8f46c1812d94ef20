"""setuptools build step: stamp the commit of the checkout being built into the built package.

`pyproject.toml` names `BuildPyWithCommit` as the `build_py` command. A wheel or `pip install .`
then carries `mla_eval/_build_info.json` ({"commit", "dirty"}), which `mla_eval.provenance` reads
when the installed package is not a git checkout. The commit is read with the same rules as at run
time (`provenance.git_commit`: the package must be tracked at the top of the checkout); when it
cannot be read (an sdist, no git) nothing is stamped and results say "unknown". Editable installs
are skipped: they read git live. The file exists only in the build, never in the source tree.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _provenance():
    # by path: the package itself (and torch) need not be importable at build time
    spec = importlib.util.spec_from_file_location("_mla_eval_provenance", ROOT / "mla_eval" / "provenance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithCommit(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        prov = _provenance()
        found = prov.git_commit(ROOT / "mla_eval", (ROOT / "kernels",))
        if found is None:
            return
        target = Path(self.build_lib) / "mla_eval" / prov.BUILD_INFO
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps({"commit": found["commit"], "dirty": found["dirty"]}) + "\n", encoding="utf-8")
