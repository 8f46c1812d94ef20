"""`python -m tools.train {prepare,train,eval,export}`: the default model's recipe commands.

prepare  (CPU) Wikipedia archives -> xz text shards + held-out eval documents + word pool, and the
         byte-level BPE tokenizer written next to the shipped weights.
train    (GPU) resumable training under a wall-clock budget; optional evaluation at the end.
eval     (GPU or CPU) wikitext-2 perplexity and the needle grid of a saved model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tools.train.recipe import load_recipe


def _prepare(args: argparse.Namespace) -> None:
    from tools.train.data import prepare_text, read_docs, train_tokenizer, word_pool

    recipe = load_recipe(args.recipe)
    d = recipe["data"]
    out = Path(args.out)
    t0 = time.time()
    manifest = prepare_text(
        Path(args.wiki), out, shard_chars=int(d["shard_chars"]), eval_docs=int(d["eval_docs"]), seed=int(d["seed"])
    )
    print(f"shards: {len(manifest['shards'])}, docs {manifest['documents']}, dropped {manifest['dropped_titles']}"
          f" ({time.time() - t0:.0f} s)", flush=True)
    sample = []
    chars = 0
    for s in manifest["shards"]:
        docs = read_docs(out / s["file"])
        sample += docs
        chars += sum(map(len, docs))
        if chars >= int(recipe["tokenizer"]["sample_chars"]):
            break
    (out / "words.json").write_text(json.dumps(word_pool(sample)))
    t0 = time.time()
    train_tokenizer(sample, int(recipe["tokenizer"]["vocab_size"]), Path(args.tokenizer_out))
    print(f"tokenizer trained on {chars / 1e6:.0f} M chars in {time.time() - t0:.0f} s", flush=True)


def _train(args: argparse.Namespace) -> None:
    from tools.train.trainer import train

    train(args)


def _eval(args: argparse.Namespace) -> None:
    from tools.train.evaluate import run_eval

    run_eval(args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.train")
    sub = p.add_subparsers(dest="cmd", required=True)

    pp = sub.add_parser("prepare", help="build text shards and the tokenizer (CPU)")
    pp.add_argument("--recipe", default="recipes/train-default-model.toml")
    pp.add_argument("--wiki", default="../shared/data/wikipedia")
    pp.add_argument("--out", default=".train_data/text")
    pp.add_argument("--tokenizer-out", default="mla_eval/default_model")
    pp.set_defaults(fn=_prepare)

    pt = sub.add_parser("train", help="train under a wall-clock budget, resuming if possible")
    pt.add_argument("--recipe", default="recipes/train-default-model.toml")
    pt.add_argument("--data", nargs="+", required=True, help="folders holding train_NN.txt.xz shards")
    pt.add_argument("--words", required=True, help="words.json from prepare")
    pt.add_argument("--tokenizer", default="mla_eval/default_model")
    pt.add_argument("--work", default="/tmp/mla_train", help="checkpoint and token cache folder")
    pt.add_argument("--init", default=None, help="folder with model.safetensors + trainer_state.json to resume from")
    pt.add_argument("--budget-s", type=float, required=True, help="wall-clock seconds for this process")
    pt.add_argument("--export", required=True, help="folder for the bf16 export (config, weights, state)")
    pt.add_argument("--log", required=True, help="JSON-lines training log (appended)")
    pt.add_argument("--init-state", default=None, help="trainer_state.json for --init (default: the one in --init)")
    pt.add_argument("--restart-curriculum", action="store_true",
                    help="with --init: run the recipe's phases from the first (a continuation recipe)")
    pt.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, short phases")
    pt.add_argument("--probe", action="store_true", help="first time one step of every micro-batch shape")
    pt.set_defaults(fn=_train)

    pe = sub.add_parser("eval", help="wikitext-2 perplexity and needle grid of a saved model")
    pe.add_argument("--model", required=True)
    pe.add_argument("--wikitext", default=None)
    pe.add_argument("--haystack-docs", required=True, help="eval_docs.txt.xz (held-out Wikipedia)")
    pe.add_argument("--austen", default=None, help="optional second haystack (plain text)")
    pe.add_argument("--words", required=True)
    pe.add_argument("--out", required=True, help="results JSON path")
    pe.add_argument("--lengths", default="4096,8192,16384,32768,65536")
    pe.add_argument("--beyond", default="98304,131072")
    pe.add_argument("--depths", type=int, default=11)
    pe.add_argument("--trials", type=int, default=4)
    pe.add_argument("--budget-s", type=float, default=1e9, help="skip remaining grid cells past this")
    pe.set_defaults(fn=_eval)

    args = p.parse_args(argv)
    args.fn(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
