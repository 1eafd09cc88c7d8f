"""Progress of long work (a download, a model packed on first load): a tqdm bar on a terminal, and
on anything else (a log file, CI, a pipe) a plain line at each tenth of the way and at the end,
which a log keeps readable where a bar's carriage returns would not.

`progress_class(stream)` picks the one to use; both take tqdm's arguments (total, desc, unit,
unit_scale, initial) and answer update(n) and close(), so a library that accepts a tqdm class
(huggingface_hub's downloads) takes either. Both also take `label`, which replaces the desc the
caller makes up (huggingface_hub shows the download's URL): `functools.partial(cls, label=...)`.
"""

import sys
import time
from typing import IO, Any

from tqdm import tqdm

STEPS = 10  # lines per job on a stream that is no terminal


def amount(n: float, unit: str = "B", scale: bool = True) -> str:
    """1536 -> '1.5 KiB' (binary prefixes, as tqdm's bars show bytes); unscaled: '1,536 it'."""
    if not scale:
        return f"{n:,.0f} {unit}".rstrip()
    for prefix in ("", "Ki", "Mi", "Gi"):
        if abs(n) < 1024 or prefix == "Gi":
            return f"{n:.1f} {prefix}{unit}" if prefix else f"{n:.0f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Bar(tqdm):
    """tqdm's own bar, with a `label` over the caller's desc."""

    def __init__(self, *args: Any, label: str | None = None, **kwargs: Any) -> None:
        kwargs.pop("name", None)  # huggingface_hub names its bars; tqdm itself takes no name
        if kwargs.get("unit") == "B":
            kwargs.setdefault("unit_divisor", 1024)  # MiB, as the lines (and `models list`) count
        super().__init__(*args, **{**kwargs, **({"desc": label} if label else {})})


class LineProgress(tqdm):
    """tqdm's interface, written as lines (see the module doc). The bar itself stays disabled."""

    def __init__(self, *args: Any, label: str | None = None, **kwargs: Any) -> None:
        self.out: IO[str] = kwargs.pop("file", None) or sys.stderr
        self.label = label or str(kwargs.get("desc") or "working")
        self.goal: float | None = kwargs.get("total")
        self.unit, self.scale = str(kwargs.get("unit", "it")), bool(kwargs.get("unit_scale", False))
        self.done: float = kwargs.get("initial", 0) or 0
        # the next tenth to say: past the ones a job already shown part done (initial) has reached
        self.started, self.finished = time.monotonic(), False
        self.next_step = int(STEPS * self.done / self.goal) + 1 if self.goal else 1
        kwargs.pop("name", None)
        super().__init__(*args, **{**kwargs, "disable": True})
        self._line("started" + (f", {amount(self.goal, self.unit, self.scale)}" if self.goal else ""))

    def _line(self, what: str) -> None:
        print(f"{self.label}: {what}", file=self.out, flush=True)

    def _status(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = f"{amount(self.done / elapsed, self.unit, self.scale)}/s"
        if not self.goal:
            return f"{amount(self.done, self.unit, self.scale)}, {rate}"
        return (f"{100 * self.done / self.goal:.0f}% ({amount(self.done, self.unit, self.scale)} of "
                f"{amount(self.goal, self.unit, self.scale)}, {rate})")

    def update(self, n: float | None = 1) -> bool | None:
        self.done += n or 0
        if self.goal:
            reached = int(STEPS * self.done / self.goal)
            if reached >= self.next_step and self.done < self.goal:
                self.next_step = reached + 1
                self._line(self._status())
        return None

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._line(f"done, {self._status()} in {time.monotonic() - self.started:.1f} s")
        super().close()


def progress_class(stream: IO[str] | None = None) -> type[tqdm]:
    """Bar on a terminal, LineProgress on anything else."""
    stream = stream or sys.stderr
    return Bar if stream.isatty() else LineProgress
