"""KLD by depth across window lengths from kld documents: python -m tools.plot_kld_depth OUT.png A.json B.json ..."""

import json
import sys
from pathlib import Path

from mla_eval.report.plots import kld_depth_across_windows

if __name__ == "__main__":
    out, *files = sys.argv[1:]
    print(kld_depth_across_windows([json.loads(Path(f).read_text()) for f in files], Path(out)))
