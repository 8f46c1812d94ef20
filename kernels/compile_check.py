"""Compile every kernel variant for sm_90a without a GPU (fake pointers), to catch DSL errors early.

    CUTE_DSL_ARCH=sm_90a python -m mla_eval_kernels.compile_check [--formats nvfp4] [--heads 16,128]
        [--cuobjdump PATH]   # also print registers / stack / spills of each attention kernel

Nothing is launched; `cute.compile` runs the whole pipeline down to the cubin.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402
from cutlass.cute.runtime import make_ptr  # noqa: E402

from mla_eval.formats import all_formats, get_format  # noqa: E402
from mla_eval_kernels.attention_tuning import VERSIONS, default_tuning, launch_choice  # noqa: E402
from mla_eval_kernels.cache_writer import CacheWriter  # noqa: E402
from mla_eval_kernels.device_limits import HOPPER_SMEM_PER_BLOCK  # noqa: E402
from mla_eval_kernels.mla_attention import MlaAttention, tile_config  # noqa: E402
from mla_eval_kernels.mla_combine import MlaCombine  # noqa: E402
from mla_eval_kernels.record_plan import UnsupportedFormat, plan_for  # noqa: E402


def _p(dtype, align=16):
    return make_ptr(dtype, 1 << 20, cute.AddressSpace.gmem, assumed_align=align)


def _usage(cuobjdump: str | None, dump_dir: str) -> str:
    if not cuobjdump:
        return ""
    cubins = sorted((os.path.join(dump_dir, f) for f in os.listdir(dump_dir) if f.endswith(".cubin")), key=os.path.getmtime)
    if not cubins:
        return ""
    out = subprocess.run([cuobjdump, "--dump-resource-usage", cubins[-1]], capture_output=True, text=True).stdout
    return " ".join(line.strip() for line in out.splitlines() if "REG:" in line)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default=",".join(s.name for s in all_formats()))
    ap.add_argument("--heads", default="16,32,128")
    ap.add_argument("--cuobjdump")
    ap.add_argument("--versions", default=",".join(VERSIONS), help="kernel generations to compile (v1 = the fallback)")
    ap.add_argument("--probes", action="store_true", help="also the benchmark's h=16 probe variants")
    args = ap.parse_args(argv)
    stream = cuda.CUstream(0)
    dump = tempfile.mkdtemp()
    opts = f"--keep-cubin --dump-dir={dump}" if args.cuobjdump else ""
    failures = 0
    for name in args.formats.split(","):
        try:
            plan = plan_for(get_format(name))
        except UnsupportedFormat as exc:  # served by the torch reference; nothing to compile
            print(f"skipped   {name:18} (torch reference: {exc})", flush=True)
            continue
        for outer in ([False, True] if plan.outer_allowed else [False]):
            t = time.time()
            w = (
                _p(cutlass.BFloat16), _p(cutlass.BFloat16, 4), _p(cutlass.Int64, 8), _p(cutlass.Uint32), Int32(8), Float32(1.0),
                stream,
            )
            cute.compile(CacheWriter(plan, cutlass.BFloat16, outer), *w)
            print(f"writer    {name:18} outer={outer!s:5} {time.time() - t:5.1f}s", flush=True)
        for heads in (int(h) for h in args.heads.split(",")):
            tile0 = tile_config(plan, heads, HOPPER_SMEM_PER_BLOCK)  # compiled for sm_90a, no device at hand
            # what dispatch runs for each version, and v2's own tile where launch_choice swaps it
            variants = [(v, *launch_choice(plan, tile0, v)) for v in args.versions.split(",")]
            if "v2" in args.versions.split(",") and launch_choice(plan, tile0, "v2")[0] != tile0:
                variants.append(("v2-wide", tile0, default_tuning(plan, tile0, "v2")))
            if args.probes and heads <= 16:
                from mla_eval_kernels.bench import probe_variants

                variants += [(name, t or tile0, tun) for name, t, tun in probe_variants(plan)]
            cases = [(v, sp, sl) for v in variants for sp in (False, True) for sl in (False, True)]
            for (version, tile, tuning), sparse, split in cases:
                t = time.time()
                a = (
                    _p(cutlass.BFloat16), _p(cutlass.Uint8), _p(Int32, 4), _p(Int32, 4), _p(Float32, 4),
                    _p(Float32), _p(Float32, 4), Int32(4), Int32(heads), Int32(64), Int32(4096), Int32(64),
                    Float32(0.1), Float32(1.0), Int32(4), Int32(2), stream,
                )
                try:
                    kern = MlaAttention(plan, tile, sparse, sparse, plan.outer_allowed, split, tuning)
                    cute.compile(kern, *a, options=opts)
                    status = "ok " + _usage(args.cuobjdump, dump)
                except Exception as exc:  # noqa: BLE001 - report every variant
                    failures += 1
                    status = f"FAILED {type(exc).__name__}: {str(exc)[:300]}"
                print(
                    f"attention {name:18} {version:12} h={heads:<3} tile={tile} sparse={sparse!s:5} split={split!s:5} "
                    f"{time.time() - t:5.1f}s {status}",
                    flush=True,
                )
    for sink in (False, True):
        c = (_p(Float32), _p(Float32, 4), _p(Float32, 4), _p(Float32), _p(Float32, 4), Int32(8), Int32(4), Int32(2), stream)
        cute.compile(MlaCombine(sink), *c)
        print(f"combine   sink={sink}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
