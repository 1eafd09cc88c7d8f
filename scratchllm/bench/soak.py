"""A bounded soak of one server: `scratchllm bench soak --minutes N` (loopback only; stops by itself).

Starts `scratchllm serve` (the default model, `--serve-model PATH`, or `--fake-engine`), or drives
a running one (`--url`, with `--pid` for its process figures), and runs a mix for N minutes:
  - closed-loop clients, each request one of the cluster soak's mix (scratchllm/cluster/soak.py):
    a stream read to its end, an unstreamed request, a stream the client closes after a few
    chunks (a cancellation), an unstreamed request the client gives up on (a disconnect);
  - every few seconds a burst of twice --max-in-flight requests at once (429 expected);
  - hostile bodies: bad JSON, huge numbers, wrong types (400 expected);
  - slow clients that trickle their request's bytes (a complete request, slowly: 200 expected).
Then it waits for the server to go idle and reports the 5xx count, the KV blocks still held
(leaked: /metrics kv_blocks_used with nothing in flight), and the server process's open file
descriptors, threads and RSS over time (from /proc/PID), as a table, a PNG (--plot) or --json.

What it promises (`check`): no 5xx, no transport error or hang, no leaked block, the same file
descriptors and threads (within a small slack) after the run as after the warm-up, and a resident
set that follows the work: RSS after the warm-up (the first minute, or quarter of a shorter run)
within the model's weights + twice the most KV the requests held at once + 100 MB (checked when
the served model is known: a started server, or --url with --serve-model naming its file).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from scratchllm.bench import http_client, serving_peer
from scratchllm.bench.serving import _first_model
from scratchllm.cluster.soak import _one
from scratchllm.errors import ConfigError
from scratchllm.extras import need

RSS_SLACK_BYTES = 100_000_000  # 100 MB: the interpreter, the libraries, the HTTP side and activations
FD_SLACK = 4  # descriptors the server may hold at the end beyond the warm-up's (a log file, an epoll)
THREAD_SLACK = 2  # threads likewise (the event loop's executor starts its threads on demand)
HOSTILE: list[tuple[str, bytes]] = [  # (what, body) sent to /v1/chat/completions; each must be refused with a 4xx
    ("bad json", b'{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}'),
    ("not an object", b'[1, 2, 3]'),
    ("huge max_tokens", b'{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], '
                        b'"max_tokens": 100000000000000000000000000000}'),
    ("huge float", b'{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}'),
    ("wrong type", b'{"model": "MODEL", "messages": "hi", "max_tokens": "ten"}'),
    ("negative n", b'{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "n": -3}'),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=2.0, help="traffic time (default 2)")
    p.add_argument("--url", default=None, help="a running server on loopback instead of starting one")
    p.add_argument("--pid", type=int, default=None, help="with --url: its process, for fds, threads and RSS")
    p.add_argument("--serve-model", default="default",
                   help="the model to serve (default: the default model); with --url, the model it serves (its "
                        "weights bound the RSS promise)")
    p.add_argument("--fake-engine", action="store_true", help="serve the fake engine (no model)")
    p.add_argument("--fake-step-ms", type=float, default=5.0, help="--fake-engine: milliseconds per step")
    p.add_argument("--max-num-seqs", type=int, default=4, help="the started server's sequences per step")
    p.add_argument("--max-in-flight", type=int, default=8,
                   help="the started server's admission bound; bursts send twice as many (default 8)")
    p.add_argument("--clients", type=int, default=6, help="closed-loop clients (default 6)")
    p.add_argument("--max-requests", type=int, default=100_000, help="stop after this many requests")
    p.add_argument("--sample-s", type=float, default=None,
                   help="seconds between samples of the process (default: the run's length / 60, 1 to 30)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the request mix")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw RSS, fds, threads and KV use over time")


@dataclass
class Sample:
    t_s: float  # since the traffic started
    rss_mb: float | None
    fds: int | None
    threads: int | None
    kv_blocks_used: float | None
    in_flight: float | None
    requests: int  # sent so far
    http_5xx: int  # so far


def process_facts(pid: int | None) -> tuple[float | None, int | None, int | None]:
    """(RSS in MiB, open file descriptors, threads) of process `pid` from /proc, None where unknown."""
    if pid is None:
        return None, None, None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss = int(fields["VmRSS"].split()[0]) / 1024
        return rss, len(os.listdir(f"/proc/{pid}/fd")), int(fields["Threads"])
    except (OSError, KeyError, ValueError):
        return None, None, None


def _count_status(counts: Counter[str], status: int) -> None:
    counts[f"http_{status}"] += 1


async def _hostile(client: httpx.AsyncClient, rng: random.Random, counts: Counter[str], model: str) -> None:
    what, body = HOSTILE[rng.randrange(len(HOSTILE))]
    counts["requests"] += 1
    counts["hostile"] += 1
    try:
        r = await client.post("/v1/chat/completions", content=body.replace(b"MODEL", model.encode()),
                              headers={"Content-Type": "application/json"}, timeout=30)
    except httpx.TimeoutException:
        counts["hung"] += 1
        return
    except httpx.HTTPError as err:
        counts[f"transport_{type(err).__name__}"] += 1
        return
    _count_status(counts, r.status_code)
    if not 400 <= r.status_code < 500:
        counts[f"hostile_not_refused_{what.replace(' ', '_')}"] += 1


async def _trickle(url: str, rng: random.Random, counts: Counter[str], model: str) -> None:
    """A whole, valid request sent a few bytes at a time over ~2 s on its own connection."""
    counts["requests"] += 1
    counts["trickled"] += 1
    host = urlsplit(url)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "slowly"}],
                       "max_tokens": 4}).encode()
    raw = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host.netloc}\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host.hostname, host.port), 10)
    except (OSError, TimeoutError) as err:
        counts[f"transport_{type(err).__name__}"] += 1
        return
    try:
        step = max(1, len(raw) // 20)
        for i in range(0, len(raw), step):
            writer.write(raw[i:i + step])
            await writer.drain()
            await asyncio.sleep(0.1 * rng.random())
        head = await asyncio.wait_for(reader.readline(), 60)
        parts = head.split()
        if len(parts) < 2 or not parts[1].isdigit():
            counts["trickle_no_status"] += 1
        else:
            _count_status(counts, int(parts[1]))
    except (OSError, TimeoutError) as err:
        counts[f"transport_{type(err).__name__}"] += 1
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _metrics(client: httpx.AsyncClient, url: str) -> tuple[float | None, float | None]:
    try:
        m = await http_client.scrape_metrics(client, url)
    except (httpx.HTTPError, OSError, ValueError):
        return None, None
    return http_client.metric(m, "kv_blocks_used"), http_client.metric(m, "requests_in_flight")


def _fivexx(counts: Counter[str]) -> int:
    return sum(v for k, v in counts.items() if k.startswith("http_5"))


async def soak(url: str, pid: int | None, model: str, seconds: float, clients: int, max_in_flight: int,
               max_requests: int, sample_s: float, seed: int) -> dict[str, Any]:
    """Run the mix against `url` for `seconds`; the raw result that `check` and `render` read."""
    rng, counts = random.Random(seed), Counter[str]()
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=clients + 4 * max_in_flight, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        await _one(client, random.Random(seed), counts, model)  # warm-up: the first request's one-off costs
        start = time.monotonic()
        end = start + seconds

        def more() -> bool:
            return time.monotonic() < end and counts["requests"] < max_requests

        async def sample() -> None:
            rss, fds, threads = process_facts(pid)
            kv, in_flight = await _metrics(client, url)
            samples.append(Sample(time.monotonic() - start, rss, fds, threads, kv, in_flight, counts["requests"],
                                  _fivexx(counts)))

        await sample()  # the baseline: after the warm-up request, before the load

        async def loop(i: int) -> None:
            local = random.Random(seed * 1000 + i)
            while more():
                roll = local.random()
                if roll < 0.1:
                    await _hostile(client, local, counts, model)
                elif roll < 0.15:
                    await _trickle(url, local, counts, model)
                else:
                    await _one(client, local, counts, model)

        workers = [asyncio.create_task(loop(i)) for i in range(clients)]
        bursts: list[asyncio.Task[None]] = []
        next_burst, next_sample = start + 3.0, start + sample_s
        while more():
            await asyncio.sleep(0.2)
            now = time.monotonic()
            if now >= next_sample:
                next_sample += sample_s
                await sample()
            if now >= next_burst:
                next_burst += 10.0
                counts["bursts"] += 1
                bursts += [asyncio.create_task(_one(client, random.Random(rng.random()), counts, model))
                           for _ in range(2 * max_in_flight)]
        await asyncio.gather(*workers, *bursts)
    traffic_s = time.monotonic() - start
    # quiescence: our connections closed, the server should hold nothing
    async with httpx.AsyncClient(timeout=30) as probe:
        deadline, kv, in_flight = time.monotonic() + 60, None, None
        while time.monotonic() < deadline:
            kv, in_flight = await _metrics(probe, url)
            if kv == 0 and in_flight == 0:
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)  # the server closes the connections we dropped
        rss, fds, threads = process_facts(pid)
        samples.append(Sample(time.monotonic() - start, rss, fds, threads, kv, in_flight, counts["requests"],
                              _fivexx(counts)))
        final = await http_client.scrape_metrics(probe, url)
    return {"seconds": seconds, "traffic_s": traffic_s, "clients": clients, "max_in_flight": max_in_flight,
            "peak_kv_bytes": http_client.metric(final, "kv_cache_peak_bytes"),
            "kv_resident_bytes": http_client.metric(final, "kv_cache_resident_bytes"),
            "model": model, "pid": pid, "counts": dict(sorted(counts.items())), "http_5xx": _fivexx(counts),
            "leaked_kv_blocks": kv, "in_flight_at_end": in_flight,
            "samples": [asdict(s) for s in samples]}


def check(result: dict[str, Any]) -> list[str]:
    """What the soak promises, as a list of broken promises (empty: all kept)."""
    c, problems = result["counts"], []
    if result["http_5xx"]:
        problems.append(f"{result['http_5xx']} responses were 5xx")
    bad = {k: v for k, v in c.items()
           if k.startswith(("transport_", "hostile_not_refused")) or k in ("hung", "stream_cut_by_server",
                                                                           "trickle_no_status")}
    if bad:
        problems.append(f"unexpected outcomes: {bad}")
    if result.get("server_errors_logged"):
        problems.append(f"the server logged {result['server_errors_logged']} errors, the last lines: "
                        + " | ".join(result["server_log_tail"][-3:]))
    if result["leaked_kv_blocks"] != 0:
        problems.append(f"KV blocks still held with nothing in flight: {result['leaked_kv_blocks']}")
    first, last = result["samples"][0], result["samples"][-1]
    if first["fds"] is not None and last["fds"] is not None and last["fds"] > first["fds"] + FD_SLACK:
        problems.append(f"open file descriptors grew from {first['fds']} to {last['fds']}")
    threads = first["threads"], last["threads"]
    if threads[0] is not None and threads[1] is not None and threads[1] > threads[0] + THREAD_SLACK:
        problems.append(f"threads grew from {first['threads']} to {last['threads']}")
    rss, bound = result.get("rss_after_warmup_mib"), result.get("rss_bound_mib")
    if rss is not None and bound is not None and rss > bound:
        problems.append(f"RSS after the warm-up reached {rss:.0f} MiB, over weights + 2 x peak KV + 100 MB = "
                        f"{bound:.0f} MiB")
    return problems


def rss_figures(result: dict[str, Any], weights_bytes: int | None) -> dict[str, float | None]:
    """The most RSS after the warm-up (samples from the first minute on, or the first quarter of a
    shorter run) and its bound: weights + 2 x the peak KV held + 100 MB (None: unknown), in MiB."""
    warm = min(60.0, result["seconds"] / 4)
    after = [s["rss_mb"] for s in result["samples"][1:] if s["t_s"] >= warm and s["rss_mb"] is not None]
    peak_kv = result.get("peak_kv_bytes")
    bound = None if weights_bytes is None or peak_kv is None else \
        (weights_bytes + 2 * peak_kv + RSS_SLACK_BYTES) / 2**20
    return {"rss_after_warmup_mib": max(after) if after else None, "rss_bound_mib": bound,
            "weights_mib": None if weights_bytes is None else weights_bytes / 2**20}


def _weights_bytes(args: argparse.Namespace) -> int | None:
    """The served model file's tensor bytes (its header only is read), or None for the fake engine."""
    if args.fake_engine:
        return None
    from scratchllm.formats import load_checkpoint
    from scratchllm.formats.refs import resolve_model

    ckpt = load_checkpoint(resolve_model(args.serve_model))
    return sum(info.nbytes for info in ckpt.infos.values())


