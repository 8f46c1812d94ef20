"""torchrun data parallelism for the evaluations: starting the process group, checking the ranks, and
turning a failed collective into one line.

Under torchrun (WORLD_SIZE > 1) every rank loads its own copy of the model and scores its share of
the windows; the ranks meet only twice: once after the process group starts (every rank describes
its device, `check_uniform_ranks`) and once at the end to gather the per-token statistics
(`evals.kld.gather_arrays`). Rules:

- Backend: NCCL when CUDA is visible (each rank takes GPU LOCAL_RANK before the model loads; an
  explicit `--device cuda:N` would put every rank on one GPU and is refused), gloo on CPU. A torch
  build without NCCL on a GPU machine is a one-line error naming the fix.
- The CPU-side collectives (device descriptions, statistics) go through a gloo group even when the
  default group is NCCL: gloo reports a dead peer or a timeout as a Python exception, which becomes
  one `UserError` line, where the NCCL watchdog would abort the process.
- Timeout: every collective waits at most `MLA_EVAL_DIST_TIMEOUT` seconds (default 1800): longer than
  ranks' finishing times differ (shards differ by at most one window batch), short enough that a
  rank that hangs or died without closing its sockets does not keep the others waiting forever.
- Uniform ranks: every rank must run the same device kind, GPU model, compute capability and memory
  (refused otherwise). The result must equal the single-GPU run of the same windows, and the
  attention path (kernel or torch reference, chosen per architecture) must be the same everywhere.
- A failed collective raises `UserError` before any result exists, so no result document is
  written (the command writes only after `evaluate_kld` returns, on rank 0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from typing import Any, Iterator

from mla_eval.errors import UserError

TIMEOUT_ENV = "MLA_EVAL_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 1800.0


def timeout_seconds() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UserError(f"{TIMEOUT_ENV}={raw!r}: give the collective timeout as a positive number of seconds")
    return value


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This process's place in the run: rank, world size, and the gloo group for CPU-side collectives."""

    rank: int = 0
    world: int = 1
    backend: str = ""  # "" single process, else the default group's backend ("nccl" or "gloo")
    cpu_group: Any = None  # None: the default group (already gloo)
    timeout_s: float = DEFAULT_TIMEOUT_S


_STATE: dict[str, Ranks] = {}


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        raise UserError(f"{name}={raw!r} is not an integer: launch with torchrun, which sets it") from None


def start(device: str | None = "auto") -> Ranks:
    """Join the torchrun process group (once per process); (rank 0, world 1) without torchrun.

    `device` is the evaluation's --device: under NCCL each rank must take its own GPU.
    """
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return Ranks()
    if "ranks" in _STATE:
        return _STATE["ranks"]
    import torch
    import torch.distributed as dist

    timeout = timeout_seconds()
    if not dist.is_available():
        raise UserError("this torch build has no torch.distributed: run without torchrun, or install a full torch build")
    use_cuda = torch.cuda.is_available() and device not in ("cpu",)
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        if not dist.is_nccl_available():
            raise UserError(
                "torchrun on CUDA GPUs needs NCCL, which this torch build lacks: install a CUDA build of torch "
                "(pip install torch from the CUDA index), or run on one GPU without torchrun"
            )
        if device not in (None, "auto", "cuda"):
            raise UserError(
                f"--device {device} under torchrun would put every rank on one GPU: use --device auto (rank r takes "
                "GPU LOCAL_RANK r), or CUDA_VISIBLE_DEVICES to choose the GPUs"
            )
        local = _env_int("LOCAL_RANK", 0)
        if local >= torch.cuda.device_count():
            raise UserError(
                f"LOCAL_RANK {local} but only {torch.cuda.device_count()} GPU(s) are visible: give torchrun "
                "--nproc-per-node at most the number of GPUs"
            )
        torch.cuda.set_device(local)  # "cuda" now means this rank's GPU (model, caches, kernels)
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        except Exception as exc:  # noqa: BLE001 - any failure to start is reported as one line
            raise UserError(
                f"torch.distributed could not start the {backend} process group ({_first_line(exc)}); check that "
                "every rank was launched by the same torchrun and that MASTER_ADDR / MASTER_PORT are reachable"
            ) from None
    cpu_group = None
    if dist.get_backend() != "gloo":
        cpu_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    ranks = Ranks(dist.get_rank(), dist.get_world_size(), backend, cpu_group, timeout)
    _STATE["ranks"] = ranks
    with collective(ranks, "comparing the ranks' devices"):
        descriptions = all_gather(ranks, describe_device(torch.device("cuda") if use_cuda else torch.device("cpu")))
    check_uniform_ranks(descriptions)
    return ranks


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def all_gather(ranks: Ranks, obj: Any) -> list:
    """Every rank's `obj`, in rank order (through the gloo group)."""
    import torch.distributed as dist

    out: list = [None] * ranks.world
    dist.all_gather_object(out, obj, group=ranks.cpu_group)
    return out


@contextlib.contextmanager
def collective(ranks: Ranks, what: str) -> Iterator[None]:
    """A collective that fails (a peer died or never answered within the timeout) becomes one UserError line."""
    if ranks.world <= 1:
        yield
        return
    try:
        yield
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError / DistBackendError subclasses
        raise UserError(
            f"rank {ranks.rank} of {ranks.world}: {what} failed ({_first_line(exc)}): another rank died or did not "
            f"answer within {ranks.timeout_s:g} s ({TIMEOUT_ENV}); no result was written, see the other ranks' output"
        ) from None


def describe_device(device) -> dict[str, Any]:
    """What must agree across ranks: device kind, GPU model, compute capability and memory."""
    import torch

    if device.type != "cuda":
        return {"type": device.type}
    props = torch.cuda.get_device_properties(device)
    return {
        "type": "cuda",
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
    }


def check_uniform_ranks(descriptions: list[dict[str, Any]]) -> None:
    """Refuse ranks on different devices (see the module docstring for why), naming the first that differs."""
    first = descriptions[0]
    for r, d in enumerate(descriptions):
        if d != first:
            raise UserError(
                f"torchrun ranks run on different devices (rank 0: {_label(first)}, rank {r}: {_label(d)}): data-parallel "
                "kld needs identical GPUs; choose them with CUDA_VISIBLE_DEVICES"
            )


def _label(d: dict[str, Any]) -> str:
    if d.get("type") != "cuda":
        return str(d.get("type"))
    return f"{d['name']} sm_{d['capability'].replace('.', '')} {d['memory_gib']:g} GiB"
