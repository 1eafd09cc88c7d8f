"""HTTP load test of a running server (`--url`), or static vs continuous batching (`--compare`).

Requests follow a seeded workload file (scratchllm/bench/workloads/*.json, or your own): prompt
and output lengths in tokens, arrivals Poisson/gamma at --rate, or all at once with a
--concurrency cap. Reports request/s, output tokens/s, TTFT, TPOT, ITL and end-to-end latency
(mean/p50/p90/p99), goodput under an SLO, peak KV blocks from /metrics, and the latency of
/health probes sent during the run (is the HTTP side starved by the engine?).

`--compare` starts `scratchllm serve` twice on the same model, `--batching static` then
`--batching continuous`, runs the same workload on each and prints the design article's figures
beside ours (docs/references.md).

`--peer llama-server` starts llama.cpp's server (built by `make peers`) on the same GGUF file,
threads and slot count (the first --max-num-seqs) beside ours at each --max-num-seqs, in
alternating rounds, and prints ours / llama-server for every figure; several --max-num-seqs
without a peer print the TTFT/TPOT trade of our concurrency (scratchllm/bench/serving_peer.py).

Against --url (any OpenAI-compatible server), each run draws fresh prompts (a new seed, printed)
unless --seed repeats a run's; the report says how many prompt tokens the server's prefix cache
served, so a warm cache is never mistaken for a cold run. A missing or non-Prometheus /metrics is
reported, never fatal. Everything stays on loopback and is bounded by --num-requests and
--max-duration.
"""

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Iterable
from typing import Any

import httpx

from scratchllm.bench import http_client, loadgen, serving_peer
from scratchllm.bench.common import add_kv_cache_dtype_argument, machine_facts
from scratchllm.bench.references import ARTICLE_SERVING
from scratchllm.errors import ConfigError

GOALS = {"qps_ratio": 2.0, "p99_ratio": 3.0, "kv_memory_less": 0.50}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000 (not with --compare)")
    p.add_argument("--workload", default="mixed", help="a workload JSON file, or a shipped one: mixed, short, "
                   "long-prompt")
    p.add_argument("--num-requests", type=int, default=None, help="default: the workload's")
    p.add_argument("--rate", type=float, default=None, help="requests/s (inf = all at once); default: the workload's")
    p.add_argument("--burstiness", type=float, default=None, help="gamma shape of the gaps; 1 = Poisson")
    p.add_argument("--concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--seed", type=int, default=None,
                   help="the prompts' seed (default: the workload's when servers are started here; a fresh one "
                        "against --url, so that a repeated run does not replay prompts the server has cached)")
    p.add_argument("--model", default=None, help="model id to request (default: the server's first)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (a server that needs one)")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw latency CDFs, output tokens/s over time and KV use over time (static vs continuous "
                        "with --compare) into a PNG")
    p.add_argument("--max-duration", type=float, default=600.0, help="stop sending after this many seconds")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO: time to first token")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO: time per output token")
    p.add_argument("--slo-e2e-ms", type=float, default=None, help="goodput SLO: end-to-end latency")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--compare", action="store_true", help="start the server twice: static vs continuous batching")
    p.add_argument("--serve-model", default="default", help="--compare: the model to serve")
    p.add_argument("--max-num-seqs", default="16",
                   help="servers started here: sequences per step (static: the batch size; llama-server: its "
                        "slots, the first value); several, comma-separated (16,32,64), run ours at each; 'default' "
                        "is our server's own")
    p.add_argument("--peer", choices=serving_peer.PEERS, default=None,
                   help="also start this server on the same GGUF file, threads and slots, in alternating rounds")
    p.add_argument("--threads", type=int, default=2, help="--peer / several --max-num-seqs: each server's threads")
    add_kv_cache_dtype_argument(p)
    p.add_argument("--target-tpot-ms", type=float, default=None,
                   help="--peer / several --max-num-seqs: our servers' time-per-output-token target")
    p.add_argument("--fake-engine", action="store_true",
                   help="--compare / several --max-num-seqs: serve the fake engine (no model)")
    p.add_argument("--fake-step-ms", type=float, default=5.0, help="--compare --fake-engine: ms per decode step")
    p.add_argument("--repeat", type=int, default=1,
                   help="servers started here: interleaved trials of each; --compare's figures are the median "
                        "trial's, --peer's medians of each figure")
    p.add_argument("--overhead", action="store_true",
                   help="--compare: also run the workload offline (LLMEngine in this process, all requests at "
                   "t=0) and report HTTP output tok/s at saturation as a share of it")


