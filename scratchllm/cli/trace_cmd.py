"""`scratchllm trace watch|heatmap|export [RING]`: read a token trace ring, live or after the
writer died.

A ring is the memory-mapped file the engine writes one record into per generated token (and
per step, and per request phase). It survives its writer: after a crash (even SIGKILL) every
record committed before it is still there. Each server writes its own ring,
scratchllm-trace-UID-PORT.ring in the temporary directory (or $SCRATCHLLM_TRACE). Without RING
the command finds this user's rings: the one whose writer is running or died without closing
it, else the newest; when there are several it asks which (on a terminal), or lists them and
stops (elsewhere): pick one by its path, --port or --pid. A ring of a server with several
models is read per model (--model, or one panel / block per model). Times (--window) are
seconds since the writer started. See docs/tracing.md.
"""

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from scratchllm.cli import Subparsers, help_func
from scratchllm.errors import ConfigError
from scratchllm.trace.format import RECORD_SIZE, ring_folder, ring_prefix
from scratchllm.trace.reader import RingReader
from scratchllm.trace.rings import CURRENT, RingInfo, find_rings
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
    p.add_argument("ring", nargs="?", default=None,
                   help=f"the ring file (default: the running server's {ring_prefix()}PORT.ring in {ring_folder()}, "
                        "or $SCRATCHLLM_TRACE; asked when there are several)")
    p.add_argument("--port", type=int, default=None, help="the ring of the server on this port")
    p.add_argument("--pid", type=int, default=None, help="the ring of the process with this pid")
    p.add_argument("--model", default=None, help="only this model's records (a server of several models)")


def _window(p: argparse.ArgumentParser) -> None:
    p.add_argument("--window", default=None, metavar="START:END",
                   help="only records in [START, END] seconds since the writer started (either may be empty)")
    p.add_argument("--last", type=float, default=None, metavar="S", help="only the last S seconds of the trace")


def _path(args: argparse.Namespace) -> Path:
    if args.ring:
        return Path(args.ring)
    return choose_ring(find_rings(), args.port, args.pid, interactive=sys.stdin.isatty() and sys.stderr.isatty(),
                       command=f"scratchllm trace {args.trace_command}")


def choose_ring(rings: list[RingInfo], port: int | None = None, pid: int | None = None, interactive: bool = False,
                command: str = "scratchllm trace", ask: Callable[[str], str] = input) -> Path:
    """The ring to read (the module doc's rule): one matching --port / --pid, else the one whose
    writer runs or died, else the newest; several: asked for on a terminal, else a ConfigError
    that lists them and how to pick one."""
    if not rings:
        raise ConfigError(f"no trace ring in {ring_folder()} ({ring_prefix()}*.ring): `scratchllm serve` writes "
                          f"one while it runs; or give the ring's path")
    if port is not None or pid is not None:
        pool = [r for r in rings if (port is None or r.port == port) and (pid is None or r.pid == pid)]
        if not pool:
            wanted = " and ".join(f"{k} {v}" for k, v in (("port", port), ("pid", pid)) if v is not None)
            raise ConfigError(f"no trace ring of {wanted}; the rings: " + "; ".join(r.describe() for r in rings))
    else:
        pool = [r for r in rings if r.state in CURRENT] or rings[:1]  # none running or died: the newest
    if len(pool) == 1:
        return pool[0].path
    if interactive:
        print(f"{len(pool)} trace rings:", file=sys.stderr)
        for i, r in enumerate(pool, 1):
            print(f"  {i}. {r.describe()}", file=sys.stderr)
        answer = ask(f"which one? [1-{len(pool)}] ").strip()
        if answer.isdigit() and 1 <= int(answer) <= len(pool):
            return pool[int(answer) - 1].path
        raise ConfigError(f"no ring chosen ({answer!r} is not a number from 1 to {len(pool)})")
    listing = "; ".join(f"{i}. {r.describe()}" for i, r in enumerate(pool, 1))
    raise ConfigError(f"{len(pool)} trace rings, which one? {listing}. Pick one: {command} RING, or --port PORT, "
                      "or --pid PID")


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


def _selected(trace: Trace, args: argparse.Namespace) -> list[tuple[str, Trace]]:
    """(model name, its records) per model to show: the one --model names, else each model with
    records (one entry named '' when the ring names no models)."""
    if args.model is not None:
        return [(args.model, trace.of_model(trace.model_id(args.model)))]
    ids = trace.model_ids()
    if len(ids) <= 1:
        return [(trace.model_name(ids[0]) if ids else "", trace)]
    return [(trace.model_name(m), trace.of_model(m)) for m in ids]


def _figure_lines(fig: LiveFigures, indent: str = "  ") -> list[str]:
    kv = "-" if fig.kv_blocks is None else (f"{fig.kv_blocks} / {fig.kv_total} blocks" if fig.kv_total else
                                            f"{fig.kv_blocks} blocks")
    if fig.idle_s is not None:
        last = "no token yet" if fig.last_token_s is None else \
            f"last token at t = {fig.last_token_s:.1f} s, {_duration(fig.idle_s)} ago"
        return [f"{indent}idle: no tokens in the last {fig.window_s:.1f} s ({last})"]
    a = fig.speculation
    spec = [] if a is None else [
        f"{indent}drafted / accepted  {f'{a.drafted} / {a.accepted}':>10}   tokens, in {a.steps} verification steps",
        f"{indent}acceptance rate     {f'{100 * a.rate:.1f}%':>10}   (speculative decoding)",
    ]
    return [
        f"{indent}tokens/s            {fig.tokens_per_s:10.1f}   ({fig.tokens} tokens, {fig.requests_seen} requests)",
        f"{indent}inter-token p50/p99 {_ms(fig.itl_ms):>18}",
        f"{indent}TTFT p50/p99        {_ms(fig.ttft_ms):>18}",
        f"{indent}batch size (mean)   {'-' if fig.batch_size is None else f'{fig.batch_size:.1f}':>10}",
        f"{indent}KV in use           {kv:>10}",
        f"{indent}queue               {'-' if fig.waiting is None else fig.waiting:>10}",
        *spec,
    ]


