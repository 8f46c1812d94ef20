"""Resumable trainer of the default model under a wall-clock budget.

One process trains until `--budget-s` is nearly spent, then writes (a) a full checkpoint with the
fp32 weights and the optimizer state to `--work/ckpt.pt` (kept only while the GPU machine stays
warm) and (b) a bf16 export (`config.json`, `model.safetensors`, `trainer_state.json`) to
`--export`. The next process resumes from (a) if present, else from (b) via `--init` with a fresh
optimizer state and a short linear re-warm-up. The curriculum position (phase, seconds spent in it,
step) travels in both.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tools.train.data import Batch, NeedleMaker, lm_batch, read_docs, tokenize_docs
from tools.train.model_config import EOS_ID, build_config
from tools.train.recipe import load_recipe

_T0 = time.time()


def _log(msg: str) -> None:
    print(f"[{time.time() - _T0:7.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------
# data


def _tokenise_shard(shard: Path, tokenizer_file: Path, out: Path) -> None:
    t0 = time.time()
    ids = tokenize_docs(tokenizer_file, read_docs(shard), EOS_ID)
    tmp = out.with_name(out.stem + ".tmp.npy")
    np.save(tmp, ids)
    os.replace(tmp, out)
    _log(f"tokenised {shard.name}: {len(ids) / 1e6:.1f} M tokens in {time.time() - t0:.1f} s")


def _tokenise_missing(todo: list[tuple[Path, Path]], tokenizer_file: Path) -> None:
    for shard, out in todo:
        _tokenise_shard(shard, tokenizer_file, out)


class TokenStore:
    """The training stream: every shard found in shard_dirs or already cached under cache/.

    Shards not yet cached are tokenised here before training when the cache is empty, else in a
    background process while training runs; `refresh()` picks up the ones it has finished.
    """

    def __init__(self, shard_dirs: list[str], tokenizer_file: Path, cache: Path):
        cache.mkdir(parents=True, exist_ok=True)
        self.cache = cache
        todo = []
        for d in shard_dirs:
            for shard in sorted(Path(d).glob("train_*.txt.xz")):
                out = cache / (shard.name.split(".")[0] + ".npy")
                if not out.exists():
                    todo.append((shard, out))
        self.proc = None
        if not self._files():
            _tokenise_missing(todo, tokenizer_file)
        elif todo:
            import multiprocessing as mp

            self.proc = mp.get_context("spawn").Process(
                target=_tokenise_missing, args=(todo, tokenizer_file), daemon=True
            )
            self.proc.start()
            _log(f"tokenising {len(todo)} new shards in the background")
        self.loaded: list[str] = []
        self.stream = np.zeros(0, dtype=np.uint16)
        self.refresh()
        if not self.loaded:
            raise SystemExit(f"no training shards in {shard_dirs} or {cache}")

    def _files(self) -> list[Path]:
        return [p for p in sorted(self.cache.glob("train_*.npy")) if ".tmp" not in p.name]

    def refresh(self) -> bool:
        files = self._files()
        if [p.name for p in files] == self.loaded:
            return False
        self.stream = np.concatenate([np.load(p) for p in files])
        self.loaded = [p.name for p in files]
        _log(f"training stream: {len(files)} shards, {len(self.stream) / 1e6:.1f} M tokens")
        return True


def _eval_stream(shard_dirs: list[str], tokenizer_file: Path, cache: Path) -> np.ndarray | None:
    out = cache / "eval_docs.npy"
    if not out.exists():
        for d in shard_dirs:
            p = Path(d) / "eval_docs.txt.xz"
            if p.exists():
                np.save(out, tokenize_docs(tokenizer_file, read_docs(p), EOS_ID))
                break
    return np.load(out) if out.exists() else None


def _tiny(recipe: dict) -> dict:
    """CPU smoke-test variant: a 2-layer model (same latent geometry) and seconds-long phases."""
    recipe["model"].update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
    for ph in recipe["phase"]:
        ph["seconds"] = 6
        ph["micro"] = [
            {**m, "seq_len": max(512, m["seq_len"] // 32), "batch": max(1, m["batch"] // 16)} for m in ph["micro"]
        ]
    recipe["optim"]["warmup_steps"] = 3
    return recipe


# ----------------------------------------------------------------------------------------------
# model and optimizer


def make_model(recipe: dict, device: torch.device):
    from transformers import AutoModelForCausalLM

    config = build_config(recipe["model"])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(device=device, dtype=torch.float32)


def make_optimizer(model: torch.nn.Module, o: dict, device: torch.device) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": float(o["weight_decay"])}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        groups, lr=float(o["lr"]), betas=tuple(o["betas"]), eps=float(o["eps"]), fused=device.type == "cuda"
    )


def export_bf16(model: torch.nn.Module, state: dict, out: Path) -> None:
    """config.json + bf16 model.safetensors (+ generation_config.json) + trainer_state.json."""
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # tied to model.embed_tokens.weight: stored once
    model.save_pretrained(str(out), state_dict=sd)
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = "bfloat16"  # save_pretrained records the fp32 training dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "trainer_state.json").write_text(json.dumps(state, indent=1))


# ----------------------------------------------------------------------------------------------
# one micro-batch


def _to(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def micro_step(model, b: Batch, device: torch.device, answer_w: float, scale: float) -> dict:
    """Forward + backward of one micro-batch (loss scaled by `scale`); returns detached stats."""
    x, y = _to(b.input_ids, device), _to(b.target_ids, device)
    w, aid = _to(b.lm_weight, device), _to(b.answer_id, device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(input_ids=x, use_cache=False).logits
    V = logits.shape[-1]
    ce = F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1), reduction="none").view_as(w)
    lm = (ce * w).sum() / w.sum().clamp_min(1.0)
    stats = {"lm": lm.detach()}
    loss = lm
    n_spans = int(b.answer_id.max())
    if n_spans > 0:
        am = aid > 0
        ans = ce[am].mean()
        loss = loss + answer_w * ans
        correct = (logits.detach().argmax(-1) == y)[am].int()
        per_span = torch.ones(n_spans + 1, dtype=torch.int32, device=device)
        per_span.scatter_reduce_(0, aid[am].long(), correct, reduce="amin")
        stats["ans"] = ans.detach()
        stats["exact"] = per_span[1:].float().mean()
    (loss * scale).backward()
    return stats


@torch.no_grad()
def val_loss(model, stream: np.ndarray, device: torch.device, seq_len: int = 2048, batch: int = 16) -> float:
    rng = np.random.default_rng(0)
    b = lm_batch(stream, batch, seq_len, rng)
    model.eval()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(input_ids=_to(b.input_ids, device), use_cache=False).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), _to(b.target_ids, device).flatten()).item()
    model.train()
    return loss


def needle_batch(maker: NeedleMaker, m: dict) -> Batch:
    """The needle micro-batch a recipe entry asks for (its optional `styles` and `edge_depths`)."""
    return maker.batch(int(m["batch"]), int(m["seq_len"]), m.get("styles"), tuple(m.get("edge_depths", (0.0, 0.0))))


def probe(model, maker, stream, phases, device, rng, answer_w) -> None:
    """Times one forward+backward of every distinct micro-batch shape of the recipe (no update)."""
    seen = set()
    for ph in phases:
        for m in ph["micro"]:
            key = (m["kind"], int(m["seq_len"]), int(m["batch"]))
            if key in seen:
                continue
            seen.add(key)
            for rep in range(2):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.time()
                b = lm_batch(stream, key[2], key[1], rng) if key[0] == "lm" else needle_batch(maker, m)
                t1 = time.time()
                micro_step(model, b, device, answer_w, 1.0)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t2 = time.time()
            mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
            _log(f"probe {key}: batch build {t1 - t0:.3f} s, fwd+bwd {t2 - t1:.3f} s, "
                 f"{b.input_ids.size / (t2 - t1):.0f} tok/s, peak {mem:.1f} GiB")
            model.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------------------------
# the loop


def train(args) -> None:
    recipe = load_recipe(args.recipe)
    if args.tiny:
        recipe = _tiny(recipe)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    deadline = _T0 + float(args.budget_s)
    o = recipe["optim"]
    phases = recipe["phase"]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tok_file = Path(args.tokenizer) / "tokenizer.json"
    torch.backends.cuda.matmul.allow_tf32 = True

    store = TokenStore(args.data, tok_file, work / "tok")
    stream = store.stream
    eval_stream = _eval_stream(args.data, tok_file, work / "tok")
    words = json.loads(Path(args.words).read_text())

    model = make_model(recipe, device)
    n_params = sum(p.numel() for p in model.parameters())
    _log(f"model: {n_params / 1e6:.2f} M parameters, attn={model.config._attn_implementation}, device={device}")
    opt = make_optimizer(model, o, device)
    state = {"phase": 0, "phase_s": 0.0, "step": 0, "tokens": 0, "resume_step": 0, "fresh_optimizer": False}
    ckpt = work / "ckpt.pt"
    if ckpt.exists():
        c = torch.load(ckpt, map_location=device, weights_only=False)
        model.load_state_dict(c["model"])
        opt.load_state_dict(c["optim"])
        state = c["state"]
        state["fresh_optimizer"] = False
        _log(f"resumed full checkpoint {ckpt} at step {state['step']}")
    elif args.init:
        from safetensors.torch import load_file

        sd = load_file(str(Path(args.init) / "model.safetensors"))
        missing, unexpected = model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
        missing = [k for k in missing if k != "lm_head.weight"]  # tied to embed_tokens
        if missing or unexpected:
            raise SystemExit(f"init weights mismatch: missing {missing} unexpected {unexpected}")
        init_state = Path(args.init_state or Path(args.init) / "trainer_state.json")
        state = json.loads(init_state.read_text())
        if args.restart_curriculum:
            # a continuation recipe (e.g. recipes/train-default-model-tasks.toml): its own phases from the
            # first, on top of the shipped weights; the step count goes on (seeds and logs stay distinct)
            state.update(phase=0, phase_s=0.0)
        state["resume_step"], state["fresh_optimizer"] = state["step"], True
        _log(f"resumed bf16 weights {args.init} at step {state['step']} (phase {state['phase']}) with a fresh optimizer state")
    model.train()

    seed = int(o["seed"]) + 1000 * state["step"]
    rng = np.random.default_rng(seed)
    maker = NeedleMaker(tok_file, stream, words, seed=seed)
    log_f = open(args.log, "a")
    if args.probe:
        probe(model, maker, stream, phases, device, rng, float(o["answer_loss_weight"]))
    step_time: dict[int, float] = {}
    last_ckpt = time.time()

    def save(final: bool) -> None:
        t0 = time.time()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "state": state}, work / "ckpt.tmp")
        os.replace(work / "ckpt.tmp", ckpt)
        if final:
            export_bf16(model, state, Path(args.export))
        _log(f"saved checkpoint (export={final}) in {time.time() - t0:.1f} s")

    while state["phase"] < len(phases):
        ph = phases[state["phase"]]
        est = step_time.get(state["phase"], 0.0)
        if time.time() + 1.3 * est + 15 > deadline:
            _log("wall-clock budget reached")
            break
        t_step = time.time()
        frac = min(1.0, state["phase_s"] / float(ph["seconds"]))
        lr = float(o["lr"]) * (ph["lr_start"] + (ph["lr_end"] - ph["lr_start"]) * frac)
        lr *= min(1.0, (state["step"] + 1) / int(o["warmup_steps"]))
        if state.get("fresh_optimizer"):
            lr *= min(1.0, (state["step"] - state["resume_step"] + 1) / int(o["rewarmup_steps"]))
        for g in opt.param_groups:
            g["lr"] = lr

        micros = ph["micro"]
        rec: dict = {"step": state["step"], "phase": ph["name"], "lr": lr}
        ntok = 0
        for m in micros:
            if m["kind"] == "lm":
                b = lm_batch(stream, int(m["batch"]), int(m["seq_len"]), rng)
            else:
                b = needle_batch(maker, m)
            st = micro_step(model, b, device, float(o["answer_loss_weight"]), 1.0 / len(micros))
            tag = f"{m['kind']}{m['seq_len']}"
            for k, v in st.items():
                rec[f"{tag}_{k}"] = v
            ntok += b.input_ids.size
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), float(o["grad_clip"]))
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec = {k: (float(v) if torch.is_tensor(v) else v) for k, v in rec.items()}  # one sync per step
        rec["grad_norm"] = float(gnorm)
        dt = time.time() - t_step
        step_time[state["phase"]] = dt if state["phase"] not in step_time else 0.8 * step_time[state["phase"]] + 0.2 * dt
        state["step"] += 1
        state["tokens"] += ntok
        state["phase_s"] += dt
        rec.update(tokens=state["tokens"], step_s=round(dt, 3), tok_per_s=round(ntok / dt), wall=round(time.time() - _T0, 1))
        if not math.isfinite(rec.get("grad_norm", 0.0)):
            raise SystemExit(f"non-finite gradient at step {state['step']}: {rec}")
        if state["phase_s"] >= float(ph["seconds"]):
            state["phase"] += 1
            state["phase_s"] = 0.0
            if eval_stream is not None:
                rec["val_loss_2k"] = val_loss(model, eval_stream, device)
            _log(f"phase {ph['name']} done at step {state['step']}")
        if state["step"] % 25 == 0 and store.refresh():
            stream = store.stream
            maker.haystack = stream
        log_f.write(json.dumps(rec) + "\n")
        if state["step"] % 10 == 0 or "val_loss_2k" in rec or state["step"] <= 3:
            log_f.flush()
            short = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()}
            _log(json.dumps(short))
        if time.time() - last_ckpt > 200:
            save(final=False)
            last_ckpt = time.time()

    if eval_stream is not None:
        v = val_loss(model, eval_stream, device)
        log_f.write(json.dumps({"step": state["step"], "final_val_loss_2k": v}) + "\n")
        _log(f"final val loss (2K, held-out Wikipedia): {v:.4f}")
    log_f.close()
    save(final=True)
    _log(f"done: step {state['step']}, phase {state['phase']}/{len(phases)}, {state['tokens'] / 1e6:.1f} M tokens")
