"""`bench serving` that starts the servers itself: ours at each --max-num-seqs, and with
`--peer llama-server` llama.cpp's server on the same file, threads and slot count (the first
--max-num-seqs), all on the same workload, in interleaved rounds.

Each server is started fresh for each round (a cold prefix cache; the figures say how many prompt
tokens any cache served anyway), waited on until /health answers 200, loaded with the workload,
then stopped. Its process's RSS is read when it is ready and its peak (VmHWM) sampled every 20 ms
until it stops. Figures are medians over rounds; ratios are medians of the rounds' paired ratios,
every one ours / llama-server: requests/s wants >= 1; TTFT, TPOT, ITL, latency and RSS <= 1.

With several --max-num-seqs and no peer it prints the TTFT/TPOT trade of our concurrency: the
same workload at 16, 32 and 64 sequences per step, the choice behind the default
(docs/memory.md).
"""

import argparse
import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from scratchllm.bench import http_client, llama_tools, loadgen
from scratchllm.bench.common import machine_facts, median, status_mb
from scratchllm.errors import ConfigError

PEERS = ("llama-server",)
# figure key -> (label, the value's path in a run's summary); lower is better except requests/s
FIGURES = [("request_throughput", "requests/s", ("request_throughput",)),
           ("ttft_p50", "TTFT p50, ms", ("ttft_ms", "p50")), ("ttft_p99", "TTFT p99, ms", ("ttft_ms", "p99")),
           ("tpot_mean", "TPOT mean, ms", ("tpot_ms", "mean")), ("tpot_p50", "TPOT p50, ms", ("tpot_ms", "p50")),
           ("tpot_p99", "TPOT p99, ms", ("tpot_ms", "p99")), ("itl_p99", "ITL p99, ms", ("itl_ms", "p99")),
           ("e2e_p99", "end-to-end p99, ms", ("e2e_ms", "p99")),
           ("rss_ready_mb", "server RSS when ready, MB", ("rss_ready_mb",)),
           ("peak_rss_mb", "server peak RSS, MB", ("peak_rss_mb",))]


