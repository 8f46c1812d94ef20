"""Reads the training recipe (TOML): every hyper-parameter of the default model lives there."""

from __future__ import annotations

from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def load_recipe(path: str | Path) -> dict:
    """The recipe as a dict; `phase` is a list of curriculum phases, run in order."""
    with open(path, "rb") as f:
        recipe = tomllib.load(f)
    for key in ("model", "tokenizer", "data", "optim", "phase"):
        if key not in recipe:
            raise ValueError(f"recipe {path} has no [{key}] section")
    return recipe
