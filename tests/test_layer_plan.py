"""Per-layer cache plans (`mla-eval plan`, `kld --formats plan:FILE`, `capacity --plan`): the knapsack against brute
force, the plan file's round trip and its refusals, the mixed cache session, a uniform plan equal to its format in
kld and capacity, and the sensitivity's prediction against a measurement."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import re

import pytest
import torch
from tiny_models import tiny_checkpoint

from mla_eval.attention.semantics import BF16 as BF16_MATH
from mla_eval.capacity import CapacitySettings, evaluate_capacity
from mla_eval.cli import main
from mla_eval.errors import UserError
from mla_eval.evals import knapsack
from mla_eval.evals.kld import KldProtocol, run_kld
from mla_eval.evals.sensitivity import measure_sensitivity, single_layer_plan, spearman
from mla_eval.evals.text_sources import TokenSource
from mla_eval.evals.variants import PlanVariant, parse_variants, scales_for
from mla_eval.formats import OuterScales, get_format
from mla_eval.formats.variant import Variant
from mla_eval.layer_plan import LayerPlan
from mla_eval.model.loader import load_model
from mla_eval.model.session import CacheSession

CTX, MIN_CONTEXT = 96, 48


# --- the knapsack ------------------------------------------------------------------------------------


def _brute(cost, size):
    """Every assignment: (picks, summed cost, summed bytes)."""
    out = []
    for picks in itertools.product(range(len(size)), repeat=len(cost)):
        out.append((picks, sum(cost[i][k] for i, k in enumerate(picks)), sum(size[k] for k in picks)))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_knapsack_equals_brute_force(seed):
    rng = random.Random(seed)
    layers, cands = rng.randint(1, 5), rng.randint(1, 4)
    size = [rng.choice([288, 304, 352, 368, 432, 656, 1152]) for _ in range(cands)]
    cost = [[rng.choice([0.0, rng.random(), rng.random() * 1e-3]) for _ in range(cands)] for _ in range(layers)]
    every = _brute(cost, size)
    budget = rng.randint(min(size) * layers - 10, max(size) * layers + 10)
    fits = [e for e in every if e[2] <= budget]
    if not fits:
        with pytest.raises(UserError, match="no plan fits"):
            knapsack.min_cost(cost, size, budget)
    else:
        got = knapsack.min_cost(cost, size, budget)
        assert got.bytes <= budget
        assert got.cost == pytest.approx(min(e[1] for e in fits), abs=1e-12)
        assert got.cost == pytest.approx(sum(cost[i][k] for i, k in enumerate(got.picks)), abs=1e-12)
        assert got.bytes == sum(size[k] for k in got.picks)
    bound = rng.choice([0.0, rng.random() * layers * 0.5, 1e9])
    ok = [e for e in every if e[1] <= bound + 1e-12]
    if not ok:
        with pytest.raises(UserError, match="no plan keeps"):
            knapsack.min_bytes(cost, size, bound)
    else:
        got = knapsack.min_bytes(cost, size, bound)
        assert got.cost <= bound + 1e-12
        assert got.bytes == min(e[2] for e in ok)


def test_knapsack_prefers_the_sensitive_layer():
    # layer 0 is 100x more sensitive to the small format: with room for one wide record it goes to layer 0
    cost = [[0.0, 1.0], [0.0, 0.01], [0.0, 0.01]]
    got = knapsack.min_cost(cost, [656, 432], 656 + 2 * 432)
    assert got.picks == (0, 1, 1) and got.cost == pytest.approx(0.02)


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 30, 20, 40]) == pytest.approx(0.8)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2, 3], [5, 5, 6, 7]) == pytest.approx(1.0)  # ties: average ranks


# --- the plan file -------------------------------------------------------------------------------------


def _mixed(n=6) -> LayerPlan:
    fp8, nv, nvs = (Variant(get_format("fp8_ds_mla")), Variant(get_format("nvfp4")),
                    Variant(get_format("nvfp4"), outer=True))
    layers = (fp8, nvs) + (nv,) * (n - 2)
    scales = (None, 0.0123) + (None,) * (n - 2)
    return LayerPlan(layers, scales, model={"name": "default", "layers": n}, budget={"kind": "bytes_per_token",
                     "value": 3000}, predicted_kld=0.004, name="mixed")


def test_plan_round_trips_through_its_file(tmp_path):
    plan = _mixed()
    path = tmp_path / "p.json"
    plan.save(path)
    back = LayerPlan.load(path)
    assert back.layers == plan.layers and back.scales == plan.scales
    assert back.predicted_kld == plan.predicted_kld and back.budget == plan.budget and back.model == plan.model
    assert back.bytes_per_token == 656 + 2 * 432 + 4 * 432 - 432  # 656 + 5 x 432
    assert back.to_json() == plan.to_json()
    doc = json.loads(path.read_text())
    assert doc["schema"] == "mla-eval/plan/v1"
    assert doc["layers"][1]["outer_scale"] == {"s_l": 0.0123, "denominator": 2688.0}
    assert any(e["engine"] == "vLLM" and e["name"] == "fp8_ds_mla" for e in doc["layers"][0]["engine_names"])
    assert back.label == "plan:p"


def _write(tmp_path, edit) -> str:
    doc = _mixed().to_json()
    edit(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    return str(path)


BAD_PLANS = [
    (lambda d: d["layers"][2].update(format="nvfp5"), "unknown cache format 'nvfp5'"),
    (lambda d: d["layers"][2].update(format="control:e2m1_g512", variant="control:e2m1_g512"), "control"),
    (lambda d: d["layers"][1].update(outer_scale=None), "gives no s_l"),
    (lambda d: d["layers"][0].update(outer_scale={"s_l": 0.1, "denominator": 2688}), "does not apply one"),
    (lambda d: d["layers"][0].update(variant="fp8_ds_mla+s_l", outer_scale={"s_l": 0.1, "denominator": 2688}),
     "takes no outer scale"),
    (lambda d: d.update(num_layers=5), "'num_layers' is 5"),
    (lambda d: d.update(bytes_per_token=1), "bytes_per_token"),
    (lambda d: d.update(schema="mla-eval/kld/v1"), "not a plan"),
    # issue 44: every field validated
    (lambda d: d["layers"][2].update(record_bytes=999), "'record_bytes' is 999 but a nvfp4 record is 432 bytes"),
    (lambda d: d.update(predicted_kld=-0.5), "'predicted_kld' is -0.5; a KL divergence is finite and >= 0"),
    (lambda d: d["layers"][1].update(outer_scale={"s_l": 1e30, "denominator": 2688}),
     "layer 1: s_l 1e+30 stands for a max |c_kv| of 2.69e+33"),
    (lambda d: d["layers"][1].update(outer_scale={"s_l": 1e-30, "denominator": 2688}), "fp16's normal range"),
    (lambda d: d.update(budget={"kind": "bytes_per_token", "value": -3}), "budget bytes_per_token = -3"),
    (lambda d: d["model"].update(layers=61), "'model.layers' is 61 but the plan has 6 layers"),
]


@pytest.mark.parametrize("edit,words", BAD_PLANS)
def test_bad_plans_are_one_line_errors(tmp_path, edit, words):
    path = _write(tmp_path, edit)
    with pytest.raises(UserError) as err:
        LayerPlan.load(path)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_bad_plan_on_the_command_line(tmp_path, capsys):
    path = _write(tmp_path, lambda d: d["layers"][1].update(outer_scale=None))
    assert main(["kld", "--formats", f"plan:{path}", "--out", str(tmp_path / "k.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "no s_l" in err and "\n" not in err
    assert main(["needle", "--formats", f"plan:{path}"]) == 2  # needle reads the same file the same way
    assert "no s_l" in capsys.readouterr().err
    assert main(["kld", "--ref", f"plan:{path}"]) == 2  # a reference is one format: plans are refused there
    assert "per-layer plans run in `mla-eval kld` and `needle` (--formats plan:FILE)" in capsys.readouterr().err


def test_plan_of_the_wrong_layer_count(tmp_path, capsys):
    path = tmp_path / "seven.json"
    _mixed(7).save(path)
    assert main(["capacity", "--config", "mla_eval/default_model", "--plan", str(path), "--kv-memory-gib", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "7 layers" in err and "\n" not in err
    with pytest.raises(UserError, match="has 7 layers but the model has 6"):
        LayerPlan.load(path).check_layers(6)


def test_a_plan_for_another_model_is_refused(embedded, tmp_path, capsys):
    """A plan names the model it was made for (name, architecture digest, latent profile: issue 44); one made for
    another model of the same layer count is refused in one line, one that does not say is a warning."""
    import warnings

    from mla_eval.evals.variants import check_plan_model, load_plan_variant
    from mla_eval.model_presets import architecture_digest

    digest = architecture_digest(embedded.model.config)
    assert digest.startswith("sha256:") and len(digest) == 23

    def row(**model):
        plan = dataclasses.replace(_mixed(), model={"layers": 6, **model})
        path = tmp_path / f"p{len(list(tmp_path.iterdir()))}.json"
        plan.save(path)
        return load_plan_variant(f"plan:{path}")

    mine = {"name": embedded.name, "geometry": digest, "latent_profile": None}
    check_plan_model([row(**mine)], embedded, None)  # its own model: accepted
    for model, profile, words in [
        ({**mine, "name": "GLM-5.2-FP8"}, None, "was made for model 'GLM-5.2-FP8', this run's model is"),
        ({**mine, "geometry": "sha256:0123456789abcdef"}, None, "a model of architecture sha256:0123456789abcdef"),
        ({**mine, "latent_profile": {"name": "glm-5.2"}}, None, "made under --latent-profile glm-5.2, this run has no"),
        (mine, "glm-5.2", "made under no --latent-profile, this run has --latent-profile glm-5.2"),
    ]:
        with pytest.raises(UserError, match=re.escape(words)):
            check_plan_model([row(**model)], embedded, profile)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        check_plan_model([row()], embedded, None)
    assert any("does not say which model it was made for" in str(w.message) for w in seen)
    other = tmp_path / "other.json"
    dataclasses.replace(_mixed(), model={**mine, "name": "another model"}).save(other)
    assert main(["kld", "--formats", f"plan:{other}", "--samples", "1", "--sample-len", "16", "--device", "cpu",
                 "--out", str(tmp_path / "k.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "was made for model 'another model'" in err and not (tmp_path / "k.json").exists()


# --- capacity ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,preset", [("nvfp4", "deepseek-v3"), ("fp8_ds_mla", "glm-5.2"), ("nvfp4_fp8rope", "kimi-k2")])
def test_uniform_plan_capacity_equals_the_formats(tmp_path, fmt, preset):
    from mla_eval.model_presets import get_preset

    layers = get_preset(preset).geometry().num_hidden_layers
    path = tmp_path / "u.json"
    LayerPlan.uniform(Variant(get_format(fmt)), layers).save(path)
    res = evaluate_capacity(CapacitySettings(preset=preset, plan=path, formats=fmt))
    ours, plan = res.rows
    assert plan.name == "plan:u" and plan.layer_record_bytes == (get_format(fmt).record_bytes,) * len(plan.layer_record_bytes)
    for key in ("bytes_per_token", "latent_bytes_per_token", "num_blocks", "pool_tokens", "max_context",
                "max_concurrency", "ratio_vs_fp8_ds_mla"):
        assert getattr(plan, key) == getattr(ours, key), key


def test_mixed_plan_capacity_sums_its_layers(tmp_path):
    path = tmp_path / "m.json"
    _mixed().save(path)
    res = evaluate_capacity(CapacitySettings(config="mla_eval/default_model", plan=path, kv_memory_gib=1.0))
    row = {r.name: r for r in res.rows}["plan:m"]
    assert row.bytes_per_token == 656 + 5 * 432
    assert row.num_blocks == (1 << 30) // (64 * row.bytes_per_token)


# --- the mixed cache -----------------------------------------------------------------------------------


def test_mixed_session_holds_each_layers_records():
    specs = [get_format(n) for n in ("fp8_ds_mla", "nvfp4", "bf16")]
    s = CacheSession(specs, 3, 1, 16, "cpu", outer_scales=[None, 0.01, None])
    assert [c.shape[-1] for c in s.caches] == [656, 432, 1152]
    assert s.outer_scale(1) == 0.01 and s.outer_scale(0) is None
    with pytest.raises(ValueError, match="one spec per layer"):
        s.spec
    assert CacheSession(get_format("nvfp4"), 2, 1, 16, "cpu").spec.name == "nvfp4"  # the one-spec form unchanged
    with pytest.raises(ValueError, match="2 layer formats for 3 layers"):
        CacheSession(specs[:2], 3, 1, 16, "cpu")


@pytest.fixture(scope="module")
def embedded():
    return load_model(None, "cpu")


def _source() -> TokenSource:
    g = torch.Generator().manual_seed(3)
    return TokenSource("text", "random tokens", [torch.randint(0, 2000, (CTX,), generator=g)], "test")


def _protocol(rows, outer=None) -> KldProtocol:
    return KldProtocol(tuple(rows), Variant(get_format("bf16")), CTX, CTX - MIN_CONTEXT, MIN_CONTEXT,
                       layer_stats=False, outer_scales=outer, prefill="mha")


def test_kld_of_a_uniform_plan_equals_its_format_and_a_mixed_one_differs(embedded):
    n = embedded.num_layers
    outer = OuterScales.from_amax([3.0 + i for i in range(n)])
    nvs = parse_variants("nvfp4+s_l")[0]
    fp8 = parse_variants("fp8_ds_mla")[0]
    uniform = PlanVariant(LayerPlan.uniform(nvs, n, scales_for(nvs, outer).scales, name="u"))
    mixed = PlanVariant(LayerPlan((fp8,) * 2 + (nvs,) * (n - 2), (None, None) + scales_for(nvs, outer).scales[2:],
                                  name="m"))
    run = run_kld(embedded, _source(), _protocol([nvs, uniform, fp8, mixed], outer))
    arrays = {k: v.arrays() for k, v in run.stats.items()}
    assert (arrays["nvfp4+s_l"]["kld"] == arrays["plan:u"]["kld"]).all()  # the same cache, bit for bit
    kld = {k: v.summary()["kld_mean"] for k, v in run.stats.items()}
    assert kld["plan:m"] not in (kld["nvfp4+s_l"], kld["fp8_ds_mla"])
    assert kld["fp8_ds_mla"] < kld["plan:m"] < kld["nvfp4+s_l"]


def test_sensitivity_predicts_one_layer_exactly_and_a_plan_roughly(embedded):
    """A single-layer plan's measured KLD is its predicted KLD (the same forward); a whole plan's prediction is the
    sum of single-layer costs, which additivity makes an estimate: its measurement is printed, the test holds it
    within an order of magnitude (interactions between layers' errors move it, the noise of a small text too)."""
    n = embedded.num_layers
    cands = parse_variants("fp8_ds_mla,nvfp4")
    sens = measure_sensitivity(embedded, _source(), _protocol(cands), cands, None, proxy=False)
    assert len(sens.kld["nvfp4"]) == n and all(k >= 0 for k in sens.kld["nvfp4"])
    one = PlanVariant(single_layer_plan(cands[1], 2, n, None))
    plan = LayerPlan(tuple(cands[i % 2] for i in range(n)), (None,) * n, name="alt",
                     predicted_kld=sum(sens.kld[cands[i % 2].name][i] for i in range(n)))
    run = run_kld(embedded, _source(), _protocol([one, PlanVariant(plan)]))
    got = {k: v.summary()["kld_mean"] for k, v in run.stats.items()}
    assert got[one.name] == sens.kld["nvfp4"][2]
    assert plan.predicted_kld / 10 < got["plan:alt"] < plan.predicted_kld * 10


def test_plan_command_end_to_end(tmp_path, capsys):
    """`mla-eval plan` on a tiny checkpoint, then kld on its file: the measured KLD beside the prediction."""
    ckpt = tiny_checkpoint(tmp_path / "tiny")
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"The river {w} flows past the mill near the {w} bridge." for w in ["north", "south"] * 40))
    out = tmp_path / "plan.json"
    common = ["--model", str(ckpt), "--text", str(text), "--ctx", "64", "--max-tokens", "160"]
    assert main(["plan", *common, "--candidates", "fp8_ds_mla,nvfp4", "--budget-bytes-per-token", "1600",
                 "--out", str(out)]) == 0
    plan = LayerPlan.load(out)
    assert plan.bytes_per_token <= 1600 and plan.extra["sensitivity"]["formats"]["nvfp4"]["attn_rel_l2"] is not None
    again = tmp_path / "again.json"
    assert main(["plan", "--sensitivity", str(out), "--max-kld", "1e9", "--out", str(again)]) == 0
    assert LayerPlan.load(again).bytes_per_token == 432 * plan.num_layers  # any KLD allowed: the fewest bytes
    kout = tmp_path / "kld.json"
    assert main(["kld", *common, "--formats", f"nvfp4,plan:{out}", "--no-layer-stats", "--out", str(kout)]) == 0
    row = json.loads(kout.read_text())["formats"]["plan:plan"]
    assert row["plan"]["predicted_kld"] == plan.predicted_kld and row["kld_mean"] >= 0