def max_num_seqs_list(text: str) -> list[int | None]:
    """--max-num-seqs: counts >= 1 and `default` (None: our server's own default), comma-separated."""
    values: list[int | None] = []
    for x in (x.strip() for x in str(text).split(",") if x.strip()):
        values.append(None if x == "default" else int(x) if x.isdigit() and int(x) >= 1 else -1)
    if not values or -1 in values:
        raise ConfigError(f"--max-num-seqs takes counts >= 1 or 'default', comma-separated (16 or 16,32,64,default), "
                          f"got {text!r}")
    return values


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Server:
    """A server process we start: its command, how its URL is found, its memory while it runs."""

    def __init__(self, name: str, cmd: list[str], url: str | None = None, timeout_s: float = 300,
                 on_log_line: Callable[[str], None] | None = None) -> None:
        """url: where a server given its port answers (None: read from its stderr's first line, as
        `scratchllm serve --port 0` prints it). on_log_line: each later line of that stderr (else
        they are read and dropped: a full pipe would stop the server mid-run)."""
        self.name, self.cmd, self.url, self.timeout_s = name, cmd, url, timeout_s
        self.on_log_line = on_log_line
        self.rss_ready_mb = 0.0
        self.drain: threading.Thread | None = None

    def __enter__(self) -> "Server":
        # ours prints its URL on stderr's first line (--port 0); llama-server is given a port
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, text=True,
                                     stderr=subprocess.PIPE if self.url is None else subprocess.DEVNULL)
        self.sampler = llama_tools.PeakSampler(self.proc.pid)
        if self.url is None:
            assert self.proc.stderr is not None
            line = self.proc.stderr.readline()
            found = re.search(r"http://\S+", line)
            if not found:  # it exited (a bad option, a model that does not load): its last words
                self.proc.wait()
                rest = line + self.proc.stderr.read()
                self._stop()
                raise ConfigError(f"{self.name} did not start: {rest.strip()[-500:]}")
            self.url = found.group(0)
            self.drain = threading.Thread(target=self._read_log, daemon=True)
            self.drain.start()
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ConfigError(f"{self.name} exited with status {self.proc.returncode} before it was ready")
            try:
                if _get(self.url + "/health").status == 200:
                    self.rss_ready_mb = status_mb(self.proc.pid, "VmRSS") or 0.0
                    return self
            except (httpx.HTTPError, OSError):
                pass
            time.sleep(0.2)
        self._stop()
        raise ConfigError(f"{self.name} at {self.url} never became healthy")

    def _read_log(self) -> None:
        assert self.proc.stderr is not None  # stderr=PIPE
        try:
            for line in self.proc.stderr:
                if self.on_log_line is not None:
                    self.on_log_line(line)
        except (OSError, ValueError):  # closed by _stop once the server is gone
            pass

    def _stop(self) -> float:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.drain is not None:
            self.drain.join(timeout=10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return self.sampler.stop()

    def __exit__(self, *exc: object) -> None:
        self.peak_rss_mb = self._stop()


def _get(url: str) -> http_client.Reply:
    async def get() -> http_client.Reply:
        async with http_client.new_client(5) as client:
            return await http_client.request(client, url)

    return asyncio.run(get())


def ours_cmd(args: argparse.Namespace, max_num_seqs: int | None, num_requests: int) -> list[str]:
    cmd = [sys.executable, "-m", "scratchllm.cli.main", "serve", "--port", "0", "--embedding-model", "none",
           "--max-in-flight", str(num_requests + 8), "--threads", str(args.threads)]
    if max_num_seqs is not None:  # None: the server's default
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    if args.fake_engine:  # the server without a model (tests of this bench)
        return cmd + ["--fake-engine", "--fake-step-ms", str(args.fake_step_ms)]
    cmd += ["--model", args.serve_model, "--kv-cache-dtype", args.kv_cache_dtype]
    if args.target_tpot_ms is not None:
        cmd += ["--target-tpot-ms", str(args.target_tpot_ms)]
    return cmd


def llama_server_cmd(args: argparse.Namespace, slots: int, per_slot_ctx: int, port: int) -> list[str]:
    exe = llama_tools.tool("llama-server")
    if exe is None:
        raise ConfigError("llama-server is not built: `make peers` builds it (scripts/build_peers.py)")
    from scratchllm.formats.refs import resolve_model

    path = resolve_model(args.serve_model)
    if path.suffix != ".gguf":
        raise ConfigError(f"--peer llama-server serves a GGUF file; {path} is not one")
    return [str(exe), "-m", str(path), "-t", str(args.threads), "-tb", str(args.threads), "-np", str(slots),
            "-c", str(slots * per_slot_ctx), "--host", "127.0.0.1", "--port", str(port), "--metrics"]


def _value(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    x: Any = summary
    for k in path:
        x = x.get(k) if isinstance(x, dict) else None
    return None if x is None else float(x)


def run(args: argparse.Namespace, workload: loadgen.Workload, slo: dict[str, float | None],
        inputs: dict[str, Any]) -> dict[str, Any]:
    seqs = max_num_seqs_list(args.max_num_seqs)
    if args.threads < 1 or args.repeat < 1:
        raise ConfigError("--threads and --repeat must be >= 1")
    if args.peer and args.fake_engine:
        raise ConfigError("--peer compares on a model file: not with --fake-engine")
    configs: list[tuple[str, Any]] = [(f"ours@{'default' if n is None else n}", n) for n in seqs]
    if args.peer:
        if seqs[0] is None:
            raise ConfigError("--peer takes its slot count from the first --max-num-seqs: a number, not 'default'")
        configs.append((f"{args.peer}@{seqs[0]}", seqs[0]))
    per_slot = max(map(len, workload.prompts)) + max(workload.output_tokens) + 16
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in configs}
    loads: list[float] = []
    for r in range(args.repeat):
        # interleaved: load that drifts on a shared machine hits every server alike
        for name, n in configs if r % 2 == 0 else configs[::-1]:
            if name.startswith("ours"):
                server = Server(name, ours_cmd(args, n, len(workload.prompts)))
            else:
                port = _free_port()
                server = Server(name, llama_server_cmd(args, n, per_slot, port), f"http://127.0.0.1:{port}")
            with server:
                assert server.url is not None
                summary = _measure(server.url, args, workload, slo)
            rounds[name].append({**summary, "rss_ready_mb": server.rss_ready_mb, "peak_rss_mb": server.peak_rss_mb})
            loads.append(os.getloadavg()[0])
    figures = {name: {key: median([v for t in runs if (v := _value(t, path)) is not None] or [float("nan")])
                      for key, _, path in FIGURES} | {"failed": sum(t["failed"] for t in runs),
                                                       "cached_prompt_tokens": sum(t["cached_prompt_tokens"]
                                                                                   for t in runs)}
               for name, runs in rounds.items()}
    ratios: dict[str, dict[str, float]] = {}
    if args.peer:
        peer = configs[-1][0]
        for name, _ in configs[:-1]:
            paired = {key: [a / b for o, p in zip(rounds[name], rounds[peer], strict=True)
                            if (a := _value(o, path)) is not None and (b := _value(p, path))]
                      for key, _, path in FIGURES}
            ratios[name] = {key: median(v) for key, v in paired.items() if v}
    for runs in rounds.values():
        for t in runs:
            t.pop("raw", None)
    return {"inputs": {**inputs, "model": args.serve_model, "fake_engine": args.fake_engine, "threads": args.threads,
                       "max_num_seqs": seqs,
                       "peer": args.peer, "repeat": args.repeat, "kv_cache_dtype": args.kv_cache_dtype,
                       "target_tpot_ms": args.target_tpot_ms, "llama_server_ctx_per_slot": per_slot,
                       "command": "scratchllm " + " ".join(sys.argv[1:])},
            "servers": [name for name, _ in configs], "figures": figures, "ratios": ratios, "rounds": rounds,
            "machine": {**machine_facts(), "loadavg_1min": loads}}


def _measure(url: str, args: argparse.Namespace, workload: loadgen.Workload,
             slo: dict[str, float | None]) -> dict[str, Any]:
    model = _get(url + "/v1/models").json()["data"][0]["id"]
    raw = asyncio.run(loadgen.run_load(url, model, workload, args.concurrency, args.max_duration))
    return loadgen.summarize(raw, slo)


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or x != x else f"{x:,.{digits}f}"


def render(r: dict[str, Any]) -> str:
    i, f = r["inputs"], r["figures"]
    servers = r["servers"]
    model = "the fake engine" if i.get("fake_engine") else i["model"]
    lines = [f"bench serving, servers started here: {', '.join(servers)}; model {model}, {i['threads']} threads, "
             f"KV cache {i['kv_cache_dtype']} (ours)" + (f", target TPOT {i['target_tpot_ms']} ms" if
                                                         i["target_tpot_ms"] else ""),
             f"workload {i['workload']}: {i['num_requests']} requests, rate {i['rate']}/s, concurrency "
             f"{i['concurrency'] or 'unbounded'}, seed {i['seed']}; medians of {i['repeat']} interleaved round(s), "
             "each server started fresh (cold prefix cache)",
             f"command: {i['command']}", ""]
    width = max(14, *(len(s) + 2 for s in servers))
    lines.append(f"{'figure':<28}" + "".join(f"{s:>{width}}" for s in servers))
    for key, label, _ in FIGURES:
        digits = 2 if key == "request_throughput" else 0 if key.endswith("_mb") else 1
        lines.append(f"{label:<28}" + "".join(f"{_fmt(f[s][key], digits):>{width}}" for s in servers))
    lines.append(f"{'failed requests':<28}" + "".join(f"{f[s]['failed']:>{width}}" for s in servers))
    lines.append(f"{'prompt tokens from a cache':<28}" + "".join(f"{f[s]['cached_prompt_tokens']:>{width}}"
                                                                    for s in servers))
    if r["ratios"]:
        peer = servers[-1]
        lines += ["", f"ours / {peer} (medians of paired ratios; requests/s wants >= 1, the rest <= 1):"]
        for name, ratio in r["ratios"].items():
            cells = ", ".join(f"{label.split(',')[0]} {ratio[key]:.2f}x" for key, label, _ in FIGURES if key in ratio)
            lines.append(f"  {name}: {cells}")
    elif len(servers) > 1:
        lines += ["", "the TTFT/TPOT trade of our concurrency (max-num-seqs): more sequences per step start "
                      "requests sooner and make each step, so each token, slower"]
    loads = r["machine"]["loadavg_1min"]
    lines.append(f"machine: {r['machine']['cpu']}, load average {min(loads):.1f}-{max(loads):.1f} during the runs")
    return "\n".join(lines)
