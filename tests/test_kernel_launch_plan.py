"""CPU checks of the attention kernel's launch grid, its E2M1 bit placement and its variant choice.

Pure Python (the modules under test import neither cutlass nor a GPU); the GPU tests run the same
code paths for real (tests/test_kernels_gpu.py).
"""

from __future__ import annotations

import struct

import pytest
import torch

from mla_eval.formats import get_format
from mla_eval.formats.numerics import e2m1_decode
from mla_eval_kernels.plan import e2m1_bits
from mla_eval_kernels.plan import tuning as attention_tuning
from mla_eval_kernels.plan.launch_grid import MAX_GRID_X, MAX_GRID_YZ, attention_grid, cta_coords
from mla_eval_kernels.plan.record_plan import plan_for, record_chunk


# ---------------------------------------------------------------------------------- launch grid
@pytest.mark.parametrize(
    "queries,head_tiles,splits",
    [(1, 1, 1), (3, 2, 5), (65535, 1, 1), (65536, 1, 1), (65537, 1, 3), (131072 + 5, 1, 1), (200_000, 8, 4)],
)
def test_attention_grid_fits_cuda_limits_and_covers_every_cta_once(queries, head_tiles, splits):
    x, y, z = attention_grid(queries, head_tiles, splits)
    assert x <= MAX_GRID_X and y <= MAX_GRID_YZ and z == 1 <= MAX_GRID_YZ
    assert x * y * z == queries * head_tiles * splits
    # every (split, query) exactly once: check the decoding at the edges and on a stride through x
    edges = {0, 1, splits - 1, splits, x // 2, x - splits, x - 1} | set(range(0, x, max(1, x // 997)))
    probe = sorted(b for b in edges if 0 <= b < x)
    seen = set()
    for bx in probe:
        s, h, q = cta_coords(bx, y - 1, splits)
        assert 0 <= s < splits and 0 <= q < queries and h == y - 1
        assert q * splits + s == bx
        seen.add((s, q))
    assert len(seen) == len(probe)
    assert cta_coords(x - 1, 0, splits) == (splits - 1, 0, queries - 1)


def test_query_count_past_the_old_z_limit_is_not_in_y_or_z():
    """The first kernel put queries in grid z (limit 65535): a 65,536-token kld window failed."""
    _, y, z = attention_grid(65536, 1, 1)
    assert (y, z) == (1, 1)


def test_attention_grid_refuses_what_cuda_cannot_launch():
    with pytest.raises(ValueError, match="exceed"):
        attention_grid(2**30, 1, 4)
    with pytest.raises(ValueError, match="y limit"):
        attention_grid(4, MAX_GRID_YZ + 1, 1)
    with pytest.raises(ValueError, match="empty grid"):
        attention_grid(0, 1, 1)


# ---------------------------------------------------------------------------------- E2M1 -> bf16x2
def _bf16_bits_to_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def test_prmt_model_selects_bytes():
    a, b = 0x33221100, 0x77665544
    assert e2m1_bits.prmt(a, b, 0x3210) == a
    assert e2m1_bits.prmt(a, b, 0x7654) == b
    assert e2m1_bits.prmt(a, b, 0x4400) == 0x44440000 | 0x00000000  # bytes 0, 0, 4, 4


def test_every_e2m1_byte_becomes_its_two_values_times_2_pow_minus_126():
    codes = torch.arange(256)
    lo = e2m1_decode(codes & 0xF)
    hi = e2m1_decode(codes >> 4)
    for byte in range(256):
        bits = e2m1_bits.e2m1_byte_to_bf16x2_bits(byte)
        got_lo = _bf16_bits_to_float(bits) * 2.0**126
        got_hi = _bf16_bits_to_float(bits >> 16) * 2.0**126
        # exact, signed zeros included (code 8 is -0)
        assert (got_lo, str(got_lo)) == (float(lo[byte]), str(float(lo[byte]))), byte
        assert (got_hi, str(got_hi)) == (float(hi[byte]), str(float(hi[byte]))), byte


def test_every_pair_of_a_word_is_decoded_from_its_own_byte():
    word = 0xF7A3_1C80  # bytes 0x80, 0x1C, 0xA3, 0xF7
    for pair in range(4):
        byte = (word >> (8 * pair)) & 0xFF
        assert e2m1_bits.e2m1_word_to_bf16x2_bits(word, pair) == e2m1_bits.e2m1_byte_to_bf16x2_bits(byte)


def test_scaled_products_are_exact_normal_bf16_numbers():
    """E2M1 * 2^-126 * (E4M3 scale * 2^117) = E2M1 * scale * 2^-9: finite and exact in bf16 for every
    E2M1 magnitude and every finite E4M3 scale, so one bf16 multiply loses nothing."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    scales = e4m3[torch.isfinite(e4m3) & (e4m3 > 0)]
    assert float(scales.max()) * 2.0**e2m1_bits.SCALE_BIAS_LOG2 < 2.0**127  # the bf16 multiplier is finite
    vals = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    prod = (vals[:, None] * scales[None, :]).double() * 2.0**-e2m1_bits.FOLD_LOG2
    assert torch.equal(prod.to(torch.bfloat16).double(), prod)
    assert float(prod.min()) >= 2.0**-126  # normal: no subnormal rounding in the product
    assert e2m1_bits.FOLD_LOG2 + e2m1_bits.SCALE_BIAS_LOG2 == 126


# ---------------------------------------------------------------------------------- variant choice
def test_fast_decode_only_where_it_is_exact():
    eligible = {n for n in ("nvfp4", "nvfp4_fp8rope", "nvfp4_fp8_ds_mla")}
    names = ("nvfp4", "nvfp4_fp8rope", "nvfp4_fp8_ds_mla", "nvfp4_fp8rope_st", "mxfp4", "fp8_ds_mla", "bf16", "trtllm_nvfp4_dsa")
    for name in names:  # TensorRT-LLM's E4M3 read-back rounds every decoded value: no folded decode
        assert attention_tuning.fast_e2m1_eligible(plan_for(get_format(name))) == (name in eligible), name


def test_kernel_version_from_the_environment(monkeypatch):
    plan = plan_for(get_format("nvfp4"))
    monkeypatch.delenv(attention_tuning.ENV, raising=False)
    v2 = attention_tuning.default_tuning(plan, (16, 1, 8, 64))
    assert v2 == attention_tuning.Tuning(q_regs=True, s_chains=2, fast_e2m1=True, prefetch=3)
    # the 64-row tile keeps Q in shared memory (its O accumulator already takes 128 registers), and
    # its 74 KB K tile leaves room for one tile of records in flight in 227 KB
    assert attention_tuning.default_tuning(plan, (64, 4, 2, 64)) == attention_tuning.Tuning(fast_e2m1=True, prefetch=1)
    # bf16 records are copied into K's two stages: no raw ring whatever the room
    bf16 = plan_for(get_format("bf16"))
    assert attention_tuning.default_tuning(bf16, (16, 1, 8, 64)).prefetch == 1
    monkeypatch.setenv(attention_tuning.ENV, "v1")
    assert attention_tuning.default_tuning(plan, (16, 1, 8, 64)) == attention_tuning.V1
    # v3's launches that fall back (sparse, formats whose stages do not fit) run v2's tuning
    monkeypatch.setenv(attention_tuning.ENV, "v3")
    assert attention_tuning.default_tuning(plan, (16, 1, 8, 64)) == v2
    assert attention_tuning.launch_choice(plan, (16, 1, 8, 64)) == attention_tuning.launch_choice(plan, (16, 1, 8, 64), "v2")
    monkeypatch.setenv(attention_tuning.ENV, "v4")
    with pytest.raises(ValueError, match="expected one of v1, v2, v3"):
        attention_tuning.default_tuning(plan, (16, 1, 8, 64))
    with pytest.raises(ValueError, match="s_chains"):
        attention_tuning.Tuning(s_chains=5)
    with pytest.raises(ValueError, match="prefetch"):
        attention_tuning.Tuning(prefetch=0)


def test_prefetch_is_the_deepest_ring_that_fits_the_shared_memory():
    from mla_eval_kernels.plan.device_limits import HOPPER_SMEM_PER_BLOCK

    for name in ("nvfp4", "fp8_ds_mla", "nvfp4_fp8_ds_mla", "mxfp4", "fp8_e4m3"):
        plan = plan_for(get_format(name))
        for tile in ((16, 1, 8, 64), (32, 2, 4, 64), (64, 4, 2, 32)):
            m, _, wn, bn = tile
            p = attention_tuning.default_tuning(plan, tile, "v2").prefetch
            assert attention_tuning.smem_bytes(plan, m, bn, wn, p) <= HOPPER_SMEM_PER_BLOCK, (name, tile)
            if p < attention_tuning.MAX_PREFETCH:
                assert attention_tuning.smem_bytes(plan, m, bn, wn, p + 1) > HOPPER_SMEM_PER_BLOCK, (name, tile)
    # each tile of prefetch costs one more tile of records and of slot ids
    plan = plan_for(get_format("nvfp4"))
    grow = attention_tuning.smem_bytes(plan, 16, 64, 8, 2) - attention_tuning.smem_bytes(plan, 16, 64, 8, 1)
    assert grow == 64 * plan.record_bytes + 4 * 64


def test_v2_at_h16_takes_the_narrow_tile_where_two_ctas_fit_an_sm(monkeypatch):
    """The H200 run measured the narrow tile (two CTAs per SM) fastest where two fit; fp8_ds_mla's
    656-byte records leave room for one, and there the 8-warp tile stays (narrow was 1.5x slower)."""
    monkeypatch.delenv(attention_tuning.ENV, raising=False)
    wide = (16, 1, 8, 64)
    two_fit = {"bf16", "nvfp4", "nvfp4_fp8rope", "nvfp4_fp8rope_st", "nvfp4_fp8_ds_mla", "mxfp4"}
    for name in two_fit | {"fp8_ds_mla", "fp8_ds_mla_pow2", "fp8_e4m3"}:
        plan = plan_for(get_format(name))
        tile, tuning = attention_tuning.launch_choice(plan, wide)
        if name in two_fit:
            assert tile == attention_tuning.NARROW_TILE and tuning.prefetch == attention_tuning.NARROW_PREFETCH, name
            assert tuning.q_regs and tuning.s_chains == 2, name
            m, _, wn, bn = tile
            assert 2 * (attention_tuning.smem_bytes(plan, m, bn, wn, tuning.prefetch) + 1024) <= 228 * 1024, name
        else:
            assert tile == wide and tuning == attention_tuning.default_tuning(plan, wide, "v2"), name
        # v1 and the larger head tiles keep their tile
        assert attention_tuning.launch_choice(plan, wide, "v1") == (wide, attention_tuning.V1)
        assert attention_tuning.launch_choice(plan, (64, 4, 2, 32))[0] == (64, 4, 2, 32)
    # a smaller SM (one narrow CTA) keeps the wide tile
    nvfp4 = plan_for(get_format("nvfp4"))
    assert attention_tuning.launch_choice(nvfp4, wide, smem_per_sm=150 * 1024)[0] == wide


def test_benchmark_probe_variants_are_named_once_and_v2_is_what_dispatch_runs():
    from benchmarks.kernel_bench import probe_variants

    for name in ("bf16", "fp8_ds_mla", "nvfp4", "nvfp4_fp8rope_st"):
        plan = plan_for(get_format(name))
        variants = probe_variants(plan)
        names = [v[0] for v in variants]
        assert len(names) == len(set(names)) and names[:3] == ["v1", "v2", "v2-wide"]
        assert (variants[1][1], variants[1][2]) == attention_tuning.launch_choice(plan, (16, 1, 8, 64), "v2")
        assert ("v2+skip_decode" in names) == (name != "bf16")  # the probe only where there is a decode


# ---------------------------------------------------------------------------------- v3 scope
def test_v3_covers_dense_launches_of_the_formats_whose_stages_fit():
    """Two bf16 K tiles of 64 x 576 (147 KB) plus two stages of records must fit the 227 KB a CTA may
    use: bf16 (no record ring) and the 4-bit formats fit two whole 64-key tiles of records; fp8 records
    (576 / 656 B) do not, and run a ring of part tiles: 2 stages of 32 keys, the fastest the H200 timed of the
    rings that fit (stages - 1 of them load while one decodes; the others stay as bench probes)."""
    limit = attention_tuning.HOPPER_SMEM_PER_BLOCK
    for name in ("bf16", "nvfp4", "nvfp4_fp8rope", "nvfp4_fp8rope_st", "nvfp4_fp8_ds_mla", "mxfp4"):
        plan = plan_for(get_format(name))
        assert attention_tuning.v3_blocker(plan, sparse=False, smem_limit=limit) is None, name
        assert attention_tuning.v3_blocker(plan, sparse=True, smem_limit=limit) is None, name
        # two producer warpgroups: decoded records share the decode, bf16's copy was timed faster with two too
        assert attention_tuning.v3_producer_wgs(plan) == 2, name
        assert attention_tuning.v3_raw_ring(plan) == (2, 64) == attention_tuning.V3_RAW_WHOLE, name
    # the 432-byte nvfp4 record: 2 x 73728 (K) + 2 x 27648 (records) + Q, P^T, slots, reductions, slack
    nvfp4 = plan_for(get_format("nvfp4"))
    fixed = 2 * 64 * 576 * 2 + 2 * 16 * 576 + 2 * 16 * 64 + 512 + 512 + 4096
    assert attention_tuning.smem_bytes_v3(nvfp4) == fixed + 2 * 64 * 432
    for name, rec in (("fp8_ds_mla", 656), ("fp8_ds_mla_pow2", 656), ("fp8_e4m3", 576)):
        ring = (2, 32)  # the measured fastest part-tile ring (attention_tuning.V3_RAW_PREFERRED)
        plan = plan_for(get_format(name))
        assert plan.record_bytes == rec
        # two whole tiles of records do not fit (257,024 / 246,784 B)
        assert fixed + 2 * 64 * rec > limit
        assert attention_tuning.v3_raw_ring(plan) == ring
        assert attention_tuning.smem_bytes_v3(plan) == fixed + ring[0] * ring[1] * rec
        rings = attention_tuning.v3_raw_rings(plan)
        assert all(fixed + s * k * rec <= limit and 2 <= s <= 64 // k + 1 and k in (16, 32) for s, k in rings), rings
        assert rings[0] == ring and ((3, 32) in rings) == (rec == 576)  # 3 x 32 x 656 B does not fit
        # after the measured ring, the others by keys in flight (64 at most: one tile ahead), then the larger stage
        rest = [((s - 1) * k, k) for s, k in rings[1:]]
        assert rest == sorted(rest, reverse=True) and rest[0][0] == 64, rings
        assert attention_tuning.v3_producer_wgs(plan) == 2
        assert attention_tuning.v3_blocker(plan, sparse=False, smem_limit=limit) is None, name
        # a CTA limit below the ring: refused by shared memory, naming the ring
        why = attention_tuning.v3_blocker(plan, sparse=False, smem_limit=200 * 1024)
        assert why is not None and "shared memory" in why and f"{ring[0]} record stages of {ring[1]} keys" in why, why


V3_RUNS = ("bf16", "nvfp4", "nvfp4_fp8rope", "nvfp4_fp8rope_st", "nvfp4_fp8_ds_mla", "mxfp4", "fp8_ds_mla",
           "fp8_ds_mla_pow2", "fp8_e4m3")


def test_forced_v3_runs_sparse_lists_and_the_32_head_tile(monkeypatch):
    """MLA_EVAL_ATTENTION_KERNEL=v3 runs sparse top-k lists and, at h > 16, the 32-head tile (both GPU-tested on an
    H200); the default stays v2 for sparse lists (timed level with v2); a device whose CTAs cannot hold the 32-head
    tile keeps the 16-head one and says why; one 16-head tile has nothing to choose."""
    env = attention_tuning.ENV
    for name in V3_RUNS:
        plan = plan_for(get_format(name))
        assert attention_tuning.v3_blocker(plan, sparse=True) is None
        assert _gen(name, monkeypatch, "v3", sparse=True) == ("v3", f"{env}=v3")
        assert _gen(name, monkeypatch, sparse=True)[0] == "v2"
        gen, why = _gen(name, monkeypatch, "v3", heads=128, sparse=True)
        assert gen == "v3" and "32-head tiles" in why, why
        assert attention_tuning.v3_head_tile(plan, 128, sparse=True)[0] == 32
        small = attention_tuning.smem_bytes_v3(plan, heads=32) - 1
        tile, tile_why = attention_tuning.v3_head_tile(plan, 128, smem_limit=small)
        assert tile == 16 and "shared memory" in tile_why and str(small) in tile_why, tile_why
        for heads in (1, 8, 16):
            assert attention_tuning.v3_head_tile(plan, heads) == (16, f"h = {heads}: one 16-head tile")


def test_two_producer_warpgroups_at_the_32_head_tile_get_per_role_registers():
    """The 32-head tile with two producer warpgroups (384 threads): 65536 / 384 leaves each thread 168 registers at
    launch (a multiple of 8), which the consumer's O^T [512, 32] (128 fp32 per thread) plus S^T did not fit (it
    spilled). `setmaxnreg` moves them: producers 136, consumer 232, exactly the CTA's 168 x 384. Every other v3 CTA
    keeps the even share (no budget: nothing changes in its kernel)."""
    consumer, producer = attention_tuning.v3_reg_budget(32, 2)
    assert (consumer, producer) == attention_tuning.V3_REG_SPLIT == (232, 136)
    assert consumer * 128 + producer * 256 == 168 * 384 == 64512 <= attention_tuning.HOPPER_REGS_PER_SM
    assert consumer - 128 >= 2 * 16 + 32  # O^T, then S^T twice (the fold's rope accumulator) and room to spare
    for heads, wgs in ((16, 1), (16, 2), (32, 1)):
        assert attention_tuning.v3_reg_budget(heads, wgs) is None, (heads, wgs)
    with pytest.raises(ValueError, match="producer_wgs must be one of"):
        attention_tuning.v3_reg_budget(32, 3)


@pytest.mark.parametrize("split,why", [
    ((240, 136), "do not redistribute"),  # 240 x 128 + 136 x 256 = 65536 > the CTA's 64512
    ((236, 128), "multiple of 8"),
    ((264, 96), "multiple of 8 in"),  # above 256
    ((160, 136), "do not redistribute"),  # the consumer below its launch share: .inc would not increase
    ((232, 176), "do not redistribute"),  # the producers above theirs
])
def test_register_budgets_that_the_hardware_refuses_are_refused(split, why, monkeypatch):
    monkeypatch.setattr(attention_tuning, "V3_REG_SPLIT", split)
    with pytest.raises(ValueError, match=why):
        attention_tuning.v3_reg_budget(32, 2)


def test_two_producer_warpgroups_are_the_32_head_tiles_default(monkeypatch):
    """The 32-head tile runs two producer warpgroups by default (GPU tests passed, timed faster than one); the
    16-head tile has two as well; `V3_WIDE_PRODUCER_WGS` is the one value that says so."""
    assert attention_tuning.V3_WIDE_PRODUCER_WGS == 2
    for name in V3_RUNS:
        plan = plan_for(get_format(name))
        assert attention_tuning.v3_producer_choice(plan, 32) == (2, "32-head tile: 2 producer warpgroups"), name
        assert attention_tuning.v3_producer_wgs(plan, 16) == 2
    nvfp4 = plan_for(get_format("nvfp4"))
    monkeypatch.setattr(attention_tuning, "V3_WIDE_PRODUCER_WGS", 1)
    assert attention_tuning.v3_producer_choice(nvfp4, 32) == (1, "32-head tile: 1 producer warpgroup")


def test_v3_shared_memory_of_the_32_head_tile_and_sparse_lists():
    """The 32-head tile grows Q to 32 x 576 bf16 and P^T to 32 x 64 (and the 4-warp reductions); sparse lists add
    each K stage's 64 slot ids (int32). Every format v3 runs fits both within the 227 KB of a CTA: the records
    whose two whole tiles no longer fit beside the larger Q run a part-tile ring, the most keys in flight that fits
    (4-bit formats 64 keys: nvfp4 5 x 16; fp8_ds_mla 3 x 16, 32 keys). The 16-head tile's rings are unchanged
    by sparse lists (their cubins, too: compile_check)."""
    limit = attention_tuning.HOPPER_SMEM_PER_BLOCK
    k_ring, slots, slack = 2 * 64 * 576 * 2, 2 * 64 * 4, 4096

    def fixed(heads, sparse):
        return k_ring + 2 * heads * 576 + 2 * heads * 64 + slots + 2 * 64 * 4 * sparse + 4 * 8 * heads + slack

    assert fixed(32, False) - fixed(16, False) == 16 * 576 * 2 + 16 * 64 * 2 + 16 * 32
    assert fixed(16, True) - fixed(16, False) == 512
    for name in V3_RUNS:
        plan = plan_for(get_format(name))
        raw = 0 if attention_tuning.is_bf16_plan(plan) else plan.record_bytes
        assert attention_tuning.v3_raw_ring(plan, 16, True) == attention_tuning.v3_raw_ring(plan), name
        for heads in (16, 32):
            for sparse in (False, True):
                ring = attention_tuning.v3_raw_ring(plan, heads, sparse)
                need = attention_tuning.smem_bytes_v3(plan, heads=heads, sparse=sparse)
                assert need == fixed(heads, sparse) + ring[0] * ring[1] * raw <= limit, (name, heads, sparse)
                rings = attention_tuning.v3_raw_rings(plan, heads, sparse)
                assert rings and rings[0] == ring
                assert all(fixed(heads, sparse) + s * k * raw <= limit for s, k in rings), (name, rings)
    want32 = {"bf16": (2, 64), "nvfp4": (5, 16), "mxfp4": (5, 16), "nvfp4_fp8rope": (3, 32),
              "nvfp4_fp8_ds_mla": (3, 32), "fp8_ds_mla": (3, 16), "fp8_e4m3": (4, 16)}
    for name, ring in want32.items():
        for sparse in (False, True):
            assert attention_tuning.v3_raw_ring(plan_for(get_format(name)), 32, sparse) == ring, (name, sparse)
    # both tiles run two producer warpgroups (the 32-head tile with per-role registers: O^T [512, 32] is 128 fp32
    # registers per consumer thread, which 384 threads at an even 168 each cannot hold)
    for name in V3_RUNS:
        plan = plan_for(get_format(name))
        assert attention_tuning.v3_producer_wgs(plan, 32) == 2
        assert attention_tuning.v3_reg_budget(32, attention_tuning.v3_producer_wgs(plan, 32)) == (232, 136)
        assert attention_tuning.v3_producer_wgs(plan) == attention_tuning.v3_producer_wgs(plan, 16)


# ---------------------------------------------------------------------------------- which generation runs
def _gen(name, monkeypatch, forced=None, **launch):
    if forced is None:
        monkeypatch.delenv(attention_tuning.ENV, raising=False)
    else:
        monkeypatch.setenv(attention_tuning.ENV, forced)
    kw = dict(sparse=False, heads=16, queries_per_seq=1, smem_limit=attention_tuning.HOPPER_SMEM_PER_BLOCK) | launch
    return attention_tuning.generation_for(plan_for(get_format(name)), **kw)


def test_default_generation_is_v3_only_where_it_was_measured_faster(monkeypatch):
    """Unset: dense decode launches (h <= 16, one query per sequence) of the formats the H200 run timed
    faster under v3 run v3 (every format v3 covers, bf16 included); at h > 16 (32-head tiles) only
    the formats and list kinds the h = 128 bench timed faster (fp8_ds_mla dense and sparse, nvfp4 and nvfp4_fp8_ds_mla
    dense); formats v3 refuses, other sparse lists, and many queries per sequence (prefill-as-decode) run v2."""
    measured = set(attention_tuning.V3_DEFAULT_FORMATS)
    assert measured == {"nvfp4", "nvfp4_fp8rope", "nvfp4_fp8rope_st", "nvfp4_fp8_ds_mla", "mxfp4", "fp8_ds_mla",
                        "fp8_ds_mla_pow2", "fp8_e4m3", "bf16"}
    wide = {("fp8_ds_mla", "dense"), ("fp8_ds_mla", "sparse"), ("nvfp4", "dense"), ("nvfp4_fp8_ds_mla", "dense")}
    for name in ("bf16", "nvfp4", "nvfp4_fp8rope", "nvfp4_fp8rope_st", "nvfp4_fp8_ds_mla", "mxfp4", "fp8_ds_mla",
                 "fp8_ds_mla_pow2", "fp8_e4m3", "trtllm_nvfp4_dsa", "trtllm_nvfp4_dsa_r64"):
        for heads in (1, 2, 8, 16):
            gen, why = _gen(name, monkeypatch, heads=heads)
            assert gen == ("v3" if name in measured else "v2"), (name, heads, why)
            assert why.startswith("default: v3 measured faster" if name in measured else ("default:", name)), why
        # every format the default sends to v3 is one v3 covers
        if name in measured:
            assert attention_tuning.v3_blocker(plan_for(get_format(name)), False) is None
        for launch in (dict(sparse=True), dict(queries_per_seq=2), dict(queries_per_seq=2048, heads=8),
                       dict(queries_per_seq=2, heads=128)):
            gen, why = _gen(name, monkeypatch, **launch)
            assert gen == "v2" and why, (name, launch)
        for sparse in (False, True):
            for heads in (17, 32, 64, 128):
                gen, why = _gen(name, monkeypatch, heads=heads, sparse=sparse)
                want = "v3" if (name, "sparse" if sparse else "dense") in wide else "v2"
                assert gen == want, (name, heads, sparse, why)
                if want == "v3":
                    assert "measured faster" in why and "32-head tiles" in why, why
    assert "one query per sequence, not 2048" in _gen("nvfp4", monkeypatch, queries_per_seq=2048, heads=8)[1]
    assert _gen("nvfp4", monkeypatch, heads=32, sparse=True) == (
        "v2", "default: v3 not measured faster for nvfp4's sparse top-k lists (h = 128)")
    assert _gen("bf16", monkeypatch, heads=128) == ("v2", "default: v3 not measured faster for bf16 at h > 16 (dense, h = 128)")
    assert "not measured faster for trtllm_nvfp4_dsa" in _gen("trtllm_nvfp4_dsa", monkeypatch)[1]
    # a device whose CTAs cannot hold v3's stages: the blocker is the reason, v2 runs
    gen, why = _gen("nvfp4", monkeypatch, smem_limit=200 * 1024)
    assert gen == "v2" and "shared memory" in why


def test_the_environment_forces_a_generation(monkeypatch):
    for forced in ("v1", "v2"):
        for name in ("bf16", "nvfp4", "fp8_ds_mla"):
            for launch in (dict(), dict(sparse=True), dict(queries_per_seq=64, heads=128)):
                assert _gen(name, monkeypatch, forced, **launch) == (forced, f"{attention_tuning.ENV}={forced}")
    # v3 wherever v3 can run (bf16 and unmeasured formats included), else v2 with v3_blocker's reason
    for name in ("bf16", "nvfp4", "mxfp4", "nvfp4_fp8rope_st", "fp8_ds_mla", "fp8_e4m3"):
        tile, tile_why = attention_tuning.v3_head_tile(plan_for(get_format(name)), 128)
        assert tile == 32 and "32-head tiles" in tile_why, tile_why  # the GPU-tested 32-head tile
        want = ("v3", f"{attention_tuning.ENV}=v3 ({tile_why})")
        assert _gen(name, monkeypatch, "v3", heads=128, queries_per_seq=8) == want
        assert _gen(name, monkeypatch, "v3", heads=16) == ("v3", f"{attention_tuning.ENV}=v3")
    for name in ("trtllm_nvfp4_dsa", "sglang_fp4_e2m1"):
        gen, why = _gen(name, monkeypatch, "v3")
        assert (gen, why) == ("v2", attention_tuning.v3_blocker(plan_for(get_format(name)), False)), name
    assert _gen("nvfp4", monkeypatch, " V3 ")[0] == "v3"  # as the variable is read: trimmed, any case
    assert _gen("nvfp4", monkeypatch, "")[0] == "v3"  # empty is unset: the default
    with pytest.raises(ValueError, match="expected one of v1, v2, v3"):
        _gen("nvfp4", monkeypatch, "v4")


def test_the_variants_that_lost_are_gone():
    """The L2 prefetch of records (timed slower for the decoded formats, docs/kernels.md#l2-prefetch), the producer
    revision knob and the consumer / decode rev 1 were deleted with their code; the shipped v3 plan takes no knob but
    the head tile (the benchmark's probes: benchmarks/probes.py)."""
    import inspect

    from mla_eval_kernels.plan import launch as lp

    for name in ("V3_L2_PREFETCH", "V3_L2_PREFETCH_PROBE", "V3_PRODUCER_REV", "V3_CONSUMER_REV", "V3_DECODE_REV"):
        assert not hasattr(attention_tuning, name), name
    assert "l2_prefetch" not in {f.name for f in __import__("dataclasses").fields(lp.V3Config)}
    assert set(inspect.signature(lp.v3_plan).parameters) == {"plan", "heads", "sparse", "facts", "why", "head_tile"}
    assert not hasattr(attention_tuning, "kernel_version")  # one definition: forced_generation / generation_for


def test_trtllm_nvfp4_dsa_runs_v2_with_4_byte_record_chunks():
    """324 B records start on 4-byte boundaries only: v2 copies them with 4-byte cp.async; v3 (16-byte
    chunks, no E4M3 read-back decode) refuses the format by reason, so dispatch runs v2."""
    plan = plan_for(get_format("trtllm_nvfp4_dsa"))
    assert (record_chunk(plan.record_bytes), record_chunk(432), record_chunk(360), record_chunk(1152)) == (4, 16, 8, 16)
    why = attention_tuning.v3_blocker(plan, sparse=False, smem_limit=attention_tuning.HOPPER_SMEM_PER_BLOCK)
    assert why is not None and "E4M3 read-back" in why
    assert not attention_tuning.default_tuning(plan, (16, 1, 8, 64), "v2").fast_e2m1


def test_sglang_fp4_e2m1_runs_v2_without_the_fast_decode():
    """SGLang's 324 B record: 4-byte cp.async in v2, v3 refuses it by its record size (no E4M3 read-back is
    involved); its E8M0 block scales are not E4M3, so the latent is decoded per value (no fast E2M1 fold)."""
    plan = plan_for(get_format("sglang_fp4_e2m1"))
    assert record_chunk(plan.record_bytes) == 4 and not plan.reader_e4m3
    why = attention_tuning.v3_blocker(plan, sparse=False, smem_limit=attention_tuning.HOPPER_SMEM_PER_BLOCK)
    assert why is not None and "16-byte chunks" in why and "324 B" in why and "read-back" not in why
    assert not attention_tuning.fast_e2m1_eligible(plan)
    assert not attention_tuning.default_tuning(plan, (16, 1, 8, 64), "v2").fast_e2m1


def _ring_cases():
    rings = {attention_tuning.V3_RAW_WHOLE}
    for name in ("fp8_ds_mla", "fp8_e4m3"):
        rings |= set(attention_tuning.v3_raw_rings(plan_for(get_format(name))))
    return sorted(rings)


@pytest.mark.parametrize("ring", _ring_cases())
def test_v3_raw_ring_schedule(ring):
    """A model of the v3 producer's raw ring, run on `attention_tuning.v3_raw_unit` (the schedule the kernel
    traces): S - 1 units loaded before the loop (one cp.async group each), then per key tile it and part h:
    wait_group(S - 2), barrier, load unit j = h + S - 1, commit, decode part h. Checked: every part of every
    tile is loaded once and decoded once in order, from the stage it was loaded into, after its group is
    complete; a stage is refilled only after its previous unit was decoded; the slot-id buffer read by a load
    (double-buffered by tile, tile it + 1's written at the start of iteration it) holds that tile's ids."""
    stages, keys = ring
    units = attention_tuning.V3_BN // keys
    assert 2 <= stages <= units + 1 and attention_tuning.V3_BN % keys == 0
    for n_local in (0, 1, 2, 3, 7):
        occupant = {}  # stage -> (tile, part) it holds
        groups = []  # committed cp.async groups, in order (a thread's copies of one unit, or none)
        loaded, decoded = [], []
        slot_buf = {0: 0}  # buffer -> tile whose slot ids it holds

        def load(it, j):
            tile, part, stage = attention_tuning.v3_raw_unit(ring, it, j)
            assert it <= tile <= it + 1 and 0 <= part < units and 0 <= stage < stages
            if tile < n_local:
                assert slot_buf.get(tile % 2) == tile, (ring, it, j)
                assert occupant.get(stage) is None or occupant[stage] in decoded, (ring, it, j)  # refilled after decode
                occupant[stage] = (tile, part)
                loaded.append((tile, part))
                groups.append({(tile, part)})
            else:
                groups.append(set())  # the empty group the kernel commits all the same

        for j in range(stages - 1):
            assert attention_tuning.v3_raw_unit(ring, 0, j)[0] == 0  # the prologue stays in tile 0
            if n_local:
                load(0, j)
            else:
                groups.append(set())
        for it in range(n_local):
            slot_buf[(it + 1) % 2] = it + 1  # look_ahead, before the iteration's first barrier
            for h in range(units):
                landed = set().union(*groups[: len(groups) - (stages - 2)])  # wait_group(S - 2)
                load(it, h + stages - 1)
                tile, part, stage = attention_tuning.v3_raw_unit(ring, it, h)
                assert (tile, part) == (it, h) and occupant[stage] == (it, h) and (it, h) in landed, (ring, it, h)
                decoded.append((it, h))
        want = [(t, p) for t in range(n_local) for p in range(units)]
        assert decoded == want and sorted(loaded) == want, (ring, n_local)


def test_bench_shapes_include_the_dense_h128_decode(capsys):
    """Shape d (dense decode h = 128, issue 14's dense target) is one the bench knows; an unknown one is refused
    before any GPU work, naming the shapes it knows."""
    from benchmarks import kernel_bench as bench

    assert bench.main(["--shapes", "d,e", "--formats", "nvfp4"]) == 2
    err = capsys.readouterr().err
    assert "unknown e" in err and "expected writer,a,b,c,d" in err
    assert "(d) dense decode, h=128" in bench.__doc__


@pytest.mark.parametrize("heads", ["8", "16", "20", "136", "0"])
def test_bench_heads_of_the_multi_tile_shapes_are_checked_before_any_gpu_work(heads, capsys):
    """--heads sets shapes (a) and (d)'s head count (DeepSeek-V3 on 1 / 2 / 4 GPUs of TP: 128 / 64 / 32): a count
    that is not several 16-head tiles up to 128 is one line naming the range, exit 2, before CUDA is touched."""
    from benchmarks import kernel_bench as bench

    assert bench.main(["--heads", heads, "--formats", "nvfp4"]) == 2
    err = capsys.readouterr().err
    assert f"--heads {heads}" in err and "multiple of 16 in 32..128" in err and "\n" == err[-1] and err.count("\n") == 1


def test_bench_h128_rows_add_the_two_producer_32_head_tile_with_variants():
    """Shapes (a) / (d) at h = 128: v3-t16 and v3-t32, and with --variants the 32-head tile with the other producer
    warpgroup count (v3-t32-p1: two are the default); formats v3 refuses get no v3 row."""
    from benchmarks import kernel_bench as bench

    nvfp4 = plan_for(get_format("nvfp4"))
    for sparse in (False, True):
        assert bench.v3_tile_variants(nvfp4, 128, sparse, False) == [("v3-t16", 16, None), ("v3-t32", 32, None)]
        assert bench.v3_tile_variants(nvfp4, 128, sparse, True) == [
            ("v3-t16", 16, None), ("v3-t32", 32, None), ("v3-t32-p1", 32, 1),
        ]
    assert bench.v3_tile_variants(plan_for(get_format("trtllm_nvfp4_dsa")), 128, True, True) == []


