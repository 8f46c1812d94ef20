"""Run a model's decoder layers over window forwards: resident or layer-major (streamed).

A `WindowForward` is one teacher-forced forward of a batch of windows through one cache session (a format's cache
under one semantics and math): token ids, the chunk schedule (engine semantics prefill a window in consecutive
chunks), and which positions' final hidden states to keep. `DecoderStack` runs it the way the model's own forward
does, unrolled layer by layer: embeddings, rotary position embeddings, each decoder layer, the final norm. Our owned
attention (`adapter`) reads only the cache session, so no [T, T] causal mask is built.

- `run_resident(fwd)`: every layer in memory; the forward's chunks each pass through all layers in turn.
- `run_streamed(fwds, loader)`: layer-major. Layer L is materialised once (`LayerLoader`), every forward of the
  pass runs its chunks through it, then it is released before layer L + 1, whose read the loader started in the
  background. Each forward keeps its own residual stream between layers (streams diverge from the first layer that
  reads a quantised cache) and its session keeps only the current layer's cache.

Both paths run the same modules on the same inputs in the same order per layer and forward, so a streamed run
computes a resident run's numbers bit for bit on the same device (tests/test_streaming.py holds them to it).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Callable, Protocol

import torch

from mla_eval.model.session import CacheSession


@dataclasses.dataclass
class WindowForward:
    """One forward of a window batch through one cache session.

    `ids` [B, T] token ids; `chunk` tokens per consecutive forward (T: one forward); final hidden states of positions
    `keep` (a slice of 0..T-1) are returned, flattened to [B * kept, hidden]."""

    ids: torch.Tensor
    session: CacheSession
    chunk: int
    keep: slice

    def chunks(self) -> list[tuple[int, int]]:
        t = self.ids.shape[1]
        return [(s, min(t, s + self.chunk)) for s in range(0, t, self.chunk)]


class LayerLoader(Protocol):
    """Where streamed layers come from: `prefetch(i)` starts reading layer i (background), `load(i)` makes its
    weights usable on the compute device (waiting for the read), `release(i)` frees them again."""

    def prefetch(self, i: int) -> None: ...

    def load(self, i: int) -> None: ...

    def release(self, i: int) -> None: ...


class DecoderStack:
    """The decoder layers of a loaded MLA model (`LoadedModel`), run one at a time."""

    def __init__(self, lm) -> None:
        self.lm = lm
        self.base = lm.model.base_model
        self.layers = list(self.base.layers[: lm.model.config.num_hidden_layers])
        params = inspect.signature(type(self.layers[0]).forward).parameters
        # the keyword arguments the model's own forward passes its decoder layers, where this version takes them
        self._layer_kwargs = {k: v for k, v in (("attention_mask", None), ("use_cache", False)) if k in params}
        self._adapter = lm.adapter
        self.timed_topk: torch.Tensor | None = None  # the DSA top-k of the last `time_layer` (None: not a DSA layer)

    def _embed(self, ids: torch.Tensor):
        h = self.base.embed_tokens(ids)
        return h, self._positions(ids, h)

    @staticmethod
    def _positions(ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.arange(ids.shape[1], device=h.device).expand(ids.shape[0], -1)

    def _layer(self, i: int, h: torch.Tensor, pos: torch.Tensor, pe) -> torch.Tensor:
        out = self.layers[i](h, position_ids=pos, position_embeddings=pe, **self._layer_kwargs)
        return out[0] if isinstance(out, tuple) else out  # GLM-DSA layers also return their top-k

    def _finish(self, fwd: WindowForward, parts: list[torch.Tensor]) -> torch.Tensor:
        hidden = parts[0] if len(parts) == 1 else torch.cat([p.to(parts[0].device) for p in parts], 1)
        return hidden.reshape(-1, hidden.shape[-1])

    def _kept(self, fwd: WindowForward, s: int, e: int, h: torch.Tensor) -> torch.Tensor | None:
        lo, hi = max(s, fwd.keep.start), min(e, fwd.keep.stop)
        return h[:, lo - s : hi - s] if lo < hi else None

    @torch.no_grad()
    def run_resident(self, fwd: WindowForward, record: list | None = None,
                     start: tuple[int, torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
        """Final hidden states of `fwd.keep` [B * kept, hidden], every layer resident (window-major).

        One-chunk forwards only: `record` collects each layer's input (hidden state, the shared indexer's top-k);
        `start` = (layer, hidden, top-k) runs from that layer on with what another forward recorded there -- the
        same bits where this forward's earlier layers would compute exactly what that one's did."""
        if (record is not None or start is not None) and len(fwd.chunks()) != 1:
            raise ValueError("recording or starting a forward mid-stack needs a one-chunk forward")
        parts = []
        with self._adapter.session(fwd.session), _quiet():
            for s, e in fwd.chunks():
                h, pos = self._embed(fwd.ids[:, s:e])
                pos = pos + s
                pe = self.base.rotary_emb(h, pos)
                first = 0
                if start is not None:
                    first, h, self._adapter.last_topk = start
                for i in range(first, len(self.layers)):
                    if record is not None:
                        record.append((h, self._adapter.last_topk))
                    h = self._layer(i, h, pos, pe)
                kept = self._kept(fwd, s, e, self.base.norm(h))
                if kept is not None:
                    parts.append(kept)
        return self._finish(fwd, parts)

    @torch.no_grad()
    def run_streamed(
        self, fwds: list[WindowForward], loader: LayerLoader, home: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
        progress: Callable[[int, int], None] = lambda done, total: None,
    ) -> list[torch.Tensor]:
        """Final hidden states of every forward (as `run_resident` returns them), layer-major.

        `home` moves a residual stream to where it waits between layers (pinned host memory, or unchanged);
        streams come back to their layer's device for each layer. `progress(layers done, layers)`."""
        n = len(self.layers)
        states = []  # per forward, per chunk: [hidden, positions, position embeddings, the shared indexer's top-k]
        for fwd in fwds:
            chunks = []
            for s, e in fwd.chunks():
                h, pos = self._embed(fwd.ids[:, s:e])
                pos = pos + s
                chunks.append([home(h), pos, self.base.rotary_emb(h, pos), None])
            states.append(chunks)
        loader.prefetch(0)
        progress(0, n)
        with _quiet():
            for i in range(n):
                loader.load(i)
                if i + 1 < n:
                    loader.prefetch(i + 1)  # the next layer's read overlaps this layer's compute
                dev = self.layers[i].self_attn.kv_a_proj_with_mqa.weight.device
                for fwd, chunks in zip(fwds, states):
                    with self._adapter.session(fwd.session):
                        for c in chunks:
                            self._adapter.last_topk = c[3]  # GLM-5 shared indexer layers read the last full layer's
                            c[0] = home(self._layer(i, c[0].to(dev, non_blocking=True), c[1].to(dev), _to(c[2], dev)))
                            c[3] = self._adapter.last_topk
                    fwd.session.release_layer(i)  # the next layer never reads this layer's cache
                loader.release(i)
                progress(i + 1, n)
        out = []
        for fwd, chunks in zip(fwds, states):
            parts = []
            for (s, e), c in zip(fwd.chunks(), chunks):
                kept = self._kept(fwd, s, e, self.base.norm(c[0].to(self.lm.device)))
                if kept is not None:
                    parts.append(kept)
            out.append(self._finish(fwd, parts))
        return out


    @torch.no_grad()
    def time_layer(self, i: int, fwd: WindowForward, repeats: int = 3, hidden: torch.Tensor | None = None,
                   topk: torch.Tensor | None = None) -> tuple[float, int]:
        """(seconds, peak bytes) of layer i's forward over `fwd`'s window (its first chunk), layer i's weights in memory:
        the median of `repeats` timed runs after one warm-up; the peak is the device's allocation above what was held
        before (0 on a CPU, where it is not measured). The run plan's measured layer cost.

        `hidden`: the layer's input [B, chunk, hidden] (default: the window's embeddings; a planning model without
        weights passes its own); `topk`: what a GLM-5 shared indexer layer reuses (a full layer's, left in
        `adapter.last_topk` after its timing)."""
        import statistics
        import time

        s, e = fwd.chunks()[0]
        h, pos = self._embed(fwd.ids[:, s:e]) if hidden is None else (hidden, self._positions(fwd.ids[:, s:e], hidden))
        pe = self.base.rotary_emb(h, pos)
        dev = h.device
        cuda = dev.type == "cuda"
        if cuda:
            torch.cuda.synchronize(dev)
            before = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        times = []
        with self._adapter.session(fwd.session), _quiet():
            for r in range(repeats + 1):
                fwd.session.reset()
                t0 = time.perf_counter()
                self._adapter.last_topk = topk
                self._layer(i, h, pos, pe)
                if cuda:
                    torch.cuda.synchronize(dev)
                if r:
                    times.append(time.perf_counter() - t0)
            self.timed_topk = self._adapter.last_topk  # before the session closes (it clears the adapter's)
        peak = torch.cuda.max_memory_allocated(dev) - before if cuda else 0
        return statistics.median(times), int(peak)


