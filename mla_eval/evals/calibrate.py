"""Per-layer outer scales s_l = max |c_kv| / (6 * 448) over a calibration text."""

from __future__ import annotations

import torch

from mla_eval.evals.text_sources import TokenSource
from mla_eval.formats import OuterScales, get_format
from mla_eval.model.session import CacheSession


@torch.no_grad()
def latent_amax(lm, source: TokenSource, ctx: int, batch: int = 1) -> list[float]:
    """max |c_kv| per layer over non-overlapping windows of `ctx` tokens of every sequence."""
    amax = [0.0] * lm.num_layers

    def observe(ev) -> None:
        amax[ev.layer] = max(amax[ev.layer], float(ev.latent.abs().max()))

    chunks = [s[i : i + ctx] for s in source.sequences for i in range(0, int(s.numel()), ctx) if s[i : i + ctx].numel() > 1]
    for chunk in chunks:
        ids = chunk.view(1, -1).to(lm.device)
        session = CacheSession(get_format("bf16"), lm.num_layers, 1, ids.shape[1], lm.layer_devices, observers=(observe,))
        with lm.adapter.session(session):
            lm.model(input_ids=ids, position_ids=torch.arange(ids.shape[1], device=lm.device).view(1, -1), use_cache=False)
    return amax


def calibrate(lm, source: TokenSource, ctx: int) -> OuterScales:
    amax = latent_amax(lm, source, ctx)
    return OuterScales.from_amax(
        amax,
        provenance={"model": lm.name, "calibration": source.label, "tokens": source.num_tokens, "max_abs_c_kv": amax},
    )
