"""Read a Hugging Face MLA checkpoint folder tensor by tensor: its plan (names, dtypes, shapes, bytes)
and its decoder layers one at a time, dequantised on the device into modules built without weights.

Open:  `ckpt = Checkpoint.open(folder, require_weights=True)`
    Reads config.json, the weight format (mla_eval.model.weight_formats) and the tensor list: from
    model.safetensors.index.json (names -> shard) when there is one, else from the single
    model.safetensors; then each present shard's safetensors header (its first bytes: no tensor data is
    read). require_weights=True refuses a missing shard (one line naming it) and a truncated one;
    require_weights=False (planning) accepts a folder holding only config.json + the index.

What is known without the shards (only config.json + index): every tensor's name and shard, which
decoder layer it belongs to, which weights are quantised (their scale tensors are named), the index's
`total_size` (all tensor bytes) and, from config.json alone, the exact shape and dtype each module
parameter will have once materialised (`materialised_bytes`). What needs the shard headers: each stored
tensor's dtype, shape and bytes (`TensorInfo.dtype/shape/nbytes` are None without them), and so exact
per-layer stored bytes and bytes by dtype. `stored_bytes` returns None rather than guess;
`estimated_stored_bytes` is the guess from config shapes and the format's dtypes, labelled as such.

Units: bytes (int). Shapes as stored ([out, in] for a Linear; NVFP4 codes [out, in/2]).

Per decoder layer, two steps, so a caller can overlap reading with compute:
- `read_layer(i, pin_memory=False) -> RawTensors`: the layer's tensors exactly as stored (CPU), read with
  positioned reads of their byte ranges (neighbours coalesced) into one buffer per range, each tensor a
  view of it; pin_memory=True allocates that buffer pinned (needs CUDA) so the host-to-device copies in
  `materialise` run asynchronously. Thread-safe: each call opens its own file handles and mutates
  nothing shared, and the reads release the GIL: call it from a background thread to prefetch.
- `materialise(layer_module, raw, device, dtype)`: on `device` (the GPU when there is one), dequantise
  every quantised weight to `dtype` and assign every tensor into the layer module's parameters and
  persistent buffers (a module built without weights: `empty_model`, or any module whose tensors are on
  the meta device), mapping checkpoint names to the module's names, per-expert checkpoint weights into
  fused expert parameters (`mlp.experts.gate_up_proj` [E, 2I, H] = cat(gate, up), `down_proj` [E, H, I])
  when the module has them. Call it on the thread that owns the device's stream.
  Dtypes as transformers' from_pretrained gives them: `dtype`, except the model class's
  `_keep_in_fp32_modules_strict` (bf16/fp16) and `_keep_in_fp32_modules` (fp16) in float32, and
  parameters the module was built in another floating dtype keep it.
- The same for the rest: `read_rest()` (embeddings, final norm, lm_head; MTP layers are not read:
  transformers builds no module for them) and `materialise_rest(model, raw, device, dtype)`.

`load_resident(folder, config, device, dtype, attn)` builds a whole model through these steps (what
loader.py uses for quantised checkpoints). `describe()` is the record a result keeps of the weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from pathlib import Path
from typing import Iterator, Mapping

import torch

from mla_eval.errors import UserError
from mla_eval.model.weight_checks import check_scale_values, check_stored
from mla_eval.model.weight_formats import QuantisedWeight, WeightFormat, describe_quantisation, read_weight_format

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_HEADER_LIMIT = 100 * 2**20  # safetensors' own cap on a header
_LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.)(?P<layer>\d+)\.(?P<rest>.+)$")
_EXPERT = re.compile(r"^(?P<experts>(?:.*\.)?experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# bytes per element of each safetensors dtype code (for estimates; stored bytes come from header offsets)
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U8": 1,
               "I8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}
# stored in float32 by the published DeepSeek / GLM checkpoints whatever the weights' dtype (estimates only)
_STORED_FP32 = ("e_score_correction_bias",)
_TORCH_TO_ST = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_ST_TO_TORCH = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
                "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
                "BOOL": torch.bool}
_COALESCE_GAP = 1 << 20  # read through gaps up to 1 MiB between a layer's tensors


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One stored tensor. dtype (a safetensors code: BF16, F32, F8_E4M3, U8 ...), shape and nbytes come
    from its shard's header: None when that shard is not present."""

    name: str
    shard: str
    part: str  # "layer" (a decoder layer), "mtp" (a layer past num_hidden_layers), "embed", "lm_head", "norm", "other"
    layer: int | None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    nbytes: int | None = None
    offset: int | None = None  # where its bytes start in the shard file


