"""Routing across engine replicas on Ray Serve: the KV-block-aware router vs round robin vs power
of two choices, in the same run, on the same request sequence, beside the oracle.

The workload: `--systems` shared system prompts (random token ids, `--system-len` tokens each),
`--per-system` requests each with a user part of its own, in a seeded random order, sent by
`--concurrency` clients in a closed loop. Each strategy gets freshly started replicas (empty
caches) of the same model, each with a KV pool of `--kv-blocks` blocks: smaller than all the
system prompts together, so where a request lands decides whether its prefix is still cached.
Per strategy: the hit rate (requests with cached prompt tokens > 0, from the engine's own
metrics), the cached fraction of prompt tokens, TTFT (client side: submit to first token,
through Ray), and how often the router's prediction matched the engine's report. The oracle
hit rate is computed from the request sequence alone: every request but the first of each
system prompt hits (an unbounded cache that sees every request).

The model is by default a tiny random Llama written to a temporary folder (no download, seconds
to load); --model takes any model folder or .gguf instead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from scratchllm.bench.common import machine_facts, require_at_least_one

if TYPE_CHECKING:
    from scratchllm.cluster.remote import RemoteEngine

STRATEGY_NAMES = {"prefix": "KV-block router", "round_robin": "round robin", "power_of_two": "power of two"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="'tiny' (a random Llama, written here) or a model reference")
    parser.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    parser.add_argument("--systems", type=int, default=16, help="shared system prompts (default 16)")
    parser.add_argument("--per-system", type=int, default=16, help="requests per system prompt (default 16)")
    parser.add_argument("--system-len", type=int, default=256, help="tokens per system prompt (default 256)")
    parser.add_argument("--user-len", default="8,40", help="user part lengths LO,HI in tokens (default 8,40)")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request (default 4)")
    parser.add_argument("--concurrency", type=int, default=4, help="clients in the closed loop (default 4)")
    parser.add_argument("--kv-blocks", type=int, default=224,
                        help="KV blocks per replica (default 224: ~12 of the 16 system prompts of 16 blocks)")
    parser.add_argument("--strategies", default="prefix,round_robin,power_of_two",
                        help="routing strategies to compare (default all three)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the generated inputs")
    parser.add_argument("--runs", type=int, default=1,
                        help="repeat the comparison (each strategy on fresh replicas each time): medians, and the "
                             "ratios' spread")
    parser.add_argument("--ray-address", default=None, help="join this Ray cluster (default: a local one)")


# --- the model: a tiny random Llama as a Hugging Face folder --------------------------------------
def write_tiny_llama(folder: Path, seed: int = 0, vocab: int = 1024, hidden: int = 256, layers: int = 4,
                     heads: int = 4, kv_heads: int = 2, inter: int = 512, ctx: int = 2048) -> Path:
    """config.json + model.safetensors (the format written by hand: 8-byte header size, JSON
    header of dtype/shape/offsets, raw little-endian data) with random weights."""
    rng = np.random.default_rng(seed)
    d = hidden // heads

    def w(*shape: int, scale: float | None = None) -> np.ndarray:
        return (rng.standard_normal(shape) * (scale or shape[-1] ** -0.5)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(vocab, hidden, scale=1.0), "model.norm.weight": 1 + w(hidden, scale=0.1),
               "lm_head.weight": w(vocab, hidden, scale=0.5)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": 1 + w(hidden, scale=0.1),
                    p + "post_attention_layernorm.weight": 1 + w(hidden, scale=0.1),
                    p + "self_attn.q_proj.weight": w(heads * d, hidden),
                    p + "self_attn.k_proj.weight": w(kv_heads * d, hidden),
                    p + "self_attn.v_proj.weight": w(kv_heads * d, hidden),
                    p + "self_attn.o_proj.weight": w(hidden, heads * d),
                    p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
                    p + "mlp.down_proj.weight": w(hidden, inter)}
    header, offset = {}, 0
    for name, t in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for t in tensors.values():
            f.write(t.tobytes())
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "intermediate_size": inter, "rms_norm_eps": 1e-5, "max_position_embeddings": ctx,
              "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# --- the workload and its oracle ---------------------------------------------------------------
def workload(args: argparse.Namespace, vocab: int) -> list[tuple[int, list[int]]]:
    """(system index, prompt token ids) in send order."""
    rng = random.Random(args.seed)
    lo, hi = (int(x) for x in args.user_len.split(","))
    systems = [[rng.randrange(3, vocab) for _ in range(args.system_len)] for _ in range(args.systems)]
    requests = [(s, systems[s] + [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))])
                for s in range(args.systems) for _ in range(args.per_system)]
    rng.shuffle(requests)
    return requests


def oracle(requests: list[tuple[int, list[int]]], system_len: int, block_size: int = 16) -> dict[str, float]:
    """The best any router could do with unbounded caches: every repeat of a system prompt hits
    the system prompt's full blocks (the user part differs from there on)."""
    seen: set[int] = set()
    hits = cached = 0
    for system, prompt in requests:
        if system in seen:
            hits += 1
            cached += min(system_len, len(prompt) - 1) // block_size * block_size
        seen.add(system)
    total = sum(len(p) for _, p in requests)
    return {"hit_rate": hits / len(requests), "cached_fraction": cached / total}


