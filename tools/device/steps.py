"""The device steps: each a function of its parsed arguments returning an exit status, registered in `STEPS` with its
help and its options (typed; `python -m tools.device STEP --help`). tests/test_device_steps.py checks that every step
is registered and that its command lines parse."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tools.device.runner import LONG_TEXT, ROOT, TEXT, cuobjdump, mla_eval, module, need, out_dir, run, say


@dataclass(frozen=True)
class Step:
    """A step: `setup(parser)` adds its options and returns the function that runs it on the parsed arguments."""

    name: str
    help: str
    setup: Callable[[argparse.ArgumentParser], Callable[[argparse.Namespace], int]]


STEPS: dict[str, Step] = {}


def step(name: str, help: str):
    """Register the decorated setup function as step `name`."""

    def deco(setup):
        STEPS[name] = Step(name, help, setup)
        return setup

    return deco


def parser() -> argparse.ArgumentParser:
    """The command line of `python -m tools.device`: one subcommand per step."""
    ap = argparse.ArgumentParser(prog="python -m tools.device", description="The device campaigns (tools/device/README.md).")
    sub = ap.add_subparsers(dest="step", required=True, metavar="STEP")
    for s in STEPS.values():
        p = sub.add_parser(s.name, help=s.help, description=s.help)
        p.set_defaults(runner=s.setup(p))
    return ap


def _csv(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


# ---------------------------------------------------------------------------------------------------- tests
GPU_MARKS = re.compile(r"needs_cuda|torch\.cuda\.is_available\(\)|pytest\.mark\.(gpu|multigpu)")


def gpu_test_files() -> list[str]:
    """Every test file with a GPU test (a `gpu` / `multigpu` marker or a CUDA skip): new files join by themselves."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if GPU_MARKS.search(p.read_text()))


@step("tests", "the GPU test suite (pytest, every test file with a GPU test; xdist workers, a per-test time limit)")
def _tests(p):
    p.add_argument("files", nargs="*", help="test files or node ids (default: every GPU test file)")
    p.add_argument("-k", dest="expr", help="pytest -k expression")
    p.add_argument("--exclude", default="", help="comma-separated files to leave out")
    p.add_argument("--workers", type=int, default=8, help="pytest-xdist workers (0: none)")
    p.add_argument("--per-test-s", type=int, default=300, help="pytest-timeout per test")
    p.add_argument("--limit-s", type=int, default=560, help="time limit of the whole run")

    def go(a):
        files = a.files or [f for f in gpu_test_files() if f not in _csv(a.exclude)]
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", f"--timeout={a.per_test_s}"]
        argv += ["-n", str(a.workers)] if a.workers else []
        argv += ["-k", a.expr] if a.expr else []
        # data the data-path fixtures need is carried (.devdata): missing data fails here instead of skipping
        env = {"MLA_EVAL_REQUIRE_DATA": "1", "MLA_EVAL_REQUIRE_CUTE": "1"}
        return run("pytest", argv + files, out_dir("tests"), a.limit_s, env=env, tail=60,
                   keep=r"FAILED|ERROR|passed|failed|error|Timeout|SKIPPED")

    return go


# ---------------------------------------------------------------------------------------------------- smoke
@step("smoke", "the GPU smoke of the committed tree and its stamp (tools/device/smoke.py; <= 4 minutes)")
def _smoke(p):
    p.add_argument("--commit", required=True, help="the commit the tree is (the device copy has no .git)")

    def go(a):
        from tools.device.smoke import run_smoke

        return run_smoke(a.commit)

    return go


# ---------------------------------------------------------------------------------------------------- kernels
@step("compile", "tools.compile_check with the machine's cuobjdump: registers, stack frames, SASS per tile")
def _compile(p):
    p.add_argument("--formats", default="nvfp4,bf16,fp8_ds_mla")
    p.add_argument("--heads", default="16,128")
    p.add_argument("--versions", default="v1,v2,v3")

    def go(a):
        tool = cuobjdump()
        say(f"cuobjdump: {tool or 'none'}")
        argv = module("tools.compile_check", "--formats", a.formats, "--heads", a.heads, "--versions", a.versions)
        return run("compile_check", argv + (["--cuobjdump", tool] if tool else []), out_dir("compile"), 400, tail=40)

    return go


