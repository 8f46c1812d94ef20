"""Checkpoints in every weight format the reader accepts, written by the project's writer
(mla_eval.model.checkpoint_writer) and then corrupted one way each (issue 44): the bad-checkpoint sweep of
tests/test_bad_input.py.

Every corruption hits one quantised weight of decoder layer 1 (`TARGET`), in the shard that holds it; the stored
names are each format's public ones (mla_eval.model.weight_formats' docstring), written out here, not taken from
the reader under test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

KINDS = ("fp8-block", "ct-fp8-dynamic", "ct-fp8-block", "ct-nvfp4", "modelopt-nvfp4")
TARGET = "model.layers.1.self_attn.kv_a_proj_with_mqa"  # quantised in every kind; 576 rows: a partial 128-row block
SCALE = {"fp8-block": "weight_scale_inv", "ct-fp8-dynamic": "weight_scale", "ct-fp8-block": "weight_scale",
         "ct-nvfp4": "weight_scale", "modelopt-nvfp4": "weight_scale"}
GLOBAL = {"ct-nvfp4": "weight_global_scale", "modelopt-nvfp4": "weight_scale_2"}
INDEX = "model.safetensors.index.json"


def _edit(folder: Path, name: str, change) -> None:
    """Rewrite the shard holding `name` with change(tensor) in its place (None: the tensor removed, index too)."""
    index = json.loads((folder / INDEX).read_text())
    shard = folder / index["weight_map"][name]
    tensors = load_file(str(shard))
    new = change(tensors[name])
    if new is None:
        del tensors[name]
        del index["weight_map"][name]
        (folder / INDEX).write_text(json.dumps(index))
    else:
        tensors[name] = new.contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _set_first(value: float):
    def change(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.float8_e4m3fn:  # only NaN: E4M3fn has no infinity, its NaN is S.1111.111
            assert value != value
            bits = t.view(torch.uint8).clone()
            bits.view(-1)[0] = 0x7F
            return bits.view(torch.float8_e4m3fn)
        out = t.clone()
        out.view(-1)[0] = value
        return out
    return change


def _negate_first(t: torch.Tensor) -> torch.Tensor:
    out = t.float().clone()
    out.view(-1)[0] = -abs(float(out.view(-1)[0])) or -1.0
    return out.to(t.dtype)


def _wrong_dtype(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)  # the same bytes, labelled U8
    if t.dtype == torch.float32:
        return t.half()
    return t.float().to(torch.int32)


# corruption -> (kinds it applies to, what it does to a copy of the kind's checkpoint)
def _scale(kind: str) -> str:
    return f"{TARGET}.{SCALE[kind]}"


def _global(kind: str) -> str:
    return f"{TARGET}.{GLOBAL[kind]}"


CORRUPTIONS = {
    "scale missing": (KINDS, lambda f, k: _edit(f, _scale(k), lambda t: None)),
    "global scale missing": (tuple(GLOBAL), lambda f, k: _edit(f, _global(k), lambda t: None)),
    "scale shape": (KINDS, lambda f, k: _edit(f, _scale(k), lambda t: t[:-1])),
    "scale dtype": (KINDS, lambda f, k: _edit(f, _scale(k), _wrong_dtype)),
    "scale NaN": (KINDS, lambda f, k: _edit(f, _scale(k), _set_first(float("nan")))),
    "scale infinite": (("fp8-block", "ct-fp8-dynamic", "ct-fp8-block"),  # E4M3 scales have no infinity
                       lambda f, k: _edit(f, _scale(k), _set_first(float("inf")))),
    "scale negative": (KINDS, lambda f, k: _edit(f, _scale(k), _negate_first)),
    "scale all zero": (KINDS, lambda f, k: _edit(f, _scale(k), torch.zeros_like)),
    "global scale NaN": (tuple(GLOBAL), lambda f, k: _edit(f, _global(k), _set_first(float("nan")))),
    "global scale zero": (tuple(GLOBAL), lambda f, k: _edit(f, _global(k), torch.zeros_like)),
    "config without quantization_config": (KINDS, lambda f, k: _drop_quantisation_config(f)),
}
# what the error line must name for each corruption (beside 'error: ')
NAMES_SHARD = {c for c in CORRUPTIONS if c != "config without quantization_config"}


def _drop_quantisation_config(folder: Path) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["quantization_config"]
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "hf_quant_config.json").unlink(missing_ok=True)  # ModelOpt says it there too


def corrupted(written: Path, kind: str, corruption: str, dst: Path) -> Path:
    """A copy of `written` (a `kind` checkpoint from the writer) with `corruption` applied."""
    kinds, apply = CORRUPTIONS[corruption]
    if kind not in kinds:
        raise ValueError(f"{corruption} does not apply to {kind}")
    shutil.copytree(written, dst)
    apply(dst, kind)
    return dst


def with_foreign_config(bf16: Path, kind: str, dst: Path) -> Path:
    """Unquantised (bf16) shards under a config declaring `kind`'s quantisation: the reverse mislabelling."""
    from mla_eval.model.checkpoint_writer import quantization_config

    shutil.copytree(bf16, dst)
    qc, hf_quant = quantization_config(kind)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    if hf_quant is not None:
        (dst / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return dst


def cases() -> list[tuple[str, str]]:
    """(kind, corruption) of the sweep: every corruption on every kind it applies to, and the reverse mislabelling."""
    out = [(k, c) for c, (kinds, _) in CORRUPTIONS.items() for k in kinds]
    return out + [(k, "config over unquantised shards") for k in KINDS]


PATHS = {"resident": ["--offload", "none"], "stream": ["--offload", "stream"], "dry-run": ["--dry-run"]}


def sweep(root: Path) -> dict[str, int]:
    """Every case of `cases()` on every path, in this process, tallied: 'refused' (exit 2, one `error:` line),
    'silent' (exit 0: a figure or plan from a corrupted checkpoint), 'traceback' (an exception escaped the CLI),
    'other' (any other exit or output). Prints one line per case that was not refused."""
    import contextlib
    import io
    import traceback

    from test_checkpoint import TOKENIZER, small_config

    from mla_eval.cli import main
    from mla_eval.model.checkpoint_writer import write_random_checkpoint

    written = {k: write_random_checkpoint(root / "written" / k, small_config("deepseek_v3", vocab=12288, layers=2), k,
                                          tokenizer_from=TOKENIZER).path for k in ("bf16", *KINDS)}
    text = root / "text.txt"
    text.write_text(" ".join(f"The river {w} flows past the old mill." for w in ["north", "south", "east", "west"] * 30))
    tally = {"refused": 0, "silent": 0, "traceback": 0, "other": 0}
    for kind, corruption in cases():
        folder = root / "bad" / f"{kind}-{corruption.replace(' ', '-')}"
        if corruption == "config over unquantised shards":
            with_foreign_config(written["bf16"], kind, folder)
        else:
            corrupted(written[kind], kind, corruption, folder)
        for path, extra in PATHS.items():
            out = root / "out" / f"{folder.name}-{path}.json"
            argv = ["kld", "--model", str(folder), "--text", str(text), "--formats", "nvfp4", "--scales", "none",
                    "--ctx", "64", "--max-tokens", "128", "--no-layer-stats", "--device", "cpu", "--out", str(out), *extra]
            err, stdout = io.StringIO(), io.StringIO()
            try:
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(stdout):
                    code = main(argv)
            except BaseException:  # noqa: BLE001 - a traceback is what the sweep counts
                code, outcome = None, "traceback"
                err.write(traceback.format_exc())
            lines = err.getvalue().strip().splitlines()
            if code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and not out.exists():
                outcome = "refused"
            elif code == 0:
                outcome = "silent"
            elif code is not None:
                outcome = "other"
            tally[outcome] += 1
            if outcome != "refused":
                print(f"{outcome}: {kind} | {corruption} | {path}: exit {code}: {err.getvalue()[-300:]!r}")
    return tally


if __name__ == "__main__":  # python tests/corrupt_checkpoints.py: a fresh sweep, tallied
    import sys
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent))
    with tempfile.TemporaryDirectory() as tmp:
        tally = sweep(Path(tmp))
    total = sum(tally.values())
    print(f"{total} runs ({len(cases())} corrupted checkpoints x {len(PATHS)} paths): " +
          ", ".join(f"{v} {k}" for k, v in tally.items()))
    sys.exit(0 if tally["refused"] == total else 1)
