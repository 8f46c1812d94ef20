"""Compile every kernel variant for sm_90a without a GPU (fake pointers), to catch DSL errors early.

    CUTE_DSL_ARCH=sm_90a python -m tools.compile_check [--formats nvfp4] [--heads 16,128]
        [--versions v1,v2,v3] [--cuobjdump PATH]   # also print registers / stack / spills of each attention kernel

Nothing is launched; `cute.compile` runs the whole pipeline down to the cubin. Every kernel is made as a launch makes
it: a launch plan (`v2_plan` / `v3_plan`, which resolve every default), a `KernelSpec`, `cute.launch.kernel_for`
and `cute.launch.placeholder_args`. The v3 kernels (`v3_cases`) are compiled per format for every (sink, outer scale,
split) combination of the dense 16-head tile, the bench's probes, and for the head tiles `--heads` selects
(`v3_head_tile`: 32 for h > 16), sparse and dense lists with and without split (the 32-head tile also with the other
producer warpgroup count); their registers and stack frame are read from the cubin itself (`cubin_usage`, no CUDA
toolkit needed), and the PTX is checked for what the design promises (wgmma of the tile's N per copy of the tile
code, mbarriers, no CTA-wide barrier inside the loops, registers that fit the CTA, `setmaxnreg` exactly where
`v3_reg_budget` asks for it, no cluster instruction). `--cuobjdump` (with nvdisasm beside it or on PATH) also reads
the registers each role of a `setmaxnreg` kernel uses from its SASS (`sass_role_registers`; the cubin's own count is
the launch's even share) and the consumer's SASS per key tile (`sass_consumer_tiles`: "454(+64) 416(+64)" = two tiles
per loop trip, each with the O^T rescale block it skips when no running max moved).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import struct
import subprocess
import tempfile
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402
from cutlass.cute.runtime import make_ptr  # noqa: E402

from benchmarks.probes import v3_probe_plan  # noqa: E402
from mla_eval.formats import all_formats, get_format  # noqa: E402
from mla_eval_kernels.cute.cache_writer import CacheWriter  # noqa: E402
from mla_eval_kernels.cute.launch import kernel_for, placeholder_args  # noqa: E402
from mla_eval_kernels.cute.mla_combine import MlaCombine  # noqa: E402
from mla_eval_kernels.plan.device_limits import HOPPER_FACTS, HOPPER_REGS_PER_SM, HOPPER_SMEM_PER_BLOCK  # noqa: E402
from mla_eval_kernels.plan.launch import KernelSpec, v2_plan  # noqa: E402
from mla_eval_kernels.plan.record_plan import UnsupportedFormat, plan_for  # noqa: E402
from mla_eval_kernels.plan.tuning import (  # noqa: E402
    V3_HEADS,
    V3_WIDE_HEADS,
    VERSIONS,
    default_tuning,
    launch_choice,
    tile_config,
    v3_blocker,
    v3_head_tile,
    v3_producer_wgs,
    v3_raw_rings,
    v3_reg_budget,
)


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


EIATTR_FRAME_SIZE, EIATTR_MIN_STACK_SIZE, EIATTR_REGCOUNT = 0x11, 0x12, 0x2F
REGS_PER_SM = HOPPER_REGS_PER_SM  # (one v3 CTA per SM)


def cubin_usage(path: str) -> dict:
    """Registers and stack frame bytes of the kernel in a cubin, from its ELF `.nv.info` section
    (attribute records: format byte 4 = sized value, then attribute id, u16 size, u32 symbol, u32 value;
    the ids are those cuobjdump prints as EIATTR_REGCOUNT / EIATTR_FRAME_SIZE / EIATTR_MIN_STACK_SIZE)."""
    b = open(path, "rb").read()
    if b[:4] != b"\x7fELF" or b[4] != 2:
        raise ValueError(f"{path}: not a 64-bit ELF cubin")
    (shoff,) = struct.unpack_from("<Q", b, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", b, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * shentsize) for i in range(shnum)]
    names = secs[shstrndx][4]
    out = {}
    for sh in secs:
        start = names + sh[0]
        if b[start : b.index(b"\0", start)] != b".nv.info":
            continue
        data, i = b[sh[4] : sh[4] + sh[5]], 0
        while i + 4 <= len(data):
            fmt, attr = data[i], data[i + 1]
            if fmt != 4:  # 1: no value (2 bytes), 2 / 3: 2-byte value (4 bytes in all)
                i += 2 if fmt == 1 else 4
                continue
            (size,) = struct.unpack_from("<H", data, i + 2)
            if size >= 8 and attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE, EIATTR_MIN_STACK_SIZE):
                key = {EIATTR_REGCOUNT: "regs", EIATTR_FRAME_SIZE: "frame", EIATTR_MIN_STACK_SIZE: "stack"}[attr]
                out[key] = max(out.get(key, 0), struct.unpack_from("<I", data, i + 8)[0])
            i += 4 + size
    return out


def check_v3_ptx(ptx: str, heads: int = 16, regs: tuple[int, int] | None = None, tile_copies: int = 1) -> list[str]:
    """What the v3 design promises, read from its PTX: 36 + 32 wgmma per key tile (S^T over 576
    dims, O^T over 8 x 4 m64nNk16 steps, N = `heads`, the head tile) in each of the consumer's `tile_copies` copies
    of its tile code (`MlaAttentionV3.tile_copies`: the tile loop is unrolled), mbarrier waits (the K ring), named
    warpgroup barriers, exactly one CTA-wide barrier (after the mbarrier init) and no cluster instruction. `regs`
    (consumer, producer): one `setmaxnreg.inc` to the first and one `.dec` to the second, with `.minnctapersm 1`
    (without which ptxas ignores them); None: no `setmaxnreg` at all."""
    problems = []
    got = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)\s*;", ptx)
    want = sorted([("inc", str(regs[0])), ("dec", str(regs[1]))]) if regs else []
    if sorted(got) != want:
        problems.append(f"setmaxnreg {sorted(got)} (expected {want})")
    if regs and not re.search(r"^\s*\.minnctapersm\s+1\s*$", ptx, re.M):
        problems.append("setmaxnreg without .minnctapersm 1 (ptxas ignores it)")
    n_wgmma = len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{heads}k16\.f32\.bf16\.bf16", ptx))
    if n_wgmma != 68 * tile_copies:
        problems.append(f"{n_wgmma} m64n{heads}k16 wgmma (expected {68 * tile_copies})")
    if "mbarrier.try_wait" not in ptx and "mbarrier.test_wait" not in ptx:
        problems.append("no mbarrier wait")
    if len(re.findall(r"bar(?:rier)?\.sync(?:\.aligned)?\s+0\s*;", ptx)) != 1:
        problems.append("expected one CTA-wide barrier")
    if re.search(r"barrier\.cluster|shared::cluster|\bmapa\b", ptx):
        problems.append("a cluster instruction (no v3 kernel runs as a cluster)")
    if not re.search(r"bar(?:rier)?\.sync(?:\.aligned)?\s+1,\s*128", ptx) or not re.search(
        r"bar(?:rier)?\.sync(?:\.aligned)?\s+2,\s*(?:128|256)", ptx
    ):
        problems.append("missing a named warpgroup barrier")
    return problems


def sass_role_registers(sass: str) -> dict[str, int]:
    """Registers each role of a `setmaxnreg` v3 kernel uses, from its SASS (`cuobjdump -sass`): the highest R<n>
    named (+ 1) before the first USETMAXREG ("entry"), between the producers' DEALLOC and the consumer's ALLOC, and
    after that, assuming the layout ptxas gave the compiled kernels (entry, producer branch, consumer branch; checked:
    the DEALLOC comes first, else {}). RZ is not counted."""
    lines = sass.splitlines()
    marks = [i for i, line in enumerate(lines) if "USETMAXREG" in line]
    if len(marks) != 2 or "DEALLOC" not in lines[marks[0]] or "DEALLOC" in lines[marks[1]]:
        return {}

    def top(part):
        regs = [int(r) for line in part for r in re.findall(r"\bR(\d+)\b", line.split("/*")[1] if "/*" in line else line)]
        return max(regs, default=-1) + 1

    return {"entry": top(lines[: marks[0]]), "producer": top(lines[marks[0] : marks[1]]), "consumer": top(lines[marks[1] :])}


def _sass_lines(sass: str) -> list[tuple[int, str]]:
    """(address, instruction without its ';') of each instruction of a `cuobjdump -sass` listing."""
    return [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def _branch_target(ins: str) -> int | None:
    m = re.search(r"\bBRA (0x[0-9a-f]+)", ins)
    return int(m.group(1), 16) if m else None


def sass_consumer_tiles(sass: str) -> list[tuple[collections.Counter, collections.Counter]]:
    """Static opcode counts of a v3 kernel's consumer per key tile, from its SASS (the metric of the consumer
    work): the consumer loop is the largest conditional backward branch whose body holds HGMMA (unconditional
    backward branches are ptxas' out-of-line mbarrier retries), cut into tiles after each SYNCS.ARRIVE (the stage
    release; the unrolled loop runs 2 tiles per trip, the loop's own overhead goes to the last). Per tile: (every
    instruction in line, predicated ones too: they issue either way; the block a VOTE.ANY branch skips, rev 2's O^T
    rescale, run only when a head's running max moved). [] without such a loop."""
    ins = _sass_lines(sass)

    def op(t):
        return re.sub(r"^@!?U?P\w+\s+", "", t).split()[0]

    back = [(_branch_target(t), a) for a, t in ins if t.startswith("@") and (_branch_target(t) or a) < a]
    loops = [(lo, hi) for lo, hi in back if any("HGMMA" in t for a, t in ins if lo <= a <= hi)]
    if not loops:
        return []
    lo, hi = max(loops, key=lambda loop: loop[1] - loop[0])
    tiles, cur, lazy, skip_to, since_vote = [], collections.Counter(), collections.Counter(), None, 99
    for a, t in ins:
        if not lo <= a <= hi:
            continue
        if skip_to is not None and a >= skip_to:
            skip_to = None
        if since_vote <= 16 and skip_to is None and t.startswith("@") and (_branch_target(t) or 0) > a:
            skip_to = _branch_target(t)  # the vote's branch past the skipped block (ptxas schedules other work between)
            since_vote = 99
            cur[op(t)] += 1
        else:
            (lazy if skip_to is not None else cur)[op(t)] += 1
        since_vote = 0 if "VOTE.ANY" in t else since_vote + 1
        if "SYNCS.ARRIVE.TRANS64" in t and ".RED" not in t:  # (.RED: a remote release, not a stage's)
            tiles.append((cur, lazy))
            cur, lazy = collections.Counter(), collections.Counter()
    if tiles and cur:
        tiles[-1][0].update(cur)
    return tiles


def _consumer_tiles(cuobjdump: str | None, cubin: str) -> str:
    if not cuobjdump:
        return ""
    tiles = sass_consumer_tiles(subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True).stdout)
    return " consumer SASS/tile " + " ".join(
        f"{sum(c.values())}" + (f"(+{sum(skip.values())})" if skip else "") for c, skip in tiles
    )


