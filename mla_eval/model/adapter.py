"""Own each MLA attention module's forward so latent KV goes through our cache formats.

Why own the forward (docs/ARCHITECTURE.md): the stable hook points across transformers versions are the
projections (`q_proj` | `q_a_proj`/`q_a_layernorm`/`q_b_proj`, `kv_a_proj_with_mqa`,
`kv_a_layernorm`, `kv_b_proj`, `o_proj`), the `position_embeddings` handed to `self_attn`, and
`module.scaling` (which includes the YaRN mscale^2). Registering an attention function instead
would need a matching mask function and an `expand_kv` override, and the forward's cache keyword
changed name (`past_key_values` -> `cache`) between 5.17 and 5.24.

With a session installed, the forward computes the absorbed query q = [q_nope W_UK, q_pe] (576),
writes c_kv and k_pe through the format's cache writer, reads attention over the quantised cache,
and projects the latent output through W_UV and `o_proj`. Without a session it runs the stock
forward untouched.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import types
from typing import Iterator

import torch

from mla_eval.errors import UserError
from mla_eval.formats import check_model_dims
from mla_eval.model.indexer import INDEXER_FIELDS, indexer_topk
from mla_eval.model.session import CacheSession, LayerEvent

# model_type -> how its attention applies RoPE; DSA models also run their indexer.
SUPPORTED = {
    "deepseek_v2": "complex",
    "deepseek_v3": "cos_sin",
    "kimi_k2": "cos_sin",
    "deepseek_v32": "cos_sin",
    "glm_moe_dsa": "cos_sin",
}
DSA_TYPES = ("deepseek_v32", "glm_moe_dsa")


def stock_attention(model_type: str) -> str:
    """The transformers attention implementation a model of `model_type` is built with (loaded checkpoints and
    random:<preset> models alike): SDPA, except eager where a DSA indexer needs the materialised attention mask. It is
    also the stock forward the benchmarks compare our cache path with."""
    return "eager" if model_type in DSA_TYPES else "sdpa"


def check_supported(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type == "deepseek_v4":
        raise UserError(
            "DeepSeek-V4 checkpoints are not loaded yet: its attention (a 448 + 64 head per entry) runs through "
            "mla_eval.model.deepseek_v4, on random:deepseek-v4 models for now"
        )
    if model_type not in SUPPORTED:
        raise UserError(
            f"unsupported architecture {model_type!r}: mla-eval runs MLA models of type {', '.join(SUPPORTED)}"
        )
    for field in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        if getattr(config, field, None) is None:
            raise UserError(f"config of {model_type!r} has no {field}: not an MLA checkpoint")
    check_model_dims(config.kv_lora_rank, config.qk_rope_head_dim, f"this {model_type} model")
    if model_type in DSA_TYPES:
        missing = [f for f in INDEXER_FIELDS if not getattr(config, f, None)]
        if missing:
            raise UserError(f"config of {model_type!r} (a DSA model) has no {', '.join(missing)}: give its full config.json")


def attention_modules(model) -> list[torch.nn.Module]:
    """The `self_attn` of every decoder layer, in layer order."""
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise UserError("model has no .model.layers: not a decoder-only MLA model")
    mods = [layer.self_attn for layer in layers]
    for m in mods:
        if not hasattr(m, "kv_a_proj_with_mqa") or not hasattr(m, "kv_b_proj"):
            raise UserError(f"layer {m.layer_idx} attention has no kv_a_proj_with_mqa/kv_b_proj: not MLA")
    return mods


def _rope_fn(module):
    """The modeling file's own RoPE function for this attention class."""
    mod = sys.modules[type(module).__module__]
    kind = SUPPORTED[module.config.model_type]
    if kind == "complex":
        return lambda q, k, pe: mod.apply_rotary_emb(q, k, pe.to(q.device))
    if getattr(module.config, "rope_interleave", True) or module.config.model_type in DSA_TYPES:
        return lambda q, k, pe: mod.apply_rotary_pos_emb_interleave(q, k, *pe)
    return lambda q, k, pe: mod.apply_rotary_pos_emb(q, k, *pe)


