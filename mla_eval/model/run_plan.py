"""Plan a run before any work: where the weights live (resident, spread by a device map, or streamed one decoder
layer at a time), where the residual streams of a streamed run wait, how many passes over the layers it takes, and
how long it should run.

Inputs are facts, each with its source: a `WeightInventory` (bytes per decoder layer as the run holds them, bytes
by stored dtype, from the checkpoint's headers or a loaded model), the run's forwards (`Workload`: window batches,
forwards per batch, tokens per forward), the memory `Budget` of the device and the host, and optionally a measured
`LayerCost` (one decoder layer's forward of one window on the device: seconds and peak memory) and the disk's read
bandwidth. `plan_run` turns them into a `RunPlan` (printed at the start of every run, stored in the result, and all
that `--dry-run` does). A plan that cannot fit is a one-line `UserError` here, before any weight is read.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from mla_eval.errors import UserError

GIB = 2**30
# Of the free device memory, what a plan may use: the rest absorbs allocator fragmentation and library workspaces.
DEVICE_UTILISATION = 0.90
# Of the host's available memory, what streams in host memory may take: the page cache keeps the rest, which a
# memory-mapped checkpoint read needs.
HOST_UTILISATION = 0.70
OFFLOAD_MODES = ("auto", "none", "stream")


@dataclasses.dataclass(frozen=True)
class WeightInventory:
    """What the weights weigh. `layer_bytes`: each decoder layer as the run holds it (dequantised to the run dtype);
    `other_bytes`: embeddings, final norm and output head (what stays on the device in a streamed run);
    `stored_by_dtype`: bytes on disk by stored dtype; `stored_layer_bytes`: each layer as read from disk."""

    source: str
    layer_bytes: tuple[int, ...]
    other_bytes: int
    stored_by_dtype: dict[str, int]
    stored_layer_bytes: tuple[int, ...]
    quantization: dict[str, Any] | None = None

    @property
    def run_bytes(self) -> int:
        return sum(self.layer_bytes) + self.other_bytes

    @classmethod
    def of_model(cls, model: torch.nn.Module, source: str) -> WeightInventory:
        """The inventory of a model in memory (the embedded model, a random model, a loaded checkpoint)."""
        layers = model.base_model.layers[: model.config.num_hidden_layers]
        layer_bytes = tuple(_tensor_bytes(layer) for layer in layers)
        total = _tensor_bytes(model)
        by_dtype: dict[str, int] = {}
        for t in _tensors(model):
            by_dtype[str(t.dtype).removeprefix("torch.")] = by_dtype.get(str(t.dtype).removeprefix("torch."), 0) + _nbytes(t)
        return cls(source, layer_bytes, total - sum(layer_bytes), by_dtype, layer_bytes)

    @classmethod
    def of_checkpoint(cls, checkpoint, model: torch.nn.Module, dtype: torch.dtype) -> WeightInventory:
        """The inventory of a checkpoint before any weight is read: bytes as run from the model built from config.json
        (`model`, on the meta device), bytes as stored from the shards' headers, or, for shards not downloaded, the
        estimate from config shapes and the format's dtypes (the source says which)."""
        run = checkpoint.materialised_bytes(model, dtype)
        n = checkpoint.num_layers
        layer_bytes = tuple(run.get(f"layer:{i}", 0) for i in range(n))
        exact = checkpoint.headers_complete
        stored = []
        for i in range(n):
            b = checkpoint.stored_bytes(i) if exact else checkpoint.estimated_stored_bytes(model, i)
            stored.append(int(b) if b is not None else layer_bytes[i])
        by_dtype = checkpoint.bytes_by_dtype() if exact else {
            "(estimated) all": int(checkpoint.estimated_stored_bytes(model) or sum(stored))}
        where = "shard headers" if exact else (
            f"config.json and {len(checkpoint.shards) - len(checkpoint.missing_shards)} of {len(checkpoint.shards)} shard "
            "headers (stored bytes estimated for the rest)")
        quant = checkpoint.describe().get("quantisation")
        return cls(f"{checkpoint.path} ({where})", layer_bytes, run.get("rest", 0), dict(by_dtype or {}), tuple(stored),
                   quant if isinstance(quant, dict) and quant.get("method") not in (None, "none") else None)


def _tensors(module: torch.nn.Module):
    seen = set()
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:  # tied weights count once
            seen.add(id(t))
            yield t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensor_bytes(module: torch.nn.Module) -> int:
    return sum(_nbytes(t) for t in _tensors(module))