# --- one strategy ---------------------------------------------------------------------------------
async def _drive(engine: RemoteEngine, requests: list[tuple[int, list[int]]],
                 args: argparse.Namespace) -> list[dict[str, Any]]:
    from scratchllm.sampling import SamplingParams

    queue: asyncio.Queue[tuple[int, list[int]]] = asyncio.Queue()
    for item in requests:
        queue.put_nowait(item)
    out: list[dict[str, Any]] = []

    async def client() -> None:
        while not queue.empty():
            system, prompt = queue.get_nowait()
            start, first = time.perf_counter(), None
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
            async for event in engine.submit(prompt, params):
                first = first or time.perf_counter()
                if event.finish_reason is not None:
                    m = event.metrics
                    out.append({"system": system, "ttft_ms": (first - start) * 1e3, "prompt_tokens": len(prompt),
                                "cached_tokens": m.cached_tokens if m else 0, "finish": event.finish_reason})

    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    return out


def run_strategy(strategy: str, model_ref: str, requests: list[tuple[int, list[int]]],
                 args: argparse.Namespace) -> dict[str, Any]:
    from ray import serve

    from scratchllm.cluster.app import ClusterSpec, engine_deployment, replica_limits
    from scratchllm.cluster.remote import RemoteEngine
    from scratchllm.cluster.replica import ReplicaSpec

    spec = ClusterSpec(replicas=args.replicas, strategy=strategy, replica_cpus=0, report_interval_s=0.25,
                       replica=ReplicaSpec(model_ref, {"num_kv_blocks": args.kv_blocks, "max_num_seqs": 8},
                                           tokenizer=False))
    started = time.perf_counter()
    handle = serve.run(engine_deployment(spec).bind(spec.replica), name=f"bench-{strategy}", route_prefix=None)
    deploy_s = time.perf_counter() - started
    engine = RemoteEngine(handle, replica_limits(spec))
    try:
        started = time.perf_counter()
        rows = asyncio.run(_drive(engine, requests, args))
        wall_s = time.perf_counter() - started
        replica_stats = handle.stats.remote().result(timeout_s=30)  # one replica's engine counters
    finally:
        serve.delete(f"bench-{strategy}")  # the next strategy starts on fresh replicas: empty caches
    ttft = sorted(r["ttft_ms"] for r in rows)
    acc = engine.accuracy.summary()
    return {"strategy": strategy, "requests": len(rows), "deploy_s": deploy_s, "wall_s": wall_s,
            "hit_rate": sum(r["cached_tokens"] > 0 for r in rows) / len(rows),
            "cached_fraction": sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows),
            "ttft_ms_mean": statistics.fmean(ttft), "ttft_ms_p50": ttft[len(ttft) // 2],
            "ttft_ms_p90": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "prediction_hit_agreement": acc["hit_agreement_rate"], "prediction_exact": acc["exact_rate"],
            "aborted": sum(r["finish"] == "abort" for r in rows),
            # per replica, for capacity planning (docs/cluster.md): what one replica sustained here
            "requests_per_s_per_replica": len(rows) / wall_s / args.replicas,
            "computed_prompt_tok_per_s_per_replica": sum(r["prompt_tokens"] - r["cached_tokens"] for r in rows)
            / wall_s / args.replicas,
            "output_tok_per_s_per_replica": len(rows) * args.max_tokens / wall_s / args.replicas,
            "kv_block_bytes": replica_stats.kv_block_bytes,
            "kv_blocks_total": replica_stats.kv_blocks_total}