def _module_step(name: str, mod: str, help: str, limit: int, needs_text: bool = False):
    @step(name, f"{help} (options after `--` go to python -m {mod})")
    def _(p):
        p.add_argument("--limit-s", type=int, default=limit)
        p.add_argument("args", nargs=argparse.REMAINDER, help=f"options of {mod}")

        def go(a):
            if needs_text and not need(TEXT, "copy ../shared/data/wikitext-2/wiki.test.raw to .devdata/"):
                return 3
            extra = [x for x in a.args if x != "--"]
            d = out_dir(name)
            if "--out" not in extra:
                extra += ["--out", str(d / (f"{name}.json" if name in ("forward", "prod") else name))]
            if needs_text and "--text" not in extra:
                extra += ["--text", TEXT]
            return run(name, module(mod, *extra), d, a.limit_s, tail=60)

        return go


_module_step("bench", "benchmarks.kernel_bench", "the kernel benchmark, ceilings in the same run", 560)
_module_step("forward", "benchmarks.forward_bench", "kld window and 64K needle cell vs the stock bf16 forward", 300)
_module_step("prod", "benchmarks.production_bench", "every preset geometry: cost per layer, kernel vs reference KLD", 300,
             needs_text=True)
_module_step("memory", "benchmarks.memory_bench", "peak GPU memory per phase at production geometry", 400)
_module_step("stream", "benchmarks.stream_bench", "layer streaming at full width, read rate, projections", 580,
             needs_text=True)
_module_step("moe", "benchmarks.moe_bench", "one MoE block per preset geometry at 2K/16K/64K tokens: eager, grouped_mm "
             "and fp8 (DeepGEMM: carry .devwheels/fp8) beside the bf16 matmul ceiling of the same run", 560)


# ---------------------------------------------------------------------------------------------------- fp8
FP8_TESTS = ("tests/test_fp8_gpu.py", "tests/test_compute_paths_gpu.py")


@step("fp8", "FP8 weight math: DeepGEMM dense and grouped against the torch reference, and each format's KLD across "
      "expert paths and weight maths (MLA_EVAL_FP8_GEMM=deepgemm: a DeepGEMM that cannot load fails; carry "
      ".devwheels/fp8)")
def _fp8(p):
    p.add_argument("-k", dest="expr", help="pytest -k expression")
    p.add_argument("--limit-s", type=int, default=560, help="time limit of the whole run")

    def go(a):
        # -s: the KLD tests print each run's rows, the figures the pass / fail is about
        argv = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-rfE", *FP8_TESTS]
        argv += ["-k", a.expr] if a.expr else []
        return run("pytest", argv, out_dir("fp8"), a.limit_s, env={"MLA_EVAL_FP8_GEMM": "deepgemm"}, tail=60)

    return go


@step("ncu", "ncu --set full of one attention launch (benchmarks.profile_dense): details and SASS source pages")
def _ncu(p):
    p.add_argument("--formats", default="nvfp4")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--context", type=int, default=65536)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--sparse", action="store_true")
    p.add_argument("--kernel-regex", default="MlaAttention", help="ncu -k regex: the launch profiled")
    p.add_argument("--name", default="ncu")

    def go(a):
        import shutil

        if not shutil.which("ncu"):
            print("no ncu on this machine")
            return 1
        d = out_dir("ncu")
        rep = d / a.name
        prof = module("benchmarks.profile_dense", "--formats", a.formats, "--heads", str(a.heads), "--context",
                      str(a.context), "--batch", str(a.batch), *(["--sparse"] if a.sparse else []))
        rc = run(a.name, ["ncu", "--clock-control", "none", "-k", f"regex:{a.kernel_regex}", "-c", "1", "--set", "full",
                          "--import-source", "no", "-o", str(rep), *prof], d, 300, tail=4)
        run(f"{a.name}-details", ["ncu", "-i", f"{rep}.ncu-rep", "--page", "details"], d, 120,
            keep=r"Duration|Issue Slots Busy|Eligible Warps|Executed Ipc A|DRAM Throughput|Registers Per|Compute \(SM\)")
        run(f"{a.name}-sass", ["ncu", "-i", f"{rep}.ncu-rep", "--page", "source", "--csv", "--print-source", "sass"], d, 120,
            tail=0)
        return rc

    return go


# ---------------------------------------------------------------------------------------------------- model campaigns
@step("eval", "mla-eval run RECIPE and mla-eval report of it")
def _eval(p):
    p.add_argument("--recipe", default="recipes/h200-full.toml")
    p.add_argument("--limit-s", type=int, default=420)

    def go(a):
        d = out_dir("eval")
        name = Path(a.recipe).stem
        rc = run(f"run-{name}", mla_eval("run", a.recipe, "--out", str(d / name)), d, a.limit_s)
        run(f"report-{name}", mla_eval("report", str(d / name)), d, 120, tail=3)
        return rc

    return go