# --- needle reads plans too ----------------------------------------------------------------------


def test_needle_runs_a_plan_row_on_the_same_prompts(tmp_path, capsys):
    """A uniform nvfp4 plan answers exactly as the nvfp4 row; a mixed plan runs with one format per layer; a plan made
    for another layer count is one line before any prompt."""
    from mla_eval.cli import main

    nv, fp8 = Variant(get_format("nvfp4")), Variant(get_format("fp8_ds_mla"))
    LayerPlan.uniform(nv, 6, name="all-nvfp4").save(tmp_path / "all-nvfp4.json")
    LayerPlan((fp8, nv) * 3, (None,) * 6, name="alt").save(tmp_path / "alt.json")
    out = tmp_path / "n.json"
    code = main(["needle", "--lengths", "384", "--depths", "0,60", "--scales", "none", "--out", str(out), "--formats",
                 f"nvfp4,plan:{tmp_path / 'all-nvfp4.json'},plan:{tmp_path / 'alt.json'}"])
    assert code == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    names = list(doc["formats"])
    assert names == ["bf16", "nvfp4", "plan:all-nvfp4", "plan:alt"]
    assert doc["settings"]["plans"] == {"plan:all-nvfp4": str(tmp_path / "all-nvfp4.json"),
                                        "plan:alt": str(tmp_path / "alt.json")}

    def answers(name):
        return [(r["depth"], r["output"]) for r in doc["records"] if r["format"] == name]

    assert answers("plan:all-nvfp4") == answers("nvfp4") and len(answers("plan:alt")) == 2
    LayerPlan.uniform(nv, 4, name="four").save(tmp_path / "four.json")
    assert main(["needle", "--lengths", "384", "--depths", "0", "--scales", "none", "--out", str(tmp_path / "x.json"),
                 "--formats", f"plan:{tmp_path / 'four.json'}"]) == 2
    assert "4 layers" in capsys.readouterr().err.strip().splitlines()[-1]