def _to(pe, dev):
    return tuple(x.to(dev) for x in pe) if isinstance(pe, tuple) else pe.to(dev)


class _quiet(warnings.catch_warnings):
    """transformers may warn that past_key_values is deprecated: our cache session replaces it."""

    def __enter__(self):
        super().__enter__()
        warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated.*")
        return self


class HostStashLoader:
    """Layers streamed from a copy of their weights in host memory (pinned when the compute device is a GPU):
    a model that fits the host but not the GPU, and the tests' way to stream any loaded model. At construction
    every decoder layer's parameters and buffers move to the stash and the layer is left on the meta device."""

    def __init__(self, stack: DecoderStack, device: torch.device) -> None:
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        self.layers = stack.layers
        self.stash: list[dict[str, torch.Tensor]] = []
        for layer in self.layers:
            state = {k: v.detach().to("cpu", copy=True) for k, v in _tensors(layer)}
            self.stash.append({k: v.pin_memory() for k, v in state.items()} if pin else state)
            layer.to("meta")

    def prefetch(self, i: int) -> None:
        pass  # already in host memory

    def load(self, i: int) -> None:
        for name, t in self.stash[i].items():
            assign(self.layers[i], name, t.to(self.device, non_blocking=True))

    def release(self, i: int) -> None:
        self.layers[i].to("meta")


