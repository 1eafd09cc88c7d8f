"""`scratchllm trace watch|heatmap|export [RING]`: read a token trace ring, live or after the
writer died.

A ring is the memory-mapped file the engine writes one record into per generated token (and
per step, and per request phase). It survives its writer: after a crash (even SIGKILL) every
record committed before it is still there. RING defaults to $SCRATCHLLM_TRACE, else
scratchllm-trace-UID.ring in the temporary directory. Times (--window) are seconds since the
writer started. See docs/tracing.md.
"""

import argparse
import sys
import time
from pathlib import Path

from scratchllm.cli import Subparsers, help_func
from scratchllm.errors import ConfigError
from scratchllm.trace.format import RECORD_SIZE, default_ring_path
from scratchllm.trace.reader import RingReader
from scratchllm.trace.views.analysis import LiveFigures, Trace, live_figures, retention_s

STATED_RATE = 1000.0  # tokens/s: the rate the retention figure is also given at, for comparison
CLEAR = "\x1b[H\x1b[2J"


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("trace", help="read a token trace ring: live view, heatmap, Perfetto export",
                       description=__doc__)
    cmds = p.add_subparsers(dest="trace_command", metavar="ACTION")
    w = cmds.add_parser("watch", help="live terminal view: tokens/s, ITL and TTFT percentiles, batch, KV, drops")
    _ring(w)
    w.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    w.add_argument("--window", type=float, default=10.0, help="figures over the last N seconds (default 10)")
    w.add_argument("--once", action="store_true", help="print one view of what the ring holds and exit")
    w.set_defaults(func=watch)
    h = cmds.add_parser("heatmap", help="PNG: token position x request, colour = latency; with a diagnosis")
    _ring(h)
    h.add_argument("-o", "--output", default="heatmap.png", help="PNG file to write (default heatmap.png)")
    h.add_argument("--width", type=int, default=1400, help="pixels (default 1400)")
    h.add_argument("--height", type=int, default=900, help="pixels (default 900)")
    h.add_argument("--max-requests", type=int, default=1000, help="the most recent N requests (default 1000)")
    _window(h)
    h.set_defaults(func=heatmap)
    e = cmds.add_parser("export", help="Chrome/Perfetto trace-event JSON (ui.perfetto.dev, chrome://tracing)")
    _ring(e)
    e.add_argument("-o", "--output", default="trace.json", help="JSON file to write (default trace.json)")
    _window(e)
    e.set_defaults(func=export)
    p.set_defaults(func=help_func(p))


def _ring(p: argparse.ArgumentParser) -> None:
    p.add_argument("ring", nargs="?", default=None, help=f"the ring file (default {default_ring_path()})")


def _window(p: argparse.ArgumentParser) -> None:
    p.add_argument("--window", default=None, metavar="START:END",
                   help="only records in [START, END] seconds since the writer started (either may be empty)")
    p.add_argument("--last", type=float, default=None, metavar="S", help="only the last S seconds of the trace")


def _path(args: argparse.Namespace) -> Path:
    return Path(args.ring or default_ring_path())


def _windowed(trace: Trace, args: argparse.Namespace) -> Trace:
    first, last = trace.time_range
    lo, hi = first, last
    if args.window:
        try:
            a, b = args.window.split(":")
            lo, hi = float(a) if a else first, float(b) if b else last
        except ValueError:
            raise ConfigError(f"--window takes START:END in seconds, got {args.window!r}") from None
    if args.last is not None:
        if args.last <= 0:
            raise ConfigError(f"--last must be > 0 seconds, got {args.last}")
        lo = max(lo, last - args.last)
    if hi < lo:
        raise ConfigError(f"the window {lo:g}:{hi:g} s is empty (the trace covers {first:.3f}:{last:.3f} s)")
    return trace.window(lo, hi) if (lo, hi) != (first, last) else trace


def _ms(d: dict[str, float | None]) -> str:
    return " / ".join("-" if d.get(q) is None else f"{d[q]:.1f}" for q in ("p50", "p99")) + " ms"


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.1f} min" if s >= 60 else f"{s:.1f} s"