def _role_registers(cuobjdump: str | None, cubin: str) -> str:
    if not cuobjdump:
        return ""
    out = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True)
    roles = sass_role_registers(out.stdout)
    return " used " + "/".join(f"{k}={v}" for k, v in roles.items()) if roles else f" (no SASS: {out.stderr.strip()[:80]})"


def _compile_dumped(spec, stream):
    """Compile `spec` through `kernel_for` (as a launch builds it) with its PTX and cubin kept: (kernel, ptx, cubin)."""
    dump = tempfile.mkdtemp()
    kern = kernel_for(spec)
    cute.compile(kern, *placeholder_args(16, stream), options=f"--keep-ptx --keep-cubin --dump-dir={dump}")
    cubin = max(glob.glob(f"{dump}/*.cubin"), key=os.path.getmtime)
    ptx = open(max(glob.glob(f"{dump}/*.ptx"), key=os.path.getmtime)).read()
    return kern, ptx, cubin


def v3_cases(plan, heads_list=(16,)) -> list[tuple[str, KernelSpec]]:
    """(label, spec) of every v3 kernel to compile for one format, each made by `v3_plan` (as dispatch and the bench
    make them): the dense 16-head tile at every (outer, sink, split); the bench's probes on one of them (the other
    producer warpgroup count, every other raw ring); and each head tile `heads_list` selects, sparse and
    dense, with sink unsplit and split without (the 32-head tile also with the other producer count)."""
    cases = []

    def add(label, heads, sparse, sink, outer, split, **probe):
        launch = v3_probe_plan(plan, heads, sparse, HOPPER_FACTS, **probe)
        cases.append((label, KernelSpec(plan, launch.config, sparse=sparse, has_sink=sink, has_outer=outer, split=split)))

    outers = [False, True] if plan.outer_allowed else [False]
    for outer in outers:
        for sink in (False, True):
            for split in (False, True):
                add("default", 16, False, sink, outer, split)
    o = plan.outer_allowed
    pwg = v3_producer_wgs(plan)
    add("probe wgs", 16, False, False, o, True, producer_wgs=3 - pwg)
    for ring in v3_raw_rings(plan)[1:]:
        add("probe ring", 16, False, False, o, True, raw_ring=ring)
    for heads in heads_list:
        for sparse in (False, True):
            tile = v3_head_tile(plan, heads, sparse)[0]
            if tile == V3_HEADS and not sparse:
                continue  # the dense 16-head tile: above
            counts = [v3_producer_wgs(plan, tile)] + ([3 - v3_producer_wgs(plan, tile)] if tile == V3_WIDE_HEADS else [])
            for sink, split in ((True, False), (False, True)):
                for wgs in counts:
                    add(f"h={heads}", heads, sparse, sink, o, split, head_tile=tile, producer_wgs=wgs)
    seen, out = set(), []
    for label, spec in cases:  # h = 32 and 128 share the 32-head tile's kernels
        if spec not in seen:
            seen.add(spec)
            out.append((label, spec))
    return out


