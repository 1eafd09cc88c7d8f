"""Progress of a load's long steps (packing a model's matrices, writing its panel cache), for
whoever shows it: `console_sink` shows it as a download is (formats/progress.py), a bar on a
terminal, a line at each tenth of the way and at the end anywhere else, once a step has run for
over a second (what `serve`, `generate` and `LLM(...)` show).

The code doing the work calls `report(step, done, total)` as it goes; the caller that loads sets
a sink with `reporting(sink)` around the load, on the loading thread. The sink lives in a
ContextVar, so two loads on two threads (two models loading at once in one server) each report
to their own; the work reports from the loading thread only (not from its pool's workers, which
do not see the ContextVar). Without a sink `report` does nothing.
"""

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import IO, Any

Sink = Callable[[str, int, int], None]  # (step, done, total), done counting up to total
PACKING = "packing the weights"
WRITING_CACHE = "writing the panel cache"
SHOW_AFTER_S = 1.0  # a step quicker than this says nothing

_sink: ContextVar[Sink | None] = ContextVar("scratchllm_load_progress", default=None)


def report(step: str, done: int, total: int) -> None:
    assert 0 <= done <= total, f"{step}: {done} of {total}"
    sink = _sink.get()
    if sink is not None:
        sink(step, done, total)


@contextmanager
def reporting(sink: Sink) -> Iterator[None]:
    """Send the reports made on this thread inside the block to `sink`."""
    token = _sink.set(sink)
    try:
        yield
    finally:
        _sink.reset(token)


def console_sink(model: str, stream: IO[str] | None = None, show_after_s: float | None = None,
                 terminal_only: bool = False) -> Sink:
    """The sink for one load of `model`: only a step still running after `show_after_s` is
    shown (a small model, or panels already cached, says nothing). `terminal_only`: bars on a
    terminal, no lines anywhere else (a server's loads before it prints its address, which
    scripts read as its first line)."""
    from scratchllm.formats.progress import progress_class  # tqdm: only where progress is shown

    out = stream or sys.stderr
    after = SHOW_AFTER_S if show_after_s is None else show_after_s
    if terminal_only and not out.isatty():
        return lambda step, done, total: None
    started: dict[str, float] = {}  # step -> when it first reported
    shown: dict[str, tuple[Any, int]] = {}  # step -> (its bar or lines, what it has counted)

    def sink(step: str, done: int, total: int) -> None:
        began = started.setdefault(step, time.monotonic())
        if step not in shown and done < total and time.monotonic() - began >= after:
            shown[step] = (progress_class(out)(total=total, initial=done, desc=f"{model}: {step}", unit="parts",
                                               file=out), done)
        if step in shown:
            bar, counted = shown[step]
            bar.update(done - counted)
            shown[step] = (bar, done)
        if done >= total:
            started.pop(step, None)
            if step in shown:
                shown.pop(step)[0].close()

    return sink