@step("formats", "mla-eval kld of every registered format on the embedded model (wikitext-2, 64K tokens) and the "
      "engine residual measurements (tools.measure.*)")
def _formats(p):
    p.add_argument("--max-tokens", type=int, default=65536)

    def go(a):
        if not need(TEXT, "copy ../shared/data/wikitext-2/wiki.test.raw to .devdata/"):
            return 3
        from mla_eval.formats import format_names

        d = out_dir("formats")
        fmts = ",".join(n for n in format_names() if n != "bf16")
        rc = run("kld-all-formats", mla_eval("kld", "--text", TEXT, "--max-tokens", str(a.max_tokens), "--formats", fmts,
                                             "--no-layer-stats", "--prefill", "absorbed", "--out",
                                             str(d / "kld-default-all-formats.json")), d, 300)
        for s in ("rope_rcp_residual", "sglang_fp4_residual", "trtllm_nvfp4_residual"):
            rc |= run(s, module(f"tools.measure.{s}", "--out", str(d / f"{s}.json")), d, 150, tail=12)
        return rc

    return go


SEMANTICS_PARTS = ("default", "prod", "qp")


@step("semantics", "the attention semantics tables: cache / engine:C / vllm x bf16 / fp8-q math")
def _semantics(p):
    p.add_argument("--parts", default=",".join(SEMANTICS_PARTS), help=f"comma-separated of {','.join(SEMANTICS_PARTS)}")
    p.add_argument("--formats", default="nvfp4,nvfp4+s_l,fp8_ds_mla")

    def go(a):
        if not need(TEXT, "copy ../shared/data/wikitext-2/wiki.test.raw to .devdata/"):
            return 3
        d, rc = out_dir("semantics"), 0
        common = ["--text", TEXT, "--no-layer-stats", "--prefill", "absorbed", "--explain", "nvfp4"]
        for part in _csv(a.parts):
            if part == "default":
                argv = mla_eval("kld", *common, "--max-tokens", "16384", "--formats", a.formats, "--semantics",
                                "cache,engine:512,vllm", "--math", "bf16,fp8-q", "--out", str(d / "kld-default-semantics.json"))
            elif part == "prod":
                argv = mla_eval("kld", *common, "--model", "random:deepseek-v3:layers=2", "--max-tokens", "16384", "--ctx",
                                "4096", "--stride", "2048", "--min-context", "2048", "--formats", a.formats, "--semantics",
                                "cache,engine:2048,vllm", "--math", "bf16,fp8-q", "--out",
                                str(d / "kld-deepseek-v3-semantics.json"))
            elif part == "qp":
                argv = mla_eval("kld", *common, "--max-tokens", "8192", "--formats", "nvfp4,fp8_ds_mla", "--scales", "none",
                                "--semantics", "cache,engine:512", "--math", "bf16,fp8-q,fp8-qp", "--backend", "reference",
                                "--out", str(d / "kld-default-fp8qp.json"))
            else:
                print(f"unknown semantics part {part} ({', '.join(SEMANTICS_PARTS)})")
                return 2
            rc |= run(f"semantics-{part}", argv, d, 170)
        return rc

    return go


LONG_PARTS = ("grid", "kld64", "yarn96", "yarn128", "confirm", "calib")
LONG_FORMATS = "fp8_ds_mla,nvfp4,nvfp4+s_l,nvfp4_fp8rope,nvfp4_fp8_ds_mla,mxfp4,trtllm_nvfp4_dsa"


@step("long", "the long-context runs on held-out Wikipedia (.devdata/wiki-long.txt): needle grid 4K/16K/64K, KLD at "
      "ctx 64K by depth, 96K / 128K under --rope-scaling yarn:2")
