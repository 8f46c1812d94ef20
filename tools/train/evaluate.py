"""bf16 quality of a trained default model: wikitext-2 perplexity and a needle-retrieval grid.

Stock Hugging Face attention (SDPA) on a bf16 model; this is the training recipe's own check, which
the project's `mla-eval needle` / `kld` commands supersede.

Perplexity: the whole test file tokenised at once; windows of `ctx` tokens every `stride`
tokens, each scoring only the tokens no earlier window scored (the first scores all), so every
token has >= ctx - stride tokens of context (the usual sliding-window protocol). Also reported:
non-overlapping windows, and bits per UTF-8 byte (tokenizer-independent).

Needles: documents built by `NeedleMaker` (same templates as training) on a haystack of held-out
Wikipedia articles (never trained on). A cell is correct when greedy decoding after the question
yields exactly the answer tokens; this is checked teacher-forced (argmax at every answer position
equals the answer token), which is equivalent to greedy decoding and needs one forward pass.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tools.train.data import NeedleMaker, read_docs, tokenize_docs
from tools.train.model_config import EOS_ID

_T0 = time.time()


def _log(msg: str) -> None:
    print(f"[eval {time.time() - _T0:6.1f}s] {msg}", flush=True)


def load_model(path: str | Path, device: torch.device, yarn_factor: float | None = None):
    """bf16 model with SDPA attention; optionally with YaRN RoPE scaling beyond the trained length."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    if yarn_factor:
        orig = int(config.max_position_embeddings)
        config.rope_parameters = {
            "rope_type": "yarn",
            "rope_theta": float(config.rope_parameters["rope_theta"]),
            "factor": float(yarn_factor),
            "original_max_position_embeddings": orig,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
        config.max_position_embeddings = int(orig * yarn_factor)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), config=config, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    return model.to(device).eval()


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, ctx: int, stride: int, batch: int = 16) -> dict:
    """Sliding-window perplexity of a 1-D id tensor; returns mean NLL (nats/token), ppl, count."""
    device = next(model.parameters()).device
    n = ids.numel()
    windows = []  # (start, end, first scored position within the window)
    prev_end = 0
    for start in range(0, n - 1, stride):
        end = min(start + ctx, n)
        windows.append((start, end, prev_end - start if start else 0))
        prev_end = end
        if end == n:
            break
    nll, count = 0.0, 0
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch]
        L = max(e - s for s, e, _ in chunk)
        x = torch.full((len(chunk), L), EOS_ID, dtype=torch.long)
        y = torch.full((len(chunk), L), -100, dtype=torch.long)
        for j, (s, e, first) in enumerate(chunk):
            x[j, : e - s] = ids[s:e]
            t = ids[s + 1 : e + 1] if e < n else torch.cat([ids[s + 1 : e], ids.new_full((1,), -100)])
            y[j, : e - s] = t
            y[j, :first] = -100  # position p predicts token s + p + 1; those up to prev_end are scored
        logits = model(input_ids=x.to(device), use_cache=False).logits.float()
        loss = F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten(), ignore_index=-100, reduction="sum")
        nll += loss.item()
        count += int((y != -100).sum())
    mean = nll / count
    return {"nll": mean, "ppl": math.exp(mean), "tokens_scored": count, "windows": len(windows)}


@torch.no_grad()
def needle_cell(model, maker: NeedleMaker, length: int, depth: float, style: str, seed: int, **kw) -> bool:
    """One needle document of `length` tokens (+1); True when greedy decoding returns the answer."""
    device = next(model.parameters()).device
    maker.rng.seed(seed)
    ids, _, spans = maker.document(length, style=style, depths=None if style != "passkey" else [depth], **kw)
    s, e = spans[-1]
    x = torch.from_numpy(ids[: e - 1]).unsqueeze(0).to(device)
    logits = model(input_ids=x, use_cache=False, logits_to_keep=e - s).logits[0]
    pred = logits.argmax(-1).cpu().numpy()
    return bool((pred == ids[s:e]).all())


def needle_grid(model, maker, lengths, depths, trials, style="passkey", deadline=1e18, seed0=0, **kw) -> dict:
    grid = []
    for L in lengths:
        for d in depths:
            ok = 0
            done = 0
            for t in range(trials):
                if time.time() > deadline:
                    break
                ok += needle_cell(model, maker, L, d, style, seed=seed0 + 7919 * L + 104729 * t + int(d * 1000), **kw)
                done += 1
            grid.append({"length": L, "depth": round(d, 3), "trials": done, "correct": ok})
        by_len = [c for c in grid if c["length"] == L]
        acc = sum(c["correct"] for c in by_len) / max(1, sum(c["trials"] for c in by_len))
        _log(f"{style} L={L}: accuracy {acc:.3f} " + " ".join(f"{c['correct']}/{c['trials']}" for c in by_len))
    by_length = {}
    for L in lengths:
        cells = [c for c in grid if c["length"] == L]
        n = sum(c["trials"] for c in cells)
        by_length[str(L)] = {"accuracy": (sum(c["correct"] for c in cells) / n) if n else None, "trials": n}
    return {"style": style, "grid": grid, "by_length": by_length}


