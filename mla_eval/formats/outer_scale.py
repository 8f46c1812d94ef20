"""Per-layer outer scales s_l in the published JSON schema `nvfp4_ds_mla_outer_scale_v1`.

    {"format": "nvfp4_ds_mla_outer_scale_v1", "num_layers": 61, "latent_dim": 512,
     "denominator": 2688, "scales": [s_0, ..., s_60]}

s_l = max |c_kv| over a calibration text / denominator (2688 = 6 * 448), so that the largest
calibrated latent value lands on the top of the E2M1 x E4M3 range. Extra keys (model, text,
tokens) are kept as provenance and ignored by readers.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from mla_eval.atomic_io import write_json_atomic
from mla_eval.errors import UserError
from mla_eval.formats.spec import LATENT_DIM, OUTER_SCALE_SCHEMA, TOKEN_SCALE_DENOMINATOR
from mla_eval.user_paths import read_small_json

# The latent magnitudes (a layer's max |c_kv|) mla-eval accepts anywhere -- latent profiles, outer scales, plans,
# calibration: fp16's normal range. A cached latent is an RMSNorm output times its weight: the published MLA models'
# lie in 0.02..5.2 (GLM-5.2's profile, mla_eval.model.latent_profile), and an engine running fp16 activations must
# hold them. A figure outside is a damaged file or a unit error, not a model: a profile of 1e30 per layer turns the
# model's arithmetic to noise (KLD 7, 0 % same top-1) and calibration then writes scales of 3.7e26.
LATENT_MAX_ABS_MIN = 2.0**-14  # fp16's smallest normal
LATENT_MAX_ABS_MAX = 65504.0  # fp16's largest finite value
# The range a scale s_l = max |c_kv| / 2688 may take (a file's denominator is always 2688)
MAX_SCALE = LATENT_MAX_ABS_MAX / TOKEN_SCALE_DENOMINATOR
MIN_SCALE = LATENT_MAX_ABS_MIN / TOKEN_SCALE_DENOMINATOR


def latent_range_text() -> str:
    return f"{LATENT_MAX_ABS_MIN:.3g}..{LATENT_MAX_ABS_MAX:g} (fp16's normal range; published models: 0.02..5.2)"


def check_latent_max_abs(value: float, what: str) -> None:
    """A layer's max |c_kv| (or the one an s_l stands for) inside LATENT_MAX_ABS_MIN..MAX, or a one-line UserError
    naming `what` (which file, which layer)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            not LATENT_MAX_ABS_MIN <= value <= LATENT_MAX_ABS_MAX:
        raise UserError(f"{what} is {value!r}: a latent's max |c_kv| lies in {latent_range_text()}; larger or smaller "
                        "is a damaged file or a unit error, not a model")


@dataclasses.dataclass(frozen=True)
class OuterScales:
    scales: tuple[float, ...]
    latent_dim: int = LATENT_DIM
    denominator: float = TOKEN_SCALE_DENOMINATOR
    provenance: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.scales)

    @classmethod
    def from_amax(cls, amax_per_layer: list[float], provenance: dict[str, Any] | None = None) -> "OuterScales":
        """s_l = amax_l / 2688; a layer whose latent was all zero gets s_l = 1 (no scaling); an amax outside the
        latent range (check_latent_max_abs) is a one-line UserError, never a scale."""
        for i, a in enumerate(amax_per_layer):
            if a > 0:
                check_latent_max_abs(float(a), f"the calibrated max |c_kv| of layer {i}")
        scales = tuple(float(a) / TOKEN_SCALE_DENOMINATOR if a > 0 else 1.0 for a in amax_per_layer)
        return cls(scales=scales, provenance=dict(provenance or {}))

    def for_layer(self, layer: int) -> float:
        return self.scales[layer]

    def check_layers(self, num_layers: int, source: str = "scales file") -> None:
        if self.num_layers != num_layers:
            raise UserError(
                f"{source} has {self.num_layers} layer scales but the model has {num_layers} layers; "
                "calibrate for this model with `mla-eval calibrate`"
            )

    def to_json(self) -> dict[str, Any]:
        doc = {
            "format": OUTER_SCALE_SCHEMA,
            "num_layers": self.num_layers,
            "latent_dim": self.latent_dim,
            "denominator": self.denominator,
            "scales": list(self.scales),
        }
        doc.update({k: v for k, v in self.provenance.items() if k not in doc})
        return doc

    def save(self, path: str | Path) -> None:
        """Write atomically (temp file + rename), so a crash never leaves half a file."""
        write_json_atomic(Path(path), self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "OuterScales":
        """A scales file: a regular file of bounded size holding UTF-8 JSON (no NaN / Infinity literals) in the
        published schema; every failure is one UserError line naming the file."""
        path = Path(path)
        doc = read_small_json(path, "scales file", "create it with `mla-eval calibrate`")
        return cls.from_json(doc, source=f"scales file {path}")

    @classmethod
    def from_json(cls, doc: Any, source: str = "scales JSON") -> "OuterScales":
        def bad(why: str) -> UserError:
            return UserError(f"{source}: {why} (expected schema {OUTER_SCALE_SCHEMA})")

        if not isinstance(doc, dict):
            raise bad("top level is not an object")
        if doc.get("format") != OUTER_SCALE_SCHEMA:
            raise bad(f"'format' is {doc.get('format')!r}")
        scales = doc.get("scales")
        if not isinstance(scales, list) or not scales:
            raise bad("'scales' must be a non-empty list")
        n = doc.get("num_layers")
        if not isinstance(n, int) or n != len(scales):
            raise bad(f"'num_layers' is {n!r} but 'scales' has {len(scales)} entries")
        if doc.get("latent_dim") != LATENT_DIM:
            raise bad(f"'latent_dim' is {doc.get('latent_dim')!r}, mla-eval formats use {LATENT_DIM}")
        den = doc.get("denominator")
        if not isinstance(den, (int, float)) or float(den) != TOKEN_SCALE_DENOMINATOR:
            raise bad(f"'denominator' is {den!r}, expected {TOKEN_SCALE_DENOMINATOR:g} (= 6 * 448)")
        out = []
        for i, s in enumerate(scales):
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
                raise bad(f"scale of layer {i} is {s!r}; every scale must be a positive finite number")
            if not MIN_SCALE <= s <= MAX_SCALE:
                raise bad(f"scale of layer {i} is {s!r}, outside {MIN_SCALE:.3g}..{MAX_SCALE:.3g} (max |c_kv| in "
                          f"{latent_range_text()}, over {TOKEN_SCALE_DENOMINATOR:g}); re-create the file with "
                          "`mla-eval calibrate`")
            out.append(float(s))
        known = {"format", "num_layers", "latent_dim", "denominator", "scales"}
        return cls(scales=tuple(out), provenance={k: v for k, v in doc.items() if k not in known})


