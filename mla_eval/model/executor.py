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
    # (the index of another forward of the same run, layer L): this forward's layers before L compute exactly what that
    # forward's do (a per-layer plan row against its bf16 reference, issue 37), so it starts at L from that forward's
    # input there. One-chunk forwards only; the source forward comes earlier in the list.
    fork: tuple[int, int] | None = None
    record: bool = False  # others fork from this forward: a resident run keeps its input to every layer

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
        forks = _valid_forks(fwds)
        states = []  # per forward, per chunk: [hidden, positions, position embeddings, the shared indexer's top-k]
        for fwd in fwds:
            chunks = []
            for s, e in fwd.chunks():
                h, pos = self._embed(fwd.ids[:, s:e])
                pos = pos + s
                chunks.append([home(h), pos, self.base.rotary_emb(h, pos), None])
            states.append(chunks)
        import time

        stats = getattr(loader, "stats", None)
        clock = _ComputeClock(self.lm.device)
        wall0 = time.perf_counter()
        loader.prefetch(0)
        progress(0, n)
        with _quiet():
            for i in range(n):
                loader.load(i)
                if i + 1 < n:
                    loader.prefetch(i + 1)  # the next layer's read overlaps this layer's compute
                dev = _device_of(self.layers[i])
                # the inputs to this layer of the forwards others fork from here (taken before the source runs it)
                inputs = {src: (states[src][0][0], states[src][0][3]) for src, at in forks.values() if at == i}
                clock.start()
                for k, (fwd, chunks) in enumerate(zip(fwds, states)):
                    if k in forks and i < forks[k][1]:
                        continue  # a forked forward waits for its source to reach its first own layer
                    if k in forks and i == forks[k][1]:  # the source's input to this layer is this forward's
                        chunks[0][0], chunks[0][3] = inputs[forks[k][0]]
                    with self._adapter.session(fwd.session):
                        for c in chunks:
                            self._adapter.last_topk = c[3]  # GLM-5 shared indexer layers read the last full layer's
                            c[0] = home(self._layer(i, c[0].to(dev, non_blocking=True), c[1].to(dev), _to(c[2], dev)))
                            c[3] = self._adapter.last_topk
                    fwd.session.release_layer(i)  # the next layer never reads this layer's cache
                clock.stop()
                loader.release(i)
                progress(i + 1, n)
        if stats is not None:  # how long the layers kept the device busy in this pass's wall time
            stats.compute_seconds += clock.seconds()
            stats.wall_seconds += time.perf_counter() - wall0
        if hasattr(loader, "settle"):
            loader.settle()
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


class _ComputeClock:
    """Time the layers' forwards spend on the device: CUDA events around each layer's work on the compute stream (what
    the GPU ran, without the waits for a layer's weights), or the host clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        import time

        self.cuda = torch.device(device).type == "cuda"
        self._now = time.perf_counter
        self._pairs: list = []
        self._host = 0.0
        self._t0 = 0.0

    def start(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._pairs.append([ev, None])
        else:
            self._t0 = self._now()

    def stop(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._pairs[-1][1] = ev
        else:
            self._host += self._now() - self._t0

    def seconds(self) -> float:
        if not self.cuda:
            return self._host
        torch.cuda.synchronize()
        return sum(a.elapsed_time(b) for a, b in self._pairs) / 1e3


def _device_of(layer: torch.nn.Module) -> torch.device:
    """Where a decoder layer computes: its attention's first projection (any weight math)."""
    return next(layer.self_attn.kv_a_proj_with_mqa.parameters()).device


def _valid_forks(fwds: list[WindowForward]) -> dict[int, tuple[int, int]]:
    """The forks of a run that can be honoured, by forward index: a one-chunk forward forking at a layer > 0 from an
    earlier one-chunk forward of the same shape. Any other runs whole (the same numbers, every layer run)."""
    forks = {}
    for k, f in enumerate(fwds):
        if f.fork is None or f.fork[1] <= 0 or not 0 <= f.fork[0] < k:
            continue
        src = fwds[f.fork[0]]
        if len(f.chunks()) == 1 and src.chunks() == f.chunks() and src.ids.shape == f.ids.shape:
            forks[k] = f.fork
    return forks


