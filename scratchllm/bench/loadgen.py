"""Drive a server with a seeded workload: arrivals, requests, per-token timestamps, percentiles.

A workload file (JSON) gives distributions of prompt and output lengths in tokens; prompts are
random token ids from a range (so the client needs no tokenizer and the lengths are exact) and
requests set `ignore_eos` (so each produces exactly its output length: static and continuous
batching then do the same work). Arrivals are a gamma process at `rate` requests/s: shape 1 is
Poisson, shape < 1 burstier; `rate=inf` sends everything at once. `concurrency` caps requests
in flight (a closed loop when the rate is infinite).
"""

import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypedDict

import httpx
import numpy as np
import numpy.typing as npt

from scratchllm.bench import http_client
from scratchllm.errors import ConfigError

WORKLOAD_DIR = Path(__file__).resolve().parent / "workloads"


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]  # token ids, one list per request
    output_tokens: list[int]
    rate: float  # requests/s; inf = all at t=0
    burstiness: float  # gamma shape; 1.0 = Poisson
    seed: int


def load_workload(ref: str, num_requests: int | None = None, rate: float | None = None,
                  burstiness: float | None = None, seed: int | None = None) -> Workload:
    """A workload file (or the name of a shipped one), sampled with its seed into concrete requests."""
    path = Path(ref) if Path(ref).exists() else WORKLOAD_DIR / f"{ref}.json"
    if not path.exists():
        shipped = ", ".join(sorted(p.stem for p in WORKLOAD_DIR.glob("*.json")))
        raise ConfigError(f"no workload '{ref}': give a JSON file or one of: {shipped}")
    try:
        spec = json.loads(path.read_text())
        seed = spec.get("seed", 0) if seed is None else seed
        n = num_requests or spec["num_requests"]
        rng = np.random.default_rng(seed)
        prompt_lens = _sample(spec["prompt_tokens"], n, rng)
        output_lens = _sample(spec["output_tokens"], n, rng)
        low, high = spec.get("token_id_range", [300, 20000])
        prompts = [rng.integers(low, high, size=k).tolist() for k in prompt_lens]
        rate = float(spec.get("rate", math.inf)) if rate is None else rate
        burst = float(spec.get("burstiness", 1.0)) if burstiness is None else burstiness
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"workload {path}: {err!r}") from None
    if n < 1 or rate <= 0 or burst <= 0:
        raise ConfigError("workload needs num_requests >= 1, rate > 0 and burstiness > 0")
    return Workload(spec.get("name", path.stem), prompts, [int(k) for k in output_lens], rate, burst, seed)


def _sample(dist: dict[str, Any], n: int, rng: np.random.Generator) -> npt.NDArray[np.int_]:  # -> [n] ints >= 1
    kind = dist["distribution"]
    x: npt.NDArray[Any]
    if kind == "fixed":
        x = np.full(n, dist["value"])
    elif kind == "uniform":
        x = rng.integers(dist["low"], dist["high"] + 1, size=n)
    elif kind == "normal":
        x = np.clip(np.rint(rng.normal(dist["mean"], dist["std"], size=n)), dist["low"], dist["high"])
    elif kind == "choice":
        p = np.asarray(dist.get("weights", [1] * len(dist["values"])), dtype=float)
        x = rng.choice(dist["values"], size=n, p=p / p.sum())
    else:
        raise ValueError(f"unknown distribution {kind!r} (fixed, uniform, normal, choice)")
    lengths: npt.NDArray[np.int_] = np.maximum(x.astype(int), 1)
    return lengths


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> npt.NDArray[np.float64]:  # -> [n] s from start
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed + 1).gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request starts the clock
    return np.cumsum(gaps)


@dataclass
class Result:
    prompt_tokens: int
    output_tokens: int = 0
    status: int = 0
    error: str = ""
    start: float = 0.0
    ttft: float | None = None  # seconds
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens the server says it took from its prefix cache (usage)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if not self.ok or self.output_tokens < 2:
            return None
        assert self.e2e is not None and self.ttft is not None  # an ok result has both
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


class Progress(Protocol):
    """What run_load reports each finished request to (a tqdm bar)."""

    def update(self, n: int = 1) -> object: ...


class LoadRun(TypedDict):
    """What run_load returns: the raw run, summarized by `summarize` and drawn by bench.plots."""

    results: list[Result]  # one per request of the workload, in its order
    duration_s: float  # from the first arrival to the last reply
    probe_ms: list[float]  # /health latency, sampled through the run
    kv_samples: list[float]  # KV blocks in use, sampled through the run
    metrics: dict[str, float]  # the server's /metrics at the end ({} when it has none)
    metrics_note: str | None  # why there are no metrics (a missing or non-Prometheus /metrics), or None


async def run_load(url: str, model: str, workload: Workload, concurrency: int | None = None,
                   max_duration_s: float = 600.0, progress: Progress | None = None, probe_interval_s: float = 0.1,
                   headers: dict[str, str] | None = None) -> LoadRun:
    """Send the workload; return results, wall time, /metrics KV peak and /health probe latencies.
    `headers` go with every request (e.g. Authorization for a server with an API key)."""
    async with http_client.new_client(max_duration_s + 60, headers) as client:
        return await _run_load(client, url, model, workload, concurrency, max_duration_s, progress,
                               probe_interval_s)


