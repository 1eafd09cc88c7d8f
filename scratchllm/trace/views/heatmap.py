"""The latency heatmap as a PNG: x = token position in its request, y = requests in arrival
order, colour = that token's latency (log scale), with the diagnosis printed under it. A request
with no last token in the ring (still running, or cut off by a killed server) ends in an x. A
token that was drafted and accepted by a verification step (speculative decoding) carries a white dot:
it came out of the step of the token after it, with the same latency. A
ring of several models gets one panel per model on one colour scale.

Matplotlib's object API on the Agg canvas (no pyplot, no global state, no display needed); the
figure is exactly width x height pixels.
"""

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from scratchllm.extras import need
from scratchllm.trace.views.diagnosis import Finding, LatencyGrid

if TYPE_CHECKING:  # matplotlib is imported where a picture is drawn
    from matplotlib.axes import Axes
    from matplotlib.colors import Colormap


def draw_heatmap(grid: LatencyGrid | list[tuple[str, LatencyGrid]], findings: list[Finding],
                 path: str | os.PathLike[str], width: int = 1200, height: int = 800,
                 title: str = "token latency") -> Path:
    """The PNG: one panel per (label, grid), stacked, on one colour scale (so two models'
    latencies compare by colour), the findings printed under them. One grid: one panel."""
    need("matplotlib", "the latency heatmap (a PNG)")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = [("", grid)] if isinstance(grid, LatencyGrid) else grid
    assert panels, "at least one panel"
    dpi = 100
    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    FigureCanvasAgg(fig)
    chars = max(60, int((width - 40) / 7.6))  # a 9-point monospace character is 7.5 pixels wide; a margin
    text = "\n".join(_wrap(f.text, chars) for f in findings)
    bottom = min(0.5, 0.1 + (text.count("\n") + 1) * 14 / height) if findings else 0.1
    top, gap = 0.9, 70 / height if len(panels) > 1 else 0.0  # room for tick labels and the next title
    shares = _panel_shares([len(g.requests) for _, g in panels])
    usable = top - bottom - gap * (len(panels) - 1)
    cax = fig.add_axes((0.88, bottom, 0.018, top - bottom))
    values = np.concatenate([g.latency_ms[~np.isnan(g.latency_ms)] for _, g in panels])
    positive = values[values > 0]
    norm, lo, hi = None, 0.0, 0.0
    if len(positive):
        lo = max(float(np.percentile(positive, 1)), 1e-3)
        hi = max(float(np.percentile(positive, 99.5)), lo * 1.01)
        norm = LogNorm(vmin=lo, vmax=hi)
    at = top
    image = None
    for (label, g), share in zip(panels, shares, strict=True):
        h = usable * share
        ax = fig.add_axes((0.08, at - h, 0.76, h))
        at -= h + gap
        lat = np.ma.masked_invalid(g.latency_ms)
        if norm is not None and lat.count():
            image = ax.imshow(np.ma.masked_less_equal(lat, 0), aspect="auto", interpolation="nearest",
                              cmap=_cmap(), norm=norm, origin="upper")
            _mark_drafted(ax, g)
            _mark_cut(ax, g)
        else:
            ax.text(0.5, 0.5, "no token records", ha="center", va="center", transform=ax.transAxes)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(f"requests ({len(g.requests)})" if label else f"requests in arrival order ({len(g.requests)})")
        ax.set_title(f"{title}: {label}" if label and len(panels) == 1 else (label or title),
                     fontsize=10 if len(panels) > 1 else None)
        last_ax = ax
    if len(panels) > 1:
        fig.suptitle(title + " (one panel per model, requests in arrival order)", y=0.97)
    last_ax.set_xlabel("token position in its request (0 = first token)")
    if image is not None and norm is not None:
        bar = fig.colorbar(image, cax=cax)
        bar.set_label("latency since the previous token, ms (position 0: TTFT)")
        ticks = colour_ticks(lo, hi)
        bar.set_ticks(ticks, labels=[tick_label(t) for t in ticks])
        bar.minorticks_off()
    else:
        cax.set_axis_off()
    fig.text(0.02, bottom - 0.07, text, va="top", ha="left", fontsize=9, family="monospace")
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    return path


def _panel_shares(rows: list[int]) -> list[float]:
    """Each panel's share of the height: by its requests, but never under half an equal share."""
    floor = 0.5 / len(rows)
    raw = np.maximum(np.array(rows, dtype=float) / max(sum(rows), 1), floor)
    shares: list[float] = (raw / raw.sum()).tolist()
    return shares


def colour_ticks(lo: float, hi: float, count: int = 6) -> list[float]:
    """Ticks for a log colour scale from lo to hi: both ends (so neither end of the bar is
    unlabelled), and between them about `count` - 2 values spread evenly on the log scale,
    rounded to two significant figures, none closer to an end than half a step."""
    if hi <= lo:
        return [lo]
    step = (np.log(hi) - np.log(lo)) / (count - 1)
    inner = {float(f"{t:.2g}") for t in np.geomspace(lo, hi, count)[1:-1]}
    keep = [t for t in inner if np.log(t) - np.log(lo) > step / 2 and np.log(hi) - np.log(t) > step / 2]
    return [lo, *sorted(keep), hi]


def tick_label(value: float) -> str:
    """A colour bar label: three significant figures, never in exponent form (2100, not 2.1e+03;
    0.0123, not 1.23e-02)."""
    return str(np.format_float_positional(value, precision=3, unique=False, fractional=False, trim="-"))


def _mark_drafted(ax: "Axes", grid: LatencyGrid) -> None:
    if grid.drafted is None:
        return
    rows, cols = np.nonzero(grid.drafted)
    size = float(np.clip(20_000 / grid.drafted.size, 2, 16))  # points^2: smaller as the cells get smaller
    ax.scatter(cols, rows, marker="o", s=size, color="white", edgecolors="#2ca02c", linewidths=0.8,
               label="accepted draft (speculative decoding: made by its successor's verification step)")
    ax.legend(loc="upper right", fontsize=8)


def _mark_cut(ax: "Axes", grid: LatencyGrid) -> None:
    rows = np.flatnonzero(grid.cut)
    if not len(rows):
        return
    last = [int(np.flatnonzero(~np.isnan(grid.latency_ms[r]))[-1]) for r in rows]
    ax.scatter(np.array(last) + 1, rows, marker="x", s=18, color="#1f77b4", linewidths=1.2,
               label="no last token: cut off or still running")
    ax.legend(loc="upper right", fontsize=8)


def _cmap() -> "Colormap":
    from matplotlib import colormaps

    # no token there: light grey, so a fast token never looks like a missing one
    return colormaps["magma"].with_extremes(bad="#f0f0f0")


def _wrap(text: str, width: int) -> str:
    words, lines, line = text.split(), [], ""
    for w in words:
        if len(line) + len(w) + 1 > width:
            lines.append(line)
            line = "  " + w
        else:
            line = f"{line} {w}" if line else w
    return "\n".join([*lines, line])
