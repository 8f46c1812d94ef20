"""A digest of the PTX of every attention kernel dispatch launches, compiled for sm_90a without a GPU: a refactor of
kernel code that claims to change nothing is checked on the CPU by running this before and after and comparing.

    CUTE_DSL_ARCH=sm_90a python -m tools.ptx_digest [--formats nvfp4,bf16] [--out digests.txt]

One line per kernel spec: its launch (format, heads, list kind, split, sink, s_l, generation) and the sha256 of its
PTX with comment, `.file` and `.loc` lines removed and kernel symbol names (which carry class and module names)
replaced. Each spec is the default launch of its combination, made as a launch makes it (`launch_plan`,
`cute.launch.launch_spec`, `kernel_for`). Identical digests mean identical PTX, hence the same cubin from the same
ptxas: GPU behaviour unchanged. (A change of the digests says nothing about correctness: that needs the GPU tests.)
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import itertools
import os
import re
import sys
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass.cute as cute  # noqa: E402

from mla_eval.formats import all_formats  # noqa: E402
from mla_eval_kernels.cute.launch import kernel_for, launch_spec, placeholder_args  # noqa: E402
from mla_eval_kernels.plan.device_limits import HOPPER_FACTS  # noqa: E402
from mla_eval_kernels.plan.launch import launch_plan  # noqa: E402
from mla_eval_kernels.plan.record_plan import UnsupportedFormat, plan_for  # noqa: E402


def ptx_digest(ptx: str) -> str:
    """sha256 (16 hex digits) of a PTX text without comments, debug lines and kernel symbol names."""
    body = "\n".join(line for line in ptx.splitlines() if not line.lstrip().startswith(("//", ".file", ".loc")))
    body = re.sub(r"\b\w*MlaAttention\w*", "K", body)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    names = []
    for spec in all_formats():
        try:
            plan_for(spec)
            names.append(spec.name)
        except UnsupportedFormat:
            continue
    ap.add_argument("--formats", default=",".join(names))
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--out", help="also write the lines to this file")
    args = ap.parse_args(argv)
    lines = []
    cases = itertools.product(args.formats.split(","), [int(h) for h in args.heads.split(",")], (False, True), (False, True),
                              (False, True))
    for name, heads, sparse, split, sink in cases:
        plan = plan_for(next(s for s in all_formats() if s.name == name))
        chosen = launch_plan(plan, sparse=sparse, heads=heads, facts=HOPPER_FACTS)
        spec = launch_spec(chosen, plan, sparse=sparse, has_sink=sink, has_outer=plan.outer_allowed, split=split)
        dump = tempfile.mkdtemp()
        cute.compile(kernel_for(spec), *placeholder_args(heads), options=f"--keep-ptx --dump-dir={dump}")
        ptx = open(max(glob.glob(f"{dump}/*.ptx"), key=os.path.getmtime)).read()
        line = (f"{name} h={heads} {'sparse' if sparse else 'dense'} {'split' if split else 'whole'} "
                f"{'sink' if sink else 'nosink'} outer={plan.outer_allowed} {chosen.generation} {ptx_digest(ptx)}")
        print(line, flush=True)
        lines.append(line)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
