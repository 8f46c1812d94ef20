"""A cache session: the paged quantised latent caches of one batch of sequences, all layers.

The adapter's attention forward hands every layer's new latent and rotated rope to `write`, then
reads attention through `attend`: exactly what a serving engine's decode sees, for prefill and for
each decode step. Sequences of a batch advance together (same length), which is what the
teacher-forced windows and the needle prompts need. `semantics` and `attn_math`
(mla_eval.attention.semantics) say which keys a prefill chunk reads from the cache and in which
precision every read computes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Protocol, Sequence

import torch

from mla_eval.attention import dispatch
from mla_eval.attention.semantics import BF16, CACHE, AttentionMath, Semantics
from mla_eval.errors import NonFiniteInputError
from mla_eval.formats import FormatSpec, OuterScales, decode

# How a fresh prefill (the first forward of a sequence, many tokens) reads the cache. Both modes
# read only what the format stored; they differ in where the up-projection happens:
#   absorbed: every query runs the format's absorbed MQA attention over the cache (576-dim keys),
#             the arithmetic decode uses; on CUDA that is our kernel.
#   mha:      the cache is decoded once, up-projected through kv_b_proj into per-head K/V and
#             attended with causal SDPA (flash on CUDA) -- how serving engines prefill MLA, with
#             3.4x fewer FLOPs per query than the absorbed form. Decode steps stay absorbed.
PREFILL_MODES = ("absorbed", "mha")

# Under engine semantics (mla_eval.attention.semantics) a multi-token forward is one prefill chunk:
# its queries read earlier positions from the cache and the chunk's own keys from CHUNK_KEYS:
#   fresh: the chunk's latent and rope as computed, rounded to bf16 (what an engine attends over);
#   cache: what the cache stores for them -- cache semantics run on the engine's chunked schedule
#          (with a bf16 cache the two are bit-identical: the tests hold them to that).
CHUNK_KEYS = ("fresh", "cache")


class LayerObserver(Protocol):
    """Called once per layer and forward with the unquantised inputs and the format's output."""

    def __call__(self, event: "LayerEvent") -> None: ...


@dataclasses.dataclass
class LayerEvent:
    layer: int
    latent: torch.Tensor  # [B, T, 512] the new tokens' c_kv (after kv_a_layernorm)
    rope: torch.Tensor  # [B, T, 64] the new tokens' rotated k_pe
    q: torch.Tensor  # [B, T, H, 576] absorbed queries
    out: torch.Tensor  # [B, T, H, 512] attention output (latent space) read from the cache
    session: "CacheSession"
    topk: torch.Tensor | None = None  # [B, T, k] positions a DSA layer's queries read (None: dense causal)


@dataclasses.dataclass
class _StepBuffers:
    """Where a one-token decode step writes and how far it reads, per sequence, on one device.

    Device tensors at fixed addresses, refilled before every step: a CUDA graph captured once
    replays the step at any position (see mla_eval.model.decode_steps).
    """

    seq_base: torch.Tensor  # [B] int64: slot of position 0 of each sequence
    slots: torch.Tensor  # [B] int64: slot of the step's token
    seq_lens: torch.Tensor  # [B] int32: keys the step's query sees (position + 1)


