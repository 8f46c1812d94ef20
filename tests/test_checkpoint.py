"""The checkpoint reader (mla_eval.model.checkpoint) on checkpoints written in each on-disk weight format.

References, each independent of the reader:
- bf16: transformers' own from_pretrained of the same folder (logits and every tensor, bit for bit);
- FP8 block: transformers' dequantising FP8 load (FineGrainedFP8, dequantize on CPU), and for the partial
  blocks it refuses (kv_a_proj_with_mqa, 576 rows) DeepSeek's weight_dequant ported below;
- compressed-tensors FP8_DYNAMIC and NVFP4A16: transformers + the compressed-tensors package's decompression;
  FP8_BLOCK: the package's own `dequantize` (transformers refuses its 576-row partial block);
- ModelOpt NVFP4: the dequantisation ModelOpt defines, ported below, and a known-answer nibble-order check.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mla_eval.errors import UserError
from mla_eval.model.checkpoint import Checkpoint, empty_model, load_resident
from mla_eval.model.checkpoint_writer import FORMATS, estimate_layer_bytes, write_random_checkpoint
from mla_eval.model.weight_formats import fp8_block_dequant, nvfp4_dequant, unpack_e2m1

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "mla_eval" / "default_model"
IDS = torch.tensor([[5, 17, 300, 2, 99, 250, 41, 7, 180, 64, 3, 311]])


def small_config(model_type: str = "deepseek_v32", vocab: int = 320, layers: int = 3):
    """Every quantised weight a multiple of 128 in both dims except kv_a_proj_with_mqa (576 rows, as in
    every MLA model), so transformers' FP8 load accepts all the others."""
    import transformers as tf

    kw = dict(vocab_size=vocab, hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=layers,
              num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64,
              v_head_dim=64, max_position_embeddings=256, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
              topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=128, tie_word_embeddings=False)
    if model_type == "deepseek_v3":
        return tf.DeepseekV3Config(**kw)
    dsa = dict(index_topk=4, index_head_dim=128, index_n_heads=1)
    if model_type == "deepseek_v32":
        return tf.DeepseekV32Config(**kw, **dsa)
    return tf.GlmMoeDsaConfig(**kw, **dsa, indexer_types=["full", "shared", "full"][:layers])


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """format -> a deepseek_v32 checkpoint folder (written once per module)."""
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for fmt in FORMATS:
        out[fmt] = write_random_checkpoint(root / fmt, small_config(), fmt, seed=3).path
    return out


def reader_model(folder, dtype=torch.bfloat16):
    from transformers import AutoConfig

    return load_resident(folder, AutoConfig.from_pretrained(folder), torch.device("cpu"), dtype, "eager")


def hf_model(folder, dtype=torch.bfloat16, **kw):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager", **kw).eval()
    finally:
        hf_logging.enable_progress_bar()


@torch.no_grad()
def logits(model):
    return model(IDS).logits


# ------------------------------------------------------------------------------------------------ references


