"""Load a local Hugging Face MLA checkpoint, the embedded default model, or a random preset model, offline."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
from pathlib import Path
from typing import Iterator

import torch

from mla_eval.errors import UserError
from mla_eval.formats import check_model_dims
from mla_eval.model.adapter import DSA_TYPES, SUPPORTED, MlaAdapter, check_supported, stock_attention
from mla_eval.model.checkpoint import load_resident, quantised_weights
from mla_eval.model.deepseek_v4 import V4Adapter, V4Stack, is_v4
from mla_eval.model.experts import DEFAULT_EXPERTS, check_experts, select_experts
from mla_eval.model.fp8_linear import check_weight_math
from mla_eval.model.indexer import INDEXER_FIELDS
from mla_eval.model.random_models import build_random_model, is_random_spec, parse_random_spec
from mla_eval.model.rope_scaling import apply_yarn, describe, parse_rope_scaling
from mla_eval.model.strategy import ExecutionRequest, check_request
from mla_eval.model_presets import preset_names

# The one help text of every command's --model option.
MODEL_HELP = (
    "A local Hugging Face MLA checkpoint folder (default: the embedded model), or "
    "'random:<preset>[:layers=N][:seed=S][:hidden=H][:topk=K]': random weights with a preset's exact attention "
    f"geometry ({', '.join(preset_names())}), N layers (default 3), for plumbing, timing and memory, not quality."
)


@dataclasses.dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    adapter: MlaAdapter
    path: Path  # the checkpoint folder; for a random model its spec string (there is no folder)
    name: str
    device: torch.device
    is_default: bool
    is_random: bool = False  # random weights (a `random:` spec): numbers about cost, never about quality
    label: str = ""  # one line saying what was loaded, for output headers
    rope_from_option: bool = False  # --rope-scaling rewrote the checkpoint's rope (model.rope_scaling)
    # a streamed checkpoint (--offload stream): its decoder layers stay on the meta device and come from here one at a
    # time (mla_eval.model.executor.CheckpointLoader); None: every layer is in memory
    checkpoint: object | None = None

    def __post_init__(self) -> None:
        if not self.label:
            self.label = "the embedded default model" if self.is_default else f"checkpoint {self.path}"

    @property
    def num_layers(self) -> int:
        return self.adapter.num_layers

    @functools.cached_property
    def stack(self):
        """The decoder layers, run one at a time (`mla_eval.model.executor.DecoderStack`)."""
        if getattr(self.adapter, "is_v4", False):
            return V4Stack(self)
        from mla_eval.model.executor import DecoderStack

        return DecoderStack(self)

    @property
    def layer_devices(self) -> list[torch.device]:
        """Where each layer's attention runs (differs per layer under --device-map auto; a streamed layer, on the meta
        device between its turns, runs on the model's device)."""
        devices = [getattr(m, "kv_a_proj_with_mqa", None) or m.kv_proj for m in self.adapter.modules]  # MLA | V4
        devices = [proj.weight.device for proj in devices]
        return [self.device if d.type == "meta" else d for d in devices]

    def weights(self) -> dict | None:
        """What the weights were as stored (`Checkpoint.describe()`: method, quantised tensors), for results; None
        for a model that never went through the checkpoint reader."""
        return getattr(self.model, "mla_eval_weights", None)

    def compute(self) -> dict:
        """How the weights compute, for results: the weight math (mla_eval.model.fp8_linear) and what runs the routed
        experts (mla_eval.model.experts; None without experts)."""
        from mla_eval.model.experts import describe

        math = getattr(self.model, "mla_eval_weight_math", None) or {"math": "dequant", "reason": "weights built in memory"}
        return {"weight_math": math, "experts": describe(self.model)}

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 0)

    @property
    def rope_scaling(self) -> dict | None:
        """The rope scaling the model runs with (None: plain rope), recorded in every result."""
        return describe(self.model.config, self.rope_from_option)


def adapter_for(model) -> MlaAdapter | V4Adapter:
    """The attention adapter of a loaded model: DeepSeek-V4's session surface, or MLA's owned forwards."""
    return V4Adapter(model) if is_v4(model.config) else MlaAdapter(model)


def default_model_path() -> Path:
    from mla_eval.model_home import default_model_path as home

    return home()