def test_plan_on_a_checkpoint_too_large_to_hold_is_one_line_when_its_shards_are_missing(tmp_path, capsys, monkeypatch):
    """The sweep streams a model larger than the memory budget (issue 41's execution strategy) instead of refusing it;
    a checkpoint whose index names shards that are absent is one line naming the shard (issue 44's checks), no
    document, no traceback."""
    from test_checkpoint import TOKENIZER, small_config

    from mla_eval.cli import main
    from mla_eval.model import run_plan
    from mla_eval.model.checkpoint_writer import write_random_checkpoint

    bare = tmp_path / "bare"
    write_random_checkpoint(bare, small_config("deepseek_v32", vocab=12288), "fp8-block", tokenizer_from=TOKENIZER,
                            index_only=True)
    text = tmp_path / "t.txt"
    text.write_text("The river flows past the mill near the bridge. " * 200)
    tiny = run_plan.Budget(1 << 20, 1 << 30, "cpu", "test: 1 MiB")
    monkeypatch.setattr(run_plan.Budget, "measure", classmethod(lambda cls, device: tiny))
    args = ["plan", "--model", str(bare), "--text", str(text), "--device", "cpu", "--budget-bytes-per-token", "4000",
            "--out", str(tmp_path / "p.json")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model-00001-of-00004.safetensors" in err[0] and "missing" in err[0]
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("model", ["embedded", "glm_moe_dsa", "deepseek_v32"])
def test_forked_rows_equal_whole_forwards_bit_for_bit(model, embedded, tmp_path):
    """A plan row starting at its first non-bf16 layer from the reference's recorded state gives the same per-token
    figures as running it whole -- on the dense model, and on DSA models (a GLM shared-indexer layer at the fork)."""
    from tiny_models import tiny_checkpoint

    from mla_eval.evals.kld import fork_layer
    from mla_eval.evals.sensitivity import single_layer_plan

    lm = embedded if model == "embedded" else load_model(tiny_checkpoint(tmp_path / model, model), "cpu")
    n = lm.num_layers
    nv, fp8 = parse_variants("nvfp4")[0], parse_variants("fp8_ds_mla")[0]
    rows = [PlanVariant(single_layer_plan(c, i, n, None)) for c in (nv, fp8) for i in range(n)]
    assert [fork_layer(r, BF16_MATH, Variant(get_format("bf16"))) for r in rows[:n]] == [0, *range(1, n)]
    src = _source() if model == "embedded" else TokenSource(
        "text", "random tokens", [torch.randint(0, 300, (CTX,), generator=torch.Generator().manual_seed(5))], "t")
    calls = []
    real = type(lm.stack)._layer

    def counted(self, i, *a):
        calls.append(i)
        return real(self, i, *a)

    type(lm.stack)._layer = counted
    try:
        whole = run_kld(lm, src, _protocol(rows))
        ran_whole = len(calls)
        forked = run_kld(lm, src, dataclasses.replace(_protocol(rows), fork_rows=True))
    finally:
        type(lm.stack)._layer = real
    per_batch = n * (1 + len(rows))  # the reference and every row, whole
    assert ran_whole % per_batch == 0
    batches = ran_whole // per_batch
    assert len(calls) - ran_whole == batches * (n + 2 * sum(n - i for i in range(n)))  # each row from its own layer
    for key, stats in whole.stats.items():
        a, b = stats.arrays(), forked.stats[key].arrays()
        assert all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a), key