@dataclasses.dataclass(frozen=True)
class Workload:
    """The forwards of a run: `batches` window batches, each run through `forwards_per_batch` cache sessions (the
    reference and every row, under each semantics), `tokens` positions per forward (batch x window), `hidden` the
    model's hidden size, `dtype_bytes` of its activations; `record_bytes` the largest cache record of the run;
    `kept` final hidden states kept per forward (the scored positions) and `exact` whether layer statistics keep
    the unquantised latent history (float32 [tokens, 576] per layer)."""

    batches: int
    forwards_per_batch: int
    tokens: int
    hidden: int
    dtype_bytes: int
    record_bytes: int
    kept: int
    exact: bool = False

    @property
    def stream_bytes(self) -> int:
        """What one forward holds between layers: its residual stream, its kept final states (at the end), and the
        current layer's cache (and unquantised history)."""
        stream = self.tokens * self.hidden * self.dtype_bytes
        return stream + self.kept * self.hidden * self.dtype_bytes + self.layer_cache_bytes

    @property
    def layer_cache_bytes(self) -> int:
        return self.tokens * self.record_bytes + (self.tokens * 576 * 4 if self.exact else 0)

    @property
    def batch_stream_bytes(self) -> int:
        return self.forwards_per_batch * self.stream_bytes


@dataclasses.dataclass(frozen=True)
class Budget:
    """Memory a run may plan with: on its compute device and in host memory (bytes), and where each figure came
    from."""

    device_bytes: int
    host_bytes: int
    device: str
    source: str

    @classmethod
    def measure(cls, device: torch.device) -> Budget:
        """Free device memory x DEVICE_UTILISATION (a GPU), or the host's for a CPU run; host: MemAvailable x
        HOST_UTILISATION."""
        host = int(available_host_memory() * HOST_UTILISATION)
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            # what torch's allocator holds but no tensor uses is free to this process too
            free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            return cls(int(free * DEVICE_UTILISATION), host, str(device),
                       f"cuda free memory x {DEVICE_UTILISATION}, host MemAvailable x {HOST_UTILISATION}")
        return cls(host, host, str(device), f"host MemAvailable x {HOST_UTILISATION} (a CPU run: one memory)")