def deepseek_weight_dequant(x: torch.Tensor, s: torch.Tensor, block: int = 128, out=torch.bfloat16) -> torch.Tensor:
    """deepseek-ai/DeepSeek-V3 inference/kernel.py (commit 06231633430c449a1f6a8c0b5a1d6f99860b8eb2),
    `weight_dequant_kernel`: one program per (block row, block col); it loads the block's in-range elements
    (offs < M, N masks), multiplies their fp32 value by the fp32 scale s[pid_m, pid_n] and stores into a
    tensor of the default dtype. Ported as that loop."""
    m, n = x.shape
    y = torch.empty(m, n, dtype=out)
    for pid_m in range(-(-m // block)):
        for pid_n in range(-(-n // block)):
            rows = slice(pid_m * block, min(m, (pid_m + 1) * block))
            cols = slice(pid_n * block, min(n, (pid_n + 1) * block))
            y[rows, cols] = (x[rows, cols].to(torch.float32) * s[pid_m, pid_n]).to(out)
    return y


def modelopt_dequant(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, out=torch.bfloat16) -> torch.Tensor:
    """NVIDIA/Model-Optimizer modelopt/torch/quantization/qtensor/nvfp4_tensor.py (commit
    211c6b3413c52b2fd7a671eda3ce8b2139a4fedd), `NVFP4QTensor.dequantize` (non-fast path): codes
    unpacked with the high nibble at odd and the low nibble at even positions, mapped through the E2M1
    table, times (float(scale) * double_scale) per block of 16, then cast."""
    table = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])
    codes = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.long)
    codes[:, 1::2] = (packed >> 4).long()
    codes[:, 0::2] = (packed & 0x0F).long()
    values = table[codes]
    per_block = scale.to(torch.float32) * scale_2
    return (values.view(values.shape[0], -1, 16) * per_block.unsqueeze(-1)).reshape(values.shape).to(out)


def dequantised_copy(src: Path, dst: Path, dequant) -> Path:
    """A bf16 copy of checkpoint `src` whose quantised weights went through `dequant(base, tensors)` (returns
    the bf16 weight, or None to keep them as stored); quantization_config dropped."""
    dst.mkdir()
    index = json.loads((src / "model.safetensors.index.json").read_text())
    new_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(src / shard))
        out = {}
        for name, t in tensors.items():
            if name.endswith(".weight") and t.dtype in (torch.float8_e4m3fn, torch.uint8):
                base = name[: -len(".weight")]
                parts = {k[len(base) + 1:]: v for k, v in tensors.items() if k.startswith(base + ".")}
                w = dequant(base, parts)
                if w is not None:
                    out[name] = w
                    continue
            out[name] = t
        for name, t in list(out.items()):
            if name.rsplit(".", 1)[-1] in ("weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale",
                                           "weight_global_scale") and name.rsplit(".", 1)[0] + ".weight" in out \
                    and out[name.rsplit(".", 1)[0] + ".weight"].dtype == torch.bfloat16:
                del out[name]
        save_file(out, str(dst / shard), metadata={"format": "pt"})
        new_map.update(dict.fromkeys(out, shard))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": new_map}))
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# ------------------------------------------------------------------------------------------------ bf16


@pytest.mark.parametrize("model_type,dtype", [("deepseek_v3", torch.float32), ("deepseek_v32", torch.bfloat16),
                                              ("glm_moe_dsa", torch.float32), ("glm_moe_dsa", torch.bfloat16)])
def test_bf16_checkpoint_reads_as_from_pretrained_bit_for_bit(model_type, dtype, tmp_path):
    folder = write_random_checkpoint(tmp_path / "c", small_config(model_type), "bf16", seed=1).path
    ours, ref = reader_model(folder, dtype), hf_model(folder, dtype)
    assert torch.equal(logits(ours), logits(ref))
    a, b = ours.state_dict(), ref.state_dict()
    assert list(a) == list(b)
    for name in a:  # fused experts, fp32-kept router tensors, buffers: every tensor as transformers loads it
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert not any(p.device.type == "meta" for p in ours.parameters())


# ------------------------------------------------------------------------------------------------ FP8 block


