"""DeepSeek-V4 (transformers `deepseek_v4`): its three kinds of cache entries through our records, whole windows.

DeepSeek-V4's attention (transformers 5.17 and 5.25, `DeepseekV4Attention`) writes every cache entry through its
`cache` argument: `cache.update(kv, kv, layer)` for the sliding-window heads, and, in a compressed layer, the
compressor's `cache.layers[layer].store_compression_weights / update_overlap_state / update_compressor_states` for the
compressed heads and (compressed-sparse layers) the lightning indexer's keys. It then attends over what those calls
return. A `V4Session` is that cache: it hands each head back as the engine's record stores it (encode, then decode:
`formats.v4.encode_head` / `decode_head`), so the stock attention -- its sinks, its sliding-window mask, its compressed
entries' causality and its indexer's top-k -- reads exactly what an engine's cache holds. Nothing of the model is
patched.

Which record goes where is a `formats.v4.V4CacheConfig` (the engine configuration a --formats name selects): the
sliding-window heads and the compressed heads each through their record; the indexer keys exact (the engines' FP8 /
MXFP4 indexer records count in `capacity` only; issue 40's indexer-format axis is where they belong).

Two ways a session serves the model. Whole windows (kld): every window is one forward from position 0 (the
compressor's windows close within it; nothing is carried between forwards), which is what the teacher-forced protocol
runs. Incremental decode (needle, `V4Decode`): transformers' own cache layers for V4 keep what carries across forwards
-- the sliding window, the compressors' not-yet-closed windows (float32 state in every engine, not a record) and the
compressed-sparse overlap -- and the session's `recording` routes each head they store through its record as it is
written, once, as an engine's cache does.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Iterator, Sequence

import torch

from mla_eval.attention import dispatch
from mla_eval.errors import UserError
from mla_eval.formats.v4 import V4_CONFIGS, V4CacheConfig, decode_head, encode_head, v4_config

V4_TYPE = "deepseek_v4"
# transformers' layer types -> the kind of entry its compressed heads are (formats.v4.ENTRY_KINDS)
_COMPRESSED_KIND = {"compressed_sparse_attention": "compressed_csa", "heavily_compressed_attention": "compressed_hca"}
WHY_REFERENCE = "DeepSeek-V4 runs the model's own attention over the decoded heads (the kernels serve the 512 + 64 MLA " \
    "attention)"


def is_v4(config) -> bool:
    return getattr(config, "model_type", None) == V4_TYPE


def config_for(name: str) -> V4CacheConfig:
    """The V4 cache configuration a --formats name selects (one-line UserError naming the choices otherwise)."""
    config = v4_config(name)
    if config is None:
        raise UserError(f"format {name!r} is a 512 + 64 MLA record; DeepSeek-V4 caches 448 + 64 heads: choose among its "
                        f"configurations {', '.join(c.name for c in V4_CONFIGS)} (see `mla-eval formats`)")
    return config


class V4Session:
    """The cache of one whole-window forward of a DeepSeek-V4 model: what transformers' attention writes to it comes
    back as `config`'s records read it. `layer_types` names each layer's attention and `rates` each compressed layer
    type's tokens per entry (the model config's)."""

    def __init__(self, config: V4CacheConfig, layer_types: Sequence[str], rates: dict[str, int]) -> None:
        self.config = config
        self.layer_types = tuple(layer_types)
        self.rates = dict(rates)  # tokens per compressed entry, per layer type
        self.num_layers = len(self.layer_types)
        self.layers = [_LayerEntries(self, i) for i in range(self.num_layers)]
        self.entries = {"sliding": 0, "compressed_csa": 0, "compressed_hca": 0, "indexer": 0}  # heads written, by kind

    def through(self, layer: int, kind: str, heads: torch.Tensor) -> torch.Tensor:
        """`heads` [..., 512] as the record of entry `kind` stores and the engine reads them, in their dtype."""
        use = self.config.record(kind)
        self.entries[kind] += heads[..., 0].numel()
        if heads.numel() == 0:
            return heads
        dispatch.reference_only("write", use.spec, heads.device, WHY_REFERENCE)
        return decode_head(use, encode_head(use, heads.float(), layer=layer)).to(heads.dtype)

    # transformers' Cache surface that DeepseekV4Attention calls
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        heads = self.through(layer_idx, "sliding", key_states)
        return heads, heads  # K = V: one head per entry

    def recording(self, cache):
        """`cache` (transformers' DynamicCache of this model's V4 layers) with every head it stores written through
        this session's records: its sliding-window `update` and its compressors' `update_compressor_states` see the
        decoded heads; the compressors' running windows stay in the model's dtype (every engine keeps them float32)."""
        if len(cache.layers) != self.num_layers:
            raise ValueError(f"cache has {len(cache.layers)} layers, session {self.num_layers}")
        for i, layer in enumerate(cache.layers):
            _record_writes(self, i, layer)
        return cache

    def reset(self) -> None:
        """Nothing is held between forwards."""

    def release_layer(self, layer: int) -> None:
        """Nothing is held between forwards."""


class _LayerEntries:
    """One layer's compressed entries (transformers' DeepseekV4HCACache / CSACache surface the compressors call). A whole
    window from position 0: every closed window compresses now, nothing is buffered or carried over."""

    def __init__(self, session: V4Session, layer: int) -> None:
        self.session, self.layer = session, layer

    def store_compression_weights(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        rate = self.session.rates[self.session.layer_types[self.layer]]
        usable = kv.shape[1] // rate * rate
        return kv[:, :usable], gate[:, :usable], 0

    def update_overlap_state(self, name, chunk_kv, chunk_gate, head_dim):
        return None, None  # the first window has no predecessor

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        if name == "indexer":
            self.session.entries["indexer"] += compressed[..., 0].numel()
            return compressed  # the indexer keys are scored exact (see the module docstring)
        kind = _COMPRESSED_KIND[self.session.layer_types[self.layer]]
        return self.session.through(self.layer, kind, compressed)


def _record_writes(session: V4Session, i: int, layer) -> None:
    """Route the heads transformers' cache layer `layer` (layer `i`) stores through `session`'s records."""
    update = layer.update

    def recorded_update(key_states, value_states, *args, **kwargs):
        heads = session.through(i, "sliding", key_states)
        return update(heads, heads, *args, **kwargs)  # K = V: one head per entry

    layer.update = recorded_update
    kind = _COMPRESSED_KIND.get(session.layer_types[i])
    if kind is None:  # a sliding-window-only layer
        return
    compress = getattr(layer, "update_compressor_states", None)
    if compress is None:
        raise UserError(f"this transformers' cache gives layer {i} ({session.layer_types[i]}) a {type(layer).__name__}, "
                        "not its DeepSeek-V4 compressed cache layer: needle on DeepSeek-V4 needs transformers >= 5.17")

    def recorded_compress(name: str, compressed: torch.Tensor) -> torch.Tensor:
        if name == "indexer":
            session.entries["indexer"] += compressed[..., 0].numel()
            return compress(name, compressed)  # the indexer keys are scored exact (see the module docstring)
        return compress(name, session.through(i, kind, compressed))

    layer.update_compressor_states = recorded_compress


class V4Decode:
    """Greedy decoding of a batch of equal-length prompts through one V4 cache configuration: `prefill(ids)` then
    `step(tokens, position)`, each returning the last position's logits [b, vocab] (`model.decode_steps.DecodeSteps`'
    surface). Eager steps through the model's own forward and transformers' cache layers (`V4Session.recording`)."""

    mode = "eager"
    blocker = "DeepSeek-V4 decodes eagerly through transformers' own cache layers (no CUDA graph)"

    def __init__(self, lm, config: V4CacheConfig) -> None:
        from transformers import DynamicCache

        self.lm = lm
        cfg = lm.model.config
        self.session = V4Session(config, cfg.layer_types, cfg.compress_rates)
        self.cache = self.session.recording(DynamicCache(config=cfg))
        params = inspect.signature(type(lm.model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # 5.25 / 5.17

    @torch.no_grad()
    def _logits(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = self.lm.model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1,
                            **{self._cache_kw: self.cache})
        return out.logits[:, -1]

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        return self._logits(ids, torch.arange(t, device=ids.device).expand(b, -1))

    def __call__(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        pos = torch.full((tokens.shape[0], 1), position, dtype=torch.int64, device=tokens.device)
        return self._logits(tokens.view(-1, 1), pos)


class V4Adapter:
    """What the evaluations ask of a loaded model's attention (`MlaAdapter`'s surface) for DeepSeek-V4. Nothing is
    patched: the session reaches the attention as its cache argument (V4Stack)."""

    is_v4 = True
    is_dsa = True  # compressed-sparse layers read only their indexer's top-k: one whole-window forward, cache semantics

    def __init__(self, model) -> None:
        if not is_v4(model.config):
            raise UserError(f"not a DeepSeek-V4 model: model_type {getattr(model.config, 'model_type', None)!r}")
        self.model = model
        self.config = model.config
        self.modules = [layer.self_attn for layer in model.model.layers]
        self.num_layers = len(self.modules)
        self.num_heads = self.config.num_attention_heads
        self.last_topk = None
        self.graph_failure = None
        self._session: V4Session | None = None

    def restore(self) -> None:
        """Nothing to restore: the model's forwards are its own."""

    def sparse_read_counts(self) -> tuple[int, int]:
        return 0, 0

    def __enter__(self) -> "V4Adapter":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    @contextlib.contextmanager
    def session(self, session: V4Session) -> Iterator[V4Session]:
        if session.num_layers != self.num_layers:
            raise ValueError(f"session has {session.num_layers} layers, model {self.num_layers}")
        prev, self._session = self._session, session
        try:
            yield session
        finally:
            self._session = prev