class _SoakServer:
    """`scratchllm serve` on a free loopback port, with a small admission bound (so bursts meet 429),
    its log's last lines and ERROR lines counted as they come."""

    def __init__(self, args: argparse.Namespace) -> None:
        cmd = [sys.executable, "-m", "scratchllm.cli.main", "serve", "--port", "0", "--embedding-model", "none",
               "--max-in-flight", str(args.max_in_flight), "--max-num-seqs", str(args.max_num_seqs),
               "--trace", "none"]
        cmd += ["--fake-engine", "--fake-step-ms", str(args.fake_step_ms)] if args.fake_engine \
            else ["--model", args.serve_model]
        self.log: list[str] = []  # the server's last lines of stderr
        self.errors_logged = 0  # of its lines, those logged at ERROR or CRITICAL
        self.server = serving_peer.Server("scratchllm serve", cmd, timeout_s=120, on_log_line=self._log_line)

    def __enter__(self) -> str:
        self.server.__enter__()
        assert self.server.url is not None  # read from the server's first line
        return self.server.url

    def __exit__(self, *exc: object) -> None:
        self.server.__exit__(*exc)

    @property
    def pid(self) -> int:
        return self.server.proc.pid

    def _log_line(self, line: str) -> None:
        self.log = [*self.log[-49:], line.rstrip()]
        self.errors_logged += " ERROR " in line or " CRITICAL " in line


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The soak, checked: the result with its broken promises under "problems" (empty: all kept)."""
    if args.minutes <= 0 or args.clients < 1 or args.max_in_flight < 1:
        raise ConfigError("--minutes must be > 0, --clients and --max-in-flight >= 1")
    seconds = args.minutes * 60
    sample_s = args.sample_s or min(30.0, max(1.0, seconds / 60))
    if args.url:
        if urlsplit(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
            raise ConfigError(f"--url {args.url}: the soak drives loopback servers only")
        url, pid = args.url.rstrip("/"), args.pid
        result = _drive(args, url, pid, seconds, sample_s)
    else:
        server = _SoakServer(args)
        with server as started:
            result = _drive(args, started, server.pid, seconds, sample_s)
        result["server_errors_logged"] = server.errors_logged
        result["server_log_tail"] = server.log[-10:]
    result.update(rss_figures(result, _weights_bytes(args)))
    result["problems"] = check(result)
    result["inputs"] = {"minutes": args.minutes, "served": "fake engine" if args.fake_engine and not args.url
                        else (args.url or args.serve_model), "clients": args.clients,
                        "max_in_flight": args.max_in_flight, "sample_s": sample_s, "seed": args.seed}
    if args.plot:
        plot(result, args.plot)
        result["plot"] = args.plot
    return result


def _drive(args: argparse.Namespace, url: str, pid: int | None, seconds: float, sample_s: float) -> dict[str, Any]:
    model = _first_model(url, args)
    return asyncio.run(soak(url, pid, model, seconds, args.clients, args.max_in_flight, args.max_requests,
                            sample_s, args.seed))


def _fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def table(samples: list[dict[str, Any]], rows: int = 16) -> list[str]:
    """The samples as text rows, at most `rows` of them (evenly picked, first and last kept)."""
    picked = samples if len(samples) <= rows else \
        [samples[round(i * (len(samples) - 1) / (rows - 1))] for i in range(rows)]
    out = [f"  {'t (s)':>8} {'RSS MiB':>8} {'fds':>5} {'threads':>7} {'KV used':>7} {'in flight':>9} "
           f"{'requests':>8} {'5xx':>4}"]
    for s in picked:
        out.append(f"  {s['t_s']:>8.1f} {_fmt(s['rss_mb'], 1):>8} {_fmt(s['fds']):>5} {_fmt(s['threads']):>7} "
                   f"{_fmt(s['kv_blocks_used']):>7} {_fmt(s['in_flight']):>9} {s['requests']:>8} {s['http_5xx']:>4}")
    return out


def render(result: dict[str, Any]) -> str:
    i, c = result["inputs"], result["counts"]
    statuses = ", ".join(f"{k[5:]}: {v}" for k, v in c.items() if k.startswith("http_"))
    kinds = ", ".join(f"{k}: {v}" for k, v in c.items() if not k.startswith("http_"))
    lines = [f"soak of {i['served']} ({result['model']}): {result['traffic_s']:.0f} s of traffic, "
             f"{i['clients']} clients, admission bound {i['max_in_flight']}",
             f"  outcomes  {kinds}", f"  statuses  {statuses}",
             f"  5xx {result['http_5xx']}   leaked KV blocks {_fmt(result['leaked_kv_blocks'])}   "
             f"in flight at the end {_fmt(result['in_flight_at_end'])}", *table(result["samples"])]
    if result.get("rss_after_warmup_mib") is not None:
        peak_kv, resident = result.get("peak_kv_bytes"), result.get("kv_resident_bytes")
        lines.append(f"  RSS after the warm-up {result['rss_after_warmup_mib']:.0f} MiB; bound "
                     f"{_fmt(result.get('rss_bound_mib'))} MiB = weights {_fmt(result.get('weights_mib'))} + 2 x peak "
                     f"KV {_fmt(None if peak_kv is None else peak_kv / 2**20, 1)} + 100 MB; KV pool resident "
                     f"{_fmt(None if resident is None else resident / 2**20, 1)} MiB")
    if result.get("plot"):
        lines.append(f"  picture: {result['plot']}")
    problems = result["problems"]
    lines.append("soak: " + ("all promises kept" if not problems else "FAILED: " + "; ".join(problems)))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str | Path) -> None:
    """RSS, open fds and threads, and KV blocks in use over the run, one panel each."""
    matplotlib = need("matplotlib", "the soak's picture")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["samples"]
    t = [x["t_s"] / 60 for x in s]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels: list[tuple[Any, list[tuple[str, str]], str]] = [
        (axes[0], [("rss_mb", "RSS")], "MiB"),
        (axes[1], [("fds", "open fds"), ("threads", "threads")], "count"),
        (axes[2], [("kv_blocks_used", "KV blocks used"), ("in_flight", "requests in flight")], "count")]
    for ax, series, unit in panels:
        for key, label in series:
            points = [(ti, x[key]) for ti, x in zip(t, s, strict=True) if x[key] is not None]
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=label)
        ax.set_xlabel("minutes")
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    axes[0].set_title("server RSS")
    axes[1].set_title("server fds and threads")
    axes[2].set_title("KV blocks and requests in flight")
    fig.suptitle(f"soak of {result['inputs']['served']}: {result['counts'].get('requests', 0)} requests, "
                 f"{result['http_5xx']} 5xx, {_fmt(result['leaked_kv_blocks'])} leaked KV blocks")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