def render_view(trace: Trace, fig: LiveFigures, path: Path,
                per_model: list[tuple[str, LiveFigures]] | None = None) -> str:
    """The watch screen: the ring and its writer, then the figures of the last window (one block
    per model when there are several), drops, retention."""
    state = {"running": "running", "closed": "closed the ring",
             "died": "died without closing the ring; what follows is what it left"}[trace.writer_state]
    mib = (trace.capacity * RECORD_SIZE) / 2**20
    port = f", port {trace.port}" if trace.port else ""
    models = f"; models: {', '.join(trace.models.values())}" if trace.models else ""
    lines = [
        f"trace ring {path}  (writer pid {trace.pid}{port}: {state}){models}",
        f"  {trace.written:,} records written; the ring holds {trace.capacity:,} ({mib:.0f} MiB)",
        f"last {fig.window_s:.1f} s, up to t = {fig.end_s:.1f} s since the writer started:",
    ]
    if per_model and len(per_model) > 1 or per_model and per_model[0][0]:
        for name, f in per_model:
            lines += [f"  model '{name}':", *_figure_lines(f, "    ")]
    else:
        lines += _figure_lines(fig)
    lines += [
        f"  drops               {trace.dropped:>10}   (writer busy); lapped {trace.lapped}, torn {trace.torn} "
        f"(reader too slow)",
        f"retention: at the observed {fig.records_per_s:,.0f} records/s the ring holds {_duration(fig.retention_s)}; "
        f"at {STATED_RATE:,.0f} tokens/s, {_duration(retention_s(trace.capacity, STATED_RATE))}",
    ]
    return "\n".join(lines)


def watch(args: argparse.Namespace) -> int:
    if args.interval <= 0 or args.window <= 0:
        raise ConfigError("--interval and --window must be > 0")
    path = _path(args)
    with RingReader(path) as reader:
        trace = Trace.opened(reader)
        while True:
            trace.add(reader.read_new(), reader)
            now = trace.now_s()
            end = max(trace.time_range[1], now or 0.0)
            trace = trace.window(end - 2 * args.window, end)  # keep what the figures need, no more
            parts = _selected(trace, args)
            whole = parts[0][1] if args.model is not None else trace
            view = render_view(trace, live_figures(whole, args.window, now), path,
                               [(name, live_figures(t, args.window, now)) for name, t in parts])
            if args.once:
                print(view)
                return 0
            sys.stdout.write(CLEAR + view + "\n")
            sys.stdout.flush()
            time.sleep(args.interval)


def heatmap(args: argparse.Namespace) -> int:
    from scratchllm.trace.views.diagnosis import LatencyGrid, compare_models, diagnose
    from scratchllm.trace.views.heatmap import draw_heatmap

    if args.width < 200 or args.height < 200 or args.max_requests < 1:
        raise ConfigError("--width and --height must be >= 200 pixels, --max-requests >= 1")
    path = _path(args)
    trace = _windowed(Trace.load(path), args)
    parts = [(name, t) for name, t in _selected(trace, args) if len(t.tokens)]
    if not parts:
        raise ConfigError(f"{path}: no token records in the ring (or the window{' or the model' if args.model else ''}"
                          ") to draw")
    grids = {name: LatencyGrid.from_trace(t, args.max_requests) for name, t in parts}
    findings = []
    for name, t in parts:
        for f in diagnose(t, grids[name]):
            if len(parts) > 1:
                f.text = f"[{name}] {f.text}"
            findings.append(f)
    models = compare_models(grids)
    if models is not None:
        findings.insert(0, models)
    tokens = sum(len(t.tokens) for _, t in parts)
    requests = sum(len(g.requests) for g in grids.values())
    label = f" of '{parts[0][0]}'" if len(parts) == 1 and parts[0][0] else ""
    title = f"token latency{label}: {requests} requests, {tokens:,} tokens ({path.name})"
    panels = list(grids.items()) if len(parts) > 1 else [("", next(iter(grids.values())))]
    out = draw_heatmap(panels, findings, args.output, args.width, args.height, title=title)
    shape = ", ".join(f"'{n}' {len(g.requests)} x {g.latency_ms.shape[1]}" for n, g in grids.items()) \
        if len(parts) > 1 else f"{requests} requests x {next(iter(grids.values())).latency_ms.shape[1]} positions"
    print(f"wrote {out} ({args.width}x{args.height}): {shape}")
    for f in findings:
        print(f"- {f.text}")
    return 0


def export(args: argparse.Namespace) -> int:
    from scratchllm.trace.views.perfetto import export as write_json

    path = _path(args)
    trace = _windowed(Trace.load(path), args)
    if args.model is not None:
        trace = trace.of_model(trace.model_id(args.model))
    counts = write_json(trace, args.output)
    size = Path(args.output).stat().st_size
    print(f"wrote {args.output} ({size / 2**20:.1f} MiB): {counts['events']:,} events, {counts['steps']:,} steps, "
          f"{counts['requests']:,} requests, {counts['tokens']:,} tokens; open it in ui.perfetto.dev")
    if size > 200 * 2**20:
        print("the viewers struggle with files this large: --last or --window cut it down", file=sys.stderr)
    return 0
