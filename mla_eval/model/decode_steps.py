"""Greedy decode steps through a cache session, replayed as one CUDA graph on GPU.

A decode step of a small model is host-bound: a few hundred small kernels per token, each
launched from Python (the 64K needle cell on the H200 spent 17 ms per step, the GPU busy for a
fraction of it). Serving engines capture the step once as a CUDA graph and replay it; so do we.

Every step runs in the session's step mode (CacheSession.begin_step): the token's write slot and
each query's key count live in device buffers refilled before the step, and the attention's
split-KV grid is sized for the session's capacity, so every step launches the same kernels with
the same arguments. The first step runs eagerly (it compiles and warms every kernel); the second
is captured and then replayed, and so is every later one. Replay and eager steps do identical
arithmetic: the graph holds exactly the kernels the eager step launches.

Graphs are used only where they can hold the whole step: one CUDA device, the CuTe kernels
serving the format, and no per-layer observers (their Python would not run on replay). A capture
that fails (a model whose forward synchronises, say a data-dependent MoE routing) falls back to
eager steps for the rest of the process, with one warning.
"""

from __future__ import annotations

import warnings

import torch

from mla_eval.attention.dispatch import kernel_status
from mla_eval.model.session import CacheSession


class EagerStepsWarning(UserWarning):
    """Decode steps could not be captured as a CUDA graph and run eagerly (same arithmetic, slower)."""


def graph_blocker(session: CacheSession) -> str | None:
    """Why this session's decode steps cannot be a CUDA graph, or None when they can."""
    devices = set(session.devices)
    if len(devices) != 1:
        return "the model spans several devices"
    (dev,) = devices
    if dev.type != "cuda":
        return f"{dev.type} device"
    for spec in dict.fromkeys(session.specs):  # a mixed plan: every layer's format must run on the kernels
        ok, why = kernel_status(spec, dev)
        if not ok:
            return why
    if session.observers or session.exact:
        return "per-layer observers run Python in every layer"
    return None


def steps_label(info: dict) -> str:
    """How decode steps ran, as results record it: 'cuda_graph' or 'eager (<why>)'.
    `info` is what needle.generate fills ({"decode_steps", "why_eager"})."""
    return info["decode_steps"] if info["why_eager"] is None else f"eager ({info['why_eager']})"


class DecodeSteps:
    """`steps(tokens [B], pos)` -> next-token logits [B, vocab] of one decode step.

    The returned logits are valid until the next step (on replay they live in the graph's memory).
    `graphs=False` keeps every step eager (same arithmetic, host-bound).
    """

    def __init__(self, lm, session: CacheSession, graphs: bool = True) -> None:
        self.model = lm.model
        self.adapter = lm.adapter
        self.session = session
        dev = session.devices[0]
        b = session.batch
        self.ids = torch.zeros(b, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(b, 1, dtype=torch.long, device=dev)
        # The adapter's attention reads what the session's lengths allow and ignores the model's
        # mask; handing the model a prepared 4-D mask spares it building one (transformers'
        # packed-sequence check syncs, which a graph capture cannot hold).
        self.mask = torch.ones(b, 1, 1, 1, dtype=torch.bool, device=dev)
        self.blocker = "disabled by --no-cuda-graphs" if not graphs else self.adapter.graph_failure or graph_blocker(session)
        self.graph: torch.cuda.CUDAGraph | None = None
        self._graph_logits: torch.Tensor | None = None
        self.eager_steps = 0
        self.replays = 0

    @property
    def mode(self) -> str:
        return "cuda_graph" if self.blocker is None else "eager"

    def _forward(self) -> torch.Tensor:
        with self.adapter.session(self.session):
            out = self.model(input_ids=self.ids, position_ids=self.pos, attention_mask=self.mask, use_cache=False)
        return out.logits[:, -1]

    def __call__(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        s = self.session
        s.begin_step(pos)
        self.ids.copy_(tokens.view(-1, 1))
        self.pos.fill_(pos)
        if self.graph is None and self.blocker is None and self.eager_steps >= 1:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
            s.end_replayed_step()
            self.replays += 1
            logits = self._graph_logits
        else:
            logits = self._forward()
            self.eager_steps += 1
        s.check_step()
        return logits

    def _capture(self) -> None:
        """Record the step at the current buffers as a graph (nothing executes during capture)."""
        s = self.session
        lengths = list(s.lengths)
        graph = torch.cuda.CUDAGraph()
        dev = s.devices[0]
        # The capture registers the device's default CUDA generator; a capture that fails inside the CUDA runtime ends
        # before torch closes the generator's capture (cudaStreamEndCapture raises first), leaving it "capturing", so
        # every later CUDA random draw in the process raised "Offset increment outside graph capture" (issue 39: the
        # GPU tests after test_a_failed_capture_falls_back_to_eager_steps). Its state before the capture is put back.
        rng = torch.cuda.default_generators[dev.index if dev.index is not None else torch.cuda.current_device()]
        rng_before = rng.clone_state()
        try:
            with torch.cuda.device(dev), torch.cuda.graph(graph):
                logits = self._forward()
        except Exception as exc:  # noqa: BLE001 - any capture failure means: run this model eagerly
            rng.graphsafe_set_state(rng_before)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self.blocker = f"CUDA graph capture failed ({type(exc).__name__}: {first[:160]})"
            self.adapter.graph_failure = self.blocker  # do not retry for this model
            # said once per model (graph_failure stops retries); the CLI shows it as one `warning:` line
            warnings.warn(f"decode steps run eagerly: {self.blocker}", EagerStepsWarning, stacklevel=2)
            torch.cuda.synchronize(s.devices[0])  # a broken context surfaces here, not in a later kernel
            return
        finally:
            s.lengths = lengths  # the captured Python advanced them; the graph has not run yet
        self.graph, self._graph_logits = graph, logits