def _stream(maker_tok_file: Path, docs: list[str]) -> np.ndarray:
    return tokenize_docs(maker_tok_file, docs, EOS_ID)


def run_eval(args) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    deadline = _T0 + float(args.budget_s)
    from transformers import AutoTokenizer

    model_dir = Path(args.model)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok_file = model_dir / "tokenizer.json"
    words = json.loads(Path(args.words).read_text())
    hay = _stream(tok_file, read_docs(Path(args.haystack_docs)))
    _log(f"held-out haystack: {len(hay) / 1e6:.2f} M tokens")
    maker = NeedleMaker(tok_file, hay, words, seed=0)
    model = load_model(model_dir, device)
    import transformers

    res: dict = {
        "schema": "mla_eval_default_model_quality_v1",
        "model": str(model_dir),
        "dtype": "bfloat16",
        "attention": "sdpa (stock transformers)",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "parameters": sum(p.numel() for p in model.parameters()),
    }

    if args.wikitext:
        text = Path(args.wikitext).read_text(encoding="utf-8")
        ids = torch.tensor(tok(text, add_special_tokens=False).input_ids, dtype=torch.long)
        n_bytes = len(text.encode("utf-8"))
        slide = perplexity(model, ids, 2048, 512)
        flat = perplexity(model, ids, 2048, 2048)
        for r in (slide, flat):
            r["bits_per_byte"] = r["nll"] * r["tokens_scored"] / math.log(2) / n_bytes
        res["wikitext2_test"] = {
            "file": "wiki.test.raw (wikitext-2-raw-v1 test, as given)",
            "tokens": ids.numel(),
            "bytes": n_bytes,
            "ctx2048_stride512": slide,
            "ctx2048_nonoverlapping": flat,
        }
        _log(f"wikitext-2 ppl (2048/512): {slide['ppl']:.2f}, non-overlapping: {flat['ppl']:.2f}")

    lengths = [int(x) for x in args.lengths.split(",") if x]
    depths = list(np.linspace(0.0, 1.0, args.depths))
    res["needle_passkey"] = needle_grid(model, maker, lengths, depths, args.trials, "passkey", deadline, intro=True, filler=False)
    res["needle_passkey"]["template"] = {
        "intro": "There is an important piece of information hidden inside a lot of irrelevant text. "
        "Find it and memorize it. I will quiz you about it later.\\n",
        "needle": " The pass key is {key}. Remember it. {key} is the pass key.",
        "question": "\\nWhat is the pass key? The pass key is",
        "answer": " {key}",
        "key": "random integer of 5-8 digits",
        "haystack": "held-out Wikipedia articles (never trained on), needle after the first sentence end at the depth",
    }
    if time.time() < deadline:
        res["needle_multikey_magic"] = needle_grid(
            model, maker, [n for n in lengths if n in (8192, 32768, 65536)], [0.5], 12, "magic", deadline, seed0=1,
            n_needles=4,
        )
        res["needle_multikey_magic"]["note"] = "4 needles (numbers, words or UUID-like values), one queried; depths random"
    if args.austen and time.time() < deadline:
        text = Path(args.austen).read_text(encoding="utf-8")
        austen = _stream(tok_file, [text])
        res["needle_passkey_austen"] = needle_grid(
            model, maker, [n for n in lengths if n in (16384, 65536)], list(np.linspace(0, 1, 5)), 2, "passkey",
            deadline, seed0=2, intro=True, filler=False, haystack=austen,
        )
    beyond = [int(x) for x in args.beyond.split(",") if x]
    if beyond and time.time() < deadline:
        d5 = list(np.linspace(0, 1, 6))
        res["needle_beyond_plain_rope"] = needle_grid(
            model, maker, beyond, d5, 2, "passkey", deadline, seed0=3, intro=True, filler=False
        )
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if time.time() < deadline:
            ymodel = load_model(model_dir, device, yarn_factor=2.0)
            res["needle_beyond_yarn2"] = needle_grid(
                ymodel, maker, beyond, d5, 2, "passkey", deadline, seed0=3, intro=True, filler=False
            )
            res["needle_beyond_yarn2"]["rope"] = dict(ymodel.config.rope_parameters)
    res["eval_seconds"] = round(time.time() - _T0, 1)
    Path(args.out).write_text(json.dumps(res, indent=1))
    _log(f"wrote {args.out}")