async def _run_load(client: httpx.AsyncClient, url: str, model: str, workload: Workload, concurrency: int | None,
                    max_duration_s: float, progress: Progress | None, probe_interval_s: float) -> LoadRun:
    times = arrival_times(len(workload.prompts), workload.rate, workload.burstiness, workload.seed)
    gate = asyncio.Semaphore(concurrency or len(workload.prompts))
    results = [Result(len(p)) for p in workload.prompts]
    start = time.monotonic()
    deadline = start + max_duration_s

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, start + times[i] - time.monotonic()))
        async with gate:
            if time.monotonic() > deadline:
                results[i].error = "not sent: --max-duration reached"
                return
            body = {"model": model, "prompt": workload.prompts[i], "max_tokens": workload.output_tokens[i],
                    "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            await _send(client, url, body, results[i], deadline)
        if progress is not None:
            progress.update(1)

    watcher = Watcher(client, url, probe_interval_s)
    watching = asyncio.ensure_future(watcher.run())
    await asyncio.gather(*(one(i) for i in range(len(results))))
    duration = time.monotonic() - start
    watching.cancel()
    await asyncio.gather(watching, return_exceptions=True)
    final, note = await http_client.scrape_metrics_noted(client, url)
    return {"results": results, "duration_s": duration, "probe_ms": watcher.probe_ms,
            "kv_samples": watcher.kv_blocks, "metrics": final, "metrics_note": note}


async def _send(client: httpx.AsyncClient, url: str, body: dict[str, Any], r: Result, deadline: float) -> None:
    r.start = time.monotonic()
    try:
        reply = await http_client.request(client, url + "/v1/completions", "POST", body,
                                          timeout=max(1.0, deadline - r.start))
    except (httpx.HTTPError, OSError, ValueError) as err:
        r.error = f"{type(err).__name__}: {err}"
        return
    r.status = reply.status
    if reply.status != 200:
        r.error = reply.body.decode(errors="replace")[:200]
        return
    token_times = [t for t, e in reply.events if e.get("choices") and e["choices"][0].get("text")]
    usage = [e["usage"] for _, e in reply.events if e.get("usage")]
    if not reply.done or not usage or not token_times:
        r.error = "stream ended early"
        return
    r.output_tokens = usage[-1]["completion_tokens"]
    r.cached_tokens = int((usage[-1].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    r.ttft = token_times[0] - r.start
    r.e2e = reply.events[-1][0] - r.start
    r.itl = np.diff(token_times).tolist()


class Watcher:
    """Until cancelled: /health latency (is the HTTP side starved?) and KV blocks in use."""

    def __init__(self, client: httpx.AsyncClient, url: str, interval_s: float):
        self.client, self.url, self.interval_s = client, url, interval_s
        self.probe_ms: list[float] = []
        self.kv_blocks: list[float] = []
        self.metrics_note: str | None = None  # once /metrics has none to give, it is not asked again

    async def run(self) -> None:
        while True:
            t = time.monotonic()
            try:
                await http_client.request(self.client, self.url + "/health", timeout=30)
                self.probe_ms.append((time.monotonic() - t) * 1e3)
                if self.metrics_note is None:
                    m, self.metrics_note = await http_client.scrape_metrics_noted(self.client, self.url)
                    used = http_client.metric(m, "kv_blocks_used")
                    if used is not None:
                        self.kv_blocks.append(used)
            except (httpx.HTTPError, OSError):
                pass
            await asyncio.sleep(self.interval_s)


def percentiles(values: Sequence[float], ms: bool = True) -> dict[str, float | None]:
    """mean/p50/p90/p99 (in ms when the values are seconds); None when there is nothing to summarize."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    x = np.asarray(values, dtype=float) * (1e3 if ms else 1.0)
    return {"mean": float(x.mean()), **{f"p{q}": float(np.percentile(x, q)) for q in (50, 90, 99)}}


def summarize(run: LoadRun, slo: dict[str, float | None]) -> dict[str, Any]:
    """Throughput, latency percentiles and goodput (requests/s meeting every SLO given, in ms)."""
    results, duration = run["results"], run["duration_s"]
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)

    def meets(r: Result) -> bool:
        checks = {"ttft_ms": r.ttft, "tpot_ms": r.tpot, "e2e_ms": r.e2e}
        return all((x := checks[k]) is not None and x * 1e3 <= v for k, v in slo.items() if v is not None) \
            if any(v is not None for v in slo.values()) else True

    m = run["metrics"]
    peak = http_client.metric(m, "kv_blocks_peak") or 0
    block_bytes = (http_client.metric(m, "kv_cache_peak_bytes") or 0) / peak if peak else None
    peak_blocks = max([peak, *run["kv_samples"]])
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = str(r.status) if r.status else r.error.split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    first_error = next((r.error for r in results if not r.ok), None)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "errors": errors, "first_error": first_error,
        "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "output_tokens": out_tokens, "goodput": sum(meets(r) for r in ok) / duration, "slo": slo,
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": percentiles([r.tpot for r in ok if r.tpot]),
        "itl_ms": percentiles([g for r in ok for g in r.itl]),
        "e2e_ms": percentiles([r.e2e for r in ok if r.e2e is not None]),
        "health_probe_ms": percentiles(run["probe_ms"], ms=False),
        "peak_kv_blocks": peak_blocks, "peak_kv_bytes": peak_blocks * block_bytes if block_bytes else None,
        "kv_bytes_per_token": http_client.metric(m, "kv_cache_bytes_per_token"),
        "metrics_note": run.get("metrics_note"),
        # prompt tokens the server took from its prefix cache: > 0 on random prompts means it has
        # seen them before (a repeated seed): a warm cache, not a cold run
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
    }
