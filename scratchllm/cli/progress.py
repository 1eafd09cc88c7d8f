"""A model load's progress on the console (models/progress.py reports it), shown as a download's
is (formats/progress.py): a tqdm bar on a terminal, a line at each tenth and at the end anywhere
else. Only a step still running after `show_after_s` is shown: a load of a small model, or of
panels already cached, says nothing. `terminal_only`: lines nowhere but bars on a terminal (a
server's loads before it prints its address, which scripts read as the first line)."""

import sys
import time
from typing import IO, Any

from scratchllm.formats.progress import progress_class
from scratchllm.models.progress import Sink

SHOW_AFTER_S = 1.0


def console_sink(model: str, stream: IO[str] | None = None, show_after_s: float = SHOW_AFTER_S,
                 terminal_only: bool = False) -> Sink:
    """The sink for one load of `model`."""
    out = stream or sys.stderr
    if terminal_only and not out.isatty():
        return lambda step, done, total: None
    started: dict[str, float] = {}  # step -> when it first reported
    shown: dict[str, tuple[Any, int]] = {}  # step -> (its bar or lines, what it has counted)

    def sink(step: str, done: int, total: int) -> None:
        began = started.setdefault(step, time.monotonic())
        if step not in shown and done < total and time.monotonic() - began >= show_after_s:
            shown[step] = (progress_class(out)(total=total, initial=done, desc=f"{model}: {step}", unit="part",
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
