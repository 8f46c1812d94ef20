"""Whether the GPU-relevant code of this tree is what the newest GPU smoke run ran (CPU only, no GPU needed).

    python -m tools.gpu_stamp            # exit 0: the tree's digest equals the newest stamp's; 1: it does not
    python -m tools.gpu_stamp --digest   # print the tree's digest only

A stamp is `results/published/<gpu>/smoke.json`, written by the device step `python -m tools.device smoke` on the
committed tree (tools/device/smoke.py): the commit, the figures, pass / fail per check, and `gpu_digest`, this
module's digest of the GPU-relevant sources -- every .py and .json file under `GPU_RELEVANT` (the kernels, the
dispatcher, the model and its cache session, the format specs the kernels' record plans are made from). Any change
there changes the digest, so a tree whose digest no stamp holds has GPU code no GPU has run. The rule
(docs/CONTRIBUTING.md): a change to GPU-relevant code lands with a fresh stamp, or its note says plainly that it is
unverified on a GPU.

The digest is computed from the files on disk (the device's copy of the tree has no .git), in sorted order of their
paths relative to the repository root, with '/' separators.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU_RELEVANT = ("kernels/mla_eval_kernels", "mla_eval/attention", "mla_eval/model", "mla_eval/formats")
SUFFIXES = (".py", ".json")
STAMP_GLOB = "results/published/*/smoke.json"
SCHEMA = "mla-eval/gpu-smoke/v1"


def gpu_files(root: Path = ROOT) -> list[Path]:
    """The GPU-relevant source files of the tree at `root`, sorted by their relative path."""
    out = []
    for rel in GPU_RELEVANT:
        base = root / rel
        if not base.is_dir():
            raise SystemExit(f"error: {base} is not a folder: run from a checkout of mla-eval")
        out += [p for p in base.rglob("*") if p.suffix in SUFFIXES and p.is_file() and "__pycache__" not in p.parts]
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def gpu_digest(root: Path = ROOT) -> str:
    """sha256 over (relative path, sha256 of the bytes) of every GPU-relevant file: 'sha256:<hex>'."""
    h = hashlib.sha256()
    for p in gpu_files(root):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + hashlib.sha256(p.read_bytes()).hexdigest().encode() + b"\n")
    return "sha256:" + h.hexdigest()


def stamps(root: Path = ROOT) -> list[tuple[Path, dict]]:
    """Every readable stamp under results/published, newest first (by its `created` time)."""
    found = []
    for p in root.glob(STAMP_GLOB):
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if doc.get("schema") == SCHEMA:
            found.append((p, doc))
    return sorted(found, key=lambda item: item[1].get("created", ""), reverse=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--digest", action="store_true", help="print the tree's GPU digest and exit")
    args = ap.parse_args(argv)
    digest = gpu_digest()
    if args.digest:
        print(digest)
        return 0
    found = stamps()
    if not found:
        print(f"no GPU stamp ({STAMP_GLOB}): this tree's GPU code ({digest}) has no recorded GPU run", file=sys.stderr)
        return 1
    path, doc = found[0]
    rel = path.relative_to(ROOT)
    verdict = "passed" if doc.get("passed") else "FAILED"
    if doc.get("gpu_digest") == digest:
        print(f"GPU stamp matches: {rel} ({doc.get('device')}, commit {doc.get('commit')}, {doc.get('created')}, "
              f"smoke {verdict})")
        return 0 if doc.get("passed") else 1
    print(f"GPU stamp is stale: the newest, {rel} (commit {doc.get('commit')}, {doc.get('created')}), ran GPU code "
          f"{doc.get('gpu_digest')}; this tree's is {digest}. Run `python -m tools.device smoke` on a GPU (docs/CONTRIBUTING.md) "
          "or say in the change's note that it is unverified on a GPU.", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
