"""Compile every kernel variant for sm_90a without a GPU (fake pointers), to catch DSL errors early.

    CUTE_DSL_ARCH=sm_90a python -m tools.compile_check [--formats nvfp4] [--heads 16,128]
        [--versions v1,v2,v3] [--cuobjdump PATH]   # also print registers / stack / spills of each attention kernel

Nothing is launched; `cute.compile` runs the whole pipeline down to the cubin. The v3 kernels
(`mla_attention_v3`, head count a run-time argument) are compiled per format for every (sink, outer scale,
split) combination of the dense 16-head tile, and, for the head tiles `--heads` selects (`v3_head_tile`: 32 for
h > 16), sparse and dense lists with and without split (the 32-head tile also with two producer warpgroups and
per-role registers, `setmaxnreg`: the bench's v3-t32-p2 probe; and as the CTA pair, `cta_pair.py`, where
`v3_pair_blocker` allows); their registers and stack frame are read from the
cubin itself (`cubin_usage`, no CUDA toolkit needed), and the PTX is checked for what the design
promises (wgmma of the tile's N, mbarriers, no CTA-wide barrier inside the loops, registers that fit the CTA,
`setmaxnreg` exactly where `v3_reg_budget` asks for it; the CTA pair's cluster protocol, `check_pair_ptx`, and no
cluster instruction in any other kernel). `--cuobjdump` (with nvdisasm beside it or on PATH) also
reads the registers each role of a `setmaxnreg` kernel uses from its SASS (`sass_role_registers`; the cubin's own
count is the launch's even share) and the consumer's SASS per key tile (`sass_consumer_tiles`: "454(+64) 416(+64)" =
two tiles per loop trip, each with the O^T rescale block it skips when no running max moved).
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

from mla_eval.formats import all_formats, get_format  # noqa: E402
from mla_eval_kernels.cute.cache_writer import CacheWriter  # noqa: E402
from mla_eval_kernels.cute.mla_attention import MlaAttention  # noqa: E402
from mla_eval_kernels.cute.mla_combine import MlaCombine  # noqa: E402
from mla_eval_kernels.plan.device_limits import HOPPER_REGS_PER_SM, HOPPER_SMEM_PER_BLOCK  # noqa: E402
from mla_eval_kernels.plan.record_plan import UnsupportedFormat, plan_for  # noqa: E402
from mla_eval_kernels.plan.tuning import VERSIONS, default_tuning, launch_choice, tile_config, v3_blocker  # noqa: E402


def _p(dtype, align=16):
    return make_ptr(dtype, 1 << 20, cute.AddressSpace.gmem, assumed_align=align)


def attention_args(heads: int = 16, stream=None) -> tuple:
    """Placeholder launch arguments of the attention kernels (v1/v2 `MlaAttention`, v3 `MlaAttentionV3`: the same
    entry signature) for compiling without a device: pointers (q, cache, lists, outputs), then the runtime scalars.
    `heads` is a runtime value: it does not change the cubin."""
    return (
        _p(cutlass.BFloat16), _p(cutlass.Uint8), _p(Int32, 4), _p(Int32, 4), _p(Float32, 4),
        _p(Float32), _p(Float32, 4), Int32(4), Int32(heads), Int32(64), Int32(4096), Int32(64),
        Float32(0.1), Float32(1.0), Int32(4), Int32(2), stream if stream is not None else cuda.CUstream(0),
    )


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


def check_v3_ptx(
    ptx: str, heads: int = 16, regs: tuple[int, int] | None = None, tile_copies: int = 1, pair: bool = False,
) -> list[str]:
    """What the v3 design promises, read from its PTX: 36 + 32 wgmma per key tile (S^T over 576
    dims, O^T over 8 x 4 m64nNk16 steps, N = `heads`, the head tile) in each of the consumer's `tile_copies` copies
    of its tile code (`MlaAttentionV3.tile_copies`: consumer rev 2 unrolls the tile loop), mbarrier waits (the K ring), named
    warpgroup barriers, and exactly one CTA-wide barrier (after the mbarrier init). `regs` (consumer, producer):
    one `setmaxnreg.inc` to the first and one `.dec` to the second, with `.minnctapersm 1` (without which ptxas
    ignores them); None: no `setmaxnreg` at all. `pair`: the CTA pair's cluster protocol (`check_pair_ptx`) in place of
    the CTA-wide barrier; without it, no cluster instruction at all."""
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
    cta_wide = len(re.findall(r"bar(?:rier)?\.sync(?:\.aligned)?\s+0\s*;", ptx))
    if pair:
        problems += check_pair_ptx(ptx)
        if cta_wide:
            problems.append("a CTA-wide barrier in the CTA pair (its init syncs the cluster)")
    else:
        if cta_wide != 1:
            problems.append("expected one CTA-wide barrier")
        if re.search(r"barrier\.cluster|shared::cluster|\bmapa\b", ptx):
            problems.append("a cluster instruction outside the CTA pair")
    if not re.search(r"bar(?:rier)?\.sync(?:\.aligned)?\s+1,\s*128", ptx) or not re.search(
        r"bar(?:rier)?\.sync(?:\.aligned)?\s+2,\s*(?:128|256)", ptx
    ):
        problems.append("missing a named warpgroup barrier")
    return problems


PAIR_PTX = {  # what the CTA pair's protocol (kernels/cta_pair.py) puts in the PTX: (pattern, least, most)
    "cluster barrier": (r"barrier\.cluster\.arrive\s*;", 2, 2),  # after the mbarrier init, before exit
    "cluster barrier wait": (r"barrier\.cluster\.wait\s*;", 2, 2),
    "mbarrier init fence": (r"fence\.mbarrier_init\.release\.cluster\s*;", 1, 1),
    "mapa": (r"mapa\.shared::cluster\.u32", 2, 99),  # the peer's mbarriers, its K ring
    "remote arrive": (r"mbarrier\.arrive\.release\.cluster\.shared::cluster\.b64\s+_,", 2, 99),  # full, empty
    "cluster-scope wait": (r"mbarrier\.try_wait\.parity\.acquire\.cluster\.shared::cta\.b64", 2, 99),  # acquire, wait
    "remote store": (r"st\.shared::cluster\.v4\.b32", 1, 99),
    "proxy fence": (r"fence\.proxy\.async\.shared::cluster\s*;", 1, 99),
}


def check_pair_ptx(ptx: str) -> list[str]:
    """The CTA pair's synchronisation, read from its PTX (`PAIR_PTX`), and no mbarrier wait at the default CTA scope
    (it would not acquire the peer's releases)."""
    problems = []
    for what, (pattern, least, most) in PAIR_PTX.items():
        n = len(re.findall(pattern, ptx))
        if not least <= n <= most:
            problems.append(f"{n} x {what} (expected {least}..{most})")
    if any(".acquire.cluster." not in w for w in re.findall(r"mbarrier\.(?:try|test)_wait[.\w:]*", ptx)):
        problems.append("an mbarrier wait at CTA scope in the CTA pair")
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
    release; consumer rev 2 runs 2 tiles per trip, the loop's own overhead goes to the last; the CTA pair's second,
    remote release, SYNCS.ARRIVE...RED, stays in its tile). Per tile: (every
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
        if "SYNCS.ARRIVE.TRANS64" in t and ".RED" not in t:  # (.RED: the CTA pair's release into the peer, same tile)
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


def compile_v3(plan, name: str, stream, heads_list=(16,), cuobjdump: str | None = None) -> int:
    """Compile every v3 specialisation of one format (dense 16-head tile: every (outer, sink, split) and the
    bench's probes; each head tile `heads_list` selects, sparse and dense: split with and without, the sink on
    the unsplit one, the outer scale where the format has one; the 32-head tile also with two producer warpgroups,
    the bench's v3-t32-p1 / -p2), all with the default consumer (`v3_consumer_rev`) and decode (`v3_decode_rev`), and
    every one but the probes with the other consumer revision (`V3_CONSUMER_REVS`: the bench's v3-c<rev> rows) and,
    for the fold formats, the other decode revision (v3-d<rev>), one revision changed at a time; returns the number
    of failures."""
    from mla_eval_kernels.cute.mla_attention_v3 import MlaAttentionV3  # noqa: PLC0415
    from mla_eval_kernels.plan.tuning import (  # noqa: PLC0415
        V3_CONSUMER_REVS,
        V3_HEADS,
        V3_L2_PREFETCH,
        V3_L2_PREFETCH_PROBE,
        V3_PAIR_CTAS,
        V3_WIDE_HEADS,
        v3_consumer_rev,
        v3_decode_rev,
        v3_head_tile,
        v3_pair_blocker,
        v3_producer_wgs,
        v3_raw_ring,
        v3_raw_rings,
        v3_reg_budget,
    )

    failures = 0
    pwg = v3_producer_wgs(plan)
    # every (outer, sink, split) with the defaults (what `generation_for` launches: no L2 prefetch), then the
    # benchmark's probes (L2 prefetch on, bench v3-pf; the other producer warpgroup count) on one of them
    cases = [
        (outer, sink, split, V3_L2_PREFETCH, pwg)
        for outer in ([False, True] if plan.outer_allowed else [False])
        for sink in (False, True)
        for split in (False, True)
    ]
    probe = plan.outer_allowed, False, True
    ring = v3_raw_ring(plan)
    cases = [(*c, ring, V3_HEADS, False, False) for c in cases]
    probes = [(*probe, V3_L2_PREFETCH_PROBE, pwg, ring, V3_HEADS, False, False)]
    probes += [(*probe, V3_L2_PREFETCH, 3 - pwg, ring, V3_HEADS, False, False)]
    probes += [(*probe, V3_L2_PREFETCH, pwg, r, V3_HEADS, False, False) for r in v3_raw_rings(plan)[1:]]  # bench v3-r<S>x<K>
    # the sparse top-k lists and the 32-head tile (held off until their GPU tests pass)
    tiles = sorted({v3_head_tile(plan, h, sparse, gated=False)[0] for h in heads_list for sparse in (False, True)})
    for tile in tiles:
        for sparse in (False, True):
            if tile == V3_HEADS and not sparse:
                continue  # the dense 16-head tile: the cases above
            # the 32-head tile: its default producer count, and the other one (two: per-role registers, a probe)
            counts = [v3_producer_wgs(plan, tile)] + ([3 - v3_producer_wgs(plan, tile)] if tile == V3_WIDE_HEADS else [])
            for sink, split in ((True, False), (False, True)):
                for wgs in counts:
                    cases.append((plan.outer_allowed, sink, split, V3_L2_PREFETCH, wgs, v3_raw_ring(plan, tile, sparse), tile,
                                  sparse, False))
                # the CTA pair (held by V3_TILE_32_PAIR: the bench's v3-t32-pair) where the tile and count allow it
                if v3_pair_blocker(plan, V3_PAIR_CTAS * tile, tile, 2) is None:
                    cases.append((plan.outer_allowed, sink, split, V3_L2_PREFETCH, 2, v3_raw_ring(plan, tile, sparse), tile,
                                  sparse, True))
    # the other consumer revision (`V3_CONSUMER_REVS`) and decode revision (`v3_decode_rev`: the fold formats only) of
    # every non-probe case, one revision changed at a time
    d0 = v3_decode_rev(plan)
    drevs = [r for r in ((1, 2) if v3_decode_rev(plan, 2) == 2 else ()) if r != d0]
    # c[8]: the CTA pair, whose consumer revision is its own (`v3_consumer_rev`: rev 2 spills there, so it has no
    # other revision to check)
    cases = ([(*c, v3_consumer_rev(c[8]), d0) for c in cases + probes]
             + [(*c, r, d0) for c in cases if not c[8] for r in V3_CONSUMER_REVS if r != v3_consumer_rev(False)]
             + [(*c, v3_consumer_rev(c[8]), r) for r in drevs for c in cases])
    for outer, sink, split, l2pf, wgs, raw_ring, tile, sparse, pair, crev, drev in cases:
        t = time.time()
        dump = tempfile.mkdtemp()
        a = attention_args(16, stream)
        try:
            opts = f"--keep-ptx --keep-cubin --dump-dir={dump}"
            kern = MlaAttentionV3(
                plan, sink, outer, split, l2pf, wgs, raw_ring=raw_ring, heads=tile, sparse=sparse, consumer_rev=crev,
                decode_rev=drev, cta_pair=pair,
            )
            cute.compile(kern, *a, options=opts)
            cubin = max(glob.glob(f"{dump}/*.cubin"), key=os.path.getmtime)
            use = cubin_usage(cubin)
            regs = v3_reg_budget(tile, wgs)
            ptx = open(max(glob.glob(f"{dump}/*.ptx"), key=os.path.getmtime)).read()
            problems = check_v3_ptx(ptx, tile, regs, kern.tile_copies, pair)
            if use.get("frame", 0) or use.get("stack", 0):
                problems.append("register spills (stack frame)")
            threads = 128 * (1 + wgs)
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
        lists = "sparse" if sparse else "dense "
        print(
            f"attention {name:18} v3           {lists} tile={tile} outer={outer!s:5} sink={sink!s:5} split={split!s:5} "
            f"l2pf={l2pf} producer_wgs={wgs} raw={raw_ring[0]}x{raw_ring[1]} consumer={crev} decode_rev={drev} pair={pair!s:5} "
            f"{time.time() - t:5.1f}s {status}",
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
            # compiled also while held off by V3_AWAITING_GPU_TESTS: the held kernels must compile before a device run
            why = v3_blocker(plan, sparse=False, smem_limit=HOPPER_SMEM_PER_BLOCK, gated=False)
            if why is None:
                held = v3_blocker(plan, sparse=False, smem_limit=HOPPER_SMEM_PER_BLOCK)
                if held:
                    print(f"attention {name:18} v3           compiled; dispatch runs v2 until GPU tests pass: {held}", flush=True)
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
                a = attention_args(heads, stream)
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