class MlaAdapter:
    """Patches a loaded MLA model in place; `with adapter.session(...)` routes attention.

    The patch is undone by `restore()` (or by leaving `with MlaAdapter(model) as adapter:`): every
    attention module gets its stock forward back and the model is as transformers built it.
    """

    def __init__(self, model) -> None:
        check_supported(model.config)
        self.model = model
        self.config = model.config
        self.modules = attention_modules(model)
        self.num_layers = len(self.modules)
        self.num_heads = self.config.num_attention_heads
        self.is_dsa = self.config.model_type in DSA_TYPES
        self._session: CacheSession | None = None
        self.graph_failure: str | None = None  # why decode-step CUDA graphs failed here, once they have
        # GLM-5 "shared" indexer layers reuse the top-k of the last full layer of the same forward;
        # we keep it here rather than rely on how a transformers version threads it between layers
        self.last_topk: torch.Tensor | None = None
        # sparse reads so far: keys the top-k really selected vs keys dense causal attention would read
        # (a device tensor, so counting never syncs; `sparse_read_counts()` reads it)
        self._selected_keys: torch.Tensor | int = 0
        self._causal_keys = 0
        for m in self.modules:
            if not hasattr(m, "_mla_eval_stock_forward"):
                m._mla_eval_stock_forward = m.forward
                m._mla_eval_rope = _rope_fn(m)
            m._mla_eval_adapter = self
            m.forward = types.MethodType(_owned_forward, m)

    def restore(self) -> None:
        """Put every stock forward back and drop our attributes (idempotent)."""
        for m in self.modules:
            stock = m.__dict__.pop("_mla_eval_stock_forward", None)
            if stock is None:
                continue
            if getattr(stock, "__self__", None) is m and getattr(stock, "__func__", None) is type(m).forward:
                m.__dict__.pop("forward", None)  # the class's own forward again, as transformers built it
            else:
                m.forward = stock  # someone else had wrapped it before us: give theirs back
            for attr in ("_mla_eval_rope", "_mla_eval_adapter"):
                m.__dict__.pop(attr, None)

    def sparse_read_counts(self) -> tuple[int, int]:
        """(keys selected by the indexers, keys a dense causal read would take), summed over every
        DSA layer forward since the adapter was made: selected < causal proves the sparse path ran."""
        return int(self._selected_keys), self._causal_keys

    def __enter__(self) -> "MlaAdapter":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    @contextlib.contextmanager
    def session(self, session: CacheSession) -> Iterator[CacheSession]:
        if session.num_layers != self.num_layers:
            raise ValueError(f"session has {session.num_layers} layers, model {self.num_layers}")
        prev, self._session = self._session, session
        hook = self.model.base_model.register_forward_pre_hook(_skip_causal_mask, with_kwargs=True) if self.is_dsa else None
        try:
            yield session
        finally:
            if hook is not None:
                hook.remove()
            self._session = prev
            self.last_topk = None


class _NoMasks(dict):
    """A prepared mask mapping that answers None for every attention type."""

    def __missing__(self, key):
        return None


def _skip_causal_mask(module, args, kwargs):
    """Spare a DSA model's forward its [B, 1, T, T] causal mask while a session routes attention.

    The stock DSA models (eager attention) always build that mask for their indexer (`allow_is_causal_skip=False`):
    B x T^2 model-dtype bytes held through the forward (128 MiB per sequence at T = 8192 in bf16, built through a
    T^2 bool mask). Our attention and our indexer apply causality themselves and never read it, so when no mask was
    given we hand the model a prepared mapping instead -- transformers 5.17 and 5.25 take a dict as already prepared
    (`isinstance(attention_mask, dict)` in `DeepseekV32Model` / `GlmMoeDsaModel.forward`) -- and every layer gets None.
    """
    if kwargs.get("attention_mask") is None and len(args) < 2:
        kwargs["attention_mask"] = _NoMasks()
    return args, kwargs


def _owned_forward(self, hidden_states, *args, **kwargs):
    adapter: MlaAdapter = self._mla_eval_adapter
    session = adapter._session
    if session is None:
        return self._mla_eval_stock_forward(hidden_states, *args, **kwargs)
    # The argument order differs between architectures (DeepSeek-V2 takes the mask first): bind
    # the call to the stock signature and take the argument we need by name.
    bound = inspect.signature(self._mla_eval_stock_forward).bind(hidden_states, *args, **kwargs)
    position_embeddings = bound.arguments.get("position_embeddings")

    bsz, seq, _ = hidden_states.shape
    heads, nope, rope_d, v_d = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
    if self.q_lora_rank is None:
        q_resid = None
        q = self.q_proj(hidden_states)
    else:
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
        q = self.q_b_proj(q_resid)
    q = q.view(bsz, seq, heads, nope + rope_d).transpose(1, 2)  # [B, H, T, nope+rope]
    q_nope, q_pe = torch.split(q, [nope, rope_d], dim=-1)

    kv = self.kv_a_proj_with_mqa(hidden_states)
    c_kv, k_pe = torch.split(kv, [self.kv_lora_rank, rope_d], dim=-1)
    c_kv = self.kv_a_layernorm(c_kv)  # [B, T, 512]
    k_pe = k_pe.view(bsz, 1, seq, rope_d)
    q_pe, k_pe = self._mla_eval_rope(q_pe, k_pe, position_embeddings)
    k_pe = k_pe.view(bsz, seq, rope_d)

    layer = self.layer_idx
    session.write(layer, c_kv, k_pe)
    if not adapter.is_dsa and session.uses_mha_prefill(layer, seq):
        return self.o_proj(_mha_prefill(self, session, q_nope, q_pe, hidden_states.dtype)), None

    # Absorb W_UK into the query and keep W_UV for the output (kv_b_proj: [H*(nope+v), 512]).
    w = self.kv_b_proj.weight.view(heads, nope + v_d, self.kv_lora_rank).float()
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    q_lat = torch.einsum("bhtn,hnc->bthc", q_nope.float(), w_uk)
    q_abs = torch.cat([q_lat, q_pe.float().transpose(1, 2)], dim=-1)  # [B, T, H, 576]
    del q, q_nope, q_lat  # O(heads x ctx) each: not held through the attention read

    topk = None
    if adapter.is_dsa:
        topk = _dsa_topk(self, hidden_states, q_resid, position_embeddings)
    out_lat = session.attend(layer, q_abs, float(self.scaling), topk=topk)  # [B, T, H, 512] fp32
    for obs in session.observers:
        obs(LayerEvent(layer, c_kv, k_pe, q_abs, out_lat, session, topk))
    out = torch.einsum("bthc,hvc->bthv", out_lat, w_uv).reshape(bsz, seq, heads * v_d)
    out = self.o_proj(out.to(hidden_states.dtype))
    if self.config.model_type == "glm_moe_dsa":  # its decoder layer passes top-k on to the next
        return out, None, topk
    return out, None