def run_resident_forwards(stack: DecoderStack, makers: list[Callable[[], WindowForward]]) -> list[torch.Tensor]:
    """`run_resident` of each forward in turn, each made only when it runs (one forward's caches live at a time). A
    one-chunk forward marked `record` keeps its input to every layer; one that forks from it starts at its fork layer
    from the input recorded there (the same bits: its earlier layers compute what the source's did)."""
    out: list[torch.Tensor] = []
    recorded: dict[int, tuple[WindowForward, list]] = {}
    for k, make in enumerate(makers):
        fwd = make()
        start = None
        if fwd.fork is not None and fwd.fork[0] in recorded:
            source, inputs = recorded[fwd.fork[0]]
            if _valid_forks([source, dataclasses.replace(fwd, fork=(0, fwd.fork[1]))]):
                start = (fwd.fork[1], *inputs[fwd.fork[1]])
        record = [] if fwd.record and len(fwd.chunks()) == 1 else None
        out.append(stack.run_resident(fwd, record=record, start=start))
        if record is not None:
            recorded[k] = (fwd, record)
    return out


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
        self.stats = ReadStats()  # bytes moved from the stash (no disk read: read_seconds stay 0)

    def prefetch(self, i: int) -> None:
        pass  # already in host memory

    def load(self, i: int) -> None:
        for name, t in self.stash[i].items():
            assign(self.layers[i], name, t.to(self.device, non_blocking=True))
        self.stats.bytes += sum(t.numel() * t.element_size() for t in self.stash[i].values())
        self.stats.layers += 1

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
    thread), seconds the compute waited for a layer (its read, and its materialisation where that is not overlapped),
    seconds materialising (dequantising or copying FP8 codes into the layer on the device; with `overlap`, on a side
    CUDA stream while the previous layer computes), the layer-major passes' wall time and the part of it the layers'
    forwards kept the device busy (`compute_seconds`: CUDA events on a GPU), and how the shards were read."""

    bytes: int = 0
    read_seconds: float = 0.0
    wait_seconds: float = 0.0
    materialise_seconds: float = 0.0
    layers: int = 0
    wall_seconds: float = 0.0
    compute_seconds: float = 0.0
    direct_reads: int = 0  # layers read with O_DIRECT (the rest buffered: the file system refused, or asked so)
    read_mode: str = ""
    overlap: bool = False

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["device_busy"] = self.compute_seconds / self.wall_seconds if self.wall_seconds else None
        d["read_bytes_per_second"] = self.bytes / self.read_seconds if self.read_seconds else None
        return d


READ_ENV = "MLA_EVAL_READ"  # auto (default) | direct | buffered: how streamed layers are read from the shards
OVERLAP_ENV = "MLA_EVAL_STREAM_OVERLAP"  # 1 (default) | 0: materialise the next layer on a side stream (GPU)


def read_mode(checkpoint) -> tuple[str, str]:
    """(direct | buffered, why): O_DIRECT where the checkpoint's layers outgrow the host's available memory (the page
    cache cannot keep them for the next pass, and filling it costs a copy), buffered where they fit (a later pass
    reads them from memory). MLA_EVAL_READ=direct|buffered decides instead."""
    import os

    from mla_eval.errors import UserError
    from mla_eval.model.run_plan import available_host_memory

    asked = os.environ.get(READ_ENV, "auto").strip().lower() or "auto"
    if asked not in ("auto", "direct", "buffered"):
        raise UserError(f"{READ_ENV}={asked!r}: choose one of auto, direct, buffered")
    if asked != "auto":
        return asked, f"{READ_ENV}={asked}"
    stored = checkpoint.stored_bytes(part="layer") or 0
    host = available_host_memory()
    if stored > host:
        return "direct", f"layers {stored / 2**30:.3g} GiB > host available {host / 2**30:.3g} GiB"
    return "buffered", f"layers {stored / 2**30:.3g} GiB fit the host's {host / 2**30:.3g} GiB (page cache kept)"


class CheckpointLoader:
    """Layers streamed from a checkpoint (`mla_eval.model.checkpoint.Checkpoint`): `prefetch(i)` reads layer i's
    stored bytes on a background thread (into pinned host memory on a GPU run; O_DIRECT per `read_mode`) and, on a
    GPU, materialises them there on a side CUDA stream (dequantised, or FP8 codes copied as stored) while the current
    layer computes; `load(i)` makes the compute stream wait for that (or, on a CPU, materialises now), `release(i)`
    puts the layer's parameters back on the meta device (buffers, small, stay) and marks where the side stream may
    reuse its memory. At most two layers' weights are on the device at once (the plan counts them). `stats` says
    where the time went."""

    def __init__(self, checkpoint, layers: list[torch.nn.Module], device: torch.device, dtype: torch.dtype,
                 overlap: bool | None = None) -> None:
        import os
        from concurrent.futures import ThreadPoolExecutor

        self.checkpoint = checkpoint
        self.layers = layers
        self.device = torch.device(device)
        self.dtype = dtype
        mode, self.read_why = read_mode(checkpoint)
        # where the plan had room for two layers (None: assume so), unless MLA_EVAL_STREAM_OVERLAP=0
        allowed = os.environ.get(OVERLAP_ENV, "1").strip() != "0"
        self.overlap = (overlap is None or bool(overlap)) and allowed and self.device.type == "cuda"
        self.stats = ReadStats(read_mode=mode, overlap=self.overlap)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mla-eval-read")
        self._pending: dict[int, object] = {}
        self._side = torch.cuda.Stream(self.device) if self.overlap else None
        self._released = None  # an event on the compute stream after the last release (the side stream waits for it)
        self._event_list: list = []  # (begin, done) of each side-stream materialisation, timed at `settle`

    def _read(self, i: int, released):
        import time

        t0 = time.perf_counter()
        raw = self.checkpoint.read_layer(i, pin_memory=self.device.type == "cuda", direct=self.stats.read_mode == "direct")
        seconds = time.perf_counter() - t0
        if not self.overlap:
            return raw, seconds, None
        with torch.cuda.stream(self._side):
            if released is not None:  # memory the last released layer used may be reused only once its compute ended
                self._side.wait_event(released)
            begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(self._side)
            self.checkpoint.materialise(self.layers[i], raw, self.device, self.dtype)
            done.record(self._side)
        return raw, seconds, (begin, done)

    def prefetch(self, i: int) -> None:
        if i not in self._pending:
            self._pending[i] = self._pool.submit(self._read, i, self._released)

    def load(self, i: int) -> None:
        import time

        self.prefetch(i)
        t0 = time.perf_counter()
        raw, seconds, events = self._pending.pop(i).result()  # a read error surfaces here, in the run's own thread
        t1 = time.perf_counter()
        if events is None:
            self.checkpoint.materialise(self.layers[i], raw, self.device, self.dtype)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.stats.materialise_seconds += time.perf_counter() - t1
            self.stats.wait_seconds += time.perf_counter() - t0
        else:
            torch.cuda.current_stream(self.device).wait_event(events[1])  # the layer's weights are in place
            self._event_list.append(events)
            self.stats.wait_seconds += t1 - t0
        self.stats.bytes += raw.nbytes
        self.stats.read_seconds += seconds
        self.stats.direct_reads += int(raw.direct)
        self.stats.layers += 1

    def release(self, i: int) -> None:
        for name, p in list(self.layers[i].named_parameters()):
            assign(self.layers[i], name, torch.empty(p.shape, dtype=p.dtype, device="meta"))
        if self.overlap:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self._released = ev

    def settle(self) -> None:
        """Fold the side stream's materialisation times into `stats` (after a synchronise: the events are done)."""
        if self._event_list:
            torch.cuda.synchronize(self.device)
            self.stats.materialise_seconds += sum(b.elapsed_time(e) for b, e in self._event_list) / 1e3
            self._event_list.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.overlap:
            self.settle()


def stream_loader(lm, overlap: bool | None = None) -> LayerLoader:
    """The layer loader of a streamed run: the checkpoint's reader where the model was loaded streamed (`overlap`: the
    next layer materialised on a side stream, where the plan has room for two), else a host stash of the loaded
    model's layers (random and in-memory models)."""
    if getattr(lm, "checkpoint", None) is not None:
        dtype = lm.model.get_input_embeddings().weight.dtype  # the run's dtype, as the rest was materialised
        return CheckpointLoader(lm.checkpoint, lm.stack.layers, lm.device, dtype, overlap=overlap)
    return HostStashLoader(lm.stack, lm.device)
