"""Random preset models on a GPU: built on the device in bf16, the DSA sparse path through the kernels."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_random_glm52_builds_on_the_gpu_and_selects_sparsely_through_the_kernels():
    pytest.importorskip("cutlass")
    from benchmarks.production_bench import _logp
    from mla_eval.attention import dispatch
    from mla_eval.model.loader import load_model

    torch.cuda.reset_peak_memory_stats()
    lm = load_model("random:glm-5.2:layers=2:seed=0", device="cuda")
    attn = lm.model.model.layers[0].self_attn
    assert attn.q_b_proj.weight.device.type == "cuda" and attn.q_b_proj.weight.dtype == torch.bfloat16
    ids = torch.randint(0, lm.model.config.vocab_size, (1, 2304), device="cuda")
    with dispatch.use_backend("kernel") as log:
        kernel = _logp(lm, "nvfp4", ids)
    with dispatch.use_backend("reference"):
        ref = _logp(lm, "nvfp4", ids)
    assert all(path == "kernel" for path in log.paths.values()), log.paths
    selected, causal = lm.adapter.sparse_read_counts()
    assert 0 < selected < causal
    assert torch.isfinite(kernel).all()
    kl = (ref.exp() * (ref - kernel)).sum(-1).mean().item()
    assert kl < 1e-2, kl  # the same cache bytes read by the kernel and by the reference


def test_same_seed_same_weights_on_the_gpu():
    from mla_eval.model.loader import load_model

    a = load_model("random:deepseek-v3:layers=1:seed=5", device="cuda").model.state_dict()
    b = load_model("random:deepseek-v3:layers=1:seed=5", device="cuda").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
