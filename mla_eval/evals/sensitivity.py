"""Per-layer sensitivity of a model to each candidate cache format: the costs a per-layer plan is solved from.

A layer's cost of a format is the teacher-forced KLD (nats, against the bf16 cache) when only that layer's cache uses
the format and every other layer stays bf16. All single-layer rows run in ONE kld pass (mla_eval.evals.kld.run_kld):
every window batch runs one reference forward, shared by the candidates x layers rows, each a single-layer plan
(mla_eval.layer_plan) that starts at its own layer from the reference's recorded state (`KldProtocol.fork_rows`: its
earlier layers are the reference's, the same bits). The pass runs L + C x L(L+1)/2 layer forwards per window batch,
against (C + 1) x L for a kld run of the C candidates: about C(L+1) / 2(C+1) x that run, plus the loss of each row.

The cheaper proxy is the per-layer attention-output error a kld run's layer statistics already record
(`attn_rel_l2`: ||out - exact|| / ||exact|| of the layer's latent-space attention output, against exact attention
over the same unquantised latents), read from one more kld pass of the C uniform candidates with layer statistics
(C + 1 forwards, absorbed prefill, since the statistics compare the absorbed output). Its agreement with the KLD
costs is the Spearman rank correlation, over every (format, layer) pair and per format over the layers: how well
the one-run proxy would rank without the sweep. The proxy pass also gives each candidate's uniform KLD.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from mla_eval.evals.kld import KldProtocol, run_kld
from mla_eval.evals.text_sources import TokenSource
from mla_eval.evals.variants import PlanVariant, scales_for
from mla_eval.formats import OuterScales, get_format
from mla_eval.formats.variant import Variant
from mla_eval.layer_plan import LayerPlan
from mla_eval.protocol import ProgressCallback, no_progress

BF16 = Variant(get_format("bf16"))


def layer_scales(variant: Variant, outer: OuterScales | None, num_layers: int) -> tuple[float | None, ...]:
    """Each layer's s_l as the variant's cache uses it (None throughout without +s_l)."""
    mapped = scales_for(variant, outer)
    return (None,) * num_layers if mapped is None else tuple(mapped.scales)


def single_layer_plan(variant: Variant, layer: int, num_layers: int, outer: OuterScales | None) -> LayerPlan:
    """`variant` at `layer`, bf16 elsewhere."""
    scales = layer_scales(variant, outer, num_layers)
    layers = tuple(variant if i == layer else BF16 for i in range(num_layers))
    return LayerPlan(layers, tuple(scales[i] if i == layer else None for i in range(num_layers)),
                     name=f"{variant.name}@{layer}")


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); NaN with fewer than 3 pairs or a constant side."""
    pairs = [(a, b) for a, b in zip(x, y) if math.isfinite(a) and math.isfinite(b)]
    if len(pairs) < 3:
        return math.nan
    rx, ry = _ranks([a for a, _ in pairs]), _ranks([b for _, b in pairs])
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return math.nan if sxx == 0 or syy == 0 else sxy / math.sqrt(sxx * syy)


def _ranks(v: Sequence[float]) -> list[float]:
    order = sorted(range(len(v)), key=lambda i: v[i])
    ranks = [0.0] * len(v)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


@dataclasses.dataclass
class Sensitivity:
    """Per candidate (its variant name) and layer: the single-layer KLD, its standard error and the proxy."""

    candidates: tuple[Variant, ...]
    num_layers: int
    kld: dict[str, list[float]]  # candidate -> per-layer single-layer KLD
    kld_se: dict[str, list[float]]
    attn_rel_l2: dict[str, list[float]] | None  # candidate -> per-layer attention-output error (uniform run); None: skipped
    uniform_kld: dict[str, float] | None  # candidate -> KLD with every layer in it (the proxy pass)
    tokens: int  # scored tokens per row
    windows: int
    seconds: dict[str, float]  # per pass

    def spearman_all(self) -> float:
        if self.attn_rel_l2 is None:
            return math.nan
        names = [c.name for c in self.candidates]
        return spearman([k for n in names for k in self.kld[n]], [a for n in names for a in self.attn_rel_l2[n]])

    def spearman_per_format(self) -> dict[str, float]:
        if self.attn_rel_l2 is None:
            return {}
        return {c.name: spearman(self.kld[c.name], self.attn_rel_l2[c.name]) for c in self.candidates}

    def as_dict(self) -> dict:
        return {
            "metric": "kld_mean with only this layer in the format (others bf16), nats",
            "proxy": "attn_rel_l2 of the layer in a run with every layer in the format",
            "tokens": self.tokens,
            "windows": self.windows,
            "seconds": self.seconds,
            "formats": {
                c.name: {
                    "record_bytes": c.spec.record_bytes,
                    "kld": self.kld[c.name],
                    "kld_se": self.kld_se[c.name],
                    "attn_rel_l2": None if self.attn_rel_l2 is None else self.attn_rel_l2[c.name],
                    "uniform_kld": None if self.uniform_kld is None else self.uniform_kld[c.name],
                    "spearman": self.spearman_per_format().get(c.name),
                }
                for c in self.candidates
            },
            "spearman_all": None if math.isnan(self.spearman_all()) else self.spearman_all(),
        }