def test_fp8_partial_blocks_match_deepseek_weight_dequant():
    gen = torch.Generator().manual_seed(0)
    codes = (torch.randn(576, 300, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(5, 3, generator=gen) * 0.01 + 1e-4  # ceil(576/128) x ceil(300/128): both last blocks partial
    for out in (torch.bfloat16, torch.float32):
        assert torch.equal(fp8_block_dequant(codes, scale, (128, 128), out), deepseek_weight_dequant(codes, scale, out=out))
    with pytest.raises(ValueError, match="scale grid"):
        fp8_block_dequant(codes, scale[:4], (128, 128), torch.bfloat16)  # a floor grid is not the format


def test_fp8_block_checkpoint_matches_transformers_dequantising_load(written, tmp_path):
    """transformers' FP8 load refuses the 576-row kv_a_proj_with_mqa ("not divisible by scale grid"), so its
    copy stores that one weight dequantised by DeepSeek's arithmetic; every other weight transformers
    dequantises itself."""
    from transformers import FineGrainedFP8Config

    src = written["fp8-block"]

    def kv_a_only(base, parts):
        if not base.endswith("kv_a_proj_with_mqa"):
            return None
        return deepseek_weight_dequant(parts["weight"], parts["weight_scale_inv"])

    copy = dequantised_copy(src, tmp_path / "ref", kv_a_only)
    cfg = json.loads((src / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(cfg))  # keep quantization_config: transformers dequantises the rest
    ref = hf_model(copy, torch.bfloat16, quantization_config=FineGrainedFP8Config(dequantize=True))
    ours = reader_model(src)
    assert torch.equal(logits(ours), logits(ref))
    q_ref = dict(ref.named_parameters())
    for name, p in ours.named_parameters():  # each dequantised weight, bit for bit
        assert torch.equal(p, q_ref[name]), name


def test_fp8_block_weights_equal_deepseek_arithmetic_everywhere(written):
    src = written["fp8-block"]
    ours = dict(reader_model(src).named_parameters())
    tensors = {}
    for shard in (src).glob("*.safetensors"):
        tensors.update(load_file(str(shard)))
    checked = 0
    for name, t in tensors.items():
        if name.endswith(".weight") and t.dtype == torch.float8_e4m3fn and ".experts." not in name:
            ref = deepseek_weight_dequant(t, tensors[name[: -len("weight")] + "weight_scale_inv"])
            assert torch.equal(ours[name], ref), name
            checked += 1
    assert checked >= 10


# ------------------------------------------------------------------------------------------------ compressed-tensors


def test_compressed_tensors_fp8_dynamic_matches_transformers_with_the_package(written):
    pytest.importorskip("compressed_tensors", reason="the reference is compressed-tensors' decompression (extra: test)")
    from transformers import CompressedTensorsConfig

    ref = hf_model(written["ct-fp8-dynamic"], torch.bfloat16, quantization_config=CompressedTensorsConfig(dequantize=True))
    ours = reader_model(written["ct-fp8-dynamic"])
    assert torch.equal(logits(ours), logits(ref))
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():  # experts included: transformers decompresses them for FP8
        assert p.dtype == ref_params[name].dtype and torch.equal(p, ref_params[name]), name


def test_compressed_tensors_nvfp4_matches_the_packages_decompression(written, tmp_path):
    """transformers 5.25 + compressed-tensors leave fused MoE experts of an NVFP4 checkpoint wrong (off by the
    global scale), so the reference is the package's own NVFP4PackedCompressor.decompress, weight by weight."""
    pytest.importorskip("compressed_tensors", reason="the reference is compressed-tensors' decompression (extra: test)")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    src = written["ct-nvfp4"]
    group = json.loads((src / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"], weights=QuantizationArgs(**group["weights"]))

    def decompress(base, parts):
        if "weight_packed" not in parts:
            return None
        return NVFP4PackedCompressor.decompress(dict(parts), scheme)["weight"]

    index = json.loads((src / "model.safetensors.index.json").read_text())
    copy = tmp_path / "ref"
    copy.mkdir()
    new_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors, out = load_file(str(src / shard)), {}
        bases = {n[: -len(".weight_packed")] for n in tensors if n.endswith(".weight_packed")}
        for base in bases:
            parts = {k[len(base) + 1:]: tensors[k] for k in list(tensors) if k.startswith(base + ".")}
            out[base + ".weight"] = decompress(base, parts)
        out.update({n: t for n, t in tensors.items() if not any(n.startswith(b + ".") for b in bases)})
        save_file(out, str(copy / shard), metadata={"format": "pt"})
        new_map.update(dict.fromkeys(out, shard))
    (copy / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": new_map}))
    cfg = json.loads((src / "config.json").read_text())
    del cfg["quantization_config"]
    (copy / "config.json").write_text(json.dumps(cfg))
    ref, ours = hf_model(copy, torch.bfloat16), reader_model(src)
    assert torch.equal(logits(ours), logits(ref))
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(p, ref_params[name]), name


def test_compressed_tensors_fp8_block_matches_the_packages_dequantize(written):
    pytest.importorskip("compressed_tensors", reason="the reference is compressed-tensors' dequantize (extra: test)")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    src = written["ct-fp8-block"]
    args = QuantizationArgs(**json.loads((src / "config.json").read_text())["quantization_config"]["config_groups"]
                            ["group_0"]["weights"])
    ours = dict(reader_model(src).named_parameters())
    tensors = {}
    for shard in src.glob("*.safetensors"):
        tensors.update(load_file(str(shard)))
    checked = 0
    for name, t in tensors.items():
        if name.endswith(".weight") and t.dtype == torch.float8_e4m3fn and ".experts." not in name:
            ref = dequantize(t, tensors[name[: -len("weight")] + "weight_scale"], args=args, dtype=torch.bfloat16)
            assert torch.equal(ours[name], ref), name
            checked += "kv_a_proj_with_mqa" in name
    assert checked == 3  # the 576-row partial block, in every layer


# ------------------------------------------------------------------------------------------------ ModelOpt NVFP4


def test_nvfp4_nibble_order_and_e2m1_values():
    # byte 0x2F: element 0 from the low nibble (0xF = -6), element 1 from the high one (0x2 = 1.0)
    assert unpack_e2m1(torch.tensor([[0x2F, 0x90]], dtype=torch.uint8)).tolist() == [[-6.0, 1.0, 0.0, -0.5]]
    packed = torch.tensor([[0x71] * 8], dtype=torch.uint8)  # 16 values 0.5, 6.0, ... in one group
    scale = torch.tensor([[2.0]]).to(torch.float8_e4m3fn)
    w = nvfp4_dequant(packed, scale, torch.tensor(0.25), 16, torch.float32, global_divides=False)
    assert w[0, :2].tolist() == [0.5 * 2.0 * 0.25, 6.0 * 2.0 * 0.25]
    w = nvfp4_dequant(packed, scale, torch.tensor([4.0]), 16, torch.float32, global_divides=True)
    assert w[0, :2].tolist() == [0.5 * 2.0 / 4.0, 6.0 * 2.0 / 4.0]


def test_modelopt_nvfp4_checkpoint_matches_modelopts_definition(written, tmp_path):
    src = written["modelopt-nvfp4"]
    assert (src / "hf_quant_config.json").is_file()
    copy = dequantised_copy(src, tmp_path / "ref",
                            lambda base, p: modelopt_dequant(p["weight"], p["weight_scale"], p["weight_scale_2"]))
    ref, ours = hf_model(copy, torch.bfloat16), reader_model(src)
    assert torch.equal(logits(ours), logits(ref))
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(p, ref_params[name]), name


def test_modelopt_detected_from_hf_quant_config_alone(written, tmp_path):
    """Older ModelOpt exports say NVFP4 only in hf_quant_config.json; exports with an FP8 KV cache also store
    k_scale / v_scale, which weights-only dequantisation leaves unread."""
    folder = tmp_path / "old"
    shutil.copytree(written["modelopt-nvfp4"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["quantization_config"]
    (folder / "config.json").write_text(json.dumps(cfg))
    shard = folder / "model-00001-of-00004.safetensors"
    tensors = load_file(str(shard))
    tensors.update({"model.layers.0.self_attn.k_scale": torch.tensor(0.5), "model.layers.0.self_attn.v_scale": torch.tensor(2.0)})
    save_file(tensors, str(shard))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(["model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale"],
                                             shard.name))
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = Checkpoint.open(folder)
    assert ckpt.format.method == "modelopt" and ckpt.format.source == "hf_quant_config.json"
    assert ckpt.describe()["quantisation"]["activation_scales_unused"] == 3 * 7 + 3 + 2 * 15 + 2  # input_scale each
    assert torch.equal(logits(reader_model(folder)), logits(reader_model(written["modelopt-nvfp4"])))


# ------------------------------------------------------------------------------------------------ the plan


@pytest.mark.parametrize("fmt", FORMATS)
def test_plan_from_config_and_index_alone(fmt, written, tmp_path):
    full = Checkpoint.open(written[fmt])
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors.index.json", "hf_quant_config.json"):
        if (written[fmt] / f).is_file():
            shutil.copy(written[fmt] / f, bare / f)
    plan = Checkpoint.open(bare, require_weights=False)
    assert not plan.headers_complete and plan.stored_bytes() is None and plan.bytes_by_dtype() is None
    assert plan.tensors[next(iter(plan.tensors))].dtype is None
    assert set(plan.quantised) == set(full.quantised) and plan.format == full.format
    assert plan.index_total_size == full.stored_bytes() == sum(full.bytes_by_dtype().values())
    with pytest.raises(UserError, match="model-00001-of-00004.safetensors named by .* is missing .0 of 4"):
        plan.check_shards()
    skeleton = empty_model(small_config(), torch.bfloat16)
    for layer in range(3):  # the estimate from config shapes + the format's dtypes is exact for these writers
        assert plan.estimated_stored_bytes(skeleton, layer=layer) == full.stored_bytes(layer=layer)
    assert plan.estimated_stored_bytes(skeleton) == full.stored_bytes()
    layers, rest = estimate_layer_bytes(small_config(), fmt)
    assert layers == [full.stored_bytes(layer=i) for i in range(3)] and rest == full.stored_bytes(part="embed") \
        + full.stored_bytes(part="lm_head") + full.stored_bytes(part="norm")


def test_bytes_by_layer_and_part_with_an_mtp_layer(written, tmp_path):
    folder = tmp_path / "mtp"
    shutil.copytree(written["fp8-block"], folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    last = load_file(str(folder / "model-00003-of-00004.safetensors"))
    mtp = {k.replace("layers.2.", "layers.3.", 1): v for k, v in last.items()}
    mtp.update({"model.layers.3.enorm.weight": torch.ones(256, dtype=torch.bfloat16),
                "model.layers.3.hnorm.weight": torch.ones(256, dtype=torch.bfloat16),
                "model.layers.3.eh_proj.weight": torch.zeros(256, 512, dtype=torch.bfloat16)})
    save_file(mtp, str(folder / "mtp.safetensors"))
    index["weight_map"].update(dict.fromkeys(mtp, "mtp.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg))
    ckpt = Checkpoint.open(folder)
    parts = ckpt.bytes_by_part()
    mtp_bytes = sum(t.numel() * t.element_size() for t in mtp.values())
    assert parts["mtp"] == mtp_bytes and ckpt.mtp_layers == 1
    assert parts["layer"] == sum(ckpt.stored_bytes(layer=i) for i in range(3))
    assert sum(parts.values()) == ckpt.stored_bytes() == sum(ckpt.bytes_by_dtype().values())
    assert not any(".layers.3." in n for n in ckpt.read_rest().tensors)  # transformers builds no MTP module
    assert torch.equal(logits(reader_model(folder)), logits(reader_model(written["fp8-block"])))


def test_describe_records_what_the_weights_were(written):
    d = Checkpoint.open(written["fp8-block"]).describe()
    q = d["quantisation"]
    assert q["method"] == "fp8" and q["block_size"] == [128, 128]
    # per layer: q_a, q_b, kv_a, kv_b, o, indexer wq_b + wk = 7 attention weights; layer 0 dense MLP (3),
    # layers 1-2: 4 experts x 3 + shared 3
    assert q["quantised_weights"] == 3 * 7 + 3 + 2 * 15
    assert q["quantised_by_kind"]["mlp.experts.up_proj"] == 8 and "mlp.gate" not in q["quantised_by_kind"]
    assert "self_attn.indexer.weights_proj" not in q["quantised_by_kind"]
    assert d["bytes_by_dtype"]["F8_E4M3"] > d["bytes_by_dtype"]["BF16"] > 0
    assert Checkpoint.open(written["bf16"]).describe()["quantisation"]["method"] == "none"


# ------------------------------------------------------------------------------------------------ reading


def test_read_layer_from_threads_equals_sequential_reads(written):
    ckpt = Checkpoint.open(written["modelopt-nvfp4"])
    want = {i: ckpt.read_layer(i).tensors for i in range(3)}
    got, errors = {}, []

    def work(i):
        try:
            for _ in range(3):
                got[(i, _)] = ckpt.read_layer(i % 3).tensors
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for (i, _), tensors in got.items():
        assert tensors.keys() == want[i % 3].keys()
        assert all(torch.equal(tensors[k], want[i % 3][k]) for k in tensors)


def test_per_expert_module_layout_is_filled_too(written):
    """A transformers version that keeps experts as a ModuleList gets the stored weights by name."""
    ckpt = Checkpoint.open(written["fp8-block"])
    fused = empty_model(small_config(), torch.bfloat16).model.layers[1]
    ckpt.materialise(fused, ckpt.read_layer(1), "cpu", torch.bfloat16)

    class Mlp(torch.nn.Module):
        def __init__(self, shapes):
            super().__init__()
            for proj, shape in shapes.items():
                setattr(self, proj, torch.nn.Linear(shape[1], shape[0], bias=False, device="meta", dtype=torch.bfloat16))

    layer = empty_model(small_config(), torch.bfloat16).model.layers[1]
    e, two_i, h = layer.mlp.experts.gate_up_proj.shape
    layer.mlp.experts = torch.nn.ModuleList(
        Mlp({"gate_proj": (two_i // 2, h), "up_proj": (two_i // 2, h), "down_proj": (h, two_i // 2)}) for _ in range(e))
    ckpt.materialise(layer, ckpt.read_layer(1), "cpu", torch.bfloat16)
    for k in range(e):
        gate_up = fused.mlp.experts.gate_up_proj[k]
        assert torch.equal(layer.mlp.experts[k].gate_proj.weight, gate_up[: two_i // 2])
        assert torch.equal(layer.mlp.experts[k].up_proj.weight, gate_up[two_i // 2:])
        assert torch.equal(layer.mlp.experts[k].down_proj.weight, fused.mlp.experts.down_proj[k])


def test_a_checkpoint_that_does_not_fit_the_model_is_refused(written):
    ckpt = Checkpoint.open(written["bf16"])
    layer = empty_model(small_config(), torch.bfloat16).model.layers[1]
    raw = ckpt.read_layer(1)
    del raw.tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(UserError, match="holds 7 of the 8 expert weights"):
        ckpt.materialise(layer, raw, "cpu", torch.bfloat16)
    raw = ckpt.read_layer(1)
    raw.tensors["model.layers.1.self_attn.bogus.weight"] = torch.zeros(2, 2)
    with pytest.raises(UserError, match="bogus.weight has no place"):
        ckpt.materialise(empty_model(small_config(), torch.bfloat16).model.layers[1], raw, "cpu", torch.bfloat16)


# ------------------------------------------------------------------------------------------------ bad input


def test_missing_shard_unsupported_method_and_truncated_shard_are_one_line(written, tmp_path):
    missing = tmp_path / "missing"
    shutil.copytree(written["fp8-block"], missing)
    (missing / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises(UserError) as exc:
        Checkpoint.open(missing)
    assert "model-00002-of-00004.safetensors" in str(exc.value) and "missing" in str(exc.value)

    gptq = tmp_path / "gptq"
    shutil.copytree(written["bf16"], gptq)
    cfg = json.loads((gptq / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (gptq / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError) as exc:
        Checkpoint.open(gptq)
    assert "'gptq' is not supported" in str(exc.value) and "modelopt" in str(exc.value) and "fp8" in str(exc.value)

    cut = tmp_path / "cut"
    shutil.copytree(written["ct-nvfp4"], cut)
    shard = cut / "model-00003-of-00004.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(UserError, match="model-00003-of-00004.safetensors is truncated"):
        Checkpoint.open(cut)
    for err in (exc.value,):
        assert "\n" not in str(err)


def test_a_shard_that_breaks_after_planning_is_a_user_error(written, tmp_path):
    folder = tmp_path / "later"
    shutil.copytree(written["fp8-block"], folder)
    ckpt = Checkpoint.open(folder)
    (folder / "model-00002-of-00004.safetensors").unlink()  # gone mid-run
    with pytest.raises(UserError, match="reading .*model-00002-of-00004.safetensors failed"):
        ckpt.read_layer(1)
    shard = folder / "model-00003-of-00004.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])  # cut short mid-run
    with pytest.raises(UserError, match=r"reading .*model-00003-of-00004.safetensors failed \(file ended 100 bytes early"):
        ckpt.read_layer(2)


@pytest.fixture(scope="module")
def cli_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    fp8 = write_random_checkpoint(root / "fp8", small_config("deepseek_v3", vocab=12288), "fp8-block",
                                  tokenizer_from=TOKENIZER).path
    return root, fp8


def test_kld_runs_on_a_quantised_checkpoint(cli_checkpoints, tmp_path, capsys):
    from mla_eval.cli import main

    _, fp8 = cli_checkpoints
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"The {w} river passes the mill." for w in ["north", "south", "east", "west"] * 20))
    out = tmp_path / "k.json"
    code = main(["kld", "--model", str(fp8), "--text", str(text), "--formats", "nvfp4", "--scales", "none",
                 "--no-layer-stats", "--ctx", "64", "--stride", "32", "--device", "cpu", "--out", str(out)])
    assert code == 0, capsys.readouterr().err[-2000:]
    scores = json.loads(out.read_text())["formats"]["nvfp4"]
    assert scores["tokens"] > 0 and 0 < scores["kld_mean"] < float("inf")


@pytest.mark.parametrize("case", ["missing shard", "unsupported method", "truncated shard"])
def test_cli_bad_checkpoints_are_one_line_exit_2(case, cli_checkpoints, tmp_path, capsys):
    from mla_eval.cli import main

    root, fp8 = cli_checkpoints
    folder = tmp_path / "bad"
    shutil.copytree(fp8, folder)
    if case == "missing shard":
        (folder / "model-00001-of-00004.safetensors").unlink()
        expected = "model-00001-of-00004.safetensors named by model.safetensors.index.json is missing"
    elif case == "unsupported method":
        cfg = json.loads((folder / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "awq"}
        (folder / "config.json").write_text(json.dumps(cfg))
        expected = "weight quantisation 'awq' is not supported; supported: none"
    else:
        shard = folder / "model-00004-of-00004.safetensors"
        shard.write_bytes(shard.read_bytes()[:-10])
        expected = "is truncated"
    text = tmp_path / "t.txt"
    text.write_text("a few words of text " * 40)
    capsys.readouterr()
    code = main(["kld", "--model", str(folder), "--text", str(text), "--formats", "nvfp4", "--scales", "none",
                 "--no-layer-stats", "--ctx", "64", "--device", "cpu", "--out", str(tmp_path / "k.json")])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err
    assert not (tmp_path / "k.json").exists()


def test_full_width_tool_bytes_per_layer_from_the_geometry(capsys):
    """tools/write_checkpoint.py --dry-run at DeepSeek-V3.2 width against the bytes worked out by hand from its
    published geometry (fp8 codes 1 B + a float32 scale per 128x128 block; bf16 elsewhere)."""
    from tools.write_checkpoint import full_width_config
    from tools.write_checkpoint import main as tool

    def fp8(out, inn):
        return out * inn + -(-out // 128) * -(-inn // 128) * 4

    h = 7168
    attention = (fp8(1536, h) + fp8(128 * 192, 1536) + fp8(576, h) + fp8(128 * 256, 512) + fp8(h, 128 * 128)
                 + fp8(64 * 128, 1536) + fp8(128, h) + 64 * h * 2 + 128 * 2 * 2  # indexer: wq_b, wk, weights_proj, k_norm
                 + (1536 + 512 + 2 * h) * 2)  # q_a / kv_a / input / post-attention norms
    dense = attention + 2 * fp8(18432, h) + fp8(h, 18432)
    moe = attention + 256 * h * 2 + 256 * 4 + 256 * (2 * fp8(2048, h) + fp8(h, 2048)) + 2 * fp8(2048, h) + fp8(h, 2048)
    rest = 2 * 129280 * h * 2 + h * 2  # embeddings, lm_head, final norm
    assert estimate_layer_bytes(full_width_config(4, 3), "fp8-block") == ([dense] * 3 + [moe], rest)
    assert tool(["unused", "--layers", "4", "--first-dense", "3", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"layer   3 (MoE  ): {moe / 1e9:8.3f} GB" in out and f"total {(3 * dense + moe + rest) / 1e9:.2f} GB" in out


@pytest.mark.parametrize("kind", ["modelopt-nvfp4", "ct-nvfp4"])
def test_a_zero_group_scale_is_accepted_only_over_zero_codes(kind, written, tmp_path):
    """An NVFP4 group whose 16 values are all zero gets a zero E4M3 scale from a quantiser (amax / 6 = 0): such a
    checkpoint loads; a zero scale over codes that are not all zero is what no quantiser writes, and is refused
    naming the shard and the tensor (mla_eval.model.weight_checks, issue 44)."""
    from corrupt_checkpoints import TARGET, _edit

    codes = f"{TARGET}.weight" if kind == "modelopt-nvfp4" else f"{TARGET}.weight_packed"
    scale = f"{TARGET}.weight_scale"

    def zero_group(t):
        t = t.clone()
        t.view(torch.uint8)[0, 0] = 0
        return t

    ok = tmp_path / "ok"
    shutil.copytree(written[kind], ok)
    _edit(ok, scale, zero_group)
    _edit(ok, codes, lambda t: torch.cat([torch.zeros_like(t[:, :8]), t[:, 8:]], dim=1))  # group 0 of row 0.. all zero
    ckpt = Checkpoint.open(ok)
    ckpt.materialise(empty_model(small_config(), torch.bfloat16).model.layers[1], ckpt.read_layer(1), "cpu", torch.bfloat16)
    bad = tmp_path / "bad"
    shutil.copytree(written[kind], bad)
    _edit(bad, scale, zero_group)
    _edit(bad, codes, lambda t: torch.cat([torch.full_like(t[:, :8], 0x11), t[:, 8:]], dim=1))
    ckpt = Checkpoint.open(bad)
    with pytest.raises(UserError, match=rf"model-0000\d-of-00004.safetensors: {re.escape(scale)} holds 1 of .* scale values "
                                        r"that no quantiser writes \(first weight_scale\[0, 0\] = 0; scales are > 0 wherever"):
        ckpt.materialise(empty_model(small_config(), torch.bfloat16).model.layers[1], ckpt.read_layer(1), "cpu",
                         torch.bfloat16)
