"""Latent profiles: give a model the per-layer latent magnitudes of another, by an exact reparametrisation.

Real MLA models' cached latents differ in size by layer far more than our embedded model's: GLM-5.2's max |c_kv|
(after kv_a_layernorm) runs from 0.0217 (layer 1) to 5.19 (layer 65), and its first eight layers stay at or below
0.10, where NVFP4 block scales (amax / 6) fall into E4M3's subnormals -- the effect the per-layer outer scale s_l
exists to fix. The embedded model spans 2.97-5.16, so it cannot show that effect as shipped.

`apply_latent_profile` multiplies each layer's kv_a_layernorm weight by c_l and divides kv_b_proj's input columns
(the 512 latent columns it reads) by c_l. c_kv becomes c_l * c_kv, and everything that reads it -- the absorbed
query W_UK, the output W_UV, the MHA up-projection -- sees W / c_l: in exact arithmetic the model computes the same
function, and its cached latent has max |c_kv| = c_l x the measured one. c_l = target_l / measured_l, measured on
a calibration window of the run's own text with the stock forward. The rope key k_pe is left as it is (the published
profiles cover c_kv only); the DSA indexer reads the hidden states, not c_kv, and is untouched.

A profile is a built-in name (`PROFILES`), or a JSON file with per-layer `max_abs` (a published outer-scale file
such as the one GLM-5.2's comes from), or `mla-eval calibrate`'s output (its `max_abs_c_kv`, or `scales` x
`denominator`). A profile of another layer count is interpolated over relative depth, linearly in log magnitude.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch

from mla_eval.errors import UserError
from mla_eval.formats.outer_scale import check_latent_max_abs

# GLM-5.2's per-layer max |c_kv| after kv_a_layernorm, 78 layers, one wikitext-2 test window of 2048 tokens:
# yatesdr/vllm-opt, kv-scales/glm52-nvfp4-nf3-hybrid_mla_outer_scales_v1.json @6023d26d73dd, field max_abs
# (model madeby561/GLM-5.2-MXFP8-NVFP4-NF3-Hybrid; "hook: mla.py kv_a_layernorm output").
_GLM52_MAX_ABS = (
    0.04833984375, 0.021728515625, 0.03662109375, 0.1005859375, 0.023681640625, 0.03515625, 0.046875, 0.033203125,
    0.259765625, 0.1474609375, 0.7734375, 1.0, 1.1171875, 0.150390625, 0.76171875, 0.392578125, 0.25390625,
    0.455078125, 0.80859375, 0.80078125, 0.96875, 0.78515625, 0.58203125, 0.330078125, 0.89453125, 0.73046875,
    1.0390625, 1.578125, 1.0078125, 0.92578125, 1.25, 1.5859375, 1.234375, 1.9140625, 1.9453125, 1.7578125,
    1.7890625, 2.546875, 2.296875, 2.4375, 1.921875, 2.171875, 2.875, 2.546875, 2.765625, 3.234375, 2.5625,
    3.390625, 2.40625, 2.546875, 3.09375, 2.90625, 3.671875, 2.46875, 2.609375, 2.359375, 3.078125, 3.171875,
    2.578125, 2.359375, 3.890625, 2.953125, 4.09375, 4.09375, 5.0625, 5.1875, 2.984375, 2.875, 2.984375, 3.296875,
    3.828125, 2.859375, 3.59375, 3.734375, 4.25, 4.1875, 4.84375, 3.75,
)


@dataclasses.dataclass(frozen=True)
class LatentProfile:
    """Target max |c_kv| per layer of some model, and where the figures come from."""

    name: str
    max_abs: tuple[float, ...]
    source: str

    def __post_init__(self) -> None:
        if not self.max_abs:
            raise UserError(f"latent profile {self.name}: it gives no layer's max |c_kv|")
        for i, a in enumerate(self.max_abs):  # 1e30 or 1e-30 would be applied as noise: refused, named
            check_latent_max_abs(a, f"latent profile {self.name}: layer {i}'s max |c_kv|")

    def summary(self) -> str:
        """'glm-5.2 (78 layers, max |c_kv| 0.0217..5.19)': what the screen says was applied."""
        return (f"{self.name} ({len(self.max_abs)} layers, max |c_kv| {min(self.max_abs):.3g}..{max(self.max_abs):.3g})")

    def for_layers(self, n: int) -> list[float]:
        """The profile at `n` layers: layer l sits at relative depth l / (n - 1) of the profile's layers,
        interpolated linearly in log magnitude (a profile of n layers is returned as it is)."""
        m = len(self.max_abs)
        if n == m:
            return list(self.max_abs)
        out = []
        for layer in range(n):
            x = 0.0 if n == 1 else layer * (m - 1) / (n - 1)
            lo = min(int(math.floor(x)), m - 1)
            hi = min(lo + 1, m - 1)
            f = x - lo
            if f == 0:  # on a profile layer: its published figure exactly
                out.append(self.max_abs[lo])
            else:
                out.append(math.exp((1 - f) * math.log(self.max_abs[lo]) + f * math.log(self.max_abs[hi])))
        return out


PROFILES = {
    "glm-5.2": LatentProfile(
        "glm-5.2", _GLM52_MAX_ABS,
        "GLM-5.2 max |c_kv| per layer (78 layers, one wikitext-2 test window of 2048 tokens): yatesdr/vllm-opt "
        "kv-scales/glm52-nvfp4-nf3-hybrid_mla_outer_scales_v1.json @6023d26d73dd",
    ),
}
PROFILE_HELP = (
    "Give the model another model's per-layer latent magnitudes by an exact reparametrisation (kv_a_layernorm x c_l, "
    f"kv_b_proj / c_l): a built-in profile ({', '.join(PROFILES)}), a JSON file with per-layer max_abs (a published "
    "outer-scale file, or `mla-eval calibrate` output), or 'none'. Interpolated over depth to the model's layers."
)
MAX_PROFILE_BYTES = 1 << 20


def parse_profile(text: str | None) -> LatentProfile | None:
    """'none' / None -> None; a built-in name; else a JSON file (one-line UserError naming what is wrong)."""
    if text is None or text == "none":
        return None
    if text in PROFILES:
        return PROFILES[text]
    path = Path(text)
    if not path.is_file():
        raise UserError(
            f"--latent-profile {text!r} is neither a built-in profile ({', '.join(PROFILES)}) nor a JSON file; "
            "give one of those or 'none'"
        )
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_PROFILE_BYTES + 1)
        if len(raw) > MAX_PROFILE_BYTES:
            raise UserError(f"--latent-profile {path}: larger than {MAX_PROFILE_BYTES} bytes; not a profile file")
        doc = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"--latent-profile {path}: not a readable UTF-8 JSON file ({str(exc).splitlines()[0]})") from None
    return LatentProfile(path.name, _max_abs_of(doc, path), f"{path} ({_digest(raw)})")


def _digest(raw: bytes) -> str:
    import hashlib

    return "sha256:" + hashlib.sha256(raw).hexdigest()[:16]


def _max_abs_of(doc: Any, path: Path) -> tuple[float, ...]:
    """A profile file's per-layer max |c_kv|: `max_abs` (published files), `max_abs_c_kv` (`mla-eval calibrate`), or
    `scales` x `denominator` (an outer-scale file without the raw figures)."""
    if isinstance(doc, dict):
        for key in ("max_abs", "max_abs_c_kv"):
            if isinstance(doc.get(key), list):
                return _floats(doc[key], path, key)
        if isinstance(doc.get("scales"), list) and isinstance(doc.get("denominator"), (int, float)):
            return tuple(s * float(doc["denominator"]) for s in _floats(doc["scales"], path, "scales"))
    raise UserError(f"--latent-profile {path}: no per-layer max_abs, max_abs_c_kv, or scales with a denominator")


def _floats(values: list, path: Path, key: str) -> tuple[float, ...]:
    if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise UserError(f"--latent-profile {path}: {key} must be a non-empty list of numbers")
    return tuple(float(v) for v in values)


@torch.no_grad()
def measure_max_abs(lm, ids: torch.Tensor) -> list[float]:
    """max |c_kv| (kv_a_layernorm's output) per layer of the stock forward over token ids [B, T]."""
    found = [0.0] * lm.num_layers
    hooks = []
    for i, module in enumerate(lm.adapter.modules):
        def hook(_mod, _args, out, i=i) -> None:
            found[i] = max(found[i], float(out.detach().abs().max()))

        hooks.append(module.kv_a_layernorm.register_forward_hook(hook))
    try:
        lm.model(input_ids=ids.to(lm.device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return found


@dataclasses.dataclass(frozen=True)
class AppliedProfile:
    """What a latent profile did to a model, for the result documents (model.latent_profile)."""

    profile: LatentProfile
    calibration: str
    measured: tuple[float, ...]
    target: tuple[float, ...]
    factors: tuple[float, ...]
    achieved: tuple[float, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.profile.name, "source": self.profile.source, "calibration": self.calibration,
            "max_abs_before": list(self.measured), "max_abs_target": list(self.target), "factors": list(self.factors),
            "max_abs_after": list(self.achieved),
        }


@torch.no_grad()
def apply_latent_profile(lm, profile: LatentProfile, ids: torch.Tensor, calibration: str) -> AppliedProfile:
    """Reparametrise `lm` in place so each layer's max |c_kv| over `ids` follows `profile` (see the module doc).
    `calibration` names the text `ids` came from."""
    measured = measure_max_abs(lm, ids)
    if any(m <= 0 for m in measured):
        raise UserError("a layer's latent is all zero on the calibration text: no latent profile can scale it")
    target = profile.for_layers(lm.num_layers)
    factors = [t / m for t, m in zip(target, measured)]
    latent = lm.adapter.config.kv_lora_rank
    for module, c in zip(lm.adapter.modules, factors):
        norm, up = module.kv_a_layernorm.weight, module.kv_b_proj.weight
        if up.shape[1] != latent:
            raise UserError(f"kv_b_proj reads {up.shape[1]} inputs, not the {latent}-wide latent: cannot apply a profile")
        # in float32, then one rounding to the weights' dtype
        norm.copy_((norm.float() * c).to(norm.dtype))
        up.copy_((up.float() / c).to(up.dtype))
    achieved = measure_max_abs(lm, ids)
    return AppliedProfile(profile, calibration, tuple(measured), tuple(target), tuple(factors), tuple(achieved))