@dataclasses.dataclass
class RawTensors:
    """A decoder layer's (or the rest's) tensors as stored, by checkpoint name."""

    layer: int | None  # None: the non-layer weights
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (name -> {dtype, shape, data_offsets}) and where its tensor data starts;
    one-line UserError when the file is shorter than its header says (a truncated download)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if length < 2 or length > _HEADER_LIMIT or 8 + length > size:
                raise UserError(f"{path} is truncated or not a safetensors file ({size} bytes, no complete header): "
                                "download it again")
            header = json.loads(f.read(length))
    except OSError as exc:
        raise UserError(f"cannot read {path} ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"{path} has a damaged safetensors header: download it again") from None
    header.pop("__metadata__", None)
    data = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + length + data > size:
        raise UserError(f"{path} is truncated: its header describes {8 + length + data} bytes, the file has {size}; "
                        "download it again")
    return header, 8 + length


def _tensor_view(buf: torch.Tensor, at: int, t: TensorInfo) -> torch.Tensor:
    """The stored tensor `t` whose bytes sit at buf[at:]: a view, or a copy where the offset is misaligned."""
    dtype = _ST_TO_TORCH.get(t.dtype or "")
    if dtype is None:
        raise UserError(f"{t.name} is stored as {t.dtype}, a safetensors dtype this reader does not know")
    raw = buf[at: at + t.nbytes]
    if at % torch.empty((), dtype=dtype).element_size():
        raw = raw.clone()
    return raw.view(dtype).reshape(t.shape)


def _classify(name: str, num_layers: int) -> tuple[str, int | None]:
    m = _LAYER.match(name)
    if m:
        layer = int(m.group("layer"))
        return ("layer" if layer < num_layers else "mtp"), layer
    if "embed_tokens" in name:
        return "embed", None
    if name.startswith("lm_head."):
        return "lm_head", None
    if name.endswith("norm.weight") or name.endswith("norm.bias"):
        return "norm", None
    return "other", None


def _text_config(raw: Mapping) -> Mapping:
    if "kv_lora_rank" not in raw and isinstance(raw.get("text_config"), Mapping):
        return raw["text_config"]
    return raw


class Checkpoint:
    """A checkpoint folder's tensors and weight format (see the module docstring)."""

    def __init__(self, path: Path, raw_config: Mapping, fmt: WeightFormat, tensors: dict[str, TensorInfo],
                 shards: list[str], missing: list[str], index_total_size: int | None) -> None:
        self.path = path
        self.raw_config = raw_config
        self.format = fmt
        self.tensors = tensors
        self.shards = shards
        self.missing_shards = missing
        self.index_total_size = index_total_size
        text = _text_config(raw_config)
        self.num_layers = int(text.get("num_hidden_layers") or 0)
        self.mtp_layers = int(text.get("num_nextn_predict_layers") or 0)
        self.quantised, plain, activation = fmt.group(tensors)
        self._plain, self._activation = plain, activation
        self._role_of = {part: (q, role) for q in self.quantised.values() for role, part in q.parts.items()}
        self._by_layer: dict[int | None, list[str]] = {}
        for info in tensors.values():
            key = info.layer if info.part == "layer" else (None if info.part != "mtp" else -1 - (info.layer or 0))
            self._by_layer.setdefault(key, []).append(info.name)

    # ------------------------------------------------------------------------------------------ opening

    @classmethod
    def open(cls, path: str | Path, require_weights: bool = True) -> "Checkpoint":
        path = Path(path).expanduser()
        try:
            raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UserError(f"{path} has no config.json: not a Hugging Face model folder") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"cannot read {path}/config.json ({str(exc).splitlines()[0]})") from None
        if not isinstance(raw, dict):
            raise UserError(f"{path}/config.json must hold a JSON object")
        fmt = read_weight_format(path, raw)
        num_layers = int(_text_config(raw).get("num_hidden_layers") or 0)
        index = path / INDEX_NAME
        total = None
        if index.is_file():
            try:
                data = json.loads(index.read_text(encoding="utf-8"))
                weight_map = data["weight_map"]
                total = (data.get("metadata") or {}).get("total_size")
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise KeyError("weight_map")
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
                raise UserError(f"cannot read {index} ({str(exc).splitlines()[0]}): download it again") from None
        elif (path / SINGLE_NAME).is_file():
            header = _read_header(path / SINGLE_NAME)[0]
            weight_map = dict.fromkeys(header, SINGLE_NAME)
        else:
            raise UserError(f"{path} has neither {INDEX_NAME} nor {SINGLE_NAME}: not a safetensors checkpoint")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if Path(shard).name != shard:
                raise UserError(f"{index} names shard {shard!r} outside the folder: refusing it")
        missing = [s for s in shards if not (path / s).is_file()]
        if missing and require_weights:
            raise UserError(f"{path}: shard {missing[0]} named by {INDEX_NAME} is missing "
                            f"({len(shards) - len(missing)} of {len(shards)} shards present); download it")
        tensors: dict[str, TensorInfo] = {}
        headers = {s: _read_header(path / s) for s in shards if s not in missing}
        for name, shard in weight_map.items():
            part, layer = _classify(name, num_layers)
            if shard not in headers:
                tensors[name] = TensorInfo(name, shard, part, layer)
                continue
            head, data_start = headers[shard]
            entry = head.get(name)
            if entry is None:
                raise UserError(f"{path / shard} does not hold {name}, which {INDEX_NAME} places there: "
                                "the index and the shard disagree; download both again")
            start, end = (int(x) for x in entry["data_offsets"])
            tensors[name] = TensorInfo(name, shard, part, layer, str(entry["dtype"]), tuple(int(d) for d in entry["shape"]),
                                       end - start, data_start + start)
        ckpt = cls(path, raw, fmt, tensors, shards, missing, int(total) if isinstance(total, (int, float)) else None)
        ckpt._check_stored()
        return ckpt

    def check_shards(self) -> None:
        """One-line UserError naming the first shard the index names that is not in the folder."""
        if self.missing_shards:
            raise UserError(f"{self.path}: shard {self.missing_shards[0]} named by {INDEX_NAME} is missing "
                            f"({len(self.shards) - len(self.missing_shards)} of {len(self.shards)} shards present); "
                            "download it")

    def _check_stored(self) -> None:
        """The tensors against the config's weight format, from the index and the headers read
        (mla_eval.model.weight_checks: every path opens the checkpoint through here)."""
        check_stored(self)

    # ------------------------------------------------------------------------------------------ the plan

    @property
    def headers_complete(self) -> bool:
        """True when every shard's header was read: stored dtypes, shapes and bytes are exact."""
        return not self.missing_shards

    def layer_names(self, layer: int) -> list[str]:
        """Checkpoint names of decoder layer `layer`'s stored tensors."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} of a {self.num_layers}-layer checkpoint")
        return sorted(self._by_layer.get(layer, []))

    def rest_names(self, include_mtp: bool = False) -> list[str]:
        """Checkpoint names of everything outside the decoder layers (MTP layers only when asked)."""
        names = [n for n, t in self.tensors.items() if t.part not in ("layer", "mtp") or (include_mtp and t.part == "mtp")]
        return sorted(names)

    def stored_bytes(self, layer: int | None = None, part: str | None = None) -> int | None:
        """Exact stored bytes of decoder layer `layer`, or of a part ("embed", "lm_head", "norm", "mtp",
        "other", "layer": all decoder layers), or of everything; None when a needed header is absent."""
        infos = self._select(layer, part)
        sizes = [t.nbytes for t in infos]
        return None if any(s is None for s in sizes) else sum(sizes)  # type: ignore[misc]

    def _select(self, layer: int | None, part: str | None) -> list[TensorInfo]:
        if layer is not None:
            return [self.tensors[n] for n in self.layer_names(layer)]
        if part is not None:
            return [t for t in self.tensors.values() if t.part == part]
        return list(self.tensors.values())

    def bytes_by_dtype(self) -> dict[str, int] | None:
        """Stored bytes per safetensors dtype over the whole checkpoint; None without every header."""
        if not self.headers_complete:
            return None
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.dtype] = out.get(t.dtype, 0) + t.nbytes  # type: ignore[index,operator]
        return dict(sorted(out.items()))

    def bytes_by_part(self) -> dict[str, int | None]:
        """Exact stored bytes of each part (None where a header is absent), in a fixed order."""
        parts = ("layer", "mtp", "embed", "lm_head", "norm", "other")
        return {p: self.stored_bytes(part=p) for p in parts if any(t.part == p for t in self.tensors.values())}

    def estimated_stored_bytes(self, model, layer: int | None = None, part: str | None = None) -> int | None:
        """An estimate of stored bytes where headers are missing: each tensor's shape from the model built
        from config.json (`empty_model`; MTP tensors from the last decoder layer's shapes), its dtype from
        the format (codes and scales as the format defines, everything else in the config's dtype).
        Exact sizes are used wherever a header was read. None when a tensor's shape cannot be derived."""
        shapes = _param_shapes(model)
        dtype = _TORCH_TO_ST.get(_config_dtype(self.raw_config), "BF16")
        total = 0
        for t in self._select(layer, part):
            if t.nbytes is not None:
                total += t.nbytes
                continue
            est = self._estimate(t, shapes, dtype)
            if est is None:
                return None
            total += est
        return total

    def _estimate(self, t: TensorInfo, shapes: Mapping[str, tuple[int, ...]], dtype: str) -> int | None:
        def as_modelled(name: str) -> str:  # an MTP layer mirrors the last decoder layer's tensors
            if t.part == "mtp" and t.layer is not None:
                return name.replace(f"layers.{t.layer}.", f"layers.{self.num_layers - 1}.", 1)
            return name

        if t.name in self._activation:
            return 4  # one float32 activation scale
        q, role = self._role_of.get(t.name, (None, None))
        shape = shapes.get(as_modelled(q.weight_name if q else t.name))
        if shape is None:
            return None
        if q is not None:
            return _format_bytes(self.format, q.scheme, role, shape, DTYPE_BYTES[dtype])
        n = 1
        for d in shape:
            n *= d
        return n * (4 if t.name.endswith(_STORED_FP32) else DTYPE_BYTES[dtype])

    @staticmethod
    def materialised_bytes(model, dtype: torch.dtype) -> dict[str, int]:
        """Bytes the model's weights take once materialised in `dtype` (exact, from config.json alone):
        {"layer:<i>": ..., "rest": ...}; fp32-kept parameters counted at 4 bytes."""
        fp32 = _fp32_patterns(type(model), dtype)
        out: dict[str, int] = {}
        for name, t in list(model.named_parameters()) + list(_persistent_buffers(model)):
            m = _LAYER.match(name)
            key = f"layer:{m.group('layer')}" if m else "rest"
            size = 4 if _keeps_fp32(name, fp32) else torch.empty((), dtype=_target_dtype(name, t, dtype, fp32)).element_size()
            out[key] = out.get(key, 0) + t.numel() * size
        return out

    def describe(self) -> dict:
        """What the weights were (recorded in results): the format, which tensors were quantised, and sizes."""
        return {
            "path": str(self.path),
            "quantisation": describe_quantisation(self.format, self.quantised, len(self._plain), len(self._activation)),
            "tensors": len(self.tensors),
            "shards": len(self.shards),
            "headers_read": self.headers_complete,
            "stored_bytes": self.stored_bytes(),
            "bytes_by_dtype": self.bytes_by_dtype(),
            "index_total_size": self.index_total_size,
            "num_hidden_layers": self.num_layers,
            "mtp_layers": self.mtp_layers,
        }

    # ------------------------------------------------------------------------------------------ reading

    def read_layer(self, layer: int, pin_memory: bool = False) -> RawTensors:
        """Decoder layer `layer`'s tensors as stored (CPU). Thread-safe (see the module docstring)."""
        return RawTensors(layer, self._read(self.layer_names(layer), pin_memory))

    def read_rest(self, pin_memory: bool = False) -> RawTensors:
        """The non-layer tensors the model uses (embeddings, final norm, lm_head, ...), as stored."""
        return RawTensors(None, self._read(self.rest_names(), pin_memory))

    def _read(self, names: list[str], pin_memory: bool) -> dict[str, torch.Tensor]:
        """Positioned reads of the tensors' byte ranges (neighbours coalesced) straight into one buffer per
        range (pinned if asked), each tensor a view of it. The read syscalls release the GIL, so a
        background thread reads while the main thread computes; each call has its own file handles."""
        if self.missing_shards:
            self.check_shards()
        by_shard: dict[str, list[TensorInfo]] = {}
        for n in names:
            by_shard.setdefault(self.tensors[n].shard, []).append(self.tensors[n])
        out: dict[str, torch.Tensor] = {}
        for shard, infos in by_shard.items():
            file = self.path / shard
            infos.sort(key=lambda t: t.offset)
            ranges: list[list[TensorInfo]] = []
            for t in infos:  # coalesce tensors whose gap is small (one read instead of many)
                if ranges and t.offset - (ranges[-1][-1].offset + ranges[-1][-1].nbytes) <= _COALESCE_GAP:
                    ranges[-1].append(t)
                else:
                    ranges.append([t])
            try:
                with file.open("rb", buffering=0) as f:
                    for group in ranges:
                        start, end = group[0].offset, group[-1].offset + group[-1].nbytes
                        buf = torch.empty(end - start, dtype=torch.uint8, pin_memory=pin_memory)
                        view, got = memoryview(buf.numpy()), 0
                        f.seek(start)
                        while got < end - start:
                            n = f.readinto(view[got:])
                            if not n:
                                raise OSError(f"file ended {end - start - got} bytes early")
                            got += n
                        for t in group:
                            out[t.name] = _tensor_view(buf, t.offset - start, t)
            except OSError as exc:
                raise UserError(f"reading {file} failed ({exc.strerror or exc}): the shard is missing, damaged or "
                                "was changed during the run; restore it and run again") from None
        return out

    # ------------------------------------------------------------------------------------------ materialising

    def materialise(self, module: torch.nn.Module, raw: RawTensors, device: torch.device | str,
                    dtype: torch.dtype) -> None:
        """Assign decoder layer raw.layer's tensors, dequantised on `device` in `dtype`, into `module`
        (that layer's module, built without weights). See the module docstring."""
        if raw.layer is None:
            raise ValueError("materialise takes a decoder layer's tensors; use materialise_rest for the rest")
        prefix = _LAYER.match(next(iter(raw.tensors))).group("prefix") + f"{raw.layer}." if raw.tensors else ""
        self._assign(module, raw, torch.device(device), dtype, prefix, f"layer {raw.layer}")

    def materialise_rest(self, model: torch.nn.Module, raw: RawTensors, device: torch.device | str,
                         dtype: torch.dtype) -> None:
        """Assign the non-layer tensors into the whole model (its decoder layers are left as they are),
        tie lm_head to the embeddings when the config ties them and the checkpoint has no lm_head."""
        self._assign(model, raw, torch.device(device), dtype, "", "the non-layer weights", skip_layers=True)

    def _assign(self, root: torch.nn.Module, raw: RawTensors, device: torch.device, dtype: torch.dtype,
                prefix: str, what: str, skip_layers: bool = False) -> None:
        fp32 = _fp32_patterns(self._model_class(), dtype)
        quantised, plain, _ = self.format.group(raw.tensors)
        expected = dict(root.named_parameters(remove_duplicate=False))
        expected.update(_persistent_buffers(root))
        if skip_layers:
            expected = {n: t for n, t in expected.items() if not _LAYER.match(n)}
        done: set[str] = set()
        fused: dict[str, torch.Tensor] = {}
        fused_filled: dict[str, set[tuple[int, str]]] = {}
        with torch.no_grad():
            for name in sorted(set(quantised) | plain):
                rel = name[len(prefix):] if prefix and name.startswith(prefix) else name
                if rel not in expected:
                    if self._assign_expert(root, rel, name, quantised, raw, expected, fused, fused_filled, device, dtype,
                                           prefix, fp32, what):
                        continue
                    raise UserError(f"{self.path}: checkpoint tensor {name} has no place in the model's {what} "
                                    f"({type(root).__name__}): the checkpoint does not match its config.json")
                target = expected[rel]
                out_dtype = _target_dtype(prefix + rel, target, dtype, fp32)
                dst = torch.empty(tuple(target.shape), dtype=out_dtype, device=device)
                self._fill(dst, name, quantised, raw, what)
                _set_tensor(root, rel, dst)
                done.add(rel)
        for base, dst in fused.items():
            want = dst.shape[0] * (1 if base.endswith("down_proj") else 2)
            if len(fused_filled[base]) != want:
                raise UserError(f"{self.path}: the checkpoint holds {len(fused_filled[base])} of the {want} expert weights "
                                f"of {prefix}{base} ({what}): it does not match its config.json")
            _set_tensor(root, base, dst)
            done.add(base)
        if skip_layers and "lm_head.weight" in expected and "lm_head.weight" not in done:
            if getattr(root.config, "tie_word_embeddings", False) and hasattr(root, "tie_weights"):
                root.tie_weights()
                done.add("lm_head.weight")
        missing = sorted(n for n, t in expected.items() if n not in done and t.device.type == "meta")
        if missing:
            raise UserError(f"{self.path}: the checkpoint has no {missing[0]} for the model's {what}"
                            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}: it does not match its config.json")

    def _fill(self, dst: torch.Tensor, name: str, quantised: Mapping[str, QuantisedWeight], raw: RawTensors, what: str) -> None:
        q = quantised.get(name)
        if q is None:
            src = raw.tensors[name]
            if tuple(src.shape) != tuple(dst.shape):
                raise UserError(f"{self.path}: {name} is stored as {list(src.shape)}, the model's {what} wants "
                                f"{list(dst.shape)}: the checkpoint does not match its config.json")
            dst.copy_(src.to(dst.device, non_blocking=True))
            return
        shape = self.format.stored_shape(q, {n: tuple(t.shape) for n, t in raw.tensors.items() if n in q.parts.values()})
        if tuple(shape) != tuple(dst.shape):
            raise UserError(f"{self.path}: {name} dequantises to {list(shape)}, the model's {what} wants "
                            f"{list(dst.shape)}: the checkpoint does not match its config.json")
        check_scale_values(self, q, raw.tensors)  # a scale no quantiser writes is refused, never dequantised
        try:
            self.format.dequantise_into(dst, q, raw.tensors)
        except ValueError as exc:
            raise UserError(f"{self.path}: {q.base}: {exc}") from None

    def _assign_expert(self, root, rel, name, quantised, raw, expected, fused, fused_filled, device, dtype, prefix, fp32,
                       what) -> bool:
        """A per-expert checkpoint weight into the module's fused expert parameter; False if it has none."""
        m = _EXPERT.match(rel)
        if not m:
            return False
        experts, e, proj = m.group("experts"), int(m.group("expert")), m.group("proj")
        base = f"{experts}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        target = expected.get(base)
        if target is None or target.dim() != 3:
            return False
        if base not in fused:
            fused[base] = torch.empty(tuple(target.shape), dtype=_target_dtype(prefix + base, target, dtype, fp32),
                                      device=device)
            fused_filled[base] = set()
        dst = fused[base]
        if e >= dst.shape[0]:
            raise UserError(f"{self.path}: {name}: expert {e} of a model with {dst.shape[0]} experts")
        if proj == "down_proj":
            view = dst[e]
        else:
            half = dst.shape[1] // 2
            view = dst[e, :half] if proj == "gate_proj" else dst[e, half:]
        self._fill(view, name, quantised, raw, what)
        fused_filled[base].add((e, proj))
        return True

    def _model_class(self):
        return _causal_lm_class(self.raw_config)


# ---------------------------------------------------------------------------------------------- helpers


def _config_dtype(raw_config: Mapping) -> torch.dtype:
    """The dtype config.json says the unquantised weights are stored in (bf16 when it says nothing)."""
    text = _text_config(raw_config)
    name = str(text.get("dtype") or text.get("torch_dtype") or raw_config.get("torch_dtype") or "bfloat16")
    return {"float32": torch.float32, "float16": torch.float16}.get(name, torch.bfloat16)


def _param_shapes(model) -> dict[str, tuple[int, ...]]:
    """Stored shapes of the model's tensors by checkpoint name: parameters and persistent buffers, and for
    fused experts each expert's gate_proj / up_proj / down_proj [out, in] as stored per expert."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, t in list(model.named_parameters()) + list(_persistent_buffers(model)):
        shapes[name] = tuple(t.shape)
        if name.endswith("experts.gate_up_proj") and t.dim() == 3:
            base = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                for proj in ("gate_proj", "up_proj"):
                    shapes[f"{base}{e}.{proj}.weight"] = (t.shape[1] // 2, t.shape[2])
        elif name.endswith("experts.down_proj") and t.dim() == 3:
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                shapes[f"{base}{e}.down_proj.weight"] = (t.shape[1], t.shape[2])
    return shapes


def _format_bytes(fmt: WeightFormat, scheme: str, role: str, shape: tuple[int, ...], model_bytes: int) -> int:
    """Stored bytes of one part of a quantised [out, in] weight, as the format defines it (compressed-tensors
    FP8 scales in the checkpoint's dtype, as llm-compressor writes them: `model_bytes` per value)."""
    out, inn = shape[-2], shape[-1]
    if role == "codes":
        return out * inn // 2 if scheme in ("ct-nvfp4", "modelopt-nvfp4") else out * inn
    if role == "global":
        return 4
    if scheme == "fp8-block":
        bm, bn = fmt.block_size or (128, 128)
        return -(-out // bm) * -(-inn // bn) * 4
    if scheme == "ct-fp8" and fmt.block_size:
        bm, bn = fmt.block_size
        return -(-out // bm) * -(-inn // bn) * model_bytes
    if scheme == "ct-fp8":
        return out * model_bytes  # per channel
    return out * (inn // (fmt.group_size or 16))  # NVFP4 E4M3 group scales


def _persistent_buffers(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for mod_name, mod in module.named_modules():
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), buf


def _set_tensor(root: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = root.get_submodule(owner_name) if owner_name else root
    if leaf in owner._parameters:
        owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    elif leaf in owner._buffers:
        owner._buffers[leaf] = value
    else:  # pragma: no cover - names come from named_parameters / buffers
        raise KeyError(name)


def _causal_lm_class(raw_config: Mapping):
    """The transformers class from_pretrained would build for this config (its dtype plan lives there)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(_text_config(raw_config).get("model_type"))
    return getattr(transformers, name, None) if name else None


def _fp32_patterns(model_cls, dtype: torch.dtype) -> list[re.Pattern]:
    """transformers' dtype plan (modeling_utils `_get_dtype_plan`, 5.17 and 5.25): `_keep_in_fp32_modules_strict`
    stay float32 under bf16/fp16, `_keep_in_fp32_modules` under fp16; patterns are searched in the full name."""
    pats: list[str] = []
    if model_cls is not None:
        if dtype == torch.float16:
            pats += list(getattr(model_cls, "_keep_in_fp32_modules", None) or [])
        if dtype in (torch.float16, torch.bfloat16):
            pats += list(getattr(model_cls, "_keep_in_fp32_modules_strict", None) or [])
    return [re.compile(p.replace("*", ".*")) for p in pats]


def _keeps_fp32(name: str, patterns: list[re.Pattern]) -> bool:
    return any(p.search(name) for p in patterns)


def _target_dtype(name: str, built: torch.Tensor, dtype: torch.dtype, fp32: list[re.Pattern]) -> torch.dtype:
    """As from_pretrained: fp32 where the dtype plan says so; else a floating tensor the model built in another
    dtype keeps it (e.g. a router made float32 explicitly); else `dtype`."""
    if _keeps_fp32(name, fp32):
        return torch.float32
    if built.dtype.is_floating_point and built.dtype != dtype:
        return built.dtype
    return dtype


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """While building a model: every parameter goes to the meta device as it is registered (no memory, no
    init), buffers stay real (the rotary inv_freq is computed as usual). The idea of accelerate's
    init_empty_weights(include_buffers=False)."""
    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def empty_model(config, dtype: torch.dtype, attn_implementation: str | None = None):
    """The transformers model of `config` with every parameter on the meta device (nothing allocated) and
    real buffers, built as from_pretrained builds it: torch's default dtype set to `dtype` meanwhile.
    Its decoder layers (model.model.layers[i]) are what `materialise` fills."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # we dequantise ourselves; transformers must build plain modules
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        # on the meta device: a full-width MoE layer's fused experts would otherwise be allocated (25 GB at GLM-5
        # width) before being moved there; the registration hook catches what a module builds on another device
        with torch.device("meta"), _parameters_on_meta():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
        _real_buffers(model)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def _real_buffers(model: torch.nn.Module) -> None:
    """Buffers made real again after a build on the meta device: a module's non-persistent buffers computed at its
    construction (the rotary tables) are computed again by building that module alone (it is small) on the CPU;
    persistent buffers (the router's e_score_correction_bias, which the checkpoint holds) become zeros, as
    transformers initialises them, until the checkpoint's values are assigned."""
    for module in model.modules():
        metas = [k for k, b in module._buffers.items() if b is not None and b.device.type == "meta"]
        rebuild = [k for k in metas if k in module._non_persistent_buffers_set]
        if rebuild:
            config = getattr(module, "config", None) or model.config
            fresh = type(module)(config=config)
            for k in rebuild:
                module._buffers[k] = fresh._buffers[k]
        for k in metas:
            if k not in rebuild:
                b = module._buffers[k]
                module._buffers[k] = torch.zeros(b.shape, dtype=b.dtype)


def quantised_weights(path: str | Path) -> bool:
    """Whether the checkpoint folder's config declares quantised weights (a UserError if unsupported)."""
    path = Path(path)
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False  # load_config reports an unreadable config.json
    return isinstance(raw, dict) and read_weight_format(path, raw).method != "none"


def load_resident(path: str | Path, config, device: torch.device, dtype: torch.dtype,
                  attn_implementation: str | None = None) -> torch.nn.Module:
    """The whole model on `device`, every layer read and materialised through the reader (resident)."""
    ckpt = Checkpoint.open(path, require_weights=True)
    model = empty_model(config, dtype, attn_implementation)
    layers = model.model.layers
    if len(layers) != ckpt.num_layers:
        raise UserError(f"{ckpt.path}: config.json builds {len(layers)} layers, the checkpoint has {ckpt.num_layers}")
    for i, layer in enumerate(layers):
        ckpt.materialise(layer, ckpt.read_layer(i), device, dtype)
    ckpt.materialise_rest(model, ckpt.read_rest(), device, dtype)
    model.to(device)  # the buffers (rotary tables) join the weights
    model.mla_eval_weights = ckpt.describe()  # what the weights were, for results
    return model.eval()
