import os
import sys
from pathlib import Path

import torch

# Without a GPU, CuTe DSL compiles for the architecture the kernels are built for (sm_90a): the "no GPU needed" kernel
# tests (tests/test_kernel_construction.py, the compile tests of the GPU files) compile there exactly as on an H100.
if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

# tests import their helpers (tiny_models) by plain name
sys.path.insert(0, str(Path(__file__).parent))