def available_host_memory() -> int:
    """MemAvailable of /proc/meminfo (Linux), else physical memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One decoder layer's forward of one window batch through one cache session, measured on the run's device.
    `per_layer`: seconds of each decoder layer (layers of the same build share the time of the one measured);
    `seconds` (their mean) stands for every layer when `per_layer` is empty."""

    seconds: float
    peak_bytes: int  # activation memory above the weights and the stream, at the layer's peak
    source: str
    per_layer: tuple[float, ...] = ()
    head_seconds: float = 0.0  # per forward: the output head and the loss over its kept positions

    def of(self, layer: int) -> float:
        return self.per_layer[layer] if self.per_layer else self.seconds


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """Where the weights and streams live, how many passes a streamed run takes, and what it is projected to cost."""

    mode: str  # resident | stream
    reason: str
    weights: WeightInventory
    workload: Workload
    budget: Budget
    streams_on: str | None = None  # stream mode: "device" or "host"
    batches_per_pass: int = 0
    passes: int = 0
    peak_device_bytes: int = 0
    peak_host_bytes: int = 0
    cost: LayerCost | None = None
    read_bytes_per_second: float | None = None
    read_source: str = ""
    layers_on_device: int = 0  # stream mode: 2 where the next layer materialises while this one computes, else 1

    def projected_split(self) -> dict[str, float] | None:
        """Where the projected time goes, seconds: `forwards` (forwards x layers x the measured layer cost), `reads`
        (for a streamed run, what the reads add where a layer's read outlasts the compute it overlaps: the next
        layer's read overlaps this layer's compute), `loss` (the output head and loss of every forward, after the
        layers). None without a measured cost."""
        if self.cost is None:
            return None
        forwards = self.workload.batches * self.workload.forwards_per_batch
        n = len(self.weights.layer_bytes)
        head = forwards * self.cost.head_seconds  # after the layers, never overlapped with a read
        if self.mode != "stream":
            return {"forwards": forwards * sum(self.cost.of(i) for i in range(n)), "reads": 0.0, "loss": head}
        compute, bounded = self._streamed_layers()
        return {"forwards": compute, "reads": max(0.0, bounded - compute), "loss": head}

    def _streamed_layers(self) -> tuple[float, float]:
        """A streamed run's layer time: (compute alone, each pass's layer time bounded below by that layer's read)."""
        forwards = self.workload.batches * self.workload.forwards_per_batch
        per_pass_forwards = self.batches_per_pass * self.workload.forwards_per_batch
        compute_total, total = 0.0, 0.0
        left = forwards
        for _ in range(self.passes):
            now = min(left, per_pass_forwards)
            left -= now
            for layer in range(len(self.weights.layer_bytes)):
                compute = now * self.cost.of(layer)
                read = self.weights.stored_layer_bytes[layer] / self.read_bytes_per_second if self.read_bytes_per_second else 0.0
                compute_total += compute
                total += max(compute, read)
        return compute_total, total

    def projected_seconds(self) -> float | None:
        """Forwards x layers x the measured layer cost, and for a streamed run each pass's layer time bounded below
        by the read of that layer (the next layer's read overlaps this layer's compute); `projected_split` parts it."""
        split = self.projected_split()
        if split is None:
            return None
        if self.mode != "stream":
            return split["forwards"] + split["loss"]
        return self._streamed_layers()[1] + split["loss"]

    def as_dict(self) -> dict[str, Any]:
        w = self.weights
        return {
            "mode": self.mode,
            "reason": self.reason,
            "weights": {
                "source": w.source, "run_bytes": w.run_bytes, "layers": len(w.layer_bytes),
                "largest_layer_bytes": max(w.layer_bytes, default=0), "other_bytes": w.other_bytes,
                "stored_by_dtype": dict(w.stored_by_dtype), "quantization": w.quantization,
            },
            "memory": {
                "device": self.budget.device, "device_budget_bytes": self.budget.device_bytes,
                "host_budget_bytes": self.budget.host_bytes, "budget_source": self.budget.source,
                "stream_bytes_per_forward": self.workload.stream_bytes, "forwards_per_batch": self.workload.forwards_per_batch,
                "window_batches": self.workload.batches, "streams_on": self.streams_on,
                "batches_per_pass": self.batches_per_pass, "passes": self.passes,
                "layers_on_device": self.layers_on_device,
                "peak_device_bytes": self.peak_device_bytes, "peak_host_bytes": self.peak_host_bytes,
            },
            "time": {
                "layer_seconds": None if self.cost is None else self.cost.seconds,
                "per_layer_seconds": None if self.cost is None or not self.cost.per_layer else list(self.cost.per_layer),
                "head_seconds_per_forward": None if self.cost is None else self.cost.head_seconds,
                "layer_peak_bytes": None if self.cost is None else self.cost.peak_bytes,
                "cost_source": None if self.cost is None else self.cost.source,
                "read_bytes_per_second": self.read_bytes_per_second, "read_source": self.read_source,
                "projected_seconds": self.projected_seconds(), "projected_split": self.projected_split(),
            },
        }

    def lines(self) -> list[str]:
        """The plan for a person, one fact per line."""
        w, m = self.weights, self.workload
        out = [f"weights: {_gib(w.run_bytes)} as run ({len(w.layer_bytes)} decoder layers, largest {_gib(max(w.layer_bytes))}; "
               f"embeddings and head {_gib(w.other_bytes)}); stored: "
               + ", ".join(f"{k} {_gib(v)}" for k, v in sorted(w.stored_by_dtype.items(), key=lambda kv: -kv[1]))
               + (f"; quantisation {w.quantization.get('method')}" if w.quantization else "")]
        out.append(f"execution: {self.mode} ({self.reason})")
        out.append(f"memory: {self.budget.device} budget {_gib(self.budget.device_bytes)}, host {_gib(self.budget.host_bytes)} "
                   f"({self.budget.source}); {m.batches} window batches x {m.forwards_per_batch} forwards, "
                   f"{_gib(m.stream_bytes)} per forward's stream")
        if self.mode == "stream":
            overlap = ("the next layer materialised while one computes" if self.layers_on_device == 2 else
                       "one layer on the device at a time")
            out.append(f"streams: in {self.streams_on} memory, {self.batches_per_pass} window batches per pass, "
                       f"{self.passes} pass(es) over the layers, {overlap}; peak {self.budget.device} "
                       f"{_gib(self.peak_device_bytes)}, host {_gib(self.peak_host_bytes)}")
        else:
            out.append(f"peak {self.budget.device} memory: about {_gib(self.peak_device_bytes)}")
        seconds = self.projected_seconds()
        if seconds is not None:
            read = (f"; disk {self.read_bytes_per_second / 1e9:.2f} GB/s ({self.read_source})"
                    if self.read_bytes_per_second else "")
            head = (f", {self.cost.head_seconds * 1e3:.3g} ms of output head and loss per forward"
                    if self.cost.head_seconds else "")
            split = self.projected_split()
            out.append(f"time: {self.cost.seconds * 1e3:.3g} ms per layer-forward{head} ({self.cost.source}){read}; "
                       f"projected {_duration(seconds)} of forwards and loss (calibration not included): "
                       f"forwards {_duration(split['forwards'])}, reads beyond compute {_duration(split['reads'])}, "
                       f"loss {_duration(split['loss'])}")
        return out


