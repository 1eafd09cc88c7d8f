"""The latency heatmap as a PNG: x = token position in its request, y = requests in arrival
order, colour = that token's latency (log scale), with the diagnosis printed under it. A request
with no last token in the ring (still running, or cut off by a killed server) ends in an x.

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


def draw_heatmap(grid: LatencyGrid, findings: list[Finding], path: str | os.PathLike[str], width: int = 1200,
                 height: int = 800,
                 title: str = "token latency") -> Path:
    need("matplotlib", "the latency heatmap (a PNG)")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    dpi = 100
    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    FigureCanvasAgg(fig)
    text_lines = [f.text for f in findings]
    bottom = min(0.45, 0.1 + 0.035 * sum(1 + len(t) // 150 for t in text_lines))
    ax = fig.add_axes((0.08, bottom, 0.8, 0.88 - bottom))
    cax = fig.add_axes((0.9, bottom, 0.02, 0.88 - bottom))
    lat = np.ma.masked_invalid(grid.latency_ms)
    if lat.count():
        positive = lat.compressed()[lat.compressed() > 0]
        lo = max(float(np.percentile(positive, 1)), 1e-3) if len(positive) else 1e-3
        hi = max(float(np.percentile(positive, 99.5)), lo * 1.01) if len(positive) else 1.0
        cmap = _cmap()
        image = ax.imshow(np.ma.masked_less_equal(lat, 0), aspect="auto", interpolation="nearest", cmap=cmap,
                          norm=LogNorm(vmin=lo, vmax=hi), origin="upper")
        bar = fig.colorbar(image, cax=cax, label="latency since the previous token, ms (position 0: TTFT)")
        ticks = colour_ticks(lo, hi)
        bar.set_ticks(ticks, labels=[f"{t:.3g}" for t in ticks])
        bar.minorticks_off()
        _mark_cut(ax, grid)
    else:
        ax.text(0.5, 0.5, "no token records", ha="center", va="center", transform=ax.transAxes)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("token position in its request (0 = first token)")
    ax.set_ylabel(f"requests in arrival order ({len(grid.requests)})")
    ax.set_title(title)
    fig.text(0.02, bottom - 0.07, "\n".join(_wrap(t) for t in text_lines), va="top", ha="left", fontsize=9,
             family="monospace")
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    return path


def colour_ticks(lo: float, hi: float, count: int = 6) -> list[float]:
    """About `count` ticks spread evenly on the log scale from lo to hi, each rounded to two
    significant figures (a narrow range otherwise gets only its two ends labelled)."""
    return sorted({t for t in (float(f"{t:.2g}") for t in np.geomspace(lo, hi, count)) if lo <= t <= hi})


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


def _wrap(text: str, width: int = 150) -> str:
    words, lines, line = text.split(), [], ""
    for w in words:
        if len(line) + len(w) + 1 > width:
            lines.append(line)
            line = "  " + w
        else:
            line = f"{line} {w}" if line else w
    return "\n".join([*lines, line])
