"""The run plan (`mla_eval.model.run_plan`): resident when it fits, streamed otherwise, streams on the device or in
host memory, passes, and a one-line refusal at plan time when nothing fits."""

from __future__ import annotations

import pytest

from mla_eval.errors import UserError
from mla_eval.model.run_plan import GIB, Budget, LayerCost, WeightInventory, Workload, plan_run

# DeepSeek-V3.2-like sizes: 61 layers of ~11 GiB in bf16 (FP8 on disk: half), embeddings + head 1.8 GiB
LAYERS = tuple([int(11.2 * GIB)] * 61)
DSV32 = WeightInventory("test", LAYERS, int(1.8 * GIB), {"float8_e4m3fn": 640 * GIB, "bfloat16": 50 * GIB},
                        tuple(x // 2 for x in LAYERS))
# wikitext-2-like: 570 windows of 2048 tokens, 10 rows + the reference, hidden 7168, bf16, fp8_ds_mla records
WIKI = Workload(batches=570, forwards_per_batch=11, tokens=2048, hidden=7168, dtype_bytes=2, record_bytes=656, kept=512)
H200 = Budget(int(139 * GIB * 0.9), int(128 * GIB * 0.7), "cuda:0", "test")


def test_a_model_that_fits_runs_resident():
    small = WeightInventory("test", (100,) * 4, 50, {"bfloat16": 450}, (100,) * 4)
    plan = plan_run(small, WIKI, H200)
    assert plan.mode == "resident" and "fits" in plan.reason and plan.passes == 0


def test_a_700b_model_streams_in_passes_of_as_many_window_batches_as_fit():
    plan = plan_run(DSV32, WIKI, H200)
    assert plan.mode == "stream" and "does not fit" in plan.reason
    per_batch = WIKI.batch_stream_bytes
    # two layers on the device (the next one materialises while this one computes); their reads wait in host memory
    fixed = DSV32.other_bytes + 2 * max(DSV32.layer_bytes)
    assert plan.layers_on_device == 2
    # beside them the H200 holds more window batches' streams than 70 % of a 128 GiB host
    assert plan.streams_on == "device"
    assert plan.batches_per_pass == (H200.device_bytes - fixed) // per_batch
    assert plan.passes == -(-WIKI.batches // plan.batches_per_pass) > 1
    assert plan.peak_device_bytes <= H200.device_bytes
    big_host = Budget(H200.device_bytes, 700 * GIB, "cuda:0", "test")
    host = plan_run(DSV32, WIKI, big_host)
    assert host.streams_on == "host" and host.passes < plan.passes  # fewer reads of the weights
    assert host.peak_host_bytes == host.batches_per_pass * per_batch <= big_host.host_bytes


def test_streams_stay_on_the_device_when_every_batch_fits_there():
    few = Workload(batches=3, forwards_per_batch=11, tokens=2048, hidden=7168, dtype_bytes=2, record_bytes=656, kept=512)
    plan = plan_run(DSV32, few, H200)
    assert plan.mode == "stream" and plan.streams_on == "device" and plan.passes == 1 and plan.batches_per_pass == 3


def test_offload_modes_are_obeyed_and_checked():
    assert plan_run(DSV32, WIKI, H200, offload="none").mode == "resident"  # asked: the user's call
    small = WeightInventory("test", (100,) * 4, 50, {"bfloat16": 450}, (100,) * 4)
    assert plan_run(small, WIKI, H200, offload="stream").mode == "stream"
    with pytest.raises(UserError, match="--offload 'disk'"):
        plan_run(small, WIKI, H200, offload="disk")


def test_host_memory_too_small_is_refused_at_plan_time():
    tiny_host = Budget(H200.device_bytes, 8 * GIB, "cuda:0", "test")
    huge = Workload(batches=570, forwards_per_batch=100, tokens=16 * 8192, hidden=7168, dtype_bytes=2, record_bytes=656,
                    kept=8192)
    with pytest.raises(UserError, match="fit neither the device .* nor host memory"):
        plan_run(DSV32, huge, tiny_host)


def test_a_gpu_too_small_for_one_layer_is_refused():
    small_gpu = Budget(12 * GIB, H200.host_bytes, "cuda:0", "test")
    with pytest.raises(UserError, match="even streamed"):
        plan_run(DSV32, WIKI, small_gpu)


def test_projection_is_bounded_below_by_the_read_of_each_layer():
    cost = LayerCost(seconds=0.001, peak_bytes=2 * GIB, source="test")
    slow_disk = plan_run(DSV32, WIKI, H200, cost=cost, read_bytes_per_second=1e9, read_source="test")
    fast_disk = plan_run(DSV32, WIKI, H200, cost=cost, read_bytes_per_second=1e12, read_source="test")
    assert slow_disk.passes == fast_disk.passes
    read_floor = slow_disk.passes * sum(DSV32.stored_layer_bytes) / 1e9
    assert slow_disk.projected_seconds() >= read_floor
    compute = WIKI.batches * WIKI.forwards_per_batch * len(LAYERS) * cost.seconds
    assert fast_disk.projected_seconds() == pytest.approx(compute, rel=0.01)
    doc = slow_disk.as_dict()
    assert doc["memory"]["passes"] == slow_disk.passes and doc["time"]["projected_seconds"] == slow_disk.projected_seconds()
    assert any(line.startswith("streams: in device memory") for line in slow_disk.lines())


def test_the_next_layer_materialises_beside_this_one_only_where_two_fit():
    """On a GPU the plan holds two layers' weights (executor.CheckpointLoader overlaps the next layer's copy with this
    layer's compute) where they fit beside one window batch's streams; else one, and the loader does not overlap."""
    one = max(DSV32.layer_bytes)
    tight = Budget(DSV32.other_bytes + one + WIKI.batch_stream_bytes + one // 2, 100 * GIB, "cuda:0", "test")
    plan = plan_run(DSV32, WIKI, tight)
    assert plan.mode == "stream" and plan.layers_on_device == 1
    assert plan.peak_device_bytes <= tight.device_bytes
    cpu = plan_run(DSV32, WIKI, Budget(100 * GIB, 100 * GIB, "cpu", "test"), "stream")
    assert cpu.layers_on_device == 1  # a CPU run materialises each layer when it runs



def test_the_projection_splits_into_forwards_reads_and_loss():
    cost = LayerCost(seconds=0.001, peak_bytes=2 * GIB, source="test", head_seconds=0.01)
    slow = plan_run(DSV32, WIKI, H200, cost=cost, read_bytes_per_second=1e9, read_source="test")
    fast = plan_run(DSV32, WIKI, H200, cost=cost, read_bytes_per_second=1e12, read_source="test")
    for plan in (slow, fast):
        split = plan.projected_split()
        assert split["forwards"] + split["reads"] + split["loss"] == pytest.approx(plan.projected_seconds(), rel=1e-12)
        assert split["loss"] == WIKI.batches * WIKI.forwards_per_batch * cost.head_seconds
    assert slow.projected_split()["reads"] > 0 and fast.projected_split()["reads"] == 0
    assert slow.projected_split()["forwards"] == fast.projected_split()["forwards"]
    line = next(x for x in slow.lines() if x.startswith("time: "))
    assert "forwards " in line and "reads beyond compute " in line and "loss " in line
    assert slow.as_dict()["time"]["projected_split"] == slow.projected_split()