def compile_v3(plan, name: str, stream, heads_list=(16,), cuobjdump: str | None = None) -> int:
    """Compile every v3 kernel of one format (`v3_cases`) and check each one's PTX and cubin: the wgmma count per tile
    copy, mbarriers and named barriers, `setmaxnreg` exactly where `v3_reg_budget` asks, no stack frame, registers
    that fit the CTA. Returns the number of failures."""
    failures = 0
    for label, spec in v3_cases(plan, heads_list):
        cfg = spec.config
        t = time.time()
        try:
            kern, ptx, cubin = _compile_dumped(spec, stream)
            use = cubin_usage(cubin)
            regs = v3_reg_budget(cfg.head_tile, cfg.producer_wgs)
            problems = check_v3_ptx(ptx, cfg.head_tile, regs, kern.tile_copies)
            if use.get("frame", 0) or use.get("stack", 0):
                problems.append("register spills (stack frame)")
            threads = 128 * (1 + cfg.producer_wgs)
            if use.get("regs", 0) * threads > REGS_PER_SM:  # the launch would fail: too many resources requested
                problems.append(f"{use.get('regs')} registers x {threads} threads > {REGS_PER_SM}")
            status = "ok " if not problems else "FAILED " + "; ".join(problems) + " "
            failures += bool(problems)
            status += f"regs={use.get('regs')} frame={use.get('frame', 0)}B stack={use.get('stack', 0)}B"
            status += _consumer_tiles(cuobjdump, cubin)
            if regs:
                status += f" setmaxnreg consumer={regs[0]} producer={regs[1]}" + _role_registers(cuobjdump, cubin)
        except Exception as exc:  # noqa: BLE001 - report every variant
            failures += 1
            status = f"FAILED {type(exc).__name__}: {str(exc)[:300]}"
        lists = "sparse" if spec.sparse else "dense "
        print(
            f"attention {name:18} v3 {label:10} {lists} tile={cfg.head_tile} outer={spec.has_outer!s:5} "
            f"sink={spec.has_sink!s:5} split={spec.split!s:5} producer_wgs={cfg.producer_wgs} "
            f"raw={cfg.raw_ring[0]}x{cfg.raw_ring[1]} {time.time() - t:5.1f}s {status}",
            flush=True,
        )
    return failures


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
        # every input dtype the dispatcher passes (bf16, fp16, fp32: the load and its conversion differ)
        for in_dtype in (cutlass.BFloat16, cutlass.Float16, cutlass.Float32):
            for outer in ([False, True] if plan.outer_allowed else [False]):
                t = time.time()
                w = (_p(in_dtype), _p(in_dtype, 4), _p(cutlass.Int64, 8), _p(cutlass.Uint32), Int32(8), Float32(1.0), stream)
                cute.compile(CacheWriter(plan, in_dtype, outer), *w)
                print(f"writer    {name:18} {in_dtype.__name__:8} outer={outer!s:5} {time.time() - t:5.1f}s", flush=True)
        versions = args.versions.split(",")
        if "v3" in versions:
            why = v3_blocker(plan, sparse=False, smem_limit=HOPPER_SMEM_PER_BLOCK)
            if why is None:
                failures += compile_v3(plan, name, stream, [int(h) for h in args.heads.split(",")], args.cuobjdump)
            else:
                print(f"attention {name:18} v3           runs v2: {why}", flush=True)
        for heads in (int(h) for h in args.heads.split(",")):
            tile0 = tile_config(plan, heads, HOPPER_SMEM_PER_BLOCK)  # compiled for sm_90a, no device at hand
            # what dispatch runs for each version (v3's sparse / blocked launches are v2's, compiled
            # under v2), and v2's own tile where launch_choice swaps it
            variants = [(v, *launch_choice(plan, tile0, v)) for v in versions if v != "v3"]
            if "v2" in versions and launch_choice(plan, tile0, "v2")[0] != tile0:
                variants.append(("v2-wide", tile0, default_tuning(plan, tile0, "v2")))
            if args.probes and heads <= 16:
                from benchmarks.kernel_bench import probe_variants

                variants += [(name, t or tile0, tun) for name, t, tun in probe_variants(plan)]
            cases = [(v, sp, sl) for v in variants for sp in (False, True) for sl in (False, True)]
            for (version, tile, tuning), sparse, split in cases:
                t = time.time()
                a = placeholder_args(heads, stream)
                try:
                    launch = v2_plan(plan, heads, HOPPER_FACTS, tile, tuning)
                    spec = KernelSpec(plan, launch.config, sparse=sparse, has_sink=sparse, has_outer=plan.outer_allowed,
                                      split=split)
                    cute.compile(kernel_for(spec), *a, options=opts)
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
