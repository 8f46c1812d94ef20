import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU, CuTe DSL compiles for the architecture the kernels are built for (sm_90a): the "no GPU needed" kernel
# tests (tests/test_kernel_construction.py, the compile tests of the GPU files) compile there exactly as on an H100.
if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

# tests import their helpers (tiny_models) by plain name
sys.path.insert(0, str(Path(__file__).parent))


def _data_file(rel: str) -> Path | None:
    """A file of the shared data (../shared/data/<rel>), found where a checkout or a device copy keeps it: under
    $MLA_EVAL_DATA, .devdata/ (carried to a GPU machine) or ../shared/data beside the checkout."""
    root = Path(__file__).resolve().parent.parent
    candidates = [Path(os.environ["MLA_EVAL_DATA"]) / rel] if os.environ.get("MLA_EVAL_DATA") else []
    candidates += [root / ".devdata" / Path(rel).name, root.parent / "shared" / "data" / rel]
    return next((p for p in candidates if p.is_file()), None)


def _need_data(rel: str) -> Path:
    found = _data_file(rel)
    if found is None:
        why = f"needs ../shared/data/{rel} (or .devdata/{Path(rel).name}, or $MLA_EVAL_DATA)"
        if os.environ.get("MLA_EVAL_REQUIRE_DATA"):  # the device's test step: missing data is a failure, not a skip
            pytest.fail(why)
        pytest.skip(why)
    return found


@pytest.fixture
def wikitext_path() -> Path:
    """wikitext-2 test (raw), the text the GPU campaign checks score."""
    return _need_data("wikitext-2/wiki.test.raw")