def test_a_plan_path_holding_a_comma_is_one_item(tmp_path):
    """`--formats plan:a,b.json` was split at the comma (issue 44): the longest run of items naming a file is one."""
    path = tmp_path / "a,b.json"
    _mixed().save(path)
    rows = parse_variants(f"nvfp4,plan:{path},fp8_ds_mla", plans=True)
    assert [r.name for r in rows] == ["nvfp4", "plan:a,b", "fp8_ds_mla"] and rows[1].source == str(path)
    with pytest.raises(UserError, match="missing"):  # no such file: the item ends at the first comma, and is named
        parse_variants(f"plan:{tmp_path / 'missing'},nvfp4", plans=True)


def test_plan_with_defaults_runs_on_the_embedded_model_as_kld_does(tmp_path, capsys):
    """`mla-eval plan --budget-bytes-per-token 3000` failed on the embedded model ("text too short to hold out 2048
    calibration tokens" with no text given): like kld it scores self-samples, windows of --sample-len, and calibrates
    the +s_l candidates on one more sample; a recipe's [plan] section the same (issue 44). Fewer, shorter samples than
    the defaults keep it quick; the path is the defaults'."""
    out = tmp_path / "plan.json"
    code = main(["plan", "--budget-bytes-per-token", "3000", "--samples", "1", "--sample-len", "40", "--no-proxy",
                 "--device", "cpu", "--out", str(out)])
    assert code == 0, capsys.readouterr().err[-1500:]
    doc = json.loads(out.read_text())
    assert doc["text"]["kind"] == "self-samples" and doc["settings"]["ctx"] == 40 and doc["outer_scales"] is not None
    assert doc["bytes_per_token"] <= 3000 and doc["model"]["geometry"].startswith("sha256:")
    recipe = tmp_path / "plan.toml"
    recipe.write_text('device = "cpu"\n[plan]\nbudget_bytes_per_token = 3000\nsamples = 1\nsample_len = 40\n'
                      "proxy = false\n")
    assert main(["run", str(recipe), "--out", str(tmp_path / "r")]) == 0, capsys.readouterr().err[-1500:]
    assert json.loads((tmp_path / "r" / "plan.json").read_text())["layers"] == doc["layers"]  # the same seed, text