def _mha_prefill(self, session: CacheSession, q_nope, q_pe, dtype) -> torch.Tensor:
    """Causal multi-head attention of a prefill over the decoded cache (session.PREFILL_MODES).

    K and V come from what the cache stores -- the format's decoded latent up-projected through
    kv_b_proj and its decoded rope -- never from the unquantised c_kv; under engine semantics the
    current chunk's own K and V come from its fresh bf16 latent instead (session.chunk_kv), as
    vLLM's MHA prefill attends over the new tokens' fresh K/V. The math is the model dtype's SDPA
    whatever the session's attention math (engines prefill MLA in bf16 MHA). Returns
    [B, T, H * v_dim] in the model's dtype, ready for o_proj.
    """
    bsz, heads, seq, _ = q_nope.shape
    nope, v_d = self.qk_nope_head_dim, self.v_head_dim
    prefix = session.lengths[self.layer_idx] - seq  # > 0 only for a later chunk under engine semantics
    if session.semantics.is_engine:
        # engine chunked prefill: earlier chunks as the cache stores them, this chunk's keys fresh (bf16)
        latent, rope = session.chunk_kv(self.layer_idx, seq)
        if prefix > 0:
            old_latent, old_rope = session.read_back(self.layer_idx, 0, prefix)
            latent, rope = torch.cat([old_latent, latent], 1), torch.cat([old_rope, rope], 1)
    else:
        latent, rope = session.read_back(self.layer_idx, 0, seq)  # float32 [B, T, 512], [B, T, 64]
    keys = prefix + seq
    kv = self.kv_b_proj(latent.to(dtype)).view(bsz, keys, heads, nope + v_d).transpose(1, 2)
    k_nope, v = torch.split(kv, [nope, v_d], dim=-1)
    k = torch.cat([k_nope, rope.to(dtype).view(bsz, 1, keys, -1).expand(-1, heads, -1, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe.to(q_nope.dtype)], dim=-1)
    if q.device.type == "cpu" and v_d != q.shape[-1]:
        # torch's CPU flash kernel needs one head dim for q, k and v; otherwise SDPA takes its math path, which holds
        # [B, H, T, T] fp32 scores (32 GiB at 128 heads x 8192). Zero columns of v add nothing to the real ones.
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - v_d))
    if prefix == 0:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=float(self.scaling))
    else:  # query i (position prefix + i) sees keys 0 .. prefix + i
        mask = torch.arange(keys, device=q.device).view(1, -1) <= (prefix + torch.arange(seq, device=q.device)).view(-1, 1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=float(self.scaling))
    return out[..., :v_d].transpose(1, 2).reshape(bsz, seq, heads * v_d)


def _dsa_topk(self, hidden_states, q_resid, position_embeddings) -> torch.Tensor:
    """Top-k positions [B, T, k] per query from our own indexer (mla_eval.model.indexer).

    Only whole-prompt forwards (no decode cache) are supported for DSA models: the indexer then
    scores the full window, which is what the teacher-forced protocol runs. A GLM-5 "shared" layer
    (no indexer of its own) reuses the top-k of the last full layer of this forward.
    """
    adapter = self._mla_eval_adapter
    session = adapter._session
    seq = hidden_states.shape[1]
    if session.lengths[self.layer_idx] != seq:
        raise UserError("DSA models are evaluated on whole windows only (no incremental decode yet)")
    if getattr(self, "indexer", None) is None:
        if adapter.last_topk is None or adapter.last_topk.shape[1] != seq:
            raise ValueError(f"layer {self.layer_idx} shares the indexer of a previous layer, but none ran in this forward")
        topk = adapter.last_topk.to(hidden_states.device)
    else:
        topk = indexer_topk(self.indexer, self.config.model_type, hidden_states, q_resid, position_embeddings,
                            self.config.index_topk)
        adapter.last_topk = topk
    start = session.lengths[self.layer_idx] - seq
    q_pos = torch.arange(start, start + seq, device=topk.device).view(1, seq, 1)
    adapter._selected_keys = adapter._selected_keys + ((topk >= 0) & (topk <= q_pos)).sum()
    adapter._causal_keys += topk.shape[0] * (seq * (seq + 1) // 2 + start * seq)
    return topk
