"""The attention launch plan (pure Python, `mla_eval_kernels.plan.launch`): made once per (format, list kind, heads,
queries per sequence, device), never outliving the setting it was made under, and the split-KV schedule."""

from __future__ import annotations

import pytest

from mla_eval.formats import get_format
from mla_eval_kernels.plan import launch as lp
from mla_eval_kernels.plan import tuning
from mla_eval_kernels.plan.device_limits import DeviceFacts
from mla_eval_kernels.plan.record_plan import plan_for

H200 = DeviceFacts(sms=132, smem_per_block=232448, smem_per_sm=233472)


def test_one_plan_per_format_shape_and_device(monkeypatch):
    monkeypatch.delenv(tuning.ENV, raising=False)
    nvfp4 = plan_for(get_format("nvfp4"))
    first = lp.launch_plan(nvfp4, sparse=False, heads=16, facts=H200)
    assert lp.launch_plan(nvfp4, sparse=False, heads=16, facts=H200) is first  # the cache, not a new object
    assert plan_for(get_format("nvfp4")) is nvfp4  # the record plan too is made once per spec
    # another shape or device is another plan
    assert lp.launch_plan(nvfp4, sparse=True, heads=16, facts=H200) is not first
    small = DeviceFacts(sms=80, smem_per_block=100 * 1024, smem_per_sm=164 * 1024)
    assert lp.launch_plan(nvfp4, sparse=False, heads=16, facts=small) is not first


def test_the_plan_is_the_generation_the_policy_picks(monkeypatch):
    monkeypatch.delenv(tuning.ENV, raising=False)
    for name in ("nvfp4", "bf16", "fp8_ds_mla", "trtllm_nvfp4_dsa"):
        plan = plan_for(get_format(name))
        for sparse, heads, qps in ((False, 16, 1), (True, 128, 1), (False, 128, 1), (False, 8, 64)):
            chosen = lp.launch_plan(plan, sparse=sparse, heads=heads, facts=H200, queries_per_seq=qps)
            assert (chosen.generation, chosen.why) == tuning.generation_for(
                plan, sparse=sparse, heads=heads, queries_per_seq=qps, smem_limit=H200.smem_per_block
            )
            if chosen.generation == "v3":
                assert chosen.config.head_tile == tuning.v3_head_tile(plan, heads, sparse, H200.smem_per_block)[0]
            else:
                wide = tuning.tile_config(plan, heads, H200.smem_per_block)
                tile, tun = tuning.launch_choice(plan, wide, chosen.generation, H200.smem_per_block, H200.smem_per_sm)
                assert chosen.config == lp.V2Config(tuple(tile), tun)


def test_a_forced_generation_is_a_new_plan(monkeypatch):
    monkeypatch.delenv(tuning.ENV, raising=False)
    nvfp4 = plan_for(get_format("nvfp4"))
    assert lp.launch_plan(nvfp4, sparse=False, heads=16, facts=H200).generation == "v3"
    monkeypatch.setenv(tuning.ENV, "v1")
    forced = lp.launch_plan(nvfp4, sparse=False, heads=16, facts=H200)
    assert forced.generation == "v1" and forced.config.tuning == tuning.V1
    monkeypatch.delenv(tuning.ENV)
    assert lp.launch_plan(nvfp4, sparse=False, heads=16, facts=H200).generation == "v3"  # unset again: the default


@pytest.mark.parametrize("max_keys", [0, 1, 64, 2048, 65536])
def test_split_schedule_covers_every_key_tile_once(max_keys):
    for name, heads in (("nvfp4", 16), ("fp8_ds_mla", 128), ("trtllm_nvfp4_dsa", 64)):
        plan = plan_for(get_format(name))
        chosen = lp.launch_plan(plan, sparse=False, heads=heads, facts=H200)
        sched = lp.split_schedule(chosen, plan, num_queries=3, heads=heads, max_keys=max_keys, facts=H200)
        tiles = -(-max_keys // chosen.config.keys_per_tile)
        assert sched.num_splits * sched.tiles_per_split >= tiles
        assert (sched.num_splits - 1) * sched.tiles_per_split < max(tiles, 1)  # no split is empty
        assert sched.head_tiles == -(-heads // chosen.config.heads_per_cta)
        assert sched.grid == (3 * sched.num_splits, sched.head_tiles, 1)
        asked = lp.split_schedule(chosen, plan, num_queries=3, heads=heads, max_keys=max_keys, facts=H200, num_splits=5)
        assert asked.num_splits <= 5 and asked.num_splits * asked.tiles_per_split >= tiles


def test_a_grid_cuda_cannot_launch_is_refused_before_any_work():
    plan = plan_for(get_format("nvfp4"))
    chosen = lp.launch_plan(plan, sparse=False, heads=16, facts=H200)
    with pytest.raises(ValueError, match="exceed"):
        lp.split_schedule(chosen, plan, num_queries=2**31, heads=16, max_keys=64, facts=H200, num_splits=1)


def test_explicit_variants():
    plan = plan_for(get_format("nvfp4"))
    v1 = lp.v2_plan(plan, 16, H200, tuning=tuning.V1)
    assert v1.generation == "v1" and v1.config.tile == tuning.tile_config(plan, 16, H200.smem_per_block)
    narrow = lp.v2_plan(plan, 16, H200, tile=tuning.NARROW_TILE)
    assert narrow.generation == "v2" and narrow.config.tile == tuning.NARROW_TILE
    from benchmarks.probes import v3_probe_plan

    probe = v3_probe_plan(plan, 128, False, H200, producer_wgs=1)
    assert probe.config.producer_wgs == 1 and probe.config.head_tile == 32
    default = lp.v3_plan(plan, 128, False, H200)  # every default resolved here, never None
    assert default.config.producer_wgs == tuning.v3_producer_wgs(plan, 32)
    assert default.config.raw_ring == tuning.v3_raw_ring(plan, 32, False)
    with pytest.raises(ValueError, match="raw_ring"):  # a ring the tile cannot hold
        v3_probe_plan(plan, 16, False, H200, raw_ring=(9, 64))
    with pytest.raises(ValueError, match="producer_wgs"):
        v3_probe_plan(plan, 16, False, H200, producer_wgs=3)
