"""Control formats (deliberately damaging yardsticks) and the needle grid's power (mla_eval.evals.needle_power)."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from mla_eval.cli import main
from mla_eval.errors import UnknownFormatError, UserError
from mla_eval.evals import needle_power as npw
from mla_eval.evals.stats import holm_reject, mcnemar_exact
from mla_eval.evals.variants import parse_variants
from mla_eval.formats import (
    Field,
    FormatSpec,
    ScaleRule,
    VectorCoding,
    all_formats,
    control_formats,
    decode,
    encode,
    format_names,
    get_format,
    register_format,
)
from mla_eval.formats.controls import CONTROL_FORMATS

# ---------------------------------------------------------------- control formats


def test_controls_resolve_by_name_but_stay_out_of_every_list():
    names = [s.name for s in control_formats()]
    assert names == [s.name for s in CONTROL_FORMATS] and len(names) >= 3
    assert all(n.startswith("control:") and get_format(n).control for n in names)
    assert not set(names) & set(format_names()) and not any(s.control for s in all_formats())
    assert [v.name for v in parse_variants("nvfp4,control:*")] == ["nvfp4", *names]


def test_unknown_control_and_registering_one_are_refused():
    with pytest.raises(UnknownFormatError, match="unknown control format 'control:nope'.*control:e2m1_g512"):
        get_format("control:nope")
    with pytest.raises(UserError, match="unknown control"):
        parse_variants("control:nope")
    spec = CONTROL_FORMATS[0]
    with pytest.raises(ValueError, match="control formats are built in"):
        register_format(spec)
    with pytest.raises(ValueError, match="named 'control:...'"):  # a control must say so in its name, and only it
        FormatSpec(name="not_labelled", title="t", description="d", source="s", record_bytes=spec.record_bytes,
                   latent=spec.latent, rope=spec.rope, pads=spec.pads, control=True)
    with pytest.raises(ValueError, match="named 'control:...'"):
        FormatSpec(name="control:unmarked", title="t", description="d", source="s", record_bytes=288,
                   latent=VectorCoding(512, "e2m1", Field("latent", 0, "e2m1", 512), ScaleRule.TENSOR, 512),
                   rope=VectorCoding(64, "e2m1", Field("rope", 256, "e2m1", 64), ScaleRule.TENSOR, 64))


def test_unscaled_control_erases_small_latents_that_a_scaled_coding_keeps():
    """The mechanism the top rung stands for: a GLM-5.2-sized layer (max |c_kv| ~0.05) stores nothing."""
    g = torch.Generator().manual_seed(1)
    latent, rope = torch.randn(64, 512, generator=g), torch.randn(64, 64, generator=g)
    small = latent * (0.05 / latent.abs().amax())
    unscaled, scaled = get_format("control:e2m1_unscaled_latent"), get_format("control:e2m1_g512")
    lat_u, rope_u = decode(unscaled, encode(unscaled, small, rope))
    lat_s, _ = decode(scaled, encode(scaled, small, rope))
    assert lat_u.abs().max() == 0 and torch.equal(rope_u, rope.bfloat16().float())
    assert (lat_s != 0).float().mean() > 0.05 and (lat_s - small).norm() < 0.6 * small.norm()
    # at the embedded model's magnitudes (max ~4) the same coding keeps most of the signal: a mild rung there
    big = latent * (4.0 / latent.abs().amax())
    lat_b, _ = decode(unscaled, encode(unscaled, big, rope))
    assert (lat_b - big).norm() < 0.3 * big.norm()


def test_rungs_damage_in_order_on_a_heavy_tailed_latent():
    g = torch.Generator().manual_seed(2)
    latent = torch.randn(256, 512, generator=g) * torch.rand(256, 512, generator=g).pow(3) * 0.3
    rope = torch.randn(256, 64, generator=g)
    errs = []
    for spec in control_formats()[:2]:  # both rungs code the latent alike; the second also damages the rope
        lat, rp = decode(spec, encode(spec, latent, rope))
        errs.append(((lat - latent).norm() / latent.norm()).item() + ((rp - rope).norm() / rope.norm()).item())
    assert errs[0] < errs[1]


# ---------------------------------------------------------------- power: the model against brute force


def _brute_power(k1: int, k0: int, q: float, w: float, alpha_test: float) -> float:
    """Every (losses b, recoveries c) outcome enumerated with exact binomial weights."""
    total = 0.0
    for b in range(k1 + 1):
        pb = math.comb(k1, b) * q**b * (1 - q) ** (k1 - b)
        for c in range(k0 + 1):
            pc = math.comb(k0, c) * w**c * (1 - w) ** (k0 - c)
            if b > c and mcnemar_exact(b, c) <= alpha_test:
                total += pb * pc
    return total


@pytest.mark.parametrize("k1,k0,q,w,alpha", [(10, 0, 0.9, 0.0, 0.05 / 8), (20, 5, 0.4, 0.2, 0.05 / 3),
                                            (7, 13, 0.8, 0.5, 0.05), (30, 30, 0.25, 0.1, 0.05 / 60)])
def test_detection_power_equals_brute_force(k1, k0, q, w, alpha):
    assert npw.detection_power(k1, k0, q, w, alpha) == pytest.approx(_brute_power(k1, k0, q, w, alpha), abs=1e-12)


def test_detection_power_matches_a_simulated_grid():
    """Simulated cells run through the real test and Holm (one test per family) flag as often as predicted."""
    rng = random.Random(3)
    k1, k0, q, w, alpha = 24, 6, 0.45, 0.3, 0.05
    hits = 0
    trials = 4000
    for _ in range(trials):
        b = sum(rng.random() < q for _ in range(k1))
        c = sum(rng.random() < w for _ in range(k0))
        hits += holm_reject([mcnemar_exact(b, c)], alpha)[0] and b > c
    assert hits / trials == pytest.approx(npw.detection_power(k1, k0, q, w, alpha), abs=0.03)


def test_detectable_drop_and_prompts_needed():
    alpha = 0.05 / 8
    # 10 prompts, bf16 10/10: the test needs 9 losses (2 * 2^-9 <= alpha < 2 * 2^-8), so P(Bin(10, q) >= 9) >= 0.8
    drop = npw.detectable_drop(10, 0, 0.0, alpha)
    q = drop
    assert 10 * q**9 * (1 - q) + q**10 == pytest.approx(0.8, abs=1e-3)
    assert npw.detectable_drop(60, 0, 0.0, alpha) < drop  # more prompts detect less
    assert npw.detectable_drop(8, 0, 0.0, alpha) is None  # 8 prompts can never reach 9 losses
    assert npw.detectable_drop(0, 10, 0.0, alpha) is None  # bf16 retrieves nothing: nothing to lose
    n = npw.prompts_needed(1.0, 0.1, 0.0, alpha)
    assert npw.detection_power(n, 0, 0.1, 0.0, alpha) >= 0.8 > npw.detection_power(n - 1, 0, 0.1, 0.0, alpha)
    assert npw.prompts_needed(0.8, 0.1, 0.2, alpha) > n  # misses bf16 makes, and chance recoveries, cost prompts
    assert npw.prompts_needed(0.05, 0.1, 0.0, alpha) is None  # cannot drop more than bf16 retrieves


def test_power_report_reads_controls_and_recoveries_from_the_tests():
    def row(fmt, both, b, c, neither, failed):
        return {"task": "single", "length": 4096, "format": fmt, "n": both + b + c + neither, "both": both,
                "base_only": b, "format_only": c, "neither": neither, "p_value": mcnemar_exact(b, c),
                "holm_rejected": failed, "format_induced_failure": failed}

    tests = [row("nvfp4", 17, 1, 1, 1, False), row("control:a", 15, 3, 0, 2, False),
             row("control:b", 2, 16, 0, 2, True)]
    rep = npw.power_report(tests, ["control:a", "control:b"], drop=0.2)
    assert rep["tests"] == 3 and rep["alpha_per_test"] == pytest.approx(0.05 / 3)
    assert rep["recovery_rate"] == pytest.approx(0.5) and rep["recovery_from"] == ["nvfp4"]
    (cell,) = rep["cells"]
    assert cell["n"] == 20 and cell["bf16_accuracy"] == pytest.approx(0.9)
    assert [c["detected"] for c in cell["controls"]] == [False, True]
    assert cell["smallest_detected_drop"] == pytest.approx(0.8) and cell["largest_missed_drop"] == pytest.approx(0.15)
    with pytest.raises(ValueError):
        npw.power_report(tests, [], drop=1.5)


# ---------------------------------------------------------------- end to end on the embedded model


def test_needle_power_flags_a_control_where_bf16_passes(tmp_path, capsys):
    """The grid can fail: under GLM-5.2's latent profile the unscaled control loses every prompt bf16 retrieves."""
    out = tmp_path / "n.json"
    code = main(["needle", "--lengths", "512", "--depths", "0,50,100", "--trials", "3", "--formats",
                 "control:e2m1_unscaled_latent", "--latent-profile", "glm-5.2", "--power", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "Power:" in printed.out and "not real formats" in printed.out
    doc = json.loads(out.read_text())
    assert doc["settings"]["controls"] == ["control:e2m1_unscaled_latent"]
    (test,) = doc["paired_tests"]
    assert test["both"] + test["base_only"] >= 8  # bf16 passes
    assert test["format_induced_failure"] and test["base_only"] >= 8
    (cell,) = doc["power"]["cells"]
    assert cell["controls"][0]["detected"] and cell["smallest_detected_drop"] >= 0.8
    assert cell["prompts_for_drop"] > 9 and 0 < cell["detectable_drop"] < 1


# ---------------------------------------------------------------- DSA: the indexer's top-k moving with the cache


def test_topk_overlap_counts_shared_valid_choices():
    from mla_eval.evals.layer_stats import topk_overlap

    ref = torch.tensor([[[0, 1, 2], [3, 1, -1], [0, 1, 9]]])  # row 1: -1 is no choice; row 2: 9 is in the future
    got = torch.tensor([[[2, 1, 0], [3, 0, 2], [5, 4, 1]]])
    inter, size = topk_overlap(ref, got, start=2)  # the queries sit at positions 2, 3, 4
    assert inter.tolist() == [[3.0, 1.0, 1.0]] and size.tolist() == [[3.0, 2.0, 2.0]]


def test_kld_records_topk_overlap_on_a_dsa_model(tmp_path):
    """The reference run's top-k vs each format's, per layer and depth: exactly 1 at layer 0 (its indexer reads the
    embeddings) and for a bf16 row; below 1 further down under a damaging cache."""
    from tiny_models import tiny_checkpoint

    from mla_eval import api

    ckpt = tiny_checkpoint(tmp_path / "dsa", "deepseek_v32")
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"The {w} river runs by the mill and the {w} bridge at {i}." for i, w in
                             enumerate(["north", "south", "east", "west"] * 12)))
    result = api.evaluate_kld(api.KldSettings(model=ckpt, text=text, formats="bf16,control:e2m1_g512_rope", ctx=96,
                                              stride=48, device="cpu"))
    bf16, control = (result.formats[n]["layers"] for n in ("bf16", "control:e2m1_g512_rope"))
    assert all(row["topk_overlap"] == 1.0 for row in bf16)
    assert control[0]["topk_overlap"] == 1.0
    assert min(row["topk_overlap"] for row in control[1:]) < 1.0
    assert all(0 <= d["overlap"] <= 1 for row in control for d in row["topk_overlap_by_depth"])


def test_every_format_list_expands_the_control_ladder():
    from mla_eval.formats import parse_format_list

    assert [s.name for s in parse_format_list("nvfp4,control:*")] == ["nvfp4", *(s.name for s in CONTROL_FORMATS)]


def test_kld_table_shows_topk_only_where_a_dsa_model_recorded_it():
    from pathlib import Path

    from mla_eval.commands.kld import available_columns

    root = Path(__file__).resolve().parents[1]
    dense = json.loads((root / "results" / "baselines" / "ci-smoke" / "kld.json").read_text())["formats"]
    dsa = json.loads((root / "results" / "published" / "h200" / "needle-power" /
                      "kld-topk-random-glm52-profile.json").read_text())["formats"]
    assert "topk%" not in [c[0] for c in available_columns(dense)]
    cols = {c[0]: c[1] for c in available_columns(dsa)}
    assert cols["topk%"](dsa["nvfp4"]) == "87.3" and cols["topk%"](dsa["fp8_ds_mla"]) == "97.2"
