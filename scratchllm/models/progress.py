"""Progress of a load's long steps (packing a model's matrices, writing its panel cache), for
whoever shows it: a bar on a terminal, a log line otherwise (cli/progress.py).

The code doing the work calls `report(step, done, total)` as it goes; the caller that loads sets
a sink with `reporting(sink)` around the load, on the loading thread. The sink lives in a
ContextVar, so two loads on two threads (two models loading at once in one server) each report
to their own; the work reports from the loading thread only (not from its pool's workers, which
do not see the ContextVar). Without a sink `report` does nothing.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

Sink = Callable[[str, int, int], None]  # (step, done, total), done counting up to total
PACKING = "packing the weights"
WRITING_CACHE = "writing the panel cache"

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