class CacheSession:
    """Paged caches `uint8 [num_blocks, block_size, record_bytes]` per layer for B sequences.

    Sequence b owns blocks b * blocks_per_seq ... (a contiguous block table, like a fresh vLLM
    pool). `capacity` is the most tokens a sequence may reach in this session. `device` is one
    device for every layer, or one per layer (a model spread over GPUs with device_map): each
    layer's cache lives where that layer's attention runs.

    `spec` is one format for every layer, or one per layer (a mixed plan, mla_eval.layer_plan): each
    layer's cache holds that layer's records and every write, read-back and attention of the layer
    goes through its own spec. `outer_scales` likewise: one `OuterScales` file for every layer, or
    one s_l per layer (None where that layer stores unscaled).
    """

    def __init__(
        self,
        spec: FormatSpec | Sequence[FormatSpec],
        num_layers: int,
        batch: int,
        capacity: int,
        device: torch.device | str | Sequence[torch.device | str],
        *,
        block_size: int = 64,
        outer_scales: OuterScales | Sequence[float | None] | None = None,
        observers: tuple[Callable[[LayerEvent], None], ...] = (),
        keep_exact: bool = False,
        prefill: str = "absorbed",
        semantics: Semantics = CACHE,
        attn_math: AttentionMath = BF16,
        chunk_keys: str = "fresh",
        lazy: bool = False,
    ) -> None:
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill mode {prefill!r}: one of {', '.join(PREFILL_MODES)}")
        if chunk_keys not in CHUNK_KEYS:
            raise ValueError(f"chunk keys {chunk_keys!r}: one of {', '.join(CHUNK_KEYS)}")
        self.specs: tuple[FormatSpec, ...] = (spec,) * num_layers if isinstance(spec, FormatSpec) else tuple(spec)
        if len(self.specs) != num_layers:
            raise ValueError(f"{len(self.specs)} layer formats for {num_layers} layers")
        if isinstance(outer_scales, OuterScales):
            outer_scales.check_layers(num_layers)
            self._outer: tuple[float | None, ...] = outer_scales.scales
        elif outer_scales is None:
            self._outer = (None,) * num_layers
        else:
            self._outer = tuple(outer_scales)
            if len(self._outer) != num_layers:
                raise ValueError(f"{len(self._outer)} layer scales for {num_layers} layers")
        self.num_layers = num_layers
        self.batch = batch
        self.capacity = capacity
        self.block_size = block_size
        if isinstance(device, (str, torch.device)):
            self.devices = [torch.device(device)] * num_layers
        else:
            self.devices = [torch.device(d) for d in device]
            if len(self.devices) != num_layers:
                raise ValueError(f"{len(self.devices)} devices for {num_layers} layers")
        self.observers = observers
        self.prefill = prefill
        self.semantics = semantics
        self.math = attn_math
        self.chunk_keys = chunk_keys
        self._fresh: dict[int, torch.Tensor] = {}  # engine semantics: the last written layer's chunk keys [B, T, 576]
        self.blocks_per_seq = math.ceil(capacity / block_size)
        nblocks = batch * self.blocks_per_seq
        self._nblocks = nblocks
        # lazy: a layer's cache is allocated at its first write and freed by release_layer (the layer-major executor
        # holds one layer's caches at a time, mla_eval.model.executor)
        self.caches: list[torch.Tensor | None] = [None if lazy else self._new_cache(i) for i in range(num_layers)]
        table = torch.arange(nblocks, dtype=torch.int32).view(batch, self.blocks_per_seq)
        self.block_tables = {d: table.to(d) for d in set(self.devices)}  # one copy per device
        self.lengths = [0] * num_layers
        self.last_scale = [1.0] * num_layers  # softmax scale of each layer's last attend()
        # Unquantised history, only when an observer compares against it (per-layer error stats).
        self.exact: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers if keep_exact else []
        # Decode-step mode (begin_step): the position of the step in flight and its buffers.
        self.step_pos: int | None = None
        self._step: dict[torch.device, _StepBuffers] = {}
        self._step_finite: list[torch.Tensor] = []  # per layer: were the step's latent and rope finite?

    @property
    def spec(self) -> FormatSpec:
        """The one format of a uniform session (a mixed one has no single spec: read `specs`)."""
        if any(s != self.specs[0] for s in self.specs):
            raise ValueError("a mixed-format cache session has one spec per layer (session.specs)")
        return self.specs[0]

    def _new_cache(self, layer: int) -> torch.Tensor:
        shape = (self._nblocks, self.block_size, self.specs[layer].record_bytes)
        return torch.zeros(shape, dtype=torch.uint8, device=self.devices[layer])

    def release_layer(self, layer: int) -> None:
        """Free what `layer` holds (its cache, its unquantised history): nothing reads that layer again."""
        self.caches[layer] = None
        if self.exact:
            self.exact[layer] = None
        self._fresh.pop(layer, None)

    def reset(self) -> None:
        """Empty every sequence, for a new batch of prompts of the same shape (reusing the caches
        and a captured decode graph). The cache bytes stay: no read reaches a slot before it is
        written again, since every read stops at its sequence's length."""
        self.lengths = [0] * self.num_layers
        self.last_scale = [1.0] * self.num_layers
        self.step_pos = None
        self._fresh = {}
        if self.exact:
            self.exact = [None] * self.num_layers

    def outer_scale(self, layer: int) -> float | None:
        return self._outer[layer]

    def _slots(self, layer: int, start: int, count: int) -> torch.Tensor:
        """Global slot ids [B, count] of positions start..start+count-1 of each sequence (on the layer's device)."""
        dev = self.devices[layer]
        pos = torch.arange(start, start + count, device=dev)
        blocks = self.block_tables[dev][:, pos // self.block_size].long()
        return blocks * self.block_size + (pos % self.block_size)

    def write(self, layer: int, latent: torch.Tensor, rope: torch.Tensor) -> None:
        """Append latent [B, T, 512] / rope [B, T, 64] of T new tokens to every sequence."""
        b, t = latent.shape[:2]
        start = self.lengths[layer]
        if start + t > self.capacity:
            raise ValueError(f"cache session holds {self.capacity} tokens per sequence; {start + t} requested")
        step = self._in_step(layer, t)
        if self.caches[layer] is None:
            self.caches[layer] = self._new_cache(layer)
        slots = self._step[self.devices[layer]].slots if step else self._slots(layer, start, t).reshape(-1)
        dispatch.write_cache(
            self.specs[layer],
            latent.reshape(b * t, -1),
            rope.reshape(b * t, -1),
            slots,
            self.caches[layer],
            outer_scale=self.outer_scale(layer),
            layer=layer,
            check_finite=not step,  # a step records a flag instead of a device sync (check_step)
        )
        if step:
            self._step_finite[layer].copy_(torch.isfinite(latent).all() & torch.isfinite(rope).all())
        self.lengths[layer] = start + t
        if self.semantics.is_engine and not step:
            # the engine attends over its bf16 activations: the same rounding a bf16 cache stores
            self._fresh = {layer: torch.cat([latent, rope.to(latent.dtype)], -1).to(torch.bfloat16).float()}
        if self.exact:
            prev = self.exact[layer]
            new = (latent.float(), rope.float())
            self.exact[layer] = new if prev is None else (torch.cat([prev[0], new[0]], 1), torch.cat([prev[1], new[1]], 1))

    def read_back(self, layer: int, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode what the cache stores for positions start..start+count-1: ([B, n, 512], [B, n, 64])."""
        slots = self._slots(layer, start, count)
        spec = self.specs[layer]
        flat = self.caches[layer].view(-1, spec.record_bytes)
        return decode(spec, flat[slots], outer_scale=self.outer_scale(layer))

    def uses_mha_prefill(self, layer: int, new_tokens: int) -> bool:
        """True when this forward is a fresh multi-token prefill that the mha mode serves.

        Observers (per-layer error statistics) need the latent-space output, so they keep the
        absorbed path.
        """
        if self.prefill != "mha" or self.observers or new_tokens <= 1:
            return False
        return self.semantics.is_engine or self.lengths[layer] == new_tokens

    def chunk_kv(self, layer: int, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Engine semantics: the keys the current chunk's queries read for the chunk itself, as
        (latent [B, T, 512], rope [B, T, 64]) float32 -- fresh bf16 or read back (CHUNK_KEYS)."""
        end = self.lengths[layer]
        if self.chunk_keys == "cache":
            return self.read_back(layer, end - new_tokens, new_tokens)
        keys = self._fresh[layer]
        return keys[..., :512], keys[..., 512:]

    def attend(self, layer: int, q: torch.Tensor, softmax_scale: float, topk: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the T newest tokens' queries q [B, T, H, 576] over the cache.

        Dense causal: the query at position p sees positions 0..p of its own sequence. With `topk`
        [B, T, k] (positions within the sequence, -1 = invalid) only those slots are read.
        Returns the latent-space output [B, T, H, 512] in float32.
        """
        b, t, h, _ = q.shape
        self.last_scale[layer] = softmax_scale
        end = self.lengths[layer]
        dev = self.devices[layer]
        if topk is None and self._in_step(layer, t, end - 1):
            # one token per sequence at the step's position: lengths from the step buffers, and
            # the split-KV grid sized for the session's capacity, so every step launches the same
            # kernels (eager or replayed from a CUDA graph, identical arithmetic)
            out, _ = dispatch.mla_attention_dense(
                self.specs[layer],
                q.reshape(b, h, -1),
                self.caches[layer],
                block_table=self.block_tables[dev],
                seq_lens=self._step[dev].seq_lens,
                softmax_scale=softmax_scale,
                outer_scale=self.outer_scale(layer),
                max_seq_len=self.capacity,
                math=self.math,
            )
            return out.view(b, t, h, -1)
        q_pos = torch.arange(end - t, end, device=dev)
        if topk is None and self.semantics.is_engine:
            latent, rope = self.chunk_kv(layer, t)
            out, _ = dispatch.mla_attention_chunk(
                self.specs[layer],
                q.reshape(b * t, h, -1),
                self.caches[layer],
                softmax_scale=softmax_scale,
                block_table=self.block_tables[dev],
                prefix_len=end - t,
                chunk_keys=torch.cat([latent, rope], -1),
                outer_scale=self.outer_scale(layer),
                math=self.math,
            )
        elif topk is None:
            out, _ = dispatch.mla_attention_dense(
                self.specs[layer],
                q.reshape(b * t, h, -1),
                self.caches[layer],
                block_table=self.block_tables[dev].repeat_interleave(t, 0),
                seq_lens=(q_pos + 1).repeat(b).to(torch.int32),
                softmax_scale=softmax_scale,
                outer_scale=self.outer_scale(layer),
                max_seq_len=end,  # the longest list, known here: spares the kernel path a device sync
                math=self.math,
                queries_per_seq=t,  # T queries read each sequence's keys: not the decode shape v3 was measured at
            )
        else:
            # The block table is contiguous per sequence, so position p of sequence b is slot
            # b * blocks_per_seq * block_size + p.
            seq_base = (torch.arange(b, device=dev) * self.blocks_per_seq * self.block_size).view(b, 1, 1)
            idx = topk.long()
            # an indexer's top-k over a causal window can name future positions when fewer than k
            # are visible (their scores are masked, not removed): those are invalid here
            valid = (idx >= 0) & (idx <= q_pos.view(1, t, 1))
            slots = torch.where(valid, seq_base + idx, -1)
            out, _ = dispatch.mla_attention_sparse(
                self.specs[layer],
                q.reshape(b * t, h, -1),
                self.caches[layer],
                indices=slots.reshape(b * t, -1).to(torch.int32),
                softmax_scale=softmax_scale,
                outer_scale=self.outer_scale(layer),
                math=self.math,
            )
        return out.view(b, t, h, -1)

    # ---------------------------------------------------------------- one-token decode steps
    def begin_step(self, pos: int) -> None:
        """The next forward is a decode step: one token per sequence at position `pos`.

        Its write slots and attention lengths come from device buffers refilled here, and
        finiteness is recorded per layer rather than checked with a sync (call `check_step`
        after the forward). Every layer must hold exactly `pos` tokens.
        """
        if any(n != pos for n in self.lengths):
            raise ValueError(f"decode step at position {pos}, but the layers hold {sorted(set(self.lengths))} tokens")
        if pos + 1 > self.capacity:
            raise ValueError(f"cache session holds {self.capacity} tokens per sequence; a step at position {pos} needs {pos + 1}")
        if not self._step:
            per_seq = self.blocks_per_seq * self.block_size  # block tables are contiguous per sequence
            for d in set(self.devices):
                base = torch.arange(self.batch, dtype=torch.int64, device=d) * per_seq
                self._step[d] = _StepBuffers(base, base.clone(), torch.zeros(self.batch, dtype=torch.int32, device=d))
            self._step_finite = [torch.ones((), dtype=torch.bool, device=d) for d in self.devices]
        for buf in self._step.values():
            torch.add(buf.seq_base, pos, out=buf.slots)
            buf.seq_lens.fill_(pos + 1)
        self.step_pos = pos

    def end_replayed_step(self) -> None:
        """Account for a step whose forward ran as a CUDA graph replay (no Python ran: the layers'
        lengths are advanced here)."""
        self.lengths = [self.step_pos + 1] * self.num_layers

    def check_step(self) -> None:
        """Raise NonFiniteInputError if any layer's step latent or rope held NaN or inf (one sync per device)."""
        for d in set(self.devices):
            layers = [i for i, dev in enumerate(self.devices) if dev == d]
            ok = torch.stack([self._step_finite[i] for i in layers]).tolist()
            bad = [layer for layer, fine in zip(layers, ok) if not fine]
            if bad:
                raise NonFiniteInputError(
                    f"the decode step at position {self.step_pos} produced a non-finite latent or rope at layer {bad[0]}; "
                    "cache formats need finite values: check the model's activations (overflow?) or the input text"
                )

    def _in_step(self, layer: int, new_tokens: int, start: int | None = None) -> bool:
        """True when this write/attend is the decode step begun with begin_step."""
        if self.step_pos is None or new_tokens != 1:
            return False
        start = self.lengths[layer] if start is None else start
        if start != self.step_pos:
            raise ValueError(f"layer {layer} at position {start} inside the decode step at {self.step_pos}; call begin_step")
        return True
