"""The on-disk weight formats of real MLA checkpoints, and their exact dequantisation.

A checkpoint's weights are either stored as they are used (bf16 / fp16 / fp32) or quantised; which
quantisation is read from the checkpoint's config.json `quantization_config` (or ModelOpt's
hf_quant_config.json). Which tensors are quantised is decided by the tensors themselves: a Linear
weight is quantised exactly when its companion scale tensors are stored next to it, so a folder
holding only config.json and the safetensors index already tells (the index names every tensor).
Everything else (embeddings, lm_head, norms, the MoE router gate, the DSA indexer's weights_proj and
k_norm, and whatever a format's ignore list names) is stored unquantised and is read as stored.

Formats (one `WeightFormat` per checkpoint; `describe_quantisation` gives the record a result keeps):

- "none": no quantization_config; tensors are read and cast to the model dtype.
- "fp8" (DeepSeek-V3/V3.2/R1, Kimi-K2, GLM-5 FP8; transformers' FineGrainedFP8): `X.weight`
  float8_e4m3fn [out, in] + `X.weight_scale_inv` float32 [ceil(out/bm), ceil(in/bn)] with
  `weight_block_size` [bm, bn] (128 x 128). W[i, j] = fp32(code[i, j]) * scale_inv[i // bm, j // bn];
  the last block row/column may be partial (kv_a_proj_with_mqa has 576 rows: 5 block rows, the last
  of 64). Arithmetic as DeepSeek's `weight_dequant` (deepseek-ai/DeepSeek-V3 inference/kernel.py,
  commit 06231633430c449a1f6a8c0b5a1d6f99860b8eb2: fp32 product, masked partial blocks, stored in the
  default dtype) and transformers' `Fp8Dequantize` (fp32 product, then the model dtype).
- "compressed-tensors", format "float-quantized" (llm-compressor FP8_DYNAMIC / FP8 / FP8_BLOCK):
  `X.weight` float8_e4m3fn + `X.weight_scale` (channel: [out, 1]; tensor: [1]; block: the ceil grid
  of `block_structure`), optional static `X.input_scale` (activations: not used, weights only).
  W = fp32(code) * fp32(scale). compressed-tensors' own `dequantize` multiplies in the scale's dtype:
  for a bf16 model the two agree bit for bit (an fp8 x bf16 product is exact in fp32, so both round
  once); for an fp32 model with bf16 scales ours keeps the exact product where it rounds to bf16.
- "compressed-tensors", format "nvfp4-pack-quantized" (NVFP4 / NVFP4A16): `X.weight_packed` uint8
  [out, in/2] (two E2M1 codes per byte, element 2k in the low nibble), `X.weight_scale` float8_e4m3fn
  [out, in/16], `X.weight_global_scale` float32 [1], optional `X.input_global_scale`.
  W = e2m1 * (fp32(scale) / global_scale), in fp32 (compressed-tensors NVFP4PackedCompressor.decompress).
- "modelopt" NVFP4 / W4A16_NVFP4 (NVIDIA Model Optimizer's unified HF export): `X.weight` uint8
  [out, in/2] (element 2k in the low nibble, 2k+1 in the high one), `X.weight_scale` float8_e4m3fn
  [out, in/16], `X.weight_scale_2` float32 scalar (amax / (6 * 448)), `X.input_scale` float32 scalar
  (activations: not used). W = e2m1 * (fp32(weight_scale) * weight_scale_2) in fp32, then the model
  dtype: NVIDIA/Model-Optimizer modelopt/torch/quantization/qtensor/nvfp4_tensor.py
  (`NVFP4QTensor.quantize` packs `(q[..., 1::2] << 4) | q[..., 0::2]`; `dequantize` multiplies the
  E2M1 values by `scale.float() * double_scale`), commit 211c6b3413c52b2fd7a671eda3ce8b2139a4fedd.
  Markers (modelopt/torch/export/unified_export_hf.py `_write_hf_export_config` and
  convert_hf_config.py, commit a2fbac7bad8ab446d3f8783dadb0c3366eb0ad73): hf_quant_config.json
  `{"producer": {"name": "modelopt", ...}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
  "exclude_modules": [...], "kv_cache_quant_algo": ...}}`, and in config.json `quantization_config`
  `{"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": [...], "config_groups": ..., ...}`.

Hopper has no FP4 (and we want the model dtype's arithmetic everywhere): every quantised weight is
dequantised once, when its layer is materialised (mla_eval.model.checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Mapping

import torch

from mla_eval.errors import UserError

SUPPORTED_METHODS = (
    "none (bf16/fp16/fp32)",
    "fp8 (128x128 block, DeepSeek/Kimi/GLM)",
    "compressed-tensors (float-quantized FP8 channel/tensor/block, nvfp4-pack-quantized)",
    "modelopt (NVFP4, W4A16_NVFP4)",
)

# E2M1 value of each 4-bit code: bit 3 the sign, bits 0-2 the magnitude (OCP MX spec; the same table in
# ModelOpt's nvfp4_tensor.py and compressed-tensors' kE2M1ToFloat).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
NVFP4_GROUP = 16
_E2M1_TABLES: dict[torch.device, torch.Tensor] = {}

# fp32 elements dequantised at once while filling a destination (bounds the temporary on the GPU)
_CHUNK_ELEMENTS = 1 << 26

# role of a stored tensor next to its weight -> the suffix it has (`X.<suffix>`), per scheme
_SUFFIXES = {
    "fp8-block": {"codes": "weight", "scale": "weight_scale_inv"},
    "ct-fp8": {"codes": "weight", "scale": "weight_scale"},
    "ct-nvfp4": {"codes": "weight_packed", "scale": "weight_scale", "global": "weight_global_scale"},
    "modelopt-nvfp4": {"codes": "weight", "scale": "weight_scale", "global": "weight_scale_2"},
}
# activation and KV-cache scales quantised formats may store (ModelOpt / compressed-tensors `k_scale`, `v_scale`
# with a kv_cache scheme): they say how a server quantises activations and its own cache; weights-only
# dequantisation does not use them, and our cache formats are what is evaluated (counted in describe(), never read)
_ACTIVATION_SUFFIXES = ("input_scale", "input_global_scale", "activation_scale", "k_scale", "v_scale")


@dataclasses.dataclass(frozen=True)
class QuantisedWeight:
    """One quantised Linear weight: `base` is the module path (`model.layers.3.mlp.experts.7.up_proj`);
    `parts` maps role ("codes", "scale", "global") -> the stored tensor's full name."""

    base: str
    scheme: str  # a key of _SUFFIXES
    parts: Mapping[str, str]

    @property
    def weight_name(self) -> str:
        return f"{self.base}.weight"


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How a checkpoint stores its weights (read from its config, see the module docstring)."""

    method: str  # "none" | "fp8" | "compressed-tensors" | "modelopt"
    source: str  # where the quantisation config was read
    block_size: tuple[int, int] | None = None  # fp8: weight_block_size; compressed-tensors block strategy
    group_size: int | None = None  # NVFP4: values per E4M3 scale
    algo: str | None = None  # modelopt quant_algo / compressed-tensors format
    ignore: tuple[str, ...] = ()  # modules the config says stay unquantised (recorded, and cross-checked)
    config: Mapping | None = None  # the quantisation config as read (recorded)

    @property
    def schemes(self) -> tuple[str, ...]:
        """The per-tensor schemes this format may store (the companions that mark a weight quantised)."""
        return {"none": (), "fp8": ("fp8-block",), "compressed-tensors": ("ct-nvfp4", "ct-fp8"),
                "modelopt": ("modelopt-nvfp4",)}[self.method]

    def group(self, names) -> tuple[dict[str, QuantisedWeight], set[str], set[str]]:
        """Split stored tensor names into (quantised weights by weight name, plain tensors, activation
        scales). A weight counts as quantised when all its scheme's companions are stored."""
        names = set(names)
        quantised: dict[str, QuantisedWeight] = {}
        used: set[str] = set()
        for scheme in self.schemes:
            suffixes = _SUFFIXES[scheme]
            scale_suffix = "." + suffixes["scale"]
            for name in names:
                if not name.endswith(scale_suffix):
                    continue
                base = name[: -len(scale_suffix)]
                parts = {role: f"{base}.{suffix}" for role, suffix in suffixes.items()}
                if f"{base}.weight" in quantised or not all(p in names and p not in used for p in parts.values()):
                    continue
                quantised[f"{base}.weight"] = QuantisedWeight(base, scheme, parts)
                used.update(parts.values())
        activation = {n for n in names - used if n.rsplit(".", 1)[-1] in _ACTIVATION_SUFFIXES} if self.method != "none" else set()
        return quantised, names - used - activation, activation

    def dequantise_into(self, dst: torch.Tensor, q: QuantisedWeight, raw: Mapping[str, torch.Tensor]) -> None:
        """Write the dequantised weight `q` (its stored parts in `raw`, any device) into `dst` (the
        weight's shape, or a view of a fused parameter), on dst's device, in dst's dtype."""
        codes = raw[q.parts["codes"]].to(dst.device, non_blocking=True)
        scale = raw[q.parts["scale"]].to(dst.device, non_blocking=True)
        glob = raw[q.parts["global"]].to(dst.device, non_blocking=True) if "global" in q.parts else None
        if q.scheme == "fp8-block":
            block = self.block_size or (128, 128)
            _fill(dst, lambda r0, r1: fp8_block_dequant(codes[r0:r1], _rows(scale, r0, r1, block[0]), block,
                                                       dst.dtype, row0=r0), align=block[0])
        elif q.scheme == "ct-fp8":
            _ct_fp8(dst, codes, scale, self.block_size)
        elif q.scheme == "ct-nvfp4":
            gs = self.group_size or NVFP4_GROUP
            _fill(dst, lambda r0, r1: nvfp4_dequant(codes[r0:r1], scale[r0:r1], glob, gs, dst.dtype, global_divides=True))
        elif q.scheme == "modelopt-nvfp4":
            gs = self.group_size or NVFP4_GROUP
            _fill(dst, lambda r0, r1: nvfp4_dequant(codes[r0:r1], scale[r0:r1], glob, gs, dst.dtype, global_divides=False))
        else:  # pragma: no cover - schemes come from _SUFFIXES
            raise ValueError(q.scheme)

    def stored_shape(self, q: QuantisedWeight, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
        """The dequantised weight's [out, in] from the stored codes' shape."""
        codes = shapes[q.parts["codes"]]
        if q.scheme in ("ct-nvfp4", "modelopt-nvfp4"):
            return (*codes[:-1], codes[-1] * 2)
        return tuple(codes)


def _rows(scale: torch.Tensor, r0: int, r1: int, block_rows: int) -> torch.Tensor:
    """The scale rows that cover weight rows r0 .. r1 (r0 a multiple of block_rows)."""
    return scale[r0 // block_rows: -(-r1 // block_rows)]


def _fill(dst: torch.Tensor, rows_fn, align: int = 128) -> None:
    """dst[r0:r1] = rows_fn(r0, r1) over row chunks (multiples of `align` rows: whole scale blocks) so the
    fp32 temporary stays bounded; every element is computed exactly as in one piece."""
    rows, cols = dst.shape[-2], dst.shape[-1]
    step = max(align, (_CHUNK_ELEMENTS // max(cols, 1)) // align * align)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        dst[r0:r1].copy_(rows_fn(r0, r1))


def fp8_block_dequant(codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
                      row0: int = 0) -> torch.Tensor:
    """codes [rows, cols] float8_e4m3fn, scale_inv [ceil(rows/bm), ceil(cols/bn)] float32 -> [rows, cols] dtype:
    fp32(code) * scale_inv of its block, rounded once to `dtype`. Partial last blocks are cropped (the
    stored grid is the ceil grid). row0: the first row's index in the full weight (a multiple of bm)."""
    bm, bn = block
    rows, cols = codes.shape
    if row0 % bm:
        raise ValueError(f"row0 {row0} is not a multiple of the block height {bm}")
    grid_r, grid_c = -(-rows // bm), -(-cols // bn)
    if tuple(scale_inv.shape) != (grid_r, grid_c):
        raise ValueError(f"scale grid {tuple(scale_inv.shape)} does not cover a [{rows}, {cols}] weight in {bm}x{bn} blocks")
    s = scale_inv.float().repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]
    return (codes.float() * s).to(dtype)


def _ct_fp8(dst: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> None:
    rows, cols = codes.shape
    if scale.numel() == 1:  # tensor strategy
        _fill(dst, lambda r0, r1: (codes[r0:r1].float() * scale.float().reshape(1, 1)).to(dst.dtype))
    elif scale.dim() == 2 and tuple(scale.shape) == (rows, 1):  # channel strategy
        _fill(dst, lambda r0, r1: (codes[r0:r1].float() * scale[r0:r1].float()).to(dst.dtype))
    elif scale.dim() == 2 and block is not None:  # block strategy: the ceil grid of block_structure
        _fill(dst, lambda r0, r1: fp8_block_dequant(codes[r0:r1], _rows(scale, r0, r1, block[0]), block, dst.dtype, row0=r0),
              align=block[0])
    else:
        raise UserError(f"compressed-tensors FP8 scale of shape {tuple(scale.shape)} for a [{rows}, {cols}] weight: "
                        "neither per-tensor, per-channel nor the configured block grid")


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> float32 [..., 2n]: element 2k from the low nibble, 2k+1 from the high one."""
    table = _E2M1_TABLES.get(packed.device)
    if table is None:  # made once per device: a host-to-device copy per weight would stall the stream
        table = _E2M1_TABLES.setdefault(packed.device, torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device))
    low, high = (packed & 0x0F).long(), (packed >> 4).long()
    return torch.stack((table[low], table[high]), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def nvfp4_dequant(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, group: int,
                  dtype: torch.dtype, global_divides: bool) -> torch.Tensor:
    """packed uint8 [rows, cols/2], scale float8_e4m3fn [rows, cols/group], global fp32 (one value) ->
    [rows, cols] dtype. ModelOpt: e2m1 * (scale * weight_scale_2); compressed-tensors (global_divides):
    e2m1 * (scale / weight_global_scale); both in fp32, rounded once to `dtype`."""
    values = unpack_e2m1(packed)
    rows, cols = values.shape
    if cols % group or tuple(scale.shape) != (rows, cols // group):
        raise ValueError(f"NVFP4 scale {tuple(scale.shape)} does not match a [{rows}, {cols}] weight in groups of {group}")
    g = global_scale.float().reshape(1, 1)
    per_group = scale.float() / g if global_divides else scale.float() * g
    return (values.view(rows, cols // group, group) * per_group.unsqueeze(-1)).view(rows, cols).to(dtype)


# ---------------------------------------------------------------------------------------------- reading configs


def _unsupported(method: str, where: str) -> UserError:
    return UserError(f"{where}: weight quantisation {method!r} is not supported; supported: {'; '.join(SUPPORTED_METHODS)}")


def read_weight_format(folder: Path, raw_config: Mapping) -> WeightFormat:
    """The weight format of the checkpoint in `folder` (its parsed config.json is `raw_config`);
    a one-line UserError naming an unsupported method and the supported ones."""
    qc = raw_config.get("quantization_config")
    if qc is None and isinstance(raw_config.get("text_config"), Mapping):
        qc = raw_config["text_config"].get("quantization_config")
    hf_quant = folder / "hf_quant_config.json"
    if qc is None and hf_quant.is_file():  # older ModelOpt exports: only hf_quant_config.json says it
        try:
            modelopt = json.loads(hf_quant.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"cannot read {hf_quant} ({str(exc).splitlines()[0]})") from None
        return _modelopt(modelopt, f"{hf_quant.name}", modelopt)
    if qc is None:
        return WeightFormat("none", "config.json (no quantization_config)")
    if not isinstance(qc, Mapping):
        raise UserError(f"{folder}/config.json quantization_config must be a JSON object")
    method = str(qc.get("quant_method", "")).lower()
    where = f"{folder}/config.json quantization_config"
    if method == "fp8":
        return _fp8(qc, where)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    if method.startswith("modelopt"):
        return _modelopt(qc, "config.json quantization_config", qc)
    raise _unsupported(method or "(no quant_method)", where)


def _fp8(qc: Mapping, where: str) -> WeightFormat:
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise _unsupported(f"fp8 fmt {fmt}", where)
    block = qc.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise _unsupported(f"fp8 without a [rows, cols] weight_block_size (got {block!r})", where)
    if qc.get("scale_fmt") not in (None, "ue8m0", "fp32"):
        raise _unsupported(f"fp8 scale_fmt {qc.get('scale_fmt')}", where)
    ignore = tuple(qc.get("modules_to_not_convert") or ())
    return WeightFormat("fp8", "config.json quantization_config", block_size=(block[0], block[1]), algo="fp8-e4m3-block",
                        ignore=ignore, config=dict(qc))


def _compressed_tensors(qc: Mapping, where: str) -> WeightFormat:
    fmt = str(qc.get("format", ""))
    groups = qc.get("config_groups") or {}
    formats = {str(g.get("format") or fmt) for g in groups.values() if isinstance(g, Mapping)} or {fmt}
    known = {"float-quantized", "nvfp4-pack-quantized"}
    if not formats <= known:
        raise _unsupported(f"compressed-tensors format {', '.join(sorted(formats - known))}", where)
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _unsupported(f"compressed-tensors with quantization_status {status!r} (not stored compressed)", where)
    block, group = None, None
    for g in groups.values():
        w = g.get("weights") or {} if isinstance(g, Mapping) else {}
        if w.get("symmetric") is False:
            raise _unsupported("compressed-tensors asymmetric weights (zero points)", where)
        if w.get("strategy") == "block":
            bs = w.get("block_structure")
            if not (isinstance(bs, (list, tuple)) and len(bs) == 2):
                raise _unsupported(f"compressed-tensors block strategy with block_structure {bs!r}", where)
            block = (int(bs[0]), int(bs[1]))
        if w.get("num_bits") == 4:
            group = int(w.get("group_size") or NVFP4_GROUP)
            if w.get("type") != "float" or group != NVFP4_GROUP:
                raise _unsupported(f"compressed-tensors 4-bit {w.get('type')} weights in groups of {group}", where)
        elif w and (w.get("num_bits") != 8 or w.get("type") != "float"):
            raise _unsupported(f"compressed-tensors {w.get('num_bits')}-bit {w.get('type')} weights", where)
    return WeightFormat("compressed-tensors", "config.json quantization_config", block_size=block, group_size=group,
                        algo="+".join(sorted(formats)), ignore=tuple(qc.get("ignore") or ()), config=dict(qc))


def _modelopt(qc: Mapping, source: str, record: Mapping) -> WeightFormat:
    details = qc.get("quantization") if isinstance(qc.get("quantization"), Mapping) else qc
    algo = str(details.get("quant_algo") or "").upper()
    producer = (qc.get("producer") or {}).get("name", "modelopt") if isinstance(qc.get("producer"), Mapping) else "modelopt"
    if producer != "modelopt":
        raise _unsupported(f"{source} from producer {producer!r}", source)
    if algo not in ("NVFP4", "W4A16_NVFP4"):
        raise _unsupported(f"modelopt {algo or '(no quant_algo)'}", source)
    group = int(details.get("group_size") or NVFP4_GROUP)
    if group != NVFP4_GROUP:
        raise _unsupported(f"modelopt {algo} in groups of {group}", source)
    ignore = tuple(details.get("exclude_modules") or details.get("ignore") or ())
    return WeightFormat("modelopt", source, group_size=group, algo=algo, ignore=ignore, config=dict(record))


def describe_quantisation(fmt: WeightFormat, quantised: Mapping[str, QuantisedWeight], plain_count: int,
                          activation_count: int) -> dict:
    """What the weights were, for results: method, block/group size, which tensors were quantised."""
    kinds: dict[str, int] = {}
    for q in quantised.values():
        kinds[_kind(q.base)] = kinds.get(_kind(q.base), 0) + 1
    schemes: dict[str, int] = {}
    for q in quantised.values():
        schemes[q.scheme] = schemes.get(q.scheme, 0) + 1
    return {
        "method": fmt.method,
        "algo": fmt.algo,
        "source": fmt.source,
        "block_size": list(fmt.block_size) if fmt.block_size else None,
        "group_size": fmt.group_size,
        "ignore": list(fmt.ignore),
        "quantised_weights": len(quantised),
        "quantised_by_kind": dict(sorted(kinds.items())),
        "schemes": dict(sorted(schemes.items())),
        "unquantised_tensors": plain_count,
        "activation_scales_unused": activation_count,
        "dequantised_to": "the model dtype, once per weight, fp32 arithmetic",
    }


def _kind(base: str) -> str:
    """A weight's kind without layer and expert numbers: model.layers.3.mlp.experts.7.up_proj -> mlp.experts.up_proj."""
    parts = [p for p in base.split(".") if not p.isdigit()]
    if parts[:2] == ["model", "layers"]:
        parts = parts[2:]
    return ".".join(parts)


def ceil_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