def _gib(n: float) -> str:
    return f"{n / GIB:.3g} GiB"


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def plan_run(
    weights: WeightInventory, workload: Workload, budget: Budget, offload: str = "auto", cost: LayerCost | None = None,
    read_bytes_per_second: float | None = None, read_source: str = "",
) -> RunPlan:
    """The plan of a run (`offload`: auto, none = resident, stream). Streams wait on the device while a window
    batch's streams fit beside one layer (two during a prefetch), else in host memory; a pass holds as many window
    batches as fit; a plan that cannot hold one window batch anywhere is a UserError naming the sizes."""
    if offload not in OFFLOAD_MODES:
        raise UserError(f"--offload {offload!r}: choose one of {', '.join(OFFLOAD_MODES)}")
    activations = cost.peak_bytes if cost is not None else 0
    forward_now = workload.stream_bytes + activations  # one forward at a time, every layer's cache of it
    resident_peak = weights.run_bytes + forward_now + len(weights.layer_bytes) * workload.layer_cache_bytes
    common = dict(weights=weights, workload=workload, budget=budget, cost=cost, read_bytes_per_second=read_bytes_per_second,
                  read_source=read_source)
    if offload == "none" or (offload == "auto" and resident_peak <= budget.device_bytes):
        fits = f"the model fits ({_gib(resident_peak)} of {_gib(budget.device_bytes)})"
        why = "asked (--offload none)" if offload == "none" else fits
        return RunPlan("resident", why, peak_device_bytes=resident_peak, **common)
    # one decoder layer on the device; the next one's read waits in (pinned) host memory until this layer is released
    fixed = weights.other_bytes + max(weights.layer_bytes) + activations
    # on a GPU the next layer is materialised while this one computes (executor.CheckpointLoader): a second layer's
    # weights on the device, where the room beside one window batch's streams allows it
    overlap = budget.device.startswith("cuda") and (
        fixed + max(weights.layer_bytes) + workload.batch_stream_bytes <= budget.device_bytes)
    if overlap:
        fixed += max(weights.layer_bytes)
    if fixed > budget.device_bytes:
        raise UserError(
            f"even streamed, the device needs {_gib(fixed)} (embeddings and head {_gib(weights.other_bytes)}, one decoder "
            f"layer {_gib(max(weights.layer_bytes))}, activations {_gib(activations)}) but the budget is "
            f"{_gib(budget.device_bytes)}; use a larger GPU, or a shorter --ctx"
        )
    why = "asked (--offload stream)" if offload == "stream" else (
        f"the model does not fit resident ({_gib(resident_peak)} needed, {_gib(budget.device_bytes)} available)")
    per_batch = workload.batch_stream_bytes
    on_device = (budget.device_bytes - fixed) // per_batch
    host_room = budget.host_bytes - (2 * max(weights.stored_layer_bytes) if budget.device != "cpu" else 0)
    in_host = host_room // per_batch if budget.device.startswith("cuda") else 0
    if on_device >= workload.batches or (on_device >= 1 and on_device >= in_host):
        where, per_pass = "device", min(workload.batches, int(on_device))
    elif in_host >= 1:
        where, per_pass = "host", min(workload.batches, int(in_host))
    else:
        raise UserError(
            f"one window batch's streams ({workload.forwards_per_batch} forwards x {_gib(workload.stream_bytes)} = "
            f"{_gib(per_batch)}) fit neither the device ({_gib(max(0, budget.device_bytes - fixed))} left beside one layer) "
            f"nor host memory ({_gib(max(0, host_room))}); lower --batch, --ctx or the number of formats"
        )
    passes = -(-workload.batches // per_pass)
    peak_device = fixed + (per_pass * per_batch if where == "device" else per_batch)
    peak_host = per_pass * per_batch if where == "host" else 0
    return RunPlan("stream", why, streams_on=where, batches_per_pass=per_pass, passes=passes,
                   peak_device_bytes=peak_device, peak_host_bytes=peak_host, layers_on_device=2 if overlap else 1, **common)
