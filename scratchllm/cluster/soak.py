"""A bounded soak of the cluster under faults: `python -m scratchllm.cluster.soak --seconds 120`
(`make soak`), or `run_soak(url, ...)` against a running ingress (the test's short version).

Clients in a closed loop, more of them than the ingress admits (so bursts meet 429), each
request one of: a stream read to its end, an unstreamed request, a stream the client drops after
a few chunks (a disconnect: the engine must free its blocks), or an unstreamed request the
client gives up on (an abort). Every few seconds a burst of extra requests at once; halfway
through, one replica is killed. Afterwards:
  - every request was answered: completed, refused with 429/503, or (on the killed replica, once
    streaming) ended by an SSE error event; nothing hung (each has a deadline) and nothing else;
  - 0 KV blocks in use in every replica once traffic stops (from the replicas' own reports);
  - replica RSS growth, start to end, for the replicas that lived through the soak.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import time
from collections import Counter
from typing import Any

import httpx

logger = logging.getLogger(__name__)
RSS_GROWTH_BOUND = 64 << 20  # bytes a surviving replica may grow by over a soak


def _body(rng: random.Random, stream: bool, model: str = "fake") -> dict[str, Any]:
    system = f"Soak system prompt {rng.randrange(6)}. " * 6
    return {"model": model, "messages": [{"role": "system", "content": system},
                                          {"role": "user", "content": f"q{rng.randrange(10**6)}"}],
            "max_tokens": rng.randint(4, 48), "stream": stream}


async def _one(client: httpx.AsyncClient, rng: random.Random, counts: Counter[str], model: str = "fake") -> None:
    """One request of the mix (`model`: the id the server serves), its outcome counted in `counts`."""
    kind = rng.choices(["stream", "plain", "disconnect", "abort"], weights=[5, 2, 2, 1])[0]
    counts["requests"] += 1
    try:
        if kind in ("stream", "disconnect"):
            async with client.stream("POST", "/v1/chat/completions", json=_body(rng, True, model)) as r:
                if r.status_code != 200:
                    counts[f"http_{r.status_code}"] += 1
                    return
                seen, cut = 0, rng.randint(1, 4)
                async for line in r.aiter_lines():
                    if line.startswith('data: {"error"'):
                        counts["stream_error_event"] += 1
                        return
                    if line.startswith("data: "):
                        seen += 1
                        if kind == "disconnect" and seen >= cut:
                            counts["disconnected"] += 1
                            return  # leaving the block closes the connection mid-stream
                    if line == "data: [DONE]":
                        counts["completed"] += 1
                        return
                counts["stream_cut_by_server"] += 1
        else:
            timeout = 0.05 if kind == "abort" else 60.0
            try:
                r = await client.post("/v1/chat/completions", json=_body(rng, False, model), timeout=timeout)
            except httpx.TimeoutException:
                if kind == "abort":
                    counts["aborted_by_client"] += 1
                    return
                raise
            counts["completed" if r.status_code == 200 else f"http_{r.status_code}"] += 1
    except httpx.TimeoutException:
        counts["hung"] += 1
    except httpx.HTTPError as err:
        counts[f"transport_{type(err).__name__}"] += 1


async def _stats(client: httpx.AsyncClient) -> dict[str, Any]:
    stats: dict[str, Any] = (await client.get("/cluster/stats", timeout=30)).json()
    return stats


async def _replicas(client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    stats = await _stats(client)
    return {rid: r for view in stats["routers"] for rid, r in view["replicas"].items()}


async def soak(url: str, seconds: float, clients: int, seed: int, kill: Any) -> dict[str, Any]:
    rng, counts = random.Random(seed), Counter[str]()
    limits = httpx.Limits(max_connections=clients * 3, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        await client.post("/v1/chat/completions", json=_body(rng, False))  # every replica has reported by now
        await asyncio.sleep(1.0)
        rss_start = {rid: r.get("rss_bytes", 0) for rid, r in (await _replicas(client)).items()}
        end, next_burst, killed = time.monotonic() + seconds, time.monotonic() + 3, None

        async def loop(i: int) -> None:
            local = random.Random(seed * 1000 + i)
            while time.monotonic() < end:
                await _one(client, local, counts)

        workers = [asyncio.create_task(loop(i)) for i in range(clients)]
        bursts: list[asyncio.Task[None]] = []
        while time.monotonic() < end:
            await asyncio.sleep(0.2)
            if killed is None and time.monotonic() > end - seconds / 2:
                killed = await asyncio.to_thread(kill)
                counts["replica_kills"] += 1
            if time.monotonic() > next_burst:
                next_burst += 4
                counts["bursts"] += 1
                bursts += [asyncio.create_task(_one(client, random.Random(rng.random()), counts)) for _ in range(30)]
        await asyncio.gather(*workers, *bursts)
        # quiescence: the replicas' next reports say what they hold with nothing in flight
        deadline, replicas = time.monotonic() + 30, {}
        while time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            replicas = await _replicas(client)
            if len(replicas) >= 2 and all(r.get("kv_blocks_used") == 0 for r in replicas.values()):
                break
        stats = await _stats(client)
    answered = sum(counts[k] for k in counts if k in ("completed", "disconnected", "aborted_by_client",
                                                     "stream_error_event") or k.startswith("http_"))
    growth = {rid: r.get("rss_bytes", 0) - rss_start[rid] for rid, r in replicas.items() if rid in rss_start}
    return {"seconds": seconds, "clients": clients, "counts": dict(counts), "answered": answered,
            "killed_replica": killed, "leaked_blocks": {rid: r.get("kv_blocks_used") for rid, r in replicas.items()},
            "rss_growth_bytes": growth, "rss_growth_bound_bytes": RSS_GROWTH_BOUND,
            "cluster_requests": stats["requests"]}


def check(result: dict[str, Any]) -> list[str]:
    """What the soak promises, as a list of broken promises (empty: all kept)."""
    c, problems = result["counts"], []
    if result["answered"] != c["requests"]:
        problems.append(f"{c['requests'] - result['answered']} requests neither answered nor refused: {c}")
    unexpected = {k: v for k, v in c.items() if k.startswith("http_") and k not in ("http_429", "http_503")}
    unexpected |= {k: v for k, v in c.items() if k.startswith("transport_") or k in ("hung", "stream_cut_by_server")}
    # a replica killed mid-request may fail the unstreamed requests that were running on it (500)
    allowed_500 = result["cluster_requests"].get("failed_mid_stream", 0) + result["cluster_requests"].get("failed", 0)
    if unexpected.get("http_500", 0) <= allowed_500:
        unexpected.pop("http_500", None)
    if unexpected:
        problems.append(f"unexpected outcomes: {unexpected}")
    if any(v != 0 for v in result["leaked_blocks"].values()):
        problems.append(f"KV blocks still held after the soak: {result['leaked_blocks']}")
    if any(g > RSS_GROWTH_BOUND for g in result["rss_growth_bytes"].values()):
        problems.append(f"RSS grew past {RSS_GROWTH_BOUND >> 20} MiB: {result['rss_growth_bytes']}")
    return problems


def kill_one_replica(app_name: str) -> str:
    """ray.kill one engine replica of the application; returns its id."""
    import ray
    from ray.util import list_named_actors

    names: list[str] = sorted(a["name"] for a in list_named_actors(all_namespaces=True)
                   if a["name"].startswith(f"SERVE_REPLICA::{app_name}#engine#"))
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return names[0].rsplit("#", 1)[-1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=120.0, help="traffic time (default 120)")
    p.add_argument("--clients", type=int, default=24, help="closed-loop clients (default 24, past the queue bound)")
    p.add_argument("--max-in-flight", type=int, default=16, help="the ingress's admission bound (default 16)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import socket
    from pathlib import Path

    import ray
    from ray import serve

    from scratchllm.cluster.app import ClusterSpec, build_app
    from scratchllm.cluster.replica import ReplicaSpec
    from scratchllm.server.app import ServerConfig

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    root = str(Path(__file__).resolve().parents[2])
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": root, "RAY_USAGE_STATS_ENABLED": "0"}})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    spec = ClusterSpec(replicas=2, replica=ReplicaSpec(engine_options={"step_ms": 10.0, "max_running": 4}),
                       replica_cpus=0, report_interval_s=0.3, server=ServerConfig(max_in_flight=args.max_in_flight))
    serve.run(build_app(spec), name="soak", route_prefix="/")
    try:
        result = asyncio.run(soak(f"http://127.0.0.1:{port}", args.seconds, args.clients, args.seed,
                                  lambda: kill_one_replica("soak")))
    finally:
        serve.shutdown()
        ray.shutdown()
    problems = check(result)
    print(json.dumps(result, indent=1))
    print("soak: " + ("all promises kept" if not problems else "FAILED: " + "; ".join(problems)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