def run(args: argparse.Namespace) -> dict[str, Any]:
    require_at_least_one(args, "replicas", "systems", "per_system", "system_len", "max_tokens", "concurrency",
                         "kv_blocks", "runs")
    import ray
    from ray import serve

    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            model_ref, vocab = str(write_tiny_llama(Path(tmp) / "tiny-llama", seed=args.seed)), 1024
        else:
            from scratchllm.models import load_model

            model_ref, vocab = args.model, load_model(args.model).config.vocab_size
        requests = workload(args, vocab)
        started = time.perf_counter()
        own = not ray.is_initialized()  # a caller (a test) may have started Ray and Serve already
        # Ray prints the errors its raylets publish (a Serve actor killed at shutdown, say) on
        # stdout, from a thread of its own: while Ray runs, stdout is stderr, so `--json` prints
        # the JSON alone
        with contextlib.redirect_stdout(sys.stderr):
            if own:
                os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
                root = str(Path(__file__).resolve().parents[2])  # the workers import this scratchllm
                ray.init(address=args.ray_address, num_cpus=None if args.ray_address else 2,
                         include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False,
                         runtime_env={"env_vars": {"PYTHONPATH": root, "RAY_USAGE_STATS_ENABLED": "0"}})
                serve.start(proxy_location="Disabled")  # handles only: no HTTP here
            try:
                runs = [{r["strategy"]: r for r in (run_strategy(s, model_ref, requests, args) for s in strategies)}
                        for _ in range(args.runs)]
            finally:
                if own:
                    serve.shutdown()
                    ray.shutdown()
        total_s = time.perf_counter() - started
    best = oracle(requests, args.system_len)
    inputs = {k: getattr(args, k) for k in ("model", "replicas", "systems", "per_system", "system_len", "user_len",
                                            "max_tokens", "concurrency", "kv_blocks", "seed", "runs")}
    return {"bench": "cluster", "inputs": inputs, "oracle": best, **summarize(runs, best), "total_s": total_s,
            "machine": machine_facts()}


def summarize(runs: list[dict[str, dict[str, Any]]], best: dict[str, float]) -> dict[str, Any]:
    """Each run's figures (per strategy) and ratios; over the runs, each figure's and ratio's
    median, and each ratio's smallest and largest (one run: its own figures)."""
    per_run: list[dict[str, Any]] = [{"figures": by, "ratios": ratios_of(by, best)} for by in runs]

    def median(values: list[Any]) -> Any:  # of counts (KV blocks, bytes): one run's, not a half
        return statistics.median_low(values) if all(isinstance(v, int) for v in values) else statistics.median(values)

    figures = {s: {k: (median([r["figures"][s][k] for r in per_run]) if isinstance(v, int | float) else v)
                   for k, v in fig.items()} for s, fig in per_run[0]["figures"].items()}
    ratios = {k: statistics.median(r["ratios"][k] for r in per_run) for k in per_run[0]["ratios"]}
    spread = {k: {"min": min(r["ratios"][k] for r in per_run), "max": max(r["ratios"][k] for r in per_run)}
              for k in ratios}
    return {"figures": figures, "ratios": ratios, "spread": spread, "runs": per_run}


