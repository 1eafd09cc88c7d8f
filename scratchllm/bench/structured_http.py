"""Structured output through the server: N concurrent chat requests with a json_schema
response_format against N unconstrained ones, on the default model, in the same run.

The whole HTTP handler path runs (parse, grammar compile off the event loop, admission, engine,
reply) over httpx's in-process ASGI transport, so no port is needed. For a like-for-like
comparison the unconstrained requests generate exactly the tokens the constrained ones did
(max_tokens = that request's count, ignore_eos), so both runs have the same batch shape;
the constrained run is timed before and after the unconstrained one and averaged, so drift on
a shared machine does not favour either side. Throughput = completion tokens / wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from scratchllm.bench.common import machine_facts
from scratchllm.bench.schemas import schemas

if TYPE_CHECKING:
    import httpx
    from fastapi import FastAPI

PROMPT = "Give an example JSON value."


def _response_format(i: int, schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                       "strict": True}}}


# each way a client can send a JSON schema: field name -> (index, schema) -> the request's fields
FIELDS: dict[str, Callable[[int, dict[str, Any]], dict[str, Any]]] = {
    "response_format": _response_format,
    "structured_outputs": lambda i, schema: {"structured_outputs": {"json": schema}},
    "guided_json": lambda i, schema: {"guided_json": schema},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent requests per run (default 16)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each constrained request")
    parser.add_argument("--field", choices=sorted(FIELDS), default="response_format",
                        help="the request field the schema goes in: OpenAI's response_format, vLLM's "
                             "structured_outputs.json or its older guided_json (default response_format)")


async def _run_all(client: httpx.AsyncClient, bodies: list[dict[str, Any]]) -> tuple[float, list[dict[str, Any]]]:
    t = time.perf_counter()
    replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
    wall = time.perf_counter() - t
    for r in replies:
        assert r.status_code == 200, r.text
    return wall, [r.json() for r in replies]


def _figures(wall: float, replies: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(r["usage"]["completion_tokens"] for r in replies)
    return {"tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall}


async def _bench(app: FastAPI, n: int, max_tokens: int, field: str = "response_format") -> dict[str, Any]:
    import httpx

    base = {"model": "default", "messages": [{"role": "user", "content": PROMPT}], "temperature": 0}
    constrained = [{**base, "max_tokens": max_tokens, **FIELDS[field](i, s)} for i, s in enumerate(schemas()[:n])]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=600) as client:
        await _run_all(client, constrained[:1])  # warm: the vocabulary trie, the prompt's prefix cache
        wall_a, first = await _run_all(client, constrained)
        counts = [r["usage"]["completion_tokens"] for r in first]
        plain = [{**base, "max_tokens": c, "ignore_eos": True} for c in counts]
        wall_u, unconstrained = await _run_all(client, plain)
        wall_b, second = await _run_all(client, constrained)
    a, b, u = _figures(wall_a, first), _figures(wall_b, second), _figures(wall_u, unconstrained)
    json_tok_s = (a["tokens"] + b["tokens"]) / (wall_a + wall_b)
    return {"json_schema_before": a, "unconstrained": u, "json_schema_after": b, "json_schema_tok_per_s": json_tok_s,
            "throughput_ratio": json_tok_s / u["tok_per_s"], "cost_pct": 100.0 * (1.0 - json_tok_s / u["tok_per_s"])}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from scratchllm.server.app import ServerConfig, create_app
    from scratchllm.server.backend import load_model

    model = load_model("default", "default", {})
    app = create_app(model, None, ServerConfig(max_in_flight=max(64, args.concurrency)))
    try:
        result = asyncio.run(_bench(app, args.concurrency, args.max_tokens, args.field))
    finally:
        model.engine.shutdown(False)
    return {"inputs": {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "field": args.field}, **result,
            "machine": machine_facts()}


def render(result: dict[str, Any]) -> str:
    n = result["inputs"]["concurrency"]
    lines = [f"structured output through the server, {n} concurrent chat requests, greedy, default model:"]
    for key, label in (("json_schema_before", "json_schema"), ("unconstrained", "unconstrained (same tokens)"),
                       ("json_schema_after", "json_schema again")):
        f = result[key]
        lines.append(f"  {label:28s} {f['tok_per_s']:7.1f} tok/s ({f['tokens']} tokens, {f['wall_s']:.1f} s)")
    lines.append(f"  throughput ratio {result['throughput_ratio']:.3f} (cost {result['cost_pct']:.1f}%; goal <= 10%)")
    return "\n".join(lines)
