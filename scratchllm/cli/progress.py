"""A model load's progress on the console (models/progress.py reports it): a tqdm bar per step
on a terminal; otherwise one log line per step when it ends (logger `scratchllm.load`, INFO:
`--log-level info` shows them), so that logs and pipes get lines, not carriage returns."""

import logging
import sys
import time
from typing import IO, Any

from scratchllm.models.progress import Sink

logger = logging.getLogger("scratchllm.load")


def console_sink(model: str, stream: IO[str] | None = None) -> Sink:
    """The sink for one load of `model`: bars on a terminal, log lines elsewhere."""
    out = stream or sys.stderr
    bars: dict[str, Any] = {}
    started: dict[str, float] = {}
    terminal = out.isatty()

    def sink(step: str, done: int, total: int) -> None:
        if terminal:
            from tqdm import tqdm

            bar = bars.get(step)
            if bar is None:
                bar = bars[step] = tqdm(total=total, desc=f"{model}: {step}", file=out, leave=False, unit="part",
                                        mininterval=0.0)  # a few hundred updates at most: draw each
            bar.update(done - bar.n)
            if done >= total:
                bar.close()
                del bars[step]
            return
        began = started.setdefault(step, time.monotonic())
        if done >= total:
            logger.info("%s: %s: %d of %d in %.1f s", model, step, done, total, time.monotonic() - began)
            del started[step]

    return sink
