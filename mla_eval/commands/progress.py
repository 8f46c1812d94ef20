"""Progress bars on stderr for the library's `progress(stage, done, total)` reports, with an ETA.

The estimate is elapsed / done * remaining since the stage's first report (rich's own estimate
needs several updates in a short window and shows nothing for slow work such as a CPU forward).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

STAGE_UNITS = {"sample": "steps", "calibrate": "windows", "score": "tokens", "prompts": "prompts", "sensitivity": "tokens",
               "proxy": "tokens"}


def duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


@contextlib.contextmanager
def progress_bars(console: Console, disable: bool = False, on_first: Callable[[str, int, int, float], None] | None = None
                  ) -> Iterator[Callable[[str, int, int], None]]:
    """Yields a progress callback; each stage gets its own bar with rate and time left.

    `on_first(stage, done, total, seconds)` is called once per stage, at its first report with
    done > 0 (the kld command prints its whole-run estimate there).
    """
    bars = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[unit]}"),
        TimeElapsedColumn(), TextColumn("{task.fields[eta]}"), console=console, disable=disable,
    )
    tasks: dict[str, tuple[int, float]] = {}
    first_seen: set[str] = set()

    def report(stage: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if disable:
            return
        if not tasks:
            bars.start()  # only once there is work to show: an early error stays one clean line
        if stage not in tasks:
            tasks[stage] = (bars.add_task(stage, total=total, unit=STAGE_UNITS.get(stage, ""), eta="left: estimating"), now)
        task, t0 = tasks[stage]
        eta = "left: estimating"
        if done > 0:
            spent = now - t0
            rate = done / max(spent, 1e-9)
            eta = f"{rate:.3g} {STAGE_UNITS.get(stage, '')}/s, left ~{duration((total - done) / rate)}"
            if stage not in first_seen:
                first_seen.add(stage)
                if on_first is not None:
                    on_first(stage, done, total, spent)
        bars.update(task, completed=done, total=total, eta=eta)

    def note(line: str) -> None:  # mla_eval.protocol.say: printed above the bars, or plainly before any bar
        if not disable:
            (bars.console if tasks else console).print(line, soft_wrap=True)

    report.note = note  # type: ignore[attr-defined]
    try:
        yield report
    finally:
        if tasks:
            bars.stop()


def peak_memory_line(environment: dict) -> str | None:
    """'peak GPU memory: cuda:0 12.3 GiB' from a result's environment, None for a CPU run."""
    peaks = environment.get("gpu_peak_memory_gib") or {}
    if not peaks:
        return None
    return "peak GPU memory (torch allocated): " + ", ".join(f"{d} {g:.1f} GiB" for d, g in peaks.items())
