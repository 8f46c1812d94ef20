"""Build the long-document text of the long-context KLD runs (issue 17), never committed.

The default model's own held-out Wikipedia articles: the 400 articles that
`tools.train.data.prepare_text` sets aside (recipe seed 1234, eval_docs 400: the same shuffle of
the same archives, so the model never trained on them), concatenated in that held-out order with a
blank line between articles until the output holds `--tokens` tokens. A window of 64K therefore spans
many articles: depth is distance in tokens, not within one article.

    python -m tools.make_wiki_long --wiki ../shared/data/wikipedia --out .devdata/wiki-long.txt

Prints the one-line description that the kld runs record (--text-note) and writes it next to the
text (`<out>.note`, e.g. .devdata/wiki-long.txt.note) for `python -m tools.device long`.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from tools.train.data import HELD_OUT_TITLES, read_archive

SEED, EVAL_DOCS = 1234, 400  # recipes/train-default-model.toml [text]


def held_out_articles(wiki: Path) -> list[str]:
    docs = []
    for archive in sorted(wiki.glob("wiki_*.tar.zst")):
        docs += [text for title, text in read_archive(archive) if title not in HELD_OUT_TITLES and len(text) >= 200]
    random.Random(SEED).shuffle(docs)
    return docs[:EVAL_DOCS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wiki", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=400_000)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from mla_eval.model_home import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    parts, n, used = [], 0, 0
    for text in held_out_articles(a.wiki):
        parts.append(text)
        n += len(tok(text + "\n\n", add_special_tokens=False)["input_ids"])
        used += 1
        if n >= a.tokens:
            break
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n\n".join(parts) + "\n", encoding="utf-8")
    note = (f"{used} held-out Wikipedia articles of the default model (train seed {SEED}, never trained on), "
            f"concatenated in held-out order with blank lines, about {n} tokens (tools/make_wiki_long.py)")
    Path(str(a.out) + ".note").write_text(note + "\n", encoding="utf-8")
    print(note)


if __name__ == "__main__":
    main()
