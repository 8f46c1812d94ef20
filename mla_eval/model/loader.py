"""Load a local Hugging Face MLA checkpoint (or the embedded default model), offline."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from mla_eval.errors import UserError
from mla_eval.model.adapter import DSA_TYPES, MlaAdapter, check_supported


@dataclasses.dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    adapter: MlaAdapter
    path: Path
    name: str
    device: torch.device
    is_default: bool

    @property
    def num_layers(self) -> int:
        return self.adapter.num_layers

    @property
    def layer_devices(self) -> list[torch.device]:
        """Where each layer's attention runs (differs per layer under --device-map auto)."""
        return [m.kv_a_proj_with_mqa.weight.device for m in self.adapter.modules]

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 0)


def default_model_path() -> Path:
    from mla_eval.model_home import default_model_path as home

    return home()


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device} asked for, but no CUDA GPU is visible; use --device cpu")
    return torch.device(device)


def load_config(path: Path):
    from transformers import AutoConfig

    if not path.is_dir():
        raise UserError(f"model directory {path} does not exist; give --model a local Hugging Face checkpoint folder")
    if not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json: not a Hugging Face model folder")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise UserError(f"cannot read {path}/config.json ({str(exc).splitlines()[0]})") from None
    check_supported(config)
    return config


DEVICE_MAPS = ("none", "auto")
DEVICE_MAP_HELP = (
    "'auto': spread the model's layers over every visible GPU (a checkpoint too large for one; needs accelerate); "
    "each layer's cache lives on its layer's GPU. 'none': the whole model on --device."
)


def load_model(
    model: str | Path | None, device: str | None = None, dtype: str = "auto", device_map: str = "none"
) -> LoadedModel:
    """Load weights + tokenizer, patch the attention modules, put the model in eval mode.

    dtype 'auto': float32 on CPU (the reference path is exact there), bfloat16 on CUDA.
    device_map 'auto': transformers spreads the layers over every visible GPU (a checkpoint too
    large for one; needs `accelerate`); each layer's cache then lives on that layer's GPU, and
    `device` is ignored.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress bar and errors own stderr
    hf_logging.set_verbosity_error()

    is_default = model is None
    path = default_model_path() if is_default else Path(model).expanduser()
    config = load_config(path)
    if device_map not in DEVICE_MAPS:
        raise UserError(f"--device-map {device_map!r}: one of {', '.join(DEVICE_MAPS)}")
    if device_map == "auto":
        import importlib.util

        if importlib.util.find_spec("accelerate") is None:
            raise UserError("--device-map auto needs the accelerate package: pip install accelerate")
        device = "auto"
    dev = resolve_device(device)
    torch_dtype = {"auto": torch.float32 if dev.type == "cpu" else torch.bfloat16, "float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise UserError(f"--dtype {dtype!r} is not one of auto, float32, bfloat16")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(f"{path} has no usable tokenizer ({str(exc).splitlines()[0]}); copy the checkpoint's tokenizer files next to it") from None
    # DSA indexers need a materialised attention mask: run those models with eager attention.
    attn = "eager" if config.model_type in DSA_TYPES else "sdpa"
    try:
        extra = {"device_map": "auto"} if device_map == "auto" else {}
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation=attn, local_files_only=True, **extra)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load weights from {path} ({str(exc).splitlines()[0]})") from None
    if device_map == "auto":
        offloaded = sorted({str(d) for d in getattr(hf, "hf_device_map", {}).values()} & {"disk", "meta"})
        if offloaded:
            raise UserError(f"--device-map auto offloaded layers to {', '.join(offloaded)}: the model does not fit the visible GPUs and CPU memory")
        dev = hf.get_input_embeddings().weight.device  # where the token ids go in
    else:
        hf = hf.to(dev)
    hf = hf.eval()
    return LoadedModel(
        model=hf,
        tokenizer=tokenizer,
        adapter=MlaAdapter(hf),
        path=path,
        name="mla-eval default model" if is_default else path.name,
        device=dev,
        is_default=is_default,
    )