class V4Stack:
    """DeepSeek-V4's decoder run the way `DeepseekV4Model.forward` runs it (embeddings on `hc_mult` streams, "main" and
    "compress" rotary tables, every layer, the hyper-head and the final norm), each layer's attention writing to and
    reading from the window's session. Resident, whole windows (`executor.DecoderStack`'s `run_resident`)."""

    def __init__(self, lm) -> None:
        self.lm = lm
        self.base = lm.model.model
        self.layers = list(self.base.layers)
        self.config = lm.model.config
        params = inspect.signature(type(self.layers[0].self_attn).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # 5.25 / 5.17

    def _mask(self, b: int, t: int, h: torch.Tensor) -> torch.Tensor:
        """The sliding-window causal mask the model builds for eager attention: key j is visible to query i when
        j <= i and i - j < sliding_window; masked scores get the dtype's most negative value."""
        i = torch.arange(t, device=h.device).view(-1, 1)
        j = torch.arange(t, device=h.device).view(1, -1)
        visible = (j <= i) & (i - j < self.config.sliding_window)
        zero = torch.zeros((), dtype=h.dtype, device=h.device)
        return torch.where(visible, zero, torch.finfo(h.dtype).min).view(1, 1, t, t).expand(b, 1, t, t)

    @torch.no_grad()
    def run_resident(self, fwd, record=None, start=None) -> torch.Tensor:
        if record is not None or start is not None:
            raise ValueError("a DeepSeek-V4 forward runs every layer from the first")
        if len(fwd.chunks()) != 1:
            raise UserError("DeepSeek-V4 runs whole windows only (no chunked prefill or incremental decode yet)")
        session = fwd.session
        ids = fwd.ids
        b, t = ids.shape
        emb = self.base.embed_tokens(ids)
        pos = torch.arange(t, device=emb.device).expand(b, -1)
        pe = {kind: self.base.rotary_emb(emb, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
        h = emb.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        mask = self._mask(b, t, emb)
        with self.lm.adapter.session(session):
            for layer in self.layers:
                h = layer(h, position_embeddings=pe, position_ids=pos, attention_mask=mask, input_ids=ids,
                          **{self._cache_kw: session})
        out = self.base.norm(self.base.hc_head(h))
        return out[:, fwd.keep].reshape(-1, out.shape[-1])


def refuse_v4(lm, what: str, why: str) -> None:
    """A one-line UserError where an evaluation does not run DeepSeek-V4 (`what` says which, `why` what it lacks)."""
    if getattr(lm.adapter, "is_v4", False):
        raise UserError(f"{what} does not run on DeepSeek-V4: {why}; kld, needle and capacity do")


def check_mla_rows(lm, variants) -> None:
    """An MLA model's --formats rows must be MLA records: a DeepSeek-V4 record is a one-line UserError."""
    if getattr(lm.adapter, "is_v4", False):
        return
    for v in variants:
        spec = getattr(v, "spec", None)
        if spec is not None and spec.geometry.name != "mla":
            raise UserError(f"format {v.name!r} is a DeepSeek-V4 record ({spec.latent.dim} + {spec.rope.dim}); this model "
                            "caches 512 + 64 MLA records: choose among them (mla-eval formats)")


def check_variant(variant) -> V4CacheConfig:
    """The V4 configuration a --formats row (`evals.variants.Variant`) selects; a plan or +s_l is a one-line UserError."""
    if getattr(variant, "plan", None) is not None:
        raise UserError("a per-layer plan holds MLA formats; DeepSeek-V4 takes one cache configuration per row")
    if variant.outer:
        raise UserError(f"{variant.name}: DeepSeek-V4's writers take no per-layer outer scale s_l; drop +s_l")
    return config_for(variant.spec.name)


def window_forward(lm, variant, ids: torch.Tensor, score_from: int):
    """The forward of one window batch through `variant`'s V4 configuration (`executor.WindowForward`)."""
    from mla_eval.model.executor import WindowForward

    config = lm.model.config
    session = V4Session(check_variant(variant), config.layer_types, config.compress_rates)
    t = ids.shape[1]
    return WindowForward(ids, session, t, slice(score_from, t - 1))


@torch.no_grad()
def sample_tokens(lm, first: torch.Tensor, length: int, gen: torch.Generator, progress=None) -> torch.Tensor:
    """[num, length] tokens drawn from a DeepSeek-V4 model (temperature 1) after `first` [num], through the model's own
    incremental cache (transformers' DynamicCache of V4 layers, exact in the model's dtype): what self-samples are for
    V4, whose sessions run whole windows only."""
    model = lm.model
    params = inspect.signature(type(model).forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"  # 5.25 / 5.17
    ids = torch.empty(first.shape[0], length, dtype=torch.int64)
    ids[:, 0] = first
    cache = None
    for t in range(length - 1):
        step = ids[:, t : t + 1].to(lm.device)
        pos = torch.full((ids.shape[0], 1), t, device=lm.device)
        out = model(input_ids=step, position_ids=pos, use_cache=True, **({cache_kw: cache} if cache is not None else {}))
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        ids[:, t + 1] = torch.multinomial(out.logits[:, -1].float().softmax(-1).cpu(), 1, generator=gen).squeeze(1)
        if progress is not None:
            progress("sample", t + 1, length - 1)
    return ids