def _long(p):
    p.add_argument("--parts", default="grid,kld64,yarn96,yarn128", help=f"comma-separated of {','.join(LONG_PARTS)}")
    p.add_argument("--model", help="a checkpoint folder instead of the embedded model")
    p.add_argument("--grid-formats", default=LONG_FORMATS)
    p.add_argument("--kld-formats", default=LONG_FORMATS)
    p.add_argument("--yarn-formats", default="nvfp4")
    p.add_argument("--tasks", default="single:number,single:word,multikey:number")
    p.add_argument("--depths", default="0,25,50,75,100")
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--scales", default="results/published/default-model/outer_scales-wikipedia-heldout.json")

    def go(a):
        if not need(LONG_TEXT, "build it with python -m tools.make_wiki_long and carry .devdata"):
            return 3
        d, rc = out_dir("long"), 0
        model = ["--model", a.model] if a.model else []
        scales = a.scales

        def needle(name, limit, lengths, formats, *extra):
            return run(f"needle-{name}", mla_eval("needle", "--task", a.tasks, "--haystack", LONG_TEXT, "--lengths", lengths,
                                                  "--depths", a.depths, "--trials", str(a.trials), "--formats", formats,
                                                  "--scales", scales, *model, *extra, "--out", str(d / f"needle-{name}.json")),
                       d, limit)

        for part in _csv(a.parts):
            n_yarn = 1 + len(_csv(a.yarn_formats))
            if part == "calib":
                scales = str(d / "outer_scales-wikipedia-heldout.json")
                rc |= run("calibrate", mla_eval("calibrate", "--text", LONG_TEXT, "--max-tokens", "32768", "--ctx", "2048",
                                                *model, "--out", scales, "--force"), d, 200)
            elif part == "confirm":
                rc |= needle("confirm", 120, "64K", "bf16")
            elif part == "grid":
                rc |= needle("grid-short", 200, "4K,16K", "bf16," + a.grid_formats)
                rc |= needle("grid-64k", 330, "64K", "bf16," + a.grid_formats)
            elif part == "kld64":
                rc |= run("kld-ctx65536", mla_eval("kld", "--text", LONG_TEXT, "--max-tokens", str(65536 * 3 + 2048), "--ctx",
                                                   "65536", "--stride", "65024", "--min-context", "512", "--no-layer-stats",
                                                   "--prefill", "absorbed", "--formats", a.kld_formats, "--scales", scales,
                                                   *model, "--out", str(d / "kld-ctx65536.json"), "--plot", str(d / "plots")),
                          d, 300)
            elif part == "yarn96":
                rc |= needle("96k-yarn2", 60 + 50 * n_yarn, "96K", "bf16," + a.yarn_formats, "--rope-scaling", "yarn:2")
            elif part == "yarn128":
                rc |= needle("128k-yarn2", 60 + 80 * n_yarn, "128K", "bf16," + a.yarn_formats, "--rope-scaling", "yarn:2")
            else:
                print(f"unknown long part {part} ({', '.join(LONG_PARTS)})")
                return 2
        return rc

    return go


POWER_PARTS = ("grid", "topk")


@step("power", "needle --power with the real formats and control:* under --latent-profile glm-5.2 (grid), and the DSA "
      "top-k overlap on random:glm-5.2 (topk)")
def _power(p):
    p.add_argument("--parts", default="grid,topk", help=f"comma-separated of {','.join(POWER_PARTS)}")
    p.add_argument("--formats", default="fp8_ds_mla,nvfp4,nvfp4+s_l,nvfp4_fp8rope,nvfp4_fp8rope+s_l,mxfp4")
    p.add_argument("--tasks", default="single:number,multikey:number")
    p.add_argument("--lengths", default="4K,16K,64K")
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--topk-layers", type=int, default=8)

    def go(a):
        d, rc = out_dir("power"), 0
        fmts = f"{a.formats},control:*"
        for part in _csv(a.parts):
            if part == "grid":
                if not need(LONG_TEXT, "build it with python -m tools.make_wiki_long and carry .devdata"):
                    return 3
                rc |= run("needle-power", mla_eval("needle", "--latent-profile", "glm-5.2", "--task", a.tasks, "--haystack",
                                                   LONG_TEXT, "--lengths", a.lengths, "--depths", "0,25,50,75,100", "--trials",
                                                   str(a.trials), "--formats", fmts, "--scales", "auto", "--power", "--out",
                                                   str(d / "needle-power-glm52-profile.json")), d, 560)
            elif part == "topk":
                if not need(TEXT, "copy ../shared/data/wikitext-2/wiki.test.raw to .devdata/"):
                    return 3
                rc |= run("kld-topk", mla_eval("kld", "--model", f"random:glm-5.2:layers={a.topk_layers}", "--latent-profile",
                                               "glm-5.2", "--text", TEXT, "--max-tokens", "34816", "--ctx", "8192", "--stride",
                                               "7168", "--min-context", "1024", "--prefill", "absorbed", "--formats", fmts,
                                               "--scales", "auto", "--out", str(d / "kld-topk-random-glm52-profile.json")),
                          d, 500)
            else:
                print(f"unknown power part {part} ({', '.join(POWER_PARTS)})")
                return 2
        return rc

    return go


# ---------------------------------------------------------------------------------------------------- training
TRAIN_WORK = "/tmp/mla_train"


