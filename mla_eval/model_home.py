"""Where the embedded default model lives: a data folder shipped inside the package."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIRNAME = "default_model"


def default_model_path() -> Path:
    """Folder of the shipped default model (config.json, model.safetensors, tokenizer files),
    loadable with `AutoModelForCausalLM.from_pretrained(default_model_path())` offline."""
    return Path(__file__).resolve().parent / DEFAULT_MODEL_DIRNAME