def resolve_device(device: str | None) -> torch.device:
    """'auto' (or None): cuda when a GPU is visible, else cpu; or exactly cpu, cuda, cuda:N."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", device.strip()):
        raise UserError(f"--device {device!r}: give one of auto, cpu, cuda, cuda:N")
    device = device.strip()
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"--device {device} asked for, but no CUDA GPU is visible; use --device cpu")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise UserError(f"--device {device}: only {torch.cuda.device_count()} CUDA GPU(s) visible (cuda:0..)")
    return torch.device(device)


def _check_raw_config(path: Path) -> None:
    """Refuse what transformers would silently fill in: a missing kv_lora_rank (it defaults to 512)
    or missing DSA indexer fields (they default to the DeepSeek/GLM values)."""
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read {path}/config.json ({str(exc).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}/config.json must hold a JSON object")
    raw = raw.get("text_config") if "kv_lora_rank" not in raw and isinstance(raw.get("text_config"), dict) else raw
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED:
        check_supported(type("Config", (), {"model_type": model_type})())  # the one-line refusal of the type
    if raw.get("kv_lora_rank") is None:
        raise UserError(
            f"{path}/config.json has no kv_lora_rank (model_type {model_type!r}): not an MLA checkpoint, or an incomplete "
            "config; give the checkpoint's full config.json"
        )
    if isinstance(raw.get("kv_lora_rank"), int) and isinstance(raw.get("qk_rope_head_dim"), int):
        check_model_dims(raw["kv_lora_rank"], raw["qk_rope_head_dim"], f"{path} ({model_type})")  # before any weight
    if model_type in DSA_TYPES:
        missing = [f for f in INDEXER_FIELDS if raw.get(f) is None]
        if missing:
            raise UserError(
                f"{path}/config.json is a DSA model ({model_type}) without {', '.join(missing)}: give its full config.json"
            )


def load_config(path: Path):
    from transformers import AutoConfig

    if path.exists() and not path.is_dir():
        raise UserError(f"--model {path} is a file, not a checkpoint folder; give the folder that holds its config.json")
    if not path.is_dir():
        raise UserError(f"model directory {path} does not exist; give --model a local Hugging Face checkpoint folder")
    if not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json: not a Hugging Face model folder")
    _check_raw_config(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise UserError(f"cannot read {path}/config.json ({str(exc).splitlines()[0]})") from None
    check_supported(config)
    return config


DEVICE_MAPS = ("none", "auto")
MAX_MEMORY_HELP = (
    "With --device-map auto: the most memory accelerate may plan on each GPU, e.g. 40GiB or 80GB (its max_memory); "
    "a smaller cap spreads the layers over more GPUs. Default: what each GPU has free."
)
_MEMORY_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                 "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str, option: str = "--max-memory") -> int:
    """'40GiB' / '80GB' / '500MiB' / '123456' (bytes) -> bytes; one-line UserError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _MEMORY_UNITS or float(m.group(1)) <= 0:
        raise UserError(f"{option} {text!r}: give a positive size such as 40GiB, 80GB or 500MiB")
    return int(float(m.group(1)) * _MEMORY_UNITS[unit])


def check_max_memory(max_memory: str | None, device_map: str) -> int | None:
    """The --max-memory cap in bytes (None without one); it only means something with --device-map auto."""
    if max_memory is None:
        return None
    cap = parse_memory(max_memory)
    if device_map != "auto":
        raise UserError("--max-memory caps what --device-map auto plans per GPU: add --device-map auto, or drop it")
    return cap


def gpu_max_memory(cap_bytes: int, gpus: int) -> dict[int, int]:
    """accelerate's max_memory: the same cap on every visible GPU (CPU and disk get nothing: an offload is refused)."""
    return {i: cap_bytes for i in range(gpus)}
DEVICE_MAP_HELP = (
    "'auto': spread the model's layers over every visible GPU (a checkpoint too large for one; needs accelerate); "
    "each layer's cache lives on its layer's GPU; with no GPU visible every layer stays on the CPU, and a warning says "
    "so. 'none': the whole model on --device."
)


