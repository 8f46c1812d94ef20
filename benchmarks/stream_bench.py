"""Layer streaming at full width on one GPU: a full-width FP8-block checkpoint (DeepSeek-V3.2 or GLM-5.2 geometry)
streamed through `mla-eval kld`, the same run resident, the disk's sequential read rate, how busy the streamed run kept
the GPU and how fast it read against that disk rate, and the projected wall time of full-depth runs (GLM-5.2,
DeepSeek-V3.2) planned from index-only folders, split into forwards, reads and loss.

    python -m benchmarks.stream_bench --out DIR --ckpt /tmp/ckpt --text wiki.test.raw [--layers 8 --first-dense 5]
                                      [--preset glm-5.2] [--kld-args "--weight-math fp8"] [--steps ...]

Steps (each writes DIR/<step>.json; a rerun skips steps whose file exists):
  write      tools.write_checkpoint: --layers full-width layers (--first-dense dense, the rest MoE), fp8-block, --preset
  disk       sequential read of the checkpoint's largest shard with O_DIRECT (the page cache bypassed), GB/s
  stream     mla-eval kld --offload stream at --ctx on --max-tokens of the text: the document (its execution record:
             plan, per-layer cost, read statistics, peak memory per phase) and the summary: GPU busy (the layers'
             forwards' share of the passes' wall time, CUDA events), read rate and its share of the `disk` rate, how
             many layers were read with O_DIRECT, whether the next layer materialised while one computed
  resident   the same settings with --offload none: the formats must equal the streamed document's bit for bit
  plan       mla-eval plan --offload stream on the written checkpoint (its few full-width layers): the sensitivity
             sweep streamed (the document, its execution record)
  plan-project  `mla-eval plan --dry-run` on the GLM-5.2 index-only folder: the sweep's projection
  project    for each preset: an index-only folder of all its layers (no shard), `mla-eval kld --dry-run`'s plan with
             one layer of each build timed on the GPU (random values of the stored shapes) at the default protocol
             (wikitext-2 test, the nine default formats + bf16, ctx 2048) and batch 1 and 8, the read rate of `disk`;
             the projection's split (forwards, reads beyond compute, loss)
Numbers are about time and memory (random weights), never quality.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

STEPS = ("write", "disk", "stream", "resident", "project", "plan", "plan-project")
PROJECT = {"glm-5.2": 78, "deepseek-v3.2": 61}  # decoder layers of the full models (MTP layers are never run)


def _save(out: Path, step: str, doc: dict) -> None:
    tmp = out / f"{step}.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    tmp.replace(out / f"{step}.json")
    print(f"[{step}] saved {out / (step + '.json')}", flush=True)


def _run(cmd: list[str], timeout: float) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    tail = "\n".join((p.stdout + p.stderr).splitlines()[-25:])
    return p.returncode, time.perf_counter() - t0, tail


def step_write(a, out: Path) -> dict:
    if (a.ckpt / "model.safetensors.index.json").is_file():
        return {"skipped": "checkpoint present", "path": str(a.ckpt)}
    rc, s, tail = _run([sys.executable, "-m", "tools.write_checkpoint", str(a.ckpt), "--layers", str(a.layers),
                        "--first-dense", str(a.first_dense), "--preset", a.preset, "--format", "fp8-block"], a.timeout)
    print(tail)
    return {"rc": rc, "seconds": s, "layers": a.layers, "first_dense": a.first_dense, "preset": a.preset,
            "path": str(a.ckpt), "log": tail}


def step_disk(a, out: Path) -> dict:
    shards = sorted(a.ckpt.glob("model-*.safetensors"), key=lambda p: p.stat().st_size)
    if not shards:
        return {"error": "no shard"}
    big = shards[-1]
    size = big.stat().st_size
    block = 64 << 20
    fd = os.open(big, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    import mmap

    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    done = 0
    t0 = time.perf_counter()
    try:
        while done < size:
            n = os.readv(fd, [buf])
            if n <= 0:
                break
            done += n
    finally:
        os.close(fd)
    s = time.perf_counter() - t0
    return {"shard": big.name, "bytes": done, "seconds": s, "gb_per_s": done / s / 1e9, "o_direct": hasattr(os, "O_DIRECT")}


def _kld(a, offload: str, path: Path) -> list[str]:
    return [sys.executable, "-m", "mla_eval", "kld", "--model", str(a.ckpt), "--text", str(a.text), "--max-tokens",
            str(a.max_tokens), "--ctx", str(a.ctx), "--stride", str(a.stride), "--formats", a.formats, "--scales", "none",
            "--batch", str(a.batch), "--offload", offload, "--out", str(path), "--force", *a.kld_args.split()]


def step_kld(a, out: Path, offload: str) -> dict:
    path = out / f"kld-{offload}.json"
    rc, s, tail = _run(_kld(a, offload, path), a.timeout)
    print(tail)
    doc = {"rc": rc, "wall_seconds": s, "document": str(path.name), "log": tail}
    if rc == 0:
        kld = json.loads(path.read_text())
        ex = kld.get("execution", {})
        doc["execution"] = ex
        doc["formats"] = {k: v["kld_mean"] for k, v in kld["formats"].items()}
        doc["peak_gib"] = kld["environment"].get("gpu_peak_memory_gib")
        read = ex.get("read") or {}
        if read.get("read_seconds"):
            doc["read_gb_per_s"] = read["bytes"] / read["read_seconds"] / 1e9
            disk = out / "disk.json"
            disk_gbps = json.loads(disk.read_text()).get("gb_per_s") if disk.is_file() else a.read_gbps
            doc["summary"] = {
                "gpu_busy": read.get("device_busy"),  # the layers' forwards / the passes' wall time
                "read_gb_per_s": doc["read_gb_per_s"],
                "disk_o_direct_gb_per_s": disk_gbps,
                "read_share_of_disk": doc["read_gb_per_s"] / disk_gbps if disk_gbps else None,
                # the passes' wall time against the reads alone: near 1 where the run is read-bound
                "read_bound": read["read_seconds"] / read["wall_seconds"] if read.get("wall_seconds") else None,
                "direct_reads": read.get("direct_reads"), "layers_read": read.get("layers"),
                "overlap": read.get("overlap"), "read_mode": read.get("read_mode"),
            }
            print(json.dumps(doc["summary"]), flush=True)
    return doc


def step_resident(a, out: Path) -> dict:
    doc = step_kld(a, out, "none")
    s = out / "kld-stream.json"
    r = out / "kld-none.json"
    if doc["rc"] == 0 and s.is_file():
        fs, fr = json.loads(s.read_text())["formats"], json.loads(r.read_text())["formats"]
        doc["formats_equal_streamed"] = fs == fr
    return doc


def step_project(a, out: Path) -> dict:
    from mla_eval.evals.kld_evaluation import KldSettings, plan_kld_run

    disk = out / "disk.json"
    bps = json.loads(disk.read_text()).get("gb_per_s", 0) * 1e9 if disk.is_file() else None
    source = "benchmarks.stream_bench disk step (O_DIRECT sequential read)"
    if bps is None and a.read_gbps:
        bps, source = a.read_gbps * 1e9, f"--read-gbps {a.read_gbps} (an earlier disk step on this kind of machine)"
    res = {}
    for preset, layers in PROJECT.items():
        folder = Path(f"/tmp/index-{preset}")
        packed = Path(f".devdata/index-{preset}.tar.xz")  # made beforehand (the device's CPU writes it slowly)
        if not (folder / "model.safetensors.index.json").is_file() and packed.is_file():
            subprocess.run(["tar", "xJf", str(packed), "-C", "/tmp"], check=True)
        if not (folder / "model.safetensors.index.json").is_file():
            rc, s, tail = _run([sys.executable, "-m", "tools.write_checkpoint", str(folder), "--layers", str(layers),
                                "--preset", preset, "--format", "fp8-block", "--index-only"], a.timeout)
            if rc:
                res[preset] = {"error": tail}
                continue
        for batch in a.batches:
            t0 = time.perf_counter()
            try:
                kp = plan_kld_run(KldSettings(model=str(folder), text=a.text, batch=batch, **a.project_settings),
                                  read_bps=bps, read_source=source)
            except Exception as exc:  # a refusal or OOM is a result of this step
                res[f"{preset}/batch{batch}"] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            d = kp.as_dict()
            res[f"{preset}/batch{batch}"] = {"plan": d, "lines": kp.lines(), "seconds": time.perf_counter() - t0,
                                             "projected_hours": (d["time"]["projected_seconds"] or 0) / 3600,
                                             "projected_split_hours": {k: v / 3600 for k, v in
                                                                       (d["time"]["projected_split"] or {}).items()}}
            print("\n".join(kp.lines()), flush=True)
    return res


def _plan_cmd(a, model: Path, out: Path | None, dry_run: bool) -> list[str]:
    cmd = [sys.executable, "-m", "mla_eval", "plan", "--model", str(model), "--text", str(a.text), "--max-tokens",
           str(a.plan_tokens), "--ctx", str(a.plan_ctx), "--candidates", a.plan_candidates, "--pool-gain",
           str(a.plan_gain), "--scales", "none", *a.kld_args.split()]
    return cmd + (["--dry-run"] if dry_run else ["--offload", "stream", "--out", str(out), "--force"])


def step_plan(a, out: Path) -> dict:
    path = out / "plan-stream.json"
    rc, s, tail = _run(_plan_cmd(a, a.ckpt, path, dry_run=False), a.timeout)
    print(tail)
    doc = {"rc": rc, "wall_seconds": s, "document": path.name, "log": tail}
    if rc == 0:
        plan = json.loads(path.read_text())
        doc["execution"] = plan.get("execution")
        doc["layers"] = plan.get("layers")
        doc["sensitivity_seconds"] = plan.get("sensitivity", {}).get("seconds")
    return doc


def step_plan_project(a, out: Path) -> dict:
    folder = Path("/tmp/index-glm-5.2")
    if not (folder / "model.safetensors.index.json").is_file():
        rc, s, tail = _run([sys.executable, "-m", "tools.write_checkpoint", str(folder), "--layers", "78", "--preset",
                            "glm-5.2", "--format", "fp8-block", "--index-only"], a.timeout)
        if rc:
            return {"error": tail}
    rc, s, tail = _run(_plan_cmd(a, folder, None, dry_run=True), a.timeout)
    print(tail)
    return {"rc": rc, "wall_seconds": s, "log": tail}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.stream_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt", type=Path, default=Path("/tmp/ckpt"))
    p.add_argument("--text", type=Path, required=True)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--first-dense", type=int, default=3, help="write: leading dense layers (the rest MoE)")
    p.add_argument("--preset", default="deepseek-v3.2", choices=("deepseek-v3.2", "glm-5.2"), help="write: geometry")
    p.add_argument("--batch", type=int, default=1, help="stream/resident: windows per forward")
    p.add_argument("--kld-args", default="", help="stream/resident: more mla-eval kld options, e.g. '--weight-math fp8'")
    p.add_argument("--weight-math", default="auto", help="project: --weight-math of the projected runs")
    p.add_argument("--experts", default="grouped_mm", help="project: --experts of the projected runs")
    p.add_argument("--plan-candidates", default="fp8_ds_mla,nvfp4", help="plan: --candidates")
    p.add_argument("--plan-gain", type=float, default=1.25, help="plan: --pool-gain (a budget for any layer count)")
    p.add_argument("--plan-ctx", type=int, default=2048, help="plan: --ctx")
    p.add_argument("--plan-tokens", type=int, default=8192, help="plan: --max-tokens of the text")
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--stride", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--formats", default="fp8_ds_mla,nvfp4")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--read-gbps", type=float, default=None,
                   help="project, stream: the disk's O_DIRECT read rate (GB/s) when no disk step ran in this --out")
    p.add_argument("--steps", default=",".join(STEPS))
    p.add_argument("--timeout", type=float, default=540)
    p.add_argument("--force", action="store_true", help="rerun steps whose file exists")
    a = p.parse_args(argv)
    a.batches = [int(b) for b in a.batches.split(",")]
    a.project_settings = {"weight_math": a.weight_math, "experts": a.experts}
    a.out.mkdir(parents=True, exist_ok=True)
    for step in a.steps.split(","):
        if step not in STEPS:
            p.error(f"unknown step {step}: one of {', '.join(STEPS)}")
        if (a.out / f"{step}.json").is_file() and not a.force:
            print(f"[{step}] done before: {a.out / (step + '.json')}")
            continue
        print(f"[{step}] start", flush=True)
        t0 = time.perf_counter()
        fn = {"write": step_write, "disk": step_disk, "stream": lambda a, o: step_kld(a, o, "stream"),
              "resident": step_resident, "project": step_project, "plan": step_plan,
              "plan-project": step_plan_project}[step]
        doc = fn(a, a.out)
        doc["step_seconds"] = time.perf_counter() - t0
        _save(a.out, step, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
