"""Approximate hardware reciprocals, reproduced on the CPU from a table measured on the GPU.

Engines' NVFP4 writers take `rcp.approx.ftz.f32` of an E4M3 block scale (and of the constant 6).
The instruction is not IEEE, so its results cannot be derived here; but those inputs come from a
small set, so the exact outputs were measured once on an H200 (`kernels/measure_rcp_approx.py`)
and committed as `data/rcp_approx_ftz_f32.json` ({"instruction", "device", "inputs": [float32
bit patterns], "outputs": [float32 bit patterns], ...}). This module loads that table and looks
inputs up in it; an input the table lacks is refused, never approximated silently.

Where an engine takes the approximate reciprocal of an arbitrary float32 (a per-token scale), no
table can hold it: the codec uses the correctly rounded reciprocal there, and the spec of that
format says so with the measured residual (`FormatSpec.engine.note`).
"""

from __future__ import annotations

import functools
import json
from importlib import resources

import torch

TABLE_FILE = "rcp_approx_ftz_f32.json"
INSTRUCTION = "rcp.approx.ftz.f32"


def load_table(doc: dict) -> dict[int, int]:
    """Validate a measured table document -> {input float32 bits: output float32 bits}."""
    if doc.get("instruction") != INSTRUCTION:
        raise ValueError(f"reciprocal table is for {doc.get('instruction')!r}, expected {INSTRUCTION!r}")
    inputs, outputs = doc.get("inputs"), doc.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
        raise ValueError("reciprocal table needs equally long, non-empty 'inputs' and 'outputs' lists")
    return {int(i) & 0xFFFFFFFF: int(o) & 0xFFFFFFFF for i, o in zip(inputs, outputs)}


@functools.cache
def measured_table() -> dict[int, int]:
    """The committed H200 measurement."""
    text = resources.files("mla_eval.formats").joinpath("data", TABLE_FILE).read_text()
    return load_table(json.loads(text))


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def rcp_approx_e4m3_lut(table: dict[int, int] | None = None) -> torch.Tensor:
    """float32 [256]: rcp.approx.ftz of the value of each E4M3 code (0 for codes 0x00 / 0x80 and NaN).

    Every positive finite E4M3 value must be in the table; negative codes mirror the positive ones.
    """
    table = measured_table() if table is None else table
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    out = torch.zeros(256, dtype=torch.int64)
    for code in range(1, 0x7F):
        key = int(_bits(values[code : code + 1]))
        if key not in table:
            raise ValueError(f"reciprocal table lacks E4M3 value {values[code].item()!r} (code {code:#04x})")
        out[code] = table[key]
        out[code | 0x80] = table[key] | 0x80000000
    return out.to(torch.int32).view(torch.float32)


def rcp_approx_of(x: float, table: dict[int, int] | None = None) -> float:
    """rcp.approx.ftz of one tabulated constant (e.g. 6.0)."""
    table = measured_table() if table is None else table
    key = int(_bits(torch.tensor([x], dtype=torch.float32)))
    if key not in table:
        raise ValueError(f"reciprocal table lacks {x!r}")
    return float(torch.tensor([table[key]], dtype=torch.int64).to(torch.int32).view(torch.float32))