def ratios_of(by: dict[str, dict[str, Any]], best: dict[str, float]) -> dict[str, float]:
    """Ours against the oracle and each baseline measured in the same run."""
    ratios: dict[str, float] = {}
    if "prefix" in by:
        ours = by["prefix"]
        ratios["hit_rate_vs_oracle"] = ours["hit_rate"] / best["hit_rate"] if best["hit_rate"] else float("nan")
        for base in ("round_robin", "power_of_two"):
            if base in by:
                ratios[f"hit_rate_vs_{base}"] = ours["hit_rate"] / max(by[base]["hit_rate"], 1e-9)
                ratios[f"ttft_mean_{base}_over_ours"] = by[base]["ttft_ms_mean"] / ours["ttft_ms_mean"]
    return ratios


def render(result: dict[str, Any]) -> str:
    i, best = result["inputs"], result["oracle"]
    lines = [f"routing on {i['replicas']} replicas: {i['systems']} system prompts x {i['per_system']} requests "
             f"({i['system_len']} + {i['user_len']} tokens), {i['concurrency']} clients, {i['kv_blocks']} KV blocks "
             f"per replica, model {i['model']}",
             f"{'strategy':<18}{'hit rate':>9}{'cached':>8}{'TTFT mean':>11}{'p50':>10}{'p90':>10}"
             f"{'pred. agree':>13}{'exact':>7}"]
    for r in result["figures"].values():
        lines.append(f"{STRATEGY_NAMES[r['strategy']]:<18}{r['hit_rate']:>9.3f}{r['cached_fraction']:>8.3f}"
                     f"{r['ttft_ms_mean']:>9.1f}ms{r['ttft_ms_p50']:>8.1f}ms{r['ttft_ms_p90']:>8.1f}ms"
                     f"{r['prediction_hit_agreement']:>13.3f}{r['prediction_exact']:>7.3f}")
    lines.append(f"{'oracle':<18}{best['hit_rate']:>9.3f}{best['cached_fraction']:>8.3f}")
    for r in result["figures"].values():
        lines.append(f"  per replica, {STRATEGY_NAMES[r['strategy']]}: {r['requests_per_s_per_replica']:.2f} req/s, "
                     f"{r['computed_prompt_tok_per_s_per_replica']:.0f} computed prompt tok/s, "
                     f"{r['output_tok_per_s_per_replica']:.1f} output tok/s; KV block {r['kv_block_bytes']} bytes "
                     f"x {r['kv_blocks_total']}")
    runs = result["runs"]
    if len(runs) > 1:
        lines.insert(1, f"medians of {len(runs)} runs (each on fresh replicas):")
        for i, r in enumerate(runs, 1):
            each = [f"{STRATEGY_NAMES[s]} {f['hit_rate']:.3f} / {f['ttft_ms_mean']:.0f} ms"
                    for s, f in r["figures"].items()]
            lines.append(f"  run {i} (hit rate / TTFT mean): " + ", ".join(each))
        lines += [f"  {k}: {v:.3f} (runs: {result['spread'][k]['min']:.3f} - {result['spread'][k]['max']:.3f})"
                  for k, v in result["ratios"].items()]
    else:
        lines += [f"  {k}: {v:.3f}" for k, v in result["ratios"].items()]
    lines.append(f"  ({result['total_s']:.0f} s in all; hit = the engine reported cached prompt tokens; TTFT from "
                 "submit to first token through Ray; pred. agree = the router's predicted hit/miss was the engine's)")
    return "\n".join(lines)
