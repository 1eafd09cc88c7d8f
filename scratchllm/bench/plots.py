"""Pictures of benchmark runs: latency CDFs (static vs continuous), tokens/s over time, KV use
over time, side by side in one PNG.

A run is a RunSeries; build one from what a benchmark holds:
  * series_from_loadgen: the raw dict of `loadgen.run_load` (`bench serving`): per-request
    Result (start, ttft, e2e, itl: monotonic seconds), duration_s, kv_samples (KV blocks in use,
    sampled by the watcher at even intervals over the run);
  * series_from_times: per-request arrival and finish seconds (what `bench engine`'s
    run_continuous / run_static_mode keep), optional token times and (time, KV blocks) samples;
  * series_from_trace: a trace ring (every token's time, every step's KV use).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from scratchllm.extras import need

if TYPE_CHECKING:
    from scratchllm.bench.loadgen import LoadRun
    from scratchllm.trace.analysis import Trace


@dataclass
class RunSeries:
    label: str  # "static", "continuous", ...
    latency_ms: np.ndarray  # [R] end-to-end latency per request
    ttft_ms: np.ndarray | None = None  # [R] time to first token per request
    token_times_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [T] each output token, from t=0
    kv_times_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [K]
    kv_blocks: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [K] blocks in use at kv_times_s


def series_from_loadgen(label: str, run: LoadRun) -> RunSeries:
    ok = [r for r in run["results"] if r.ok]
    ttft = np.array([r.ttft for r in ok], dtype=float)  # an ok result has its ttft and e2e
    e2e = np.array([r.e2e for r in ok], dtype=float)
    t0 = min((r.start for r in ok), default=0.0)
    tokens = [r.start - t0 + t + np.concatenate([[0.0], np.cumsum(r.itl)]) for r, t in zip(ok, ttft, strict=True)]
    kv = np.asarray(run.get("kv_samples", []), dtype=float)
    return RunSeries(label, e2e * 1e3, ttft * 1e3,
                     np.sort(np.concatenate(tokens)) if tokens else np.zeros(0),
                     np.linspace(0.0, run["duration_s"], len(kv)), kv)


def series_from_times(label: str, arrivals_s: npt.ArrayLike, finish_s: npt.ArrayLike,
                      token_times_s: npt.ArrayLike | None = None, kv_samples: npt.ArrayLike | None = None) -> RunSeries:
    """kv_samples: [(seconds, blocks in use), ...]."""
    arrivals, finish = np.asarray(arrivals_s, dtype=float), np.asarray(finish_s, dtype=float)
    kv = np.asarray(kv_samples if kv_samples is not None else np.zeros((0, 2)), dtype=float).reshape(-1, 2)
    tokens = np.sort(np.asarray(token_times_s if token_times_s is not None else [], dtype=float))
    return RunSeries(label, (finish - arrivals) * 1e3, None, tokens, kv[:, 0], kv[:, 1])


def series_from_trace(label: str, trace: Trace) -> RunSeries:
    """From a trace ring (scratchllm.trace.views.analysis.Trace): latency = arrival to last token."""
    from scratchllm.trace.format import TokenFlag

    t = trace.tokens
    arrival = trace.arrivals()
    keys = np.unique(t["request"])
    last = {int(k): int(t["time_ns"][t["request"] == k].max()) for k in keys}
    first_tok = t[(t["flags"] & TokenFlag.FIRST) != 0]
    start = trace.time_range[0]
    return RunSeries(label, np.array([(last[k] - arrival[k]) / 1e6 for k in last]), first_tok["latency_ns"] / 1e6,
                     np.sort(trace.seconds(t["time_ns"]) - start), trace.seconds(trace.steps["end_ns"]) - start,
                     trace.steps["kv_blocks"].astype(float))


def cdf(values: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """(sorted values, fraction of values <= each): the empirical CDF's steps."""
    x = np.sort(np.asarray(values, dtype=float))
    return x, np.arange(1, len(x) + 1) / max(len(x), 1)


def rate(times_s: npt.ArrayLike, bin_s: float) -> tuple[np.ndarray, np.ndarray]:
    """(bin centres, events per second in each bin of bin_s seconds)."""
    times = np.asarray(times_s, dtype=float)
    if not len(times):
        return np.zeros(0), np.zeros(0)
    edges = np.arange(0.0, times.max() + bin_s, bin_s)
    counts, edges = np.histogram(times, bins=edges if len(edges) > 1 else [0.0, bin_s])
    return (edges[:-1] + edges[1:]) / 2, counts / bin_s


def plot_runs(runs: list[RunSeries], path: str | Path, title: str = "", width: int = 1500, height: int = 450,
              bin_s: float | None = None) -> Path:
    need("matplotlib", "the benches' --plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    dpi = 100
    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    FigureCanvasAgg(fig)
    ax_cdf, ax_tps, ax_kv = fig.subplots(1, 3)
    end = max([float(r.token_times_s.max()) for r in runs if len(r.token_times_s)] or [1.0])
    bin_s = bin_s or max(end / 60, 0.05)  # about 60 bins over the longest run
    for i, r in enumerate(runs):
        colour = f"C{i}"
        x, y = cdf(r.latency_ms)
        ax_cdf.step(x, y, where="post", color=colour, label=f"{r.label}: end-to-end")
        if r.ttft_ms is not None and len(r.ttft_ms):
            x, y = cdf(r.ttft_ms)
            ax_cdf.step(x, y, where="post", color=colour, linestyle="--", label=f"{r.label}: first token")
        centres, per_s = rate(r.token_times_s, bin_s)
        ax_tps.plot(centres, per_s, color=colour, label=r.label)
        if len(r.kv_blocks):
            ax_kv.step(r.kv_times_s, r.kv_blocks, where="post", color=colour, label=r.label)
    ax_cdf.set(xlabel="latency, ms", ylabel="fraction of requests", title="latency CDF", ylim=(0, 1.02))
    ax_tps.set(xlabel="seconds since the run began", ylabel=f"output tokens/s ({bin_s:.2g} s bins)",
               title="tokens/s over time")
    ax_kv.set(xlabel="seconds since the run began", ylabel="KV blocks in use", title="KV use over time")
    for ax in (ax_cdf, ax_tps, ax_kv):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.subplots_adjust(left=0.05, right=0.98, bottom=0.13, top=0.85 if title else 0.9, wspace=0.25)
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    return path