def sensitivity_from_dict(doc: dict, candidates: Sequence[Variant], num_layers: int) -> Sensitivity:
    """The table `Sensitivity.as_dict` wrote (a plan file's "sensitivity"), for these candidates."""
    fmts = doc["formats"]
    missing = [c.name for c in candidates if c.name not in fmts]
    if missing:
        raise ValueError(f"no sensitivity for {', '.join(missing)}")
    has_proxy = all(fmts[c.name].get("attn_rel_l2") is not None for c in candidates)
    has_uniform = all(fmts[c.name].get("uniform_kld") is not None for c in candidates)
    for c in candidates:
        if len(fmts[c.name]["kld"]) != num_layers:
            raise ValueError(f"{c.name} has {len(fmts[c.name]['kld'])} layer costs for {num_layers} layers")
    return Sensitivity(
        tuple(candidates), num_layers,
        {c.name: [float(x) for x in fmts[c.name]["kld"]] for c in candidates},
        {c.name: [float(x) for x in fmts[c.name]["kld_se"]] for c in candidates},
        {c.name: [float(x) for x in fmts[c.name]["attn_rel_l2"]] for c in candidates} if has_proxy else None,
        {c.name: float(fmts[c.name]["uniform_kld"]) for c in candidates} if has_uniform else None,
        int(doc.get("tokens", 0)), int(doc.get("windows", 0)), dict(doc.get("seconds", {})),
    )


def sweep_protocol(protocol: KldProtocol, candidates: Sequence[Variant], outer: OuterScales | None,
                   num_layers: int) -> KldProtocol:
    """The single-layer pass: one plan row per (candidate, layer), each starting at its own layer from the reference's
    state there (`fork_rows`: its layers before are the reference's)."""
    rows = [PlanVariant(single_layer_plan(c, i, num_layers, outer)) for c in candidates for i in range(num_layers)]
    return dataclasses.replace(protocol, variants=tuple(rows), layer_stats=False, outer_scales=outer, fork_rows=True)


def measure_sensitivity(
    lm,
    source: TokenSource,
    protocol: KldProtocol,
    candidates: Sequence[Variant],
    outer: OuterScales | None,
    proxy: bool = True,
    progress: ProgressCallback = no_progress,
    execution=None,
) -> Sensitivity:
    """The single-layer KLD of every candidate at every layer (one pass, one reference forward per window batch) and,
    with `proxy`, the uniform candidates' per-layer attention error (a second pass with layer statistics).

    `protocol` gives the windows, semantics and prefill of the single-layer pass; its variants are replaced.
    `execution` (mla_eval.model.strategy.ExecutionStrategy; None: resident) runs each pass, its passes sized for it."""
    from mla_eval.evals.kld import workload

    def runner(p: KldProtocol):
        return None if execution is None else execution.runner_for(workload(lm, source, p))

    n = lm.num_layers
    sweep = sweep_protocol(protocol, candidates, outer, n)
    rows = {(c.name, i): v for (c, i), v in zip([(c, i) for c in candidates for i in range(n)], sweep.variants)}
    run = run_kld(lm, source, sweep, progress=lambda s, d, t: progress("sensitivity" if s == "score" else s, d, t),
                  runner=runner(sweep))
    summary = {row["format"]: row for row in run.summary().values()}
    kld = {c.name: [summary[rows[(c.name, i)].name]["kld_mean"] for i in range(n)] for c in candidates}
    se = {c.name: [summary[rows[(c.name, i)].name]["kld_se"] for i in range(n)] for c in candidates}
    tokens = next(iter(summary.values()))["tokens"] if summary else 0
    seconds = {"sensitivity": run.seconds}
    attn = uniform = None
    if proxy:
        stats = dataclasses.replace(protocol, variants=tuple(candidates), layer_stats=True, prefill="absorbed",
                                    outer_scales=outer)
        prun = run_kld(lm, source, stats, progress=lambda s, d, t: progress("proxy" if s == "score" else s, d, t),
                       runner=runner(stats))
        psum = {row["format"]: row for row in prun.summary().values()}
        attn = {c.name: [layer["attn_rel_l2"] for layer in psum[c.name]["layers"]] for c in candidates}
        uniform = {c.name: psum[c.name]["kld_mean"] for c in candidates}
        seconds["proxy"] = prun.seconds
    return Sensitivity(tuple(candidates), n, kld, se, attn, uniform, tokens, run.windows, seconds)
