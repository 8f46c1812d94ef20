"""Is a checkpoint what its config says, and are its quantised weights whole? The one place every path checks it.

A corrupted or mislabelled checkpoint must never be scored: a weight read without its scale (FP8 codes taken as
values), a config that does not describe its shards, or a scale no quantiser writes (NaN, infinite, negative, zero)
gives figures that look like any others. Two checks, each called from one place of the reader
(mla_eval.model.checkpoint), which every path goes through -- resident, streamed (`--offload stream`) and the dry run
(`Checkpoint.open` for the headers, `Checkpoint.materialise` for the values):

- `check_stored(ckpt)`, when the headers are read (no tensor data): the config's weight format against the tensors
  the index and headers name. A checkpoint whose config declares no quantisation may hold no quantised tensor (no
  scale companion by name, no FP8 / packed-FP4 weight by dtype); one that declares a quantisation must hold
  quantised weights. Every quantised weight has all its companions (a weight stored in a quantised dtype without
  its scale is refused, not read as values), in the format's dtypes and in the shapes its block or group size
  gives (module docstring of mla_eval.model.weight_formats). Dtypes and shapes need the shard headers: in a
  folder without its shards (planning a download) only the names are checked.
- `check_scale_values(...)`, when a weight is read for materialising: every scale is finite and positive (what
  DeepSeek's `weight_quant`, llm-compressor and ModelOpt write: amax / 448 or amax / (6 * 448), clamped away from
  zero), the NVFP4 E4M3 group scales finite and non-negative, zero only for a group whose codes are all zero (the
  one case a quantiser writes a zero scale for).

Each error is one line naming the shard file, the tensor and what is wrong.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping

import torch

from mla_eval.errors import UserError
from mla_eval.model.weight_formats import _SUFFIXES, NVFP4_GROUP, QuantisedWeight, WeightFormat

# safetensors dtypes a weight has only when it is quantised (codes): read as values, they are wrong numbers
QUANTISED_DTYPES = ("F8_E4M3", "F8_E5M2", "U8", "I8")
_FLOAT_SCALES = ("F32", "BF16", "F16")
# what each scheme stores: codes dtype, {role: allowed dtypes}
_DTYPES = {
    "fp8-block": ("F8_E4M3", {"scale": ("F32",)}),
    "ct-fp8": ("F8_E4M3", {"scale": _FLOAT_SCALES}),
    "ct-nvfp4": ("U8", {"scale": ("F8_E4M3",), "global": ("F32",)}),
    "modelopt-nvfp4": ("U8", {"scale": ("F8_E4M3",), "global": ("F32",)}),
}
# every companion name a quantised weight may have, across schemes, and the codes names other than `weight` (a
# config without quantisation has none of them)
_COMPANIONS = sorted({suffix for parts in _SUFFIXES.values() for suffix in parts.values() if suffix != "weight"})
_WEIGHT_LEAVES = ("weight", "weight_packed")  # what a (quantised or plain) Linear weight is called
_FIX_DAMAGED = "the shard is damaged or was written wrongly: download it again"


def _where(ckpt, name: str) -> str:
    info = ckpt.tensors.get(name)
    return str(Path(ckpt.path) / info.shard) if info is not None else str(ckpt.path)


def _config_name(fmt: WeightFormat) -> str:
    return f"{fmt.source}" if fmt.method != "none" else "config.json (no quantization_config)"


# --------------------------------------------------------------------------------------------- at header time


def check_stored(ckpt) -> None:
    """The checkpoint's tensors against its weight format (see the module docstring); a one-line UserError naming
    the shard, the tensor and what is wrong. `ckpt`: a `Checkpoint` (its path, format, tensors and quantised
    weights)."""
    fmt: WeightFormat = ckpt.format
    if fmt.method == "none":
        _no_quantised_tensors(ckpt)
        return
    if not ckpt.quantised:
        companions = sorted({s for scheme in fmt.schemes for r, s in _SUFFIXES[scheme].items() if r != "codes"})
        raise UserError(f"{ckpt.path}: {_config_name(fmt)} declares {fmt.method} weights, but no weight has its "
                        f"{' / '.join(companions)} beside it: the shards are not quantised as the config says; give the "
                        "config.json that came with these shards")
    _orphan_parts(ckpt)
    _unscaled_codes(ckpt)
    for q in ckpt.quantised.values():
        _check_parts(ckpt, fmt, q)


def _no_quantised_tensors(ckpt) -> None:
    """A config without quantization_config over shards that hold quantised weights: every path refuses it."""
    for name in sorted(ckpt.tensors):
        info = ckpt.tensors[name]
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _COMPANIONS or (leaf == "weight" and info.dtype in QUANTISED_DTYPES):
            what = f"the quantisation companion {name}" if leaf in _COMPANIONS else f"{name} as {info.dtype} codes"
            raise UserError(f"{_where(ckpt, name)} holds {what}, but {ckpt.path}/config.json has no quantization_config: "
                            "read as plain values these weights would be wrong; restore the config.json (with its "
                            "quantization_config) that came with these shards")


def _orphan_parts(ckpt) -> None:
    """A companion whose weight has not all its parts (e.g. ModelOpt's weight_scale without weight_scale_2)."""
    used = {part for q in ckpt.quantised.values() for part in q.parts.values()}
    for scheme in ckpt.format.schemes:
        suffixes = _SUFFIXES[scheme]
        for role, suffix in suffixes.items():
            if role == "codes":
                continue
            for name in sorted(n for n in ckpt.tensors if n.endswith("." + suffix) and n not in used):
                base = name[: -len(suffix) - 1]
                if f"{base}.weight" in ckpt.quantised:  # a part of another scheme's weight (ct: fp8 and nvfp4 share
                    continue  # the weight_scale suffix)
                missing = [f"{base}.{s}" for s in suffixes.values() if f"{base}.{s}" not in ckpt.tensors]
                if not missing:
                    continue
                raise UserError(f"{_where(ckpt, name)} holds {name}, but {', '.join(missing)} "
                                f"{'is' if len(missing) == 1 else 'are'} in no shard: the quantised weight {base} is "
                                f"incomplete ({ckpt.format.method}, {scheme}); {_FIX_DAMAGED}")


def _unscaled_codes(ckpt) -> None:
    """A weight stored in a quantised dtype that is not part of a quantised weight: its scale is missing."""
    parts = {part for q in ckpt.quantised.values() for part in q.parts.values()}
    for name in sorted(ckpt.tensors):
        info = ckpt.tensors[name]
        leaf = name.rsplit(".", 1)[-1]
        if name in parts or info.dtype not in QUANTISED_DTYPES or leaf not in _WEIGHT_LEAVES:
            continue
        base = name[: -len(leaf) - 1]
        wanted = []
        for scheme in ckpt.format.schemes:
            if name == f"{base}.{_SUFFIXES[scheme]['codes']}" and info.dtype == _DTYPES[scheme][0]:
                wanted = [f"{base}.{s}" for r, s in _SUFFIXES[scheme].items() if r != "codes"]
                break
        missing = [w for w in wanted if w not in ckpt.tensors] or [f"{base}.<scale>"]
        raise UserError(f"{_where(ckpt, name)}: {name} is stored as {info.dtype} (quantised codes) but "
                        f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} in no shard: without its scale the "
                        f"weight would be read as raw codes; {_FIX_DAMAGED}")


