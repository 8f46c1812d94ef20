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
