"""The GPU smoke of the committed tree (`python -m tools.device smoke --commit C`, <= 4 minutes on an H100), and its
stamp: $OUT/runs/smoke/smoke.json, committed as results/published/<gpu>/smoke.json (`python -m tools.gpu_stamp`
compares its `gpu_digest` with the tree's).

What it runs, each a user's command on the embedded model or a random preset, each under its own time limit:
1. `mla-eval kld` on wikitext-2 (8,192 tokens, ctx 2048) with every format the kernels serve, kernel backend and
   torch reference backend on the same tokens: the kernels' KLD must equal the reference's within `KLD_TOL`.
2. `mla-eval needle` at 4K through the decode kernels (bf16, nvfp4, fp8_ds_mla; 2 trials x 2 depths): it must run.
3. `mla-eval kld` on random:glm-5.2:layers=2 (a DSA model: the lightning indexer's top-2048 lists through the sparse
   kernels) at ctx 4096, kernel and reference: equal within `KLD_TOL`.
4. One benchmark row per kernel generation at shape (b) 8K (v3 and v2 by default, v1 forced): they must run.
A check that fails marks the stamp `passed: false` (the stamp is still written: a failure is a result).
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch

from tools import gpu_stamp
from tools.device.runner import TEXT, mla_eval, module, need, out_dir, run, say

NEEDLE_FORMATS = "bf16,nvfp4,fp8_ds_mla"
DSA_FORMATS = "nvfp4,fp8_ds_mla"
# kernel vs reference on the same tokens: the kernels' bf16 rounding of P and the accumulation order differ from the
# reference's float32 (docs/kernels.md); on the embedded model the two agreed within 0.8 % (issue 39's H100 run)
KLD_TOL = (0.05, 1e-4)  # relative, absolute


def kernel_formats() -> list[str]:
    from mla_eval.formats import all_formats
    from mla_eval_kernels.plan.record_plan import UnsupportedFormat, plan_for

    names = []
    for spec in all_formats():
        try:
            plan_for(spec)
        except UnsupportedFormat:
            continue
        names.append(spec.name)
    return names


def _kld_rows(path: Path) -> dict[str, float]:
    doc = json.loads(path.read_text())
    return {name: row["kld_mean"] for name, row in doc["formats"].items()}


def _compare(kernel: dict, ref: dict, what: str) -> dict:
    rel, ab = KLD_TOL
    rows = {}
    for name, r in ref.items():
        k = kernel.get(name)
        ok = k is not None and abs(k - r) <= max(ab, rel * r)
        rows[name] = dict(kernel=k, reference=r, ok=ok)
    bad = [n for n, row in rows.items() if not row["ok"]]
    return dict(check=f"{what}: kernel KLD = reference KLD within {rel:.0%} (or {ab})", passed=not bad and bool(rows),
                failed=bad, rows=rows)


def run_smoke(commit: str) -> int:
    d = out_dir("smoke")
    checks, figures = [], {}
    if not need(TEXT, "copy ../shared/data/wikitext-2/wiki.test.raw to .devdata/"):
        return 3
    fmts = ",".join(kernel_formats())
    kld_common = ["--text", TEXT, "--max-tokens", "8192", "--ctx", "2048", "--formats", fmts,
                  "--no-layer-stats", "--prefill", "absorbed", "--force"]
    rcs = {}
    for backend in ("kernel", "reference"):
        rcs[backend] = run(f"kld-{backend}", mla_eval("kld", *kld_common, "--backend", backend,
                                                      "--out", str(d / f"kld-{backend}.json")), d, 150, tail=16)
    if rcs["kernel"] == 0 and rcs["reference"] == 0:
        cmp = _compare(_kld_rows(d / "kld-kernel.json"), _kld_rows(d / "kld-reference.json"), "embedded model, wikitext-2")
    else:
        cmp = dict(check="embedded model kld, kernel and reference", passed=False, exit=rcs)
    checks.append(cmp)
    figures["kld_embedded"] = cmp.get("rows")

    rc = run("needle-4k", mla_eval("needle", "--lengths", "4K", "--trials", "2", "--depth-steps", "2", "--formats",
                                   NEEDLE_FORMATS, "--backend", "kernel", "--out", str(d / "needle-4k.json"), "--force"),
             d, 120, tail=14)
    checks.append(dict(check="needle 4K through the decode kernels runs", passed=rc == 0, exit=rc))
    if rc == 0:
        doc = json.loads((d / "needle-4k.json").read_text())
        figures["needle_4k_mean_accuracy"] = {f: v["mean_accuracy"] for f, v in doc["formats"].items()}

    dsa = ["--model", "random:glm-5.2:layers=2", "--text", TEXT, "--max-tokens", "8192", "--ctx", "4096", "--stride",
           "2048", "--min-context", "2048", "--formats", DSA_FORMATS, "--no-layer-stats", "--prefill", "absorbed", "--force"]
    rcs = {b: run(f"kld-dsa-{b}", mla_eval("kld", *dsa, "--backend", b, "--out", str(d / f"kld-dsa-{b}.json")), d, 150,
                  tail=12) for b in ("kernel", "reference")}
    if rcs["kernel"] == 0 and rcs["reference"] == 0:
        cmp = _compare(_kld_rows(d / "kld-dsa-kernel.json"), _kld_rows(d / "kld-dsa-reference.json"),
                       "random:glm-5.2:layers=2 (DSA, sparse kernels), ctx 4096")
    else:
        cmp = dict(check="random DSA model kld, kernel and reference", passed=False, exit=rcs)
    checks.append(cmp)
    figures["kld_dsa_random_glm52"] = cmp.get("rows")

    bench_rows = []
    for label, env in (("default", {}), ("v1", {"MLA_EVAL_ATTENTION_KERNEL": "v1"})):
        bdir = d / f"bench-{label}"
        rc = run(f"bench-{label}", module("benchmarks.kernel_bench", "--formats", "nvfp4", "--shapes", "b", "--quick",
                                          "--out", str(bdir)), d, 150, env=env, tail=8)
        checks.append(dict(check=f"kernel bench (b) 8K nvfp4, {label} generation runs", passed=rc == 0, exit=rc))
        for p in bdir.glob("bench-*.json"):
            doc = json.loads(p.read_text())
            figures.setdefault("ceilings", doc.get("ceilings"))
            bench_rows += [{k: r.get(k) for k in ("format", "shape", "kernel", "context", "ms", "cache_gb_s", "copy_ratio")}
                           for r in doc["rows"]]
    gens = {r["kernel"] for r in bench_rows}
    checks.append(dict(check="a bench row of each kernel generation (v1, v2, v3)", passed={"v1", "v2", "v3"} <= gens,
                       generations=sorted(g for g in gens if g)))
    figures["bench_b_8k_nvfp4"] = bench_rows

    from mla_eval import provenance

    stamp = {
        "schema": gpu_stamp.SCHEMA,
        "commit": commit,
        "gpu_digest": gpu_stamp.gpu_digest(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cutlass_dsl": provenance.cutlass_dsl_version(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": ["python", "-m", "tools.device", "smoke", "--commit", commit],
        "passed": all(c["passed"] for c in checks),
        "checks": checks,
        "figures": figures,
    }
    (d / "smoke.json").write_text(json.dumps(stamp, indent=1) + "\n")
    for c in checks:
        say(f"{'PASS' if c['passed'] else 'FAIL'} {c['check']}" + (f" {c.get('failed') or ''}" if not c["passed"] else ""))
    slug = "h200" if "H200" in stamp["device"] else "h100" if "H100" in stamp["device"] else "gpu"
    say(f"stamp: {d / 'smoke.json'} (commit it as results/published/{slug}/smoke.json); passed={stamp['passed']}")
    return 0 if stamp["passed"] else 1


if __name__ == "__main__":
    sys.exit(run_smoke(sys.argv[1] if len(sys.argv) > 1 else "unknown"))