def run(args: argparse.Namespace) -> dict[str, Any]:
    fresh_seed = args.url and args.seed is None
    seed = int(time.time_ns() % 1_000_000_007) if fresh_seed else args.seed
    workload = loadgen.load_workload(args.workload, args.num_requests, args.rate, args.burstiness, seed)
    slo: dict[str, float | None] = {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "e2e_ms": args.slo_e2e_ms}
    inputs = {"workload": workload.name, "num_requests": len(workload.prompts), "rate": workload.rate,
              "burstiness": workload.burstiness, "concurrency": args.concurrency, "seed": workload.seed,
              "mean_prompt_tokens": sum(map(len, workload.prompts)) / len(workload.prompts),
              "mean_output_tokens": sum(workload.output_tokens) / len(workload.output_tokens),
              "fresh_seed": bool(fresh_seed)}
    if args.peer or len(serving_peer.max_num_seqs_list(args.max_num_seqs)) > 1:
        if args.url or args.compare:
            raise ConfigError("--peer and several --max-num-seqs start their own servers: not with --url or --compare")
        return serving_peer.run(args, workload, slo, inputs)
    if not args.compare:
        if not args.url:
            raise ConfigError("give --url of a running server, --compare or --peer to start them")
        figures = _measure(args.url, args, workload, slo)
        _plot(args, {"run": figures.pop("raw")})
        return {"inputs": {**inputs, "url": args.url}, "figures": figures, "ratios": {},
                "machine": machine_facts()}
    args.max_num_seqs = serving_peer.max_num_seqs_list(args.max_num_seqs)[0]
    if args.max_num_seqs is None:
        raise ConfigError("--compare runs both modes at one --max-num-seqs: a number")
    trials: dict[str, list[dict[str, Any]]] = {"static": [], "continuous": [], "offline": []}
    for _ in range(args.repeat):
        # Interleaved, so load that drifts on a shared machine hits every mode alike.
        for mode in ("static", "continuous"):
            with serving_peer.Server(mode, _compare_cmd(args, mode, len(workload.prompts)), timeout_s=120) as server:
                assert server.url is not None  # read from the server's first line
                trials[mode].append(_measure(server.url, args, workload, slo))
        if args.overhead and not args.fake_engine:
            trials["offline"].append(_offline(args, workload))
    runs = {mode: _median_run(t) for mode, t in trials.items() if t}
    _plot(args, {mode: runs[mode]["raw"] for mode in ("static", "continuous")})
    for t in [*runs.values(), *trials["static"], *trials["continuous"]]:
        t.pop("raw", None)  # the load generator's per-request results: plotted, not printed
    # Ratios are paired: trial k of each mode ran back to back, so they saw the same machine load;
    # the reported ratio is the median over trials of those paired ratios.
    offline: list[dict[str, Any] | None] = [*trials["offline"]] or [None] * args.repeat
    per_trial = [_ratios(st, ct, off) for st, ct, off in
                 zip(trials["static"], trials["continuous"], offline, strict=True)]
    ratios: dict[str, Any] = {k: _median([t[k] for t in per_trial]) for k in per_trial[0]}
    ratios["per_trial"] = per_trial
    model = "fake engine" if args.fake_engine else args.serve_model
    return {"inputs": {**inputs, "model": model, "max_num_seqs": args.max_num_seqs, "repeat": args.repeat},
            "figures": runs,
            "ratios": ratios, "published": ARTICLE_SERVING, "goals": GOALS, "machine": machine_facts()}