def render_view(trace: Trace, fig: LiveFigures, path: Path) -> str:
    state = {"running": "running", "closed": "closed the ring",
             "died": "died without closing the ring; what follows is what it left"}[trace.writer_state]
    mib = (trace.capacity * RECORD_SIZE) / 2**20
    kv = "-" if fig.kv_blocks is None else (f"{fig.kv_blocks} / {fig.kv_total} blocks" if fig.kv_total else
                                            f"{fig.kv_blocks} blocks")
    lines = [
        f"trace ring {path}  (writer pid {trace.pid}: {state})",
        f"  {trace.written:,} records written; the ring holds {trace.capacity:,} ({mib:.0f} MiB)",
        f"last {fig.window_s:.1f} s, up to t = {fig.end_s:.1f} s since the writer started:",
        f"  tokens/s            {fig.tokens_per_s:10.1f}   ({fig.tokens} tokens, {fig.requests_seen} requests)",
        f"  inter-token p50/p99 {_ms(fig.itl_ms):>18}",
        f"  TTFT p50/p99        {_ms(fig.ttft_ms):>18}",
        f"  batch size (mean)   {'-' if fig.batch_size is None else f'{fig.batch_size:.1f}':>10}",
        f"  KV in use           {kv:>10}",
        f"  queue               {'-' if fig.waiting is None else fig.waiting:>10}",
        f"  drops               {trace.dropped:>10}   (writer busy); lapped {trace.lapped}, torn {trace.torn} "
        f"(reader too slow)",
        f"retention: at the observed {fig.records_per_s:,.0f} records/s the ring holds {_duration(fig.retention_s)}; "
        f"at {STATED_RATE:,.0f} tokens/s, {_duration(retention_s(trace.capacity, STATED_RATE))}",
    ]
    return "\n".join(lines)


def watch(args: argparse.Namespace) -> int:
    path = _path(args)
    if args.interval <= 0 or args.window <= 0:
        raise ConfigError("--interval and --window must be > 0")
    with RingReader(path) as reader:
        trace = Trace.empty(reader.clock_origin_ns, reader.capacity)
        trace.pid, trace.path, trace.wall_origin_ns = reader.pid, str(path), reader.wall_origin_ns
        while True:
            trace.add(reader.read_new(), reader)
            first, last = trace.time_range
            trace = trace.window(last - 2 * args.window, last)  # keep what the figures need, no more
            view = render_view(trace, live_figures(trace, args.window), path)
            if args.once:
                print(view)
                return 0
            sys.stdout.write(CLEAR + view + "\n")
            sys.stdout.flush()
            time.sleep(args.interval)


def heatmap(args: argparse.Namespace) -> int:
    from scratchllm.trace.views.diagnosis import LatencyGrid, diagnose
    from scratchllm.trace.views.heatmap import draw_heatmap

    if args.width < 200 or args.height < 200 or args.max_requests < 1:
        raise ConfigError("--width and --height must be >= 200 pixels, --max-requests >= 1")
    path = _path(args)
    trace = _windowed(Trace.load(path), args)
    if not len(trace.tokens):
        raise ConfigError(f"{path}: no token records in the ring (or the window) to draw")
    grid = LatencyGrid.from_trace(trace, args.max_requests)
    findings = diagnose(trace, grid)
    title = f"token latency: {len(grid.requests)} requests, {len(trace.tokens):,} tokens ({path.name})"
    out = draw_heatmap(grid, findings, args.output, args.width, args.height, title=title)
    print(f"wrote {out} ({args.width}x{args.height}): {len(grid.requests)} requests x {grid.latency_ms.shape[1]} "
          f"positions")
    for f in findings:
        print(f"- {f.text}")
    return 0


def export(args: argparse.Namespace) -> int:
    from scratchllm.trace.views.perfetto import export as write_json

    path = _path(args)
    trace = _windowed(Trace.load(path), args)
    counts = write_json(trace, args.output)
    size = Path(args.output).stat().st_size
    print(f"wrote {args.output} ({size / 2**20:.1f} MiB): {counts['events']:,} events, {counts['steps']:,} steps, "
          f"{counts['requests']:,} requests, {counts['tokens']:,} tokens; open it in ui.perfetto.dev")
    if size > 200 * 2**20:
        print("the viewers struggle with files this large: --last or --window cut it down", file=sys.stderr)
    return 0