@contextlib.contextmanager
def _quiet_offline() -> Iterator[None]:
    """Offline and quiet only while loading: HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE set (unless the
    user set them), transformers' verbosity at error and its progress bars off; all restored after."""
    from transformers.utils import logging as hf_logging

    saved_env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    for key in saved_env:
        os.environ.setdefault(key, "1")
    hf_logging.set_verbosity_error()  # our own progress bar and errors own stderr
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _torch_dtype(dtype: str, dev: torch.device) -> torch.dtype:
    torch_dtype = {"auto": torch.float32 if dev.type == "cpu" else torch.bfloat16, "float32": torch.float32,
                   "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise UserError(f"--dtype {dtype!r} is not one of auto, float32, bfloat16")
    return torch_dtype


def load_model(
    model: str | Path | None, device: str | None = None, dtype: str = "auto", device_map: str = "none",
    rope_scaling: str | None = None,
    max_memory: str | None = None,
    streamed: bool = False,
    experts: str = DEFAULT_EXPERTS,
    weight_math: str = "auto",
) -> LoadedModel:
    """Load weights + tokenizer, patch the attention modules, put the model in eval mode.

    `model`: None (the embedded default model), a local Hugging Face checkpoint folder, or a random
    preset spec `random:<preset>[:layers=N][:seed=S][:hidden=H][:topk=K]` (see mla_eval.model.random_models):
    random weights with the preset's exact attention geometry (heads, q_lora, nope/rope/v dims,
    kv_lora 512, DSA indexer and its layer schedule, rope), N layers (default 3) of small dense MLP,
    the embedded tokenizer, built directly on the device (bf16 on CUDA), seeded by S (default 0):
    the same spec gives the same weights. Its LoadedModel has is_random=True and a label saying the
    numbers are for plumbing, timing and memory, not quality.
    dtype 'auto': float32 on CPU (the reference path is exact there), bfloat16 on CUDA.
    device_map 'auto': transformers spreads the layers over every visible GPU (a checkpoint too
    large for one; needs `accelerate`); each layer's cache then lives on that layer's GPU, and
    `device` is ignored. `max_memory` ('40GiB'): the cap accelerate plans with on each GPU.
    rope_scaling 'yarn:FACTOR' extends the checkpoint's context (mla_eval.model.rope_scaling).
    streamed: a checkpoint's decoder layers are not loaded (they stay on the meta device): the embeddings, final
    norm and head are, and `LoadedModel.checkpoint` reads each layer when the layer-major executor runs it.
    experts: the routed experts' implementation (mla_eval.model.experts); weight_math: how quantised weights compute
    (mla_eval.model.fp8_linear: auto, dequant, fp8).
    Environment variables and transformers' logging state are changed only during the load.
    """
    if device_map not in DEVICE_MAPS:
        raise UserError(f"--device-map {device_map!r}: one of {', '.join(DEVICE_MAPS)}")
    factor = parse_rope_scaling(rope_scaling)
    cap = check_max_memory(max_memory, device_map)
    check_experts(experts)
    check_weight_math(weight_math)
    # the execution refusals (a device map never streams nor holds quantised weights): mla_eval.model.strategy
    check_request(ExecutionRequest(model, device_map=device_map, offload="stream" if streamed else "auto"))
    with _quiet_offline():
        if model is not None and is_random_spec(str(model)):
            if factor is not None:
                raise UserError("--rope-scaling applies to checkpoints; a random:<preset> model keeps its preset's rope/yarn")
            _refuse_fp8_of_random(weight_math)
            lm = _load_random(str(model), device, dtype, device_map)
        else:
            lm = _load_checkpoint(model, device, dtype, device_map, factor, cap, streamed, weight_math)
    select_experts(lm.model, experts)
    return lm


def _load_random(text: str, device: str | None, dtype: str, device_map: str) -> LoadedModel:
    from transformers import AutoTokenizer

    spec = parse_random_spec(text)
    if device_map != "none":
        raise UserError("--device-map auto is for checkpoints too large for one GPU; a random model is built on --device")
    dev = resolve_device(device)
    tokenizer_dir = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    vocab = json.loads((tokenizer_dir / "config.json").read_text(encoding="utf-8"))["vocab_size"]  # the embedded model's
    hf = build_random_model(spec, vocab, dev, _torch_dtype(dtype, dev))
    return LoadedModel(
        # path: the spec itself, not the tokenizer's folder, so nothing keyed on a model's path (a stored
        # reference, a result name) mistakes one random model for another or for the embedded model
        model=hf, tokenizer=tokenizer, adapter=adapter_for(hf), path=Path(spec.name), name=spec.name, device=dev,
        is_default=False, is_random=True, label=spec.label,
    )


def _refuse_fp8_of_random(weight_math: str) -> None:
    if weight_math == "fp8":
        raise UserError("--weight-math fp8 computes a checkpoint's FP8 weights as stored; a random:<preset> model "
                        "has bf16 weights: drop it")


def _random_skeleton(text: str, device: str | None, dtype: str) -> LoadedModel:
    """A random model planned from its shapes alone: every parameter on the meta device, nothing drawn (a 61-layer
    DeepSeek-V3 would need ~48 GiB built)."""
    from transformers import AutoTokenizer

    from mla_eval.model.random_models import build_random_skeleton

    spec = parse_random_spec(text)
    dev = resolve_device(device)
    with _quiet_offline():
        tokenizer = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)
    vocab = json.loads((default_model_path() / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    hf = build_random_skeleton(spec, vocab, _torch_dtype(dtype, dev))
    return LoadedModel(model=hf, tokenizer=tokenizer, adapter=MlaAdapter(hf), path=Path(spec.name), name=spec.name,
                       device=dev, is_default=False, is_random=True, label=spec.label)


def _load_checkpoint(
    model: str | Path | None, device: str | None, dtype: str, device_map: str, yarn_factor: float | None = None,
    cap: int | None = None, streamed: bool = False, weight_math: str = "auto",
) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    is_default = model is None
    path = default_model_path() if is_default else Path(model).expanduser()
    config = load_config(path)
    if yarn_factor is not None:
        apply_yarn(config, yarn_factor)
    if device_map == "auto":
        import importlib.util

        if importlib.util.find_spec("accelerate") is None:
            raise UserError("--device-map auto needs the accelerate package: pip install accelerate")
        device = "auto"
    dev = resolve_device(device)
    torch_dtype = _torch_dtype(dtype, dev)
    tokenizer = _tokenizer(path)
    attn = stock_attention(config.model_type)
    if streamed:
        hf, ckpt = _streamed_skeleton(path, config, dev, torch_dtype, attn, weight_math)
        return LoadedModel(
            model=hf, tokenizer=tokenizer, adapter=MlaAdapter(hf), path=path,
            name="mla-eval default model" if is_default else path.name, device=dev, is_default=is_default,
            rope_from_option=yarn_factor is not None, checkpoint=ckpt,
        )
    try:
        extra = {"device_map": "auto"} if device_map == "auto" else {}
        if cap is not None:
            if not torch.cuda.is_available():
                raise UserError("--max-memory caps each GPU, but no CUDA GPU is visible; drop it on a CPU machine")
            extra["max_memory"] = gpu_max_memory(cap, torch.cuda.device_count())
        if quantised_weights(path):  # FP8 / NVFP4 weights: our reader materialises them (mla_eval.model.checkpoint)
            hf = load_resident(path, config, dev, torch_dtype, attn, weight_math)
        else:
            resolve_math(weight_math, None)  # fp8 asked of a bf16 checkpoint: refused here
            _check_headers(path)  # as every path: a config that does not describe its shards is refused, not loaded
            hf = AutoModelForCausalLM.from_pretrained(
                path, config=config, dtype=torch_dtype, attn_implementation=attn, local_files_only=True, **extra
            )
            hf.mla_eval_weight_math = {"math": "dequant", "reason": resolve_math(weight_math, None)[1]}
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load weights from {path} ({str(exc).splitlines()[0]})") from None
    if device_map == "auto":
        offloaded = sorted({str(d) for d in getattr(hf, "hf_device_map", {}).values()} & {"disk", "meta"})
        if offloaded or (cap is not None and "cpu" in {str(d) for d in getattr(hf, "hf_device_map", {}).values()}):
            where = ", ".join(offloaded) or "cpu"
            limit = f" under --max-memory {cap / 2**30:.3g} GiB per GPU" if cap is not None else " and CPU memory"
            raise UserError(
                f"--device-map auto offloaded layers to {where}: the model does not fit the visible GPUs{limit}; "
                "raise the cap or use more GPUs"
            )
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
        rope_from_option=yarn_factor is not None,
    )


def resolve_math(weight_math: str, fmt) -> tuple[str, str]:
    from mla_eval.model.fp8_linear import resolve_weight_math

    return resolve_weight_math(weight_math, fmt)


def _check_headers(path: Path) -> None:
    """The shards' headers against config.json (mla_eval.model.weight_checks) before transformers reads a weight."""
    from mla_eval.model.checkpoint import INDEX_NAME, SINGLE_NAME, Checkpoint

    if (path / INDEX_NAME).is_file() or (path / SINGLE_NAME).is_file():
        Checkpoint.open(path, require_weights=True)


def _skeleton(path: Path, config, dtype: torch.dtype, attn: str, require_weights: bool, weight_math: str = "auto"):
    """The model built from config.json with every parameter on the meta device (FP8 modules where the weight math
    keeps FP8 weights as stored), and its checkpoint (headers only)."""
    from mla_eval.model.checkpoint import Checkpoint, apply_weight_math, empty_model

    ckpt = Checkpoint.open(path, require_weights=require_weights)
    hf = empty_model(config, dtype, attn)
    if len(hf.model.layers) != ckpt.num_layers:
        raise UserError(f"{path}: config.json builds {len(hf.model.layers)} layers, the checkpoint has {ckpt.num_layers}")
    apply_weight_math(hf, ckpt, weight_math)
    hf.mla_eval_weights = ckpt.describe()
    return hf, ckpt


def _materialise_rest(hf, ckpt, dev: torch.device, dtype: torch.dtype) -> None:
    """Embeddings, final norm and head read into a skeleton on `dev`; its buffers (rotary tables) join them."""
    ckpt.check_shards()
    ckpt.materialise_rest(hf, ckpt.read_rest(), dev, dtype)
    buffers_to(hf, dev)


def buffers_to(model: torch.nn.Module, dev: torch.device) -> None:
    """Every real buffer of `model` (rotary tables, router biases) moved to `dev`; parameters stay where they are
    (a skeleton's decoder layers on the meta device)."""
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device.type != "meta":
                module._buffers[name] = buf.to(dev)


def _streamed_skeleton(path: Path, config, dev: torch.device, dtype: torch.dtype, attn: str, weight_math: str = "auto"):
    """The model with only its embeddings, final norm and head loaded (decoder layers on the meta device), and the
    checkpoint its layers will be read from."""
    hf, ckpt = _skeleton(path, config, dtype, attn, require_weights=True, weight_math=weight_math)
    _materialise_rest(hf, ckpt, dev, dtype)
    return hf.eval(), ckpt


def load_skeleton(model: str | Path | None, device: str | None = None, dtype: str = "auto",
                  rope_scaling: str | None = None, require_weights: bool = True, experts: str = DEFAULT_EXPERTS,
                  weight_math: str = "auto") -> LoadedModel:
    """A checkpoint's model with no weight read (every parameter on the meta device), its tokenizer, and its
    checkpoint's plan (`LoadedModel.checkpoint`): what a run plan needs before deciding how to load.
    `require_weights=False` accepts a folder holding only config.json, the safetensors index and the tokenizer
    (planning a download). `stream(lm)` turns it into a streamed model; nothing else may run it. A `random:<preset>`
    spec gives its model on the meta device (a dry run plans from its shapes; it has no checkpoint)."""
    factor = parse_rope_scaling(rope_scaling)
    check_weight_math(weight_math)
    if model is not None and is_random_spec(str(model)):
        if factor is not None:
            raise UserError("--rope-scaling applies to checkpoints; a random:<preset> model keeps its preset's rope/yarn")
        _refuse_fp8_of_random(weight_math)
        lm = _random_skeleton(str(model), device, dtype)
        select_experts(lm.model, check_experts(experts))
        return lm
    with _quiet_offline():
        is_default = model is None
        path = default_model_path() if is_default else Path(model).expanduser()
        config = load_config(path)
        if factor is not None:
            apply_yarn(config, factor)
        dev = resolve_device(device)
        tokenizer = _tokenizer(path)
        hf, ckpt = _skeleton(path, config, _torch_dtype(dtype, dev), stock_attention(config.model_type), require_weights,
                             weight_math)
    select_experts(hf, check_experts(experts))
    return LoadedModel(
        model=hf.eval(), tokenizer=tokenizer, adapter=MlaAdapter(hf), path=path,
        name="mla-eval default model" if is_default else path.name, device=dev, is_default=is_default,
        rope_from_option=factor is not None, checkpoint=ckpt,
    )


def stream(lm: LoadedModel) -> LoadedModel:
    """A skeleton (`load_skeleton`) made runnable layer by layer: its embeddings, final norm and head read onto its
    device; the decoder layers stay on the meta device until the streamed executor reads each."""
    _materialise_rest(lm.model, lm.checkpoint, lm.device, lm.model.dtype)
    return lm


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(
            f"{path} has no usable tokenizer ({str(exc).splitlines()[0]}); copy the checkpoint's tokenizer files next to it"
        ) from None