def _offline(args: argparse.Namespace, workload: loadgen.Workload) -> dict[str, Any]:
    """The same requests straight into LLMEngine.step(), no HTTP: the ceiling serving is measured against."""
    from scratchllm.engine.engine import LLMEngine
    from scratchllm.sampling import SamplingParams

    options = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
    engine = LLMEngine.from_pretrained(args.serve_model, tokenizer=True, **options)
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_tokens, strict=True)):
        engine.add_request(f"offline-{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    start, tokens = time.monotonic(), 0
    while engine.has_work():
        tokens += sum(o.token_id is not None for o in engine.step())
    duration = time.monotonic() - start
    return {"duration_s": duration, "output_tokens": tokens, "output_token_throughput": tokens / duration,
            "request_throughput": len(workload.prompts) / duration}


def _ratios(s: dict[str, Any], c: dict[str, Any], offline: dict[str, Any] | None) -> dict[str, float | None]:
    r = {"qps_ratio": _div(c["request_throughput"], s["request_throughput"]),
         "p99_ratio": _div(s["e2e_ms"]["p99"], c["e2e_ms"]["p99"]),
         "ttft_p99_ratio": _div(s["ttft_ms"]["p99"], c["ttft_ms"]["p99"]),
         "output_tps_ratio": _div(c["output_token_throughput"], s["output_token_throughput"]),
         "kv_memory_less": 1 - c["peak_kv_blocks"] / s["peak_kv_blocks"] if s["peak_kv_blocks"] else None}
    if offline is not None:
        r["http_vs_offline_output_tps"] = _div(c["output_token_throughput"], offline["output_token_throughput"])
    return r


def _median(values: Iterable[float | None]) -> float | None:
    known = sorted(v for v in values if v is not None)
    return known[(len(known) - 1) // 2] if known else None


def _median_run(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """The trial with the median request/s (a whole, coherent run), plus every trial's request/s."""
    ordered = sorted(trials, key=lambda t: t["request_throughput"])
    return {**ordered[(len(ordered) - 1) // 2], "trials_request_throughput": [t["request_throughput"] for t in trials]}


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _measure(url: str, args: argparse.Namespace, workload: loadgen.Workload,
             slo: dict[str, float | None]) -> dict[str, Any]:
    from tqdm import tqdm

    model = args.model or _first_model(url, args)
    with tqdm(total=len(workload.prompts), disable=args.no_progress, desc="requests", file=sys.stderr) as bar:
        raw = asyncio.run(loadgen.run_load(url, model, workload, args.concurrency, args.max_duration, bar,
                                           headers=_headers(args)))
    return {**loadgen.summarize(raw, slo), "raw": raw}


def _plot(args: argparse.Namespace, raw_runs: dict[str, loadgen.LoadRun]) -> None:
    """--plot FILE.png: latency CDFs, tokens/s and KV blocks over time of each run, side by side."""
    if not getattr(args, "plot", None):
        return
    from scratchllm.bench.plots import plot_runs, series_from_loadgen

    plot_runs([series_from_loadgen(label, raw) for label, raw in raw_runs.items()], args.plot,
              title=f"bench serving: {args.workload}")


def _headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if getattr(args, "api_key", None) else {}


def _get(url: str, headers: dict[str, str], timeout: float) -> http_client.Reply:
    async def get() -> http_client.Reply:
        async with http_client.new_client(timeout, headers) as client:
            return await http_client.request(client, url)

    return asyncio.run(get())


def _first_model(url: str, args: argparse.Namespace) -> str:
    try:
        reply = _get(url + "/v1/models", _headers(args), 30)
        model: str = reply.json()["data"][0]["id"]
        return model
    except (httpx.HTTPError, OSError, ValueError, KeyError, IndexError) as err:
        raise ConfigError(f"no OpenAI-compatible server at {url}: {err}") from None


def _compare_cmd(args: argparse.Namespace, batching: str, num_requests: int) -> list[str]:
    """`scratchllm serve` for --compare: one batching mode on a free loopback port (started and
    stopped, SIGTERM first, by serving_peer.Server)."""
    cmd = [sys.executable, "-m", "scratchllm.cli.main", "serve", "--port", "0", "--batching", batching,
           "--embedding-model", "none", "--max-in-flight", str(num_requests + 8)]
    cmd += ["--fake-engine", "--fake-step-ms", str(args.fake_step_ms)] if args.fake_engine \
        else ["--model", args.serve_model]
    return cmd + ["--max-num-seqs", str(args.max_num_seqs)]


def _fmt(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def _latency_rows(f: dict[str, Any]) -> list[str]:
    rows: list[str] = []
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "end-to-end"),
                      ("health_probe_ms", "/health probe")):
        d = f[key]
        rows.append(f"  {name:<14} mean {_fmt(d['mean']):>9}  p50 {_fmt(d['p50']):>9}  p90 {_fmt(d['p90']):>9}  "
                    f"p99 {_fmt(d['p99']):>9}  ms")
    return rows


def _summary(f: dict[str, Any]) -> list[str]:
    lines = [f"  completed {f['completed']}, failed {f['failed']} {f['errors'] or ''}in {_fmt(f['duration_s'], 2)} s",
             f"  request/s {_fmt(f['request_throughput'], 2)}   output tok/s {_fmt(f['output_token_throughput'])}   "
             f"total tok/s {_fmt(f['total_token_throughput'])}   goodput {_fmt(f['goodput'], 2)} req/s",
             f"  peak KV blocks {_fmt(f['peak_kv_blocks'], 0)}"
             + (f" ({_fmt(f['peak_kv_bytes'] / 2**20)} MiB)" if f["peak_kv_bytes"] else "")
             + (f", {f['kv_bytes_per_token'] / 1024:.1f} KiB per token" if f.get("kv_bytes_per_token") else "")]
    if f.get("metrics_note"):
        lines.append(f"  no server metrics: {f['metrics_note']}")
    cached, prompts = f.get("cached_prompt_tokens", 0), f.get("prompt_tokens", 0)
    lines.append(f"  prompt tokens from the server's prefix cache: {cached} of {prompts}"
                 + (" - a warm cache: these prompts (this seed) ran against it before" if cached > prompts // 10
                    else ""))
    return lines + _latency_rows(f)


def render(result: dict[str, Any]) -> str:
    i = result["inputs"]
    head = (f"workload {i['workload']}: {i['num_requests']} requests, rate {i['rate']}/s "
            f"(gamma shape {i['burstiness']}), concurrency {i['concurrency'] or 'unbounded'}, seed {i['seed']}, "
            f"mean prompt {_fmt(i['mean_prompt_tokens'])} / output {_fmt(i['mean_output_tokens'])} tokens")
    if "servers" in result:
        return serving_peer.render(result)
    if "published" not in result:
        seed = (" (a fresh seed: pass --seed to repeat these prompts; against the same server they then meet a "
                "warm prefix cache)" if i.get("fresh_seed") else "")
        return "\n".join([f"serving benchmark against {i['url']}", head + seed, *_summary(result["figures"])])
    s, c, r = result["figures"]["static"], result["figures"]["continuous"], result["ratios"]
    pub = result["published"]
    kv_less = r["kv_memory_less"]
    table = [
        "| figure | static (ours) | continuous (ours) | ours: continuous vs static | published: static "
        "| published: continuous | published ratio | goal |",
        "|---|---|---|---|---|---|---|---|",
        f"| QPS (completed requests/s) | {_fmt(s['request_throughput'], 2)} | {_fmt(c['request_throughput'], 2)} | "
        f"{_fmt(r['qps_ratio'], 2)}x | {pub['static']['qps']:.0f} | {pub['continuous']['qps']:.0f} | "
        f"{pub['continuous']['qps'] / pub['static']['qps']:.2f}x | >= {GOALS['qps_ratio']:.0f}x |",
        f"| p99 latency, ms | {_fmt(s['e2e_ms']['p99'])} | {_fmt(c['e2e_ms']['p99'])} | "
        f"{_fmt(r['p99_ratio'], 2)}x lower | {pub['static']['p99_ms']:.0f} | {pub['continuous']['p99_ms']:.0f} | "
        f"{pub['static']['p99_ms'] / pub['continuous']['p99_ms']:.2f}x lower | >= {GOALS['p99_ratio']:.0f}x lower |",
        f"| p99 time to first token, ms | {_fmt(s['ttft_ms']['p99'])} | {_fmt(c['ttft_ms']['p99'])} | "
        f"{_fmt(_div(s['ttft_ms']['p99'], c['ttft_ms']['p99']), 2)}x lower | - | - | - | - |",
        f"| peak KV memory, blocks | {_fmt(s['peak_kv_blocks'], 0)} | {_fmt(c['peak_kv_blocks'], 0)} | "
        f"{'-' if kv_less is None else f'{kv_less:.0%} less'} | - | - | {pub['kv_memory_less']:.0%} less | "
        f">= {GOALS['kv_memory_less']:.0%} less |",
        f"| output tok/s | {_fmt(s['output_token_throughput'])} | {_fmt(c['output_token_throughput'])} | "
        f"{_fmt(r['output_tps_ratio'], 2)}x | - | - | - | - |",
    ]
    trials = ", ".join(f"{m} {[round(q, 3) for q in result['figures'][m]['trials_request_throughput']]}"
                       for m in ("static", "continuous", "offline") if m in result["figures"])
    paired = ", ".join(f"{t['qps_ratio']:.2f}x" for t in r.get("per_trial", []) if t["qps_ratio"])
    lines = [f"static vs continuous batching, model {i['model']}, {i.get('repeat', 1)} interleaved trial(s): "
             f"absolute figures from each mode's median trial, ratios are medians of per-trial paired ratios",
             f"request/s per trial: {trials}; paired QPS ratios: {paired}", head, "", *table, "",
             "static:", *_summary(s), "continuous:", *_summary(c)]
    if "offline" in result["figures"]:
        o = result["figures"]["offline"]
        lines += [f"serving overhead: HTTP (continuous) {_fmt(c['output_token_throughput'])} output tok/s vs offline "
                  f"engine {_fmt(o['output_token_throughput'])} tok/s on the same workload; paired median "
                  f"{r['http_vs_offline_output_tps']:.0%} (goal >= 90%)"]
    return "\n".join(lines)


if __name__ == "__main__":  # handy while developing: python -m scratchllm.bench.serving --url ...
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args()
    out = run(ns)
    print(json.dumps(out, default=str) if ns.json else render(out))