def expected_shapes(fmt: WeightFormat, q: QuantisedWeight, codes: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], ...]]:
    """role -> the shapes the format allows for it, given the stored codes' shape [out, in] (NVFP4: [out, in/2])."""
    out, inn = codes
    one = ((), (1,), (1, 1))
    if q.scheme == "fp8-block":
        bm, bn = fmt.block_size or (128, 128)
        return {"scale": ((math.ceil(out / bm), math.ceil(inn / bn)),)}
    if q.scheme == "ct-fp8":
        shapes = [*one, (out, 1)]
        if fmt.block_size:
            shapes.append((math.ceil(out / fmt.block_size[0]), math.ceil(inn / fmt.block_size[1])))
        return {"scale": tuple(shapes)}
    group = fmt.group_size or NVFP4_GROUP
    return {"scale": ((out, inn * 2 // group),), "global": one}


def _check_parts(ckpt, fmt: WeightFormat, q: QuantisedWeight) -> None:
    """One quantised weight's parts: dtypes and shapes, where the headers were read."""
    infos = {role: ckpt.tensors[name] for role, name in q.parts.items()}
    codes = infos["codes"]
    want_codes, want = _DTYPES[q.scheme]
    if codes.dtype is not None and codes.dtype != want_codes:
        raise UserError(f"{_where(ckpt, codes.name)}: {codes.name} is stored as {codes.dtype}; {fmt.method} ({q.scheme}) "
                        f"stores its codes as {want_codes}; {_FIX_DAMAGED}")
    for role, allowed in want.items():
        info = infos[role]
        if info.dtype is not None and info.dtype not in allowed:
            raise UserError(f"{_where(ckpt, info.name)}: {info.name} is stored as {info.dtype}; {fmt.method} ({q.scheme}) "
                            f"stores it as {' or '.join(allowed)}; {_FIX_DAMAGED}")
    if codes.shape is None:
        return
    if len(codes.shape) != 2:
        raise UserError(f"{_where(ckpt, codes.name)}: quantised weight {codes.name} has shape {list(codes.shape)}, not "
                        f"[out, in]; {_FIX_DAMAGED}")
    if q.scheme in ("ct-nvfp4", "modelopt-nvfp4") and (codes.shape[1] * 2) % (fmt.group_size or NVFP4_GROUP):
        raise UserError(f"{_where(ckpt, codes.name)}: {codes.name} holds {codes.shape[1] * 2} values per row, not a "
                        f"multiple of the NVFP4 group of {fmt.group_size or NVFP4_GROUP}; {_FIX_DAMAGED}")
    for role, shapes in expected_shapes(fmt, q, codes.shape).items():
        info = infos[role]
        if info.shape is not None and tuple(info.shape) not in shapes:
            said = " or ".join(str(list(s)) for s in shapes)
            raise UserError(f"{_where(ckpt, info.name)}: {info.name} has shape {list(info.shape)}; a {list(codes.shape)} "
                            f"{codes.dtype} weight in {fmt.method} ({q.scheme}{_layout(fmt, q)}) needs {said}; "
                            f"{_FIX_DAMAGED}")


def _layout(fmt: WeightFormat, q: QuantisedWeight) -> str:
    if q.scheme == "fp8-block" or (q.scheme == "ct-fp8" and fmt.block_size):
        bm, bn = fmt.block_size or (128, 128)
        return f", {bm}x{bn} blocks"
    if q.scheme in ("ct-nvfp4", "modelopt-nvfp4"):
        return f", groups of {fmt.group_size or NVFP4_GROUP}"
    return ""


# --------------------------------------------------------------------------------------------- at load time


def check_scale_values(ckpt, q: QuantisedWeight, raw: Mapping[str, torch.Tensor]) -> None:
    """The scales of quantised weight `q` as read (`raw`: its stored tensors): finite and > 0 (NVFP4 group scales:
    finite, >= 0, zero only over a group whose codes are all zero). One-line UserError naming the shard, the tensor
    and the first bad value."""
    for role, name in q.parts.items():
        if role == "codes":
            continue
        t = raw[name]
        if t.dtype == torch.float8_e4m3fn:  # E4M3 group scales, checked on their bits (no float copy of a large tensor)
            _check_e4m3_scales(ckpt, name, t, raw[q.parts["codes"]])
            continue
        x = t.float()
        bad = ~torch.isfinite(x) | (x <= 0)
        if bool(bad.any()):
            _refuse(ckpt, name, x, bad, "finite and > 0")


def _check_e4m3_scales(ckpt, name: str, scale: torch.Tensor, packed: torch.Tensor) -> None:
    bits = scale.view(torch.uint8)
    magnitude = bits & 0x7F
    nan = magnitude == 0x7F  # E4M3fn has no infinity: S.1111.111 is its NaN
    negative = (bits & 0x80).bool() & (magnitude != 0)
    bad = nan | negative
    if bool(bad.any()):
        _refuse(ckpt, name, scale.float(), bad, "finite and >= 0")
    zero = magnitude == 0
    if bool(zero.any()) and packed.dim() == 2 and packed.shape[0] == scale.shape[0]:
        rows, groups = scale.shape
        per_group = packed.shape[1] // groups  # bytes per group (two codes a byte)
        if per_group * groups == packed.shape[1]:
            rows_with_zero = zero.any(dim=1).nonzero().flatten()
            codes = packed[rows_with_zero].view(len(rows_with_zero), groups, per_group)
            nonzero = ((codes & 0x77) != 0).any(dim=-1)  # any E2M1 code of the group with a magnitude
            wrong = torch.zeros_like(zero)
            wrong[rows_with_zero] = zero[rows_with_zero] & nonzero
            if bool(wrong.any()):
                _refuse(ckpt, name, scale.float(), wrong, "> 0 wherever its group of codes is not all zero")


def _refuse(ckpt, name: str, values: torch.Tensor, bad: torch.Tensor, rule: str) -> None:
    n = int(bad.sum())
    at = tuple(int(i) for i in bad.nonzero()[0]) if values.dim() else ()
    first = values[at] if at else values.reshape(-1)[0]
    where = f"[{', '.join(map(str, at))}]" if at else ""
    raise UserError(f"{_where(ckpt, name)}: {name} holds {n} of {values.numel()} scale values that no quantiser writes "
                    f"(first {name.rsplit('.', 1)[-1]}{where} = {float(first):g}; scales are {rule}); {_FIX_DAMAGED}")
