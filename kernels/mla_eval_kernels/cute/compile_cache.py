"""The one cache of compiled CuTe kernels, keyed on every specialisation.

A key is a tuple built by each kernel module's `compile_key(...)`: kernel name and revision, the
format's `RecordPlan` (offsets, element types, group sizes, scale dtypes and rules), head count
and tile shape, dtypes, scale modes (outer scale on/off, sink on/off), split mode and the GPU
architecture. Run-time values (s_l, softmax scale, lengths, pointers) are kernel arguments, never
constants baked into a compiled kernel, so a kernel can never be reused for a setting it was not
compiled for: a published bug elsewhere reused a kernel specialised for s_l = 1.0 and broke KLD.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

_lock = threading.Lock()
_compiled: dict[tuple, Any] = {}
_builds: list[tuple] = []  # every key compiled, in order (tests read it)


def compiled(key: tuple, build: Callable[[], Any]) -> Any:
    """The compiled kernel for `key`, building it with `build()` on first use."""
    fn = _compiled.get(key)
    if fn is None:
        with _lock:
            fn = _compiled.get(key)
            if fn is None:
                fn = build()
                _compiled[key] = fn
                _builds.append(key)
    return fn


def keys() -> list[tuple]:
    """Keys of the kernels compiled so far, in compile order."""
    return list(_builds)


def clear() -> None:
    with _lock:
        _compiled.clear()
        _builds.clear()


def arch_tag(device) -> str:
    """'sm_90' etc. for a CUDA device (part of every key), plus the CuTe DSL version."""
    import cutlass
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}/cutlass-dsl-{getattr(cutlass, '__version__', '?')}"