def _tensors(module: torch.nn.Module):
    yield from module.named_parameters()
    yield from module.named_buffers()  # persistent or not: everything the layer computes with


def assign(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put `tensor` in place of the parameter or buffer `name` (dotted) of `module`, without copying."""
    *path, leaf = name.split(".")
    for part in path:
        module = getattr(module, part)
    if leaf in module._parameters:
        module._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
    elif leaf in module._buffers:
        module._buffers[leaf] = tensor
    else:
        raise KeyError(f"{name} is neither a parameter nor a buffer of the layer")


@dataclasses.dataclass
class ReadStats:
    """What streaming the layers cost: bytes read from the checkpoint, seconds the reads took (on the background
    thread), seconds the compute waited for a read, seconds spent dequantising into the layers."""

    bytes: int = 0
    read_seconds: float = 0.0
    wait_seconds: float = 0.0
    materialise_seconds: float = 0.0
    layers: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class CheckpointLoader:
    """Layers streamed from a checkpoint (`mla_eval.model.checkpoint.Checkpoint`): `prefetch(i)` reads layer i's
    stored bytes on a background thread (into pinned host memory on a GPU run), `load(i)` waits for that read and
    dequantises into the layer on the device, `release(i)` puts the layer's parameters back on the meta device
    (buffers, small, stay). `stats` says where the time went."""

    def __init__(self, checkpoint, layers: list[torch.nn.Module], device: torch.device, dtype: torch.dtype) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.checkpoint = checkpoint
        self.layers = layers
        self.device = torch.device(device)
        self.dtype = dtype
        self.stats = ReadStats()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mla-eval-read")
        self._pending: dict[int, object] = {}

    def _read(self, i: int):
        import time

        t0 = time.perf_counter()
        raw = self.checkpoint.read_layer(i, pin_memory=self.device.type == "cuda")
        return raw, time.perf_counter() - t0

    def prefetch(self, i: int) -> None:
        if i not in self._pending:
            self._pending[i] = self._pool.submit(self._read, i)

    def load(self, i: int) -> None:
        import time

        self.prefetch(i)
        t0 = time.perf_counter()
        raw, seconds = self._pending.pop(i).result()  # a read error surfaces here, in the run's own thread
        t1 = time.perf_counter()
        self.checkpoint.materialise(self.layers[i], raw, self.device, self.dtype)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.bytes += raw.nbytes
        self.stats.read_seconds += seconds
        self.stats.wait_seconds += t1 - t0
        self.stats.materialise_seconds += time.perf_counter() - t1
        self.stats.layers += 1

    def release(self, i: int) -> None:
        for name, p in list(self.layers[i].named_parameters()):
            assign(self.layers[i], name, torch.empty(p.shape, dtype=p.dtype, device="meta"))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def stream_loader(lm) -> LayerLoader:
    """The layer loader of a streamed run: the checkpoint's reader where the model was loaded streamed, else a host
    stash of the loaded model's layers (random and in-memory models)."""
    if getattr(lm, "checkpoint", None) is not None:
        dtype = lm.model.get_input_embeddings().weight.dtype  # the run's dtype, as the rest was materialised
        return CheckpointLoader(lm.checkpoint, lm.stack.layers, lm.device, dtype)
    return HostStashLoader(lm.stack, lm.device)