@step("train-tok", "copy the training shards to the work folder and tokenise them")
def _train_tok(p):
    p.add_argument("--shards", default=".train_data/a")

    def go(a):
        import shutil

        shards = Path(TRAIN_WORK) / "shards"
        shards.mkdir(parents=True, exist_ok=True)
        for f in (ROOT / a.shards).glob("train_*.txt.xz"):
            shutil.copy(f, shards / f.name)
        code = ("from pathlib import Path; from tools.train.trainer import TokenStore; "
                f"TokenStore([{str(shards)!r}], Path('mla_eval/default_model/tokenizer.json'), Path('{TRAIN_WORK}/tok'))")
        return run("tokenise", [sys.executable, "-c", code], out_dir("train"), 300)

    return go


@step("train", "python -m tools.train train for --seconds, resuming from the work folder's checkpoint; the bf16 export "
      "comes back as $OUT/model.safetensors.partNN + $OUT/meta.tar")
def _train(p):
    p.add_argument("--seconds", type=int, required=True)
    p.add_argument("--recipe", default="recipes/train-default-model.toml")
    p.add_argument("--init", help="a folder to start from (model.safetensors + trainer_state.json)")
    p.add_argument("--init-state")
    p.add_argument("--restart-curriculum", action="store_true")
    p.add_argument("--data", nargs="+", default=[f"{TRAIN_WORK}/shards"])
    p.add_argument("--export", default=f"{TRAIN_WORK}/export")

    def go(a):
        import os
        import shutil
        import subprocess

        d = out_dir("train")
        init = []
        if a.init:
            init = ["--init", a.init] + (["--init-state", a.init_state] if a.init_state else [])
        elif not Path(TRAIN_WORK, "ckpt.pt").exists() and (ROOT / ".train_data/weights/model.safetensors").exists():
            init = ["--init", ".train_data/weights"]  # a cold machine: resume from carried weights
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "true",
               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        argv = module("tools.train", "train", "--recipe", a.recipe, "--data", *a.data, ".train_data/eval", "--words",
                      ".train_data/eval/words.json", "--work", TRAIN_WORK, *init,
                      *(["--restart-curriculum"] if a.restart_curriculum else []), "--budget-s", str(a.seconds), "--export",
                      a.export, "--log", str(d / "train_log.jsonl"))
        rc = run("train", argv, d, a.seconds + 120, env=env, tail=30)
        e = Path(a.export)
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (ROOT / "mla_eval/default_model" / f).exists() and e.is_dir():
                shutil.copy(ROOT / "mla_eval/default_model" / f, e / f)
        if (e / "model.safetensors").exists():
            out = os.environ.get("OUT", "/tmp/out")
            subprocess.run(["split", "-b", "15M", "-d", str(e / "model.safetensors"), f"{out}/model.safetensors.part"])
            subprocess.run(["tar", "-cf", f"{out}/meta.tar", "-C", str(e), "config.json", "trainer_state.json"])
        return rc

    return go


@step("train-check", "an export's wikitext-2 perplexity and pass key, per-layer latent statistics, bf16 needle tasks")
def _train_check(p):
    p.add_argument("--export", default=f"{TRAIN_WORK}/export")

    def go(a):
        d = out_dir("train-check")
        rc = run("quality", module("tools.train", "eval", "--model", a.export, "--wikitext", ".train_data/eval/wiki.test.raw",
                                   "--haystack-docs", ".train_data/eval/eval_docs.txt.xz", "--words",
                                   ".train_data/eval/words.json", "--lengths", "4096,65536", "--beyond", "", "--depths", "3",
                                   "--trials", "2", "--out", str(d / "quality_bf16.json")), d, 150, env={"HF_HUB_OFFLINE": "1"})
        rc |= run("latent-stats", module("tools.train.latent_stats", "--model", a.export, "--text",
                                         ".train_data/eval/wiki.test.raw", "--json", str(d / "latent_stats.json")), d, 150)
        heldout = Path("/tmp/heldout.txt")
        code = ("import lzma, pathlib; docs = lzma.open('.train_data/eval/eval_docs.txt.xz', 'rt', encoding='utf-8')"
                f".read().split(chr(0)); pathlib.Path({str(heldout)!r}).write_text(chr(10).join(docs), encoding='utf-8')")
        run("heldout", [sys.executable, "-c", code], d, 60)
        rc |= run("needle-tasks", mla_eval("needle", "--model", a.export, "--formats", "bf16", "--task",
                                           "single:number,single:word,multikey:number,multivalue:number,vt", "--haystack",
                                           str(heldout), "--lengths", "4K,16K,64K", "--depths", "0,50,100", "--trials", "4",
                                           "--out", str(d / "needle-tasks-check.json")), d, 200)
        return rc

    return go
