"""Per-layer outer scales s_l in the published JSON schema `nvfp4_ds_mla_outer_scale_v1`.

    {"format": "nvfp4_ds_mla_outer_scale_v1", "num_layers": 61, "latent_dim": 512,
     "denominator": 2688, "scales": [s_0, ..., s_60]}

s_l = max |c_kv| over a calibration text / denominator (2688 = 6 * 448), so that the largest
calibrated latent value lands on the top of the E2M1 x E4M3 range. Extra keys (model, text,
tokens) are kept as provenance and ignored by readers.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from mla_eval.atomic_io import write_json_atomic
from mla_eval.errors import UserError
from mla_eval.formats.spec import LATENT_DIM, OUTER_SCALE_SCHEMA, TOKEN_SCALE_DENOMINATOR


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
        """s_l = amax_l / 2688; a layer whose latent was all zero gets s_l = 1 (no scaling)."""
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
        path = Path(path)
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"scales file {path} does not exist; create it with `mla-eval calibrate`") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"scales file {path} is not readable JSON ({exc}); re-create it with `mla-eval calibrate`") from None
        return cls.from_json(doc, source=str(path))

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
            out.append(float(s))
        known = {"format", "num_layers", "latent_dim", "denominator", "scales"}
        return cls(scales=tuple(out), provenance={k: v for k, v in doc.items() if k not in known})


