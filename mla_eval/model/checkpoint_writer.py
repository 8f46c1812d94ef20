"""Write random-weight checkpoints in each on-disk weight format real MLA models ship in.

For tests (small widths, CPU) and for device measurements at full width (tools/write_checkpoint.py).
The tensor names are the ones transformers saves for the config (`save_pretrained` unfuses experts to
`mlp.experts.<e>.{gate,up,down}_proj.weight`, as the published checkpoints store them); dtypes, scale
shapes and the config's quantization_config follow each format's public definition, documented in
mla_eval.model.weight_formats:

- "bf16": every tensor bf16 (e_score_correction_bias float32, as transformers builds it).
- "fp8-block": DeepSeek-V3 layout, `weight_scale_inv` fp32 over the ceil grid of 128x128 blocks,
  scale = block amax / 448 (DeepSeek's `weight_quant`, inference/kernel.py); quantization_config
  {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}.
- "ct-fp8-dynamic": compressed-tensors "float-quantized", per-channel weights (bf16 scale [out, 1]),
  dynamic per-token activations (llm-compressor's FP8_DYNAMIC scheme).
- "ct-fp8-block": compressed-tensors "float-quantized", block strategy 128x128 (bf16 scale grid).
- "ct-nvfp4": compressed-tensors "nvfp4-pack-quantized" weights-only (NVFP4A16): weight_packed,
  weight_scale (E4M3 per 16), weight_global_scale fp32 [1].
- "modelopt-nvfp4": ModelOpt unified HF export NVFP4: weight (packed uint8), weight_scale (E4M3 per
  16), weight_scale_2 fp32 scalar, input_scale fp32 scalar; hf_quant_config.json and config.json's
  quantization_config as ModelOpt writes them.

Quantised: every 2-D weight inside a decoder layer except the MoE router (`mlp.gate.weight`) and the
DSA indexer's `weights_proj` (DeepSeek-V3.2's reference keeps both in bf16); embeddings, lm_head and
norms stay bf16. The config's ignore / modules_to_not_convert lists say the same.

One shard per decoder layer (plus one for the rest), written one at a time, so a full-width checkpoint
never needs more host memory than one layer; the index is written last (a folder without it is
unfinished). The same (config, format, seed) gives the same bytes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import zlib
from pathlib import Path
from typing import Callable

import torch

from mla_eval.errors import UserError
from mla_eval.model.checkpoint import INDEX_NAME, _param_shapes, empty_model
from mla_eval.model.weight_formats import E2M1_VALUES, NVFP4_GROUP

FORMATS = ("bf16", "fp8-block", "ct-fp8-dynamic", "ct-fp8-block", "ct-nvfp4", "modelopt-nvfp4")
FP8_MAX = 448.0  # largest float8_e4m3fn value
E2M1_MAX = 6.0
BLOCK = (128, 128)
# never quantised (see the module docstring); matched against the end of a module path
_KEEP = ("mlp.gate", "indexer.weights_proj")


@dataclasses.dataclass(frozen=True)
class WrittenCheckpoint:
    path: Path
    fmt: str
    layer_bytes: tuple[int, ...]  # stored bytes of each decoder layer
    rest_bytes: int
    total_bytes: int


def quantised_by_writer(name: str) -> bool:
    """Whether the writer stores this (stored-name, 2-D) weight quantised."""
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    return ".layers." in f".{name}" and name.endswith(".weight") and not any(base.endswith(k) for k in _KEEP) \
        and "norm" not in base.rsplit(".", 1)[-1]


def quantization_config(fmt: str, producer_version: str = "0.0") -> tuple[dict | None, dict | None]:
    """(config.json quantization_config, hf_quant_config.json) of a format as its tools write them."""
    ignore_ct = ["lm_head", "re:.*mlp\\.gate$", "re:.*indexer\\.weights_proj$"]
    if fmt == "bf16":
        return None, None
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}, None
    if fmt in ("ct-fp8-dynamic", "ct-fp8-block"):
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "observer": "minmax",
                   "strategy": "channel", "group_size": None, "block_structure": None, "actorder": None}
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "observer": None,
                "strategy": "token", "group_size": None, "block_structure": None, "actorder": None}
        if fmt == "ct-fp8-block":
            weights.update(strategy="block", block_structure=list(BLOCK))
            acts.update(strategy="group", group_size=BLOCK[1])
        group = {"targets": ["Linear"], "weights": weights, "input_activations": acts, "output_activations": None,
                 "format": "float-quantized"}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": group}, "ignore": ignore_ct, "kv_cache_scheme": None,
                "global_compression_ratio": None, "sparsity_config": {}}, None
    if fmt == "ct-nvfp4":
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "dynamic": False, "observer": "minmax",
                   "strategy": "tensor_group", "group_size": NVFP4_GROUP, "block_structure": None, "actorder": None}
        group = {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None,
                 "format": "nvfp4-pack-quantized"}
        return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": group}, "ignore": ignore_ct, "kv_cache_scheme": None,
                "global_compression_ratio": None, "sparsity_config": {}}, None
    if fmt == "modelopt-nvfp4":
        exclude = ["lm_head", "*mlp.gate", "*indexer.weights_proj"]
        hf_quant = {"producer": {"name": "modelopt", "version": producer_version},
                    "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": NVFP4_GROUP,
                                     "exclude_modules": exclude}}
        group = {"input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_GROUP},
                 "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_GROUP},
                 "targets": ["Linear"]}
        config = {"config_groups": {"group_0": group}, "ignore": exclude, "quant_algo": "NVFP4",
                  "producer": hf_quant["producer"], "quant_method": "modelopt"}
        return config, hf_quant
    raise UserError(f"checkpoint format {fmt!r}: one of {', '.join(FORMATS)}")


# ---------------------------------------------------------------------------------------------- quantisers


def quantise_fp8_block(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (float8_e4m3fn codes, float32 scale_inv [ceil(out/bm), ceil(in/bn)]): scale = block amax / 448."""
    bm, bn = block
    rows, cols = w.shape
    gr, gc = math.ceil(rows / bm), math.ceil(cols / bn)
    padded = torch.zeros(gr * bm, gc * bn, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w.float()
    amax = padded.view(gr, bm, gc, bn).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]
    return (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantise_fp8_channel(w: torch.Tensor, scale_dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    amax = w.float().abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(scale_dtype)
    return (w.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantise_fp8_block_ct(w: torch.Tensor, scale_dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    _, scale = quantise_fp8_block(w)
    scale = scale.to(scale_dtype)
    rows, cols = w.shape
    full = scale.float().repeat_interleave(BLOCK[0], 0)[:rows].repeat_interleave(BLOCK[1], 1)[:, :cols]
    return (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (uint8 0..15) of each fp32 value (|x| <= 6 expected; larger saturate)."""
    mags = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=x.device)
    idx = (x.abs().unsqueeze(-1) - mags).abs().argmin(dim=-1).to(torch.uint8)
    return idx | ((x < 0).to(torch.uint8) << 3)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def quantise_nvfp4(w: torch.Tensor, modelopt: bool) -> dict[str, torch.Tensor]:
    """w [out, in] -> the stored NVFP4 tensors of ModelOpt (modelopt=True: weight, weight_scale,
    weight_scale_2) or compressed-tensors (weight_packed, weight_scale, weight_global_scale)."""
    rows, cols = w.shape
    if cols % NVFP4_GROUP:
        raise UserError(f"NVFP4 needs input widths divisible by {NVFP4_GROUP}; got {cols}")
    wf = w.float()
    amax = wf.abs().amax().clamp(min=1e-12)
    group_amax = wf.view(rows, cols // NVFP4_GROUP, NVFP4_GROUP).abs().amax(-1)
    if modelopt:  # nvfp4_tensor.py: scale_2 = amax / (6 * 448); group scale = group amax / (6 * scale_2) in E4M3
        scale_2 = (amax / (E2M1_MAX * FP8_MAX)).float()
        scale = (group_amax / (E2M1_MAX * scale_2)).clamp(min=2**-9, max=FP8_MAX).to(torch.float8_e4m3fn)
        per_group = scale.float() * scale_2
    else:  # compressed-tensors: global = 448 * 6 / amax; group scale = group amax / 6 * global in E4M3
        glob = (FP8_MAX * E2M1_MAX / amax).float().reshape(1)
        scale = (group_amax / E2M1_MAX * glob).clamp(min=2**-9, max=FP8_MAX).to(torch.float8_e4m3fn)
        per_group = scale.float() / glob
    codes = torch.empty(rows, cols // 2, dtype=torch.uint8, device=w.device)
    step = max(1, (1 << 22) // cols)
    for r0 in range(0, rows, step):
        x = wf[r0:r0 + step].view(-1, cols // NVFP4_GROUP, NVFP4_GROUP) / per_group[r0:r0 + step].unsqueeze(-1)
        codes[r0:r0 + step] = _pack(_e2m1_codes(x.reshape(-1, cols)))
    if modelopt:
        return {"weight": codes, "weight_scale": scale, "weight_scale_2": scale_2.reshape(()),
                "input_scale": torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)}
    return {"weight_packed": codes, "weight_scale": scale, "weight_global_scale": glob}


def stored_tensors(fmt: str, name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The stored tensors (full names) for one weight `name` of value `w` in format `fmt`."""
    if fmt == "bf16" or w.dim() != 2 or not quantised_by_writer(name):
        return {name: w}
    base = name[: -len(".weight")]
    if fmt == "fp8-block":
        codes, scale = quantise_fp8_block(w)
        return {name: codes, f"{base}.weight_scale_inv": scale}
    if fmt == "ct-fp8-dynamic":
        codes, scale = quantise_fp8_channel(w)
        return {name: codes, f"{base}.weight_scale": scale}
    if fmt == "ct-fp8-block":
        codes, scale = quantise_fp8_block_ct(w)
        return {name: codes, f"{base}.weight_scale": scale}
    parts = quantise_nvfp4(w, modelopt=fmt == "modelopt-nvfp4")
    return {f"{base}.{k}": v for k, v in parts.items()}


# ---------------------------------------------------------------------------------------------- writing


def _stored_layout(config) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.dtype]]:
    """Stored name -> shape (experts per expert, as save_pretrained writes them) and the built dtype of each."""
    model = empty_model(config, torch.bfloat16)
    shapes = _param_shapes(model)
    fused = [n for n in shapes if n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj")]
    for n in fused:
        if len(shapes[n]) == 3:
            del shapes[n]
    # as DeepSeek's checkpoints store them: the router's score-correction bias in float32, all else bf16
    dtypes = {n: torch.float32 if n.endswith("e_score_correction_bias") else torch.bfloat16 for n in shapes}
    return shapes, dtypes


def _random(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: torch.device) -> torch.Tensor:
    """Deterministic per (seed, name): Linear weights N(0, 1/in), norms 1 + N(0, 0.1), biases N(0, 0.01)."""
    gen = torch.Generator(device=device).manual_seed((zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1)) & 0x7FFFFFFF)
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    if len(shape) == 1:
        x = (1.0 + 0.1 * x) if "norm" in leaf else 0.01 * x
    else:
        x = x / math.sqrt(shape[-1])
    return x.to(dtype)


def write_random_checkpoint(folder: str | Path, config, fmt: str, seed: int = 0, tokenizer_from: Path | None = None,
                            device: str | torch.device = "cpu", progress: Callable[[str], None] | None = None,
                            free_bytes_check: bool = False, index_only: bool = False) -> WrittenCheckpoint:
    """Write a random checkpoint of transformers `config` in format `fmt` into `folder` (created; must be empty).

    One shard per decoder layer, then one for the rest; the index last. `device`: where weights are drawn
    and quantised (a GPU is much faster at full width). `free_bytes_check`: refuse up front when the
    folder's disk cannot hold the estimated size. Returns the bytes written per layer. `index_only`: config.json,
    the safetensors index and the tokenizer, no shard (what a user has before downloading the weights: `mla-eval
    kld --dry-run` plans from it); the sizes returned are the format's byte counts of what the shards would hold."""
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise UserError(f"checkpoint format {fmt!r}: one of {', '.join(FORMATS)}")
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise UserError(f"{folder} is not empty: give a new folder for the checkpoint")
    folder.mkdir(parents=True, exist_ok=True)
    dev = torch.device(device)
    shapes, dtypes = _stored_layout(config)
    layers = int(config.num_hidden_layers)
    groups: list[list[str]] = [[] for _ in range(layers + 1)]
    for name in shapes:
        parts = name.split(".")
        idx = int(parts[2]) if name.startswith("model.layers.") else layers
        groups[idx].append(name)
    if free_bytes_check and not index_only:
        import shutil

        need = sum(_estimate_stored(fmt, n, shapes[n], dtypes[n]) for n in shapes)
        free = shutil.disk_usage(folder).free
        if need > free:
            raise UserError(f"{folder}: the checkpoint needs about {need / 1e9:.1f} GB, the disk has {free / 1e9:.1f} GB free; "
                            "write fewer layers")
    weight_map: dict[str, str] = {}
    sizes: list[int] = []
    count = len(groups)
    for k, names in enumerate(groups):
        shard = f"model-{k + 1:05d}-of-{count:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for name in sorted(names):
            w = (torch.empty(shapes[name], dtype=dtypes[name], device="meta") if index_only
                 else _random(name, shapes[name], dtypes[name], seed, dev))
            for stored_name, t in stored_tensors(fmt, name, w).items():
                tensors[stored_name] = t if index_only else t.contiguous().cpu()
        if not index_only:
            save_file(tensors, str(folder / shard), metadata={"format": "pt"})
        sizes.append(sum(t.numel() * t.element_size() for t in tensors.values()))
        weight_map.update(dict.fromkeys(tensors, shard))
        if progress:
            what = f"layer {k}" if k < layers else "embeddings, norm, lm_head"
            progress(f"{shard}: {what}, {sizes[-1] / 1e9:.3f} GB")
        del tensors
    qc, hf_quant = quantization_config(fmt)
    config.save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    raw.pop("quantization_config", None)
    # transformers >= 5.2x writes a derived `layer_types` ("indexed_attention") that transformers 5.17 (the H200's)
    # refuses; the published DSA configs do not carry it, and every version derives it again
    if raw.get("model_type") in ("glm_moe_dsa", "deepseek_v32") and set(raw.get("layer_types") or []) <= {"indexed_attention"}:
        raw.pop("layer_types", None)
    if qc is not None:
        raw["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if hf_quant is not None:
        (folder / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4) + "\n", encoding="utf-8")
    if tokenizer_from is not None:
        import shutil

        for f in ("tokenizer.json", "tokenizer_config.json"):
            if (Path(tokenizer_from) / f).is_file():
                shutil.copy(Path(tokenizer_from) / f, folder / f)
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
    tmp = folder / (INDEX_NAME + ".tmp")
    tmp.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    tmp.replace(folder / INDEX_NAME)  # last: a folder with an index is complete
    return WrittenCheckpoint(folder, fmt, tuple(sizes[:layers]), sizes[layers], sum(sizes))


def _estimate_stored(fmt: str, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = math.prod(shape)
    if fmt == "bf16" or len(shape) != 2 or not quantised_by_writer(name):
        return n * torch.empty((), dtype=dtype).element_size()
    rows, cols = shape
    if fmt == "fp8-block":
        return n + math.ceil(rows / BLOCK[0]) * math.ceil(cols / BLOCK[1]) * 4
    if fmt == "ct-fp8-dynamic":
        return n + rows * 2
    if fmt == "ct-fp8-block":
        return n + math.ceil(rows / BLOCK[0]) * math.ceil(cols / BLOCK[1]) * 2
    return n // 2 + n // NVFP4_GROUP + (8 if fmt == "modelopt-nvfp4" else 4)  # + weight_scale_2 / global, input_scale


def estimate_layer_bytes(config, fmt: str) -> tuple[list[int], int]:
    """Stored bytes per decoder layer and for the rest, as write_random_checkpoint will write them."""
    shapes, dtypes = _stored_layout(config)
    layers = int(config.num_hidden_layers)
    per = [0] * (layers + 1)
    for name, shape in shapes.items():
        idx = int(name.split(".")[2]) if name.startswith("model.layers.") else layers
        per[idx] += _estimate_stored(fmt, name, shape, dtypes[name])
    return per[:layers], per[layers]
