"""`bench spec --serving`: speculation under load. A serving workload (default `mixed`: short and
long answers, Poisson arrivals) at --concurrency requests in flight, through our server started
here twice per round, without speculation and with n-gram speculation (the bench's
--draft-max and lookup sizes), in an order reversed every other round. Each server is started
fresh (a cold prefix cache) on the same model and threads. Figures per server: output tokens/s
and requests/s (medians of the rounds), and on / off as the median of the rounds' paired ratios.

This is where the draft-length rule and the batch-size switch (docs/speculative-decoding.md) must
keep speculation from costing: most steps decode many requests at once, where a drafted row is
no longer nearly free.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from scratchllm.bench import loadgen
from scratchllm.bench.common import median
from scratchllm.bench.serving_peer import Server, _get

SIDES = ("off", "ngram")


def server_cmd(model: str, threads: int, in_flight: int, spec: dict[str, Any] | None) -> list[str]:
    cmd = [sys.executable, "-m", "scratchllm.cli.main", "serve", "--port", "0", "--embedding-model", "none",
           "--max-in-flight", str(in_flight), "--threads", str(threads), "--model", model]
    return cmd + (["--speculative-config", json.dumps(spec)] if spec is not None else [])


def measure(model: str, threads: int, workload_name: str, concurrency: int, rounds: int,
            spec: dict[str, Any]) -> dict[str, Any]:
    workload = loadgen.load_workload(workload_name)
    out: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    loads: list[float] = []
    for r in range(rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            cmd = server_cmd(model, threads, len(workload.prompts) + 8, spec if side == "ngram" else None)
            with Server(f"ours {side}", cmd) as server:
                assert server.url is not None
                name = _get(server.url + "/v1/models").json()["data"][0]["id"]
                raw = asyncio.run(loadgen.run_load(server.url, name, workload, concurrency, 1800.0))
                s = loadgen.summarize(raw, {"ttft_ms": None, "tpot_ms": None, "e2e_ms": None})
            out[side].append({"output_tok_s": float(s["output_token_throughput"]),
                              "requests_s": float(s["request_throughput"]), "failed": int(s["failed"]),
                              "peak_rss_mb": server.peak_rss_mb})
            loads.append(os.getloadavg()[0])
    figures = {side: {k: median([x[k] for x in runs]) for k in ("output_tok_s", "requests_s", "peak_rss_mb")}
               | {"failed": sum(x["failed"] for x in runs)} for side, runs in out.items()}
    ratio = median([on["output_tok_s"] / off["output_tok_s"] for on, off in zip(out["ngram"], out["off"],
                                                                                strict=True)])
    return {"workload": workload_name, "num_requests": len(workload.prompts), "concurrency": concurrency,
            "figures": figures, "on_over_off": ratio, "rounds": out, "loadavg_1min": loads}


def render(s: dict[str, Any]) -> list[str]:
    f = s["figures"]
    lines = ["", f"serving: workload {s['workload']} ({s['num_requests']} requests), {s['concurrency']} in flight, "
                 "our server without and with n-gram speculation:",
             f"{'server':<16}{'output tok/s':>14}{'requests/s':>12}{'peak RSS, MB':>14}{'failed':>8}"]
    for side in SIDES:
        x = f[side]
        lines.append(f"{side:<16}{x['output_tok_s']:>14.1f}{x['requests_s']:>12.2f}{x['peak_rss_mb']:>14.0f}"
                     f"{x['failed']:>8}")
    lines.append(f"with / without speculation, output tokens/s: {s['on_over_off']:.2f}x (median of paired rounds)")
    return lines
