"""Per-layer outer scales s_l = max |c_kv| / (6 * 448) over a calibration text.

`evaluate_calibration(CalibrateSettings(...)) -> CalibrationResult` is the library call behind
`mla-eval calibrate`; `calibrate(lm, source, ctx)` is the step kld and needle run on a held-out slice.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mla_eval.attention import dispatch
from mla_eval.evals import text_sources
from mla_eval.evals.settings import DEFAULT_CTX, ModelSettings, ProgressCallback, check_ctx, no_progress
from mla_eval.evals.text_sources import TokenSource
from mla_eval.formats import OuterScales, get_format
from mla_eval.model.session import CacheSession
from mla_eval.results import environment


@torch.no_grad()
def latent_amax(lm, source: TokenSource, ctx: int, progress: ProgressCallback = no_progress) -> list[float]:
    """max |c_kv| per layer over non-overlapping windows of `ctx` tokens of every sequence."""
    check_ctx(ctx)
    amax = [0.0] * lm.num_layers

    def observe(ev) -> None:
        amax[ev.layer] = max(amax[ev.layer], float(ev.latent.abs().max()))

    chunks = [s[i : i + ctx] for s in source.sequences for i in range(0, int(s.numel()), ctx) if s[i : i + ctx].numel() > 1]
    progress("calibrate", 0, len(chunks))
    for done, chunk in enumerate(chunks, 1):
        ids = chunk.view(1, -1).to(lm.device)
        session = CacheSession(get_format("bf16"), lm.num_layers, 1, ids.shape[1], lm.layer_devices, observers=(observe,))
        with lm.adapter.session(session):
            lm.model(input_ids=ids, position_ids=torch.arange(ids.shape[1], device=lm.device).view(1, -1), use_cache=False)
        progress("calibrate", done, len(chunks))
    return amax


def calibrate(lm, source: TokenSource, ctx: int, progress: ProgressCallback = no_progress) -> OuterScales:
    amax = latent_amax(lm, source, ctx, progress)
    return OuterScales.from_amax(
        amax,
        provenance={"model": lm.name, "calibration": source.label, "tokens": source.num_tokens, "max_abs_c_kv": amax},
    )


@dataclasses.dataclass(frozen=True)
class CalibrateSettings(ModelSettings, text_sources.TextSettings):
    """Everything `mla-eval calibrate` takes. Its self-samples default to one 768-token sample of
    seed 1000: not the text kld evaluates on (seed 0) by default."""

    samples: int = 1
    sample_len: int = 768
    seed: int = 1000
    ctx: int = DEFAULT_CTX

    def __post_init__(self) -> None:
        ModelSettings.__post_init__(self)
        text_sources.TextSettings.__post_init__(self)
        check_ctx(self.ctx)


@dataclasses.dataclass
class CalibrationResult:
    scales: OuterScales
    source_label: str
    environment: dict[str, Any]

    def to_document(self) -> dict[str, Any]:
        """The published outer-scale schema; the environment rides along as provenance (readers ignore extra keys)."""
        doc = self.scales.to_json()
        doc["environment"] = self.environment
        return doc


def evaluate_calibration(st: CalibrateSettings, progress: ProgressCallback = no_progress) -> CalibrationResult:
    with dispatch.use_backend(st.backend) as log:
        lm = st.load()
        source = text_sources.load_source(lm, st, progress)
        scales = calibrate(lm, source, st.ctx, progress)
        env = environment(attention=log)
    return CalibrationResult(scales, source.label, env)
