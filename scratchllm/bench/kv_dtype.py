"""The KV-cache dtypes side by side on one model: bytes per token, speed and closeness to float32.

For each dtype (float32, float16, bfloat16, int8), in interleaved rounds (each round visits the
dtypes in turn, the order reversed every other round), on the same token ids:
  decode tok/s at a short and a long context   one stream, --new-tokens greedy steps after a prompt
                                                of --short / --long ids (the long one reads the KV
                                                cache more per step)
  aggregate tok/s                               --batch prompts of 32 ids x --new-tokens each, one
                                                batched LLM.generate (prefill included)
  peak KV bytes of that batch                   the engine's peak blocks x the block's bytes
and, once, how far each dtype's logits are from the float32 cache's along the float32 run's greedy
path after the long prompt: the largest |difference| over the steps, and for how many steps the
greedy ids agree when each dtype runs on its own. Then the kernel alone: one layer's paged
attention for a decode step (the model's heads) at a few (sequences, positions), the dtypes
interleaved call by call, --kernel-calls calls each. Rows are medians; ratios are against float32
measured in the same run. This is the measurement behind the default (docs/memory.md).
"""

import argparse
import os
import time
from typing import Any

import numpy as np

from scratchllm.bench.common import machine_facts, median, require_at_least_one
from scratchllm.engine.kv_sizing import DEFAULT_KV_DTYPE, KV_DTYPES, kv_bytes_per_token
from scratchllm.engine.paged_attention import PagedSequence

DTYPES = list(KV_DTYPES)
KERNEL_SHAPES = "1x16,1x1024,16x160,16x1024,1x4096"  # sequences x positions of a decode step
ROWS = [("decode_short_tok_s", "decode tok/s, short context"), ("decode_long_tok_s", "decode tok/s, long context"),
        ("aggregate_tok_s", "aggregate tok/s"), ("peak_kv_mb", "peak KV of the batch, MB")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="a model reference (default: the default model)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="compute threads (default 2)")
    parser.add_argument("--short", type=int, default=16, help="the short context's prompt ids (default 16)")
    parser.add_argument("--long", type=int, default=1024, help="the long context's prompt ids (default 1024)")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy steps per row (default 64)")
    parser.add_argument("--batch", type=int, default=16, help="prompts of the aggregate row (default 16)")
    parser.add_argument("--kernel-calls", type=int, default=60, help="timed calls of each kernel shape (default 60)")
    parser.add_argument("--kernel-shapes", default=KERNEL_SHAPES,
                        help=f"the kernel's decode steps, sequences x positions (default {KERNEL_SHAPES})")


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(min(100, vocab // 2), vocab, n)]


def _decode(model: Any, prompt: list[int], steps: int, dtype: str,
            follow: list[int] | None = None) -> tuple[float, list[int], list[Any]]:
    """(tok/s, greedy ids, logits rows) of `steps` steps after `prompt`; `follow`: feed these ids
    instead of the greedy ones (the float32 run's path, to compare logits position by position)."""
    cache = PagedSequence(model.config, len(prompt) + steps + 1, kv_dtype=dtype)
    logits = model.forward(np.array(prompt), np.arange(len(prompt)), cache, logits_rows=[-1])
    ids, rows = [], []
    t = time.perf_counter()
    for i in range(steps):
        if follow is not None:
            rows.append(logits[-1].copy())
        ids.append(int(np.argmax(logits[-1])))
        nxt = follow[i] if follow is not None else ids[-1]
        logits = model.forward(np.array([nxt]), np.array([cache.length]), cache)
    return steps / (time.perf_counter() - t), ids, rows


def _kernel_step(config: Any, dtype: str, seqs: int, positions: int, threads: int) -> Any:
    """One layer's paged attention for a decode step of `seqs` sequences at `positions` each (their
    K/V written first): a callable that runs it."""
    from scratchllm.engine.paged_attention import PagedAttention

    H, KVH, D, BS = config.num_heads, config.num_kv_heads, config.head_dim, 16
    per_seq = positions // BS + 2
    attn = PagedAttention(1, seqs * per_seq, BS, KVH, D, num_threads=threads, kv_dtype=dtype)
    rng = np.random.default_rng(0)
    tables = np.arange(seqs * per_seq, dtype=np.int32).reshape(seqs, per_seq)
    attn.set_layout(tables, np.repeat(np.arange(seqs, dtype=np.int32), positions),
                    np.tile(np.arange(positions, dtype=np.int32), seqs))
    kv = rng.standard_normal((seqs * positions, KVH, D)).astype(np.float32)
    attn(0, rng.standard_normal((seqs * positions, H, D)).astype(np.float32), kv, kv)
    q, k = rng.standard_normal((seqs, H, D)).astype(np.float32), rng.standard_normal((seqs, KVH, D)).astype(np.float32)
    out = np.empty_like(q)
    attn.set_layout(tables, np.arange(seqs, dtype=np.int32), np.full(seqs, positions, np.int32))
    return lambda: attn(0, q, k, k, out)


def kernel_shapes(text: str) -> list[tuple[int, int]]:
    from scratchllm.errors import ConfigError

    try:
        shapes = [(int(a), int(b)) for a, b in (x.split("x") for x in text.split(",") if x.strip())]
    except ValueError:
        shapes = []
    if not shapes or min(min(s) for s in shapes) < 1:
        raise ConfigError(f"--kernel-shapes takes SEQSxPOSITIONS, comma-separated (1x16,16x1024), got {text!r}")
    return shapes


def kernel_times(config: Any, threads: int, calls: int, shapes: list[tuple[int, int]]) -> dict[str, dict[str, float]]:
    """{"<seqs>x<positions>": {dtype: median microseconds}}, the dtypes interleaved call by call."""
    out = {}
    for seqs, positions in shapes:
        steps = {d: _kernel_step(config, d, seqs, positions, threads) for d in DTYPES}
        times: dict[str, list[float]] = {d: [] for d in DTYPES}
        for c in range(calls):
            for d in DTYPES if c % 2 == 0 else DTYPES[::-1]:
                t = time.perf_counter()
                steps[d]()
                times[d].append(time.perf_counter() - t)
        out[f"{seqs}x{positions}"] = {d: median(v) * 1e6 for d, v in times.items()}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from scratchllm.engine import EngineConfig, LLMEngine
    from scratchllm.engine.load import load_weights
    from scratchllm.models.threads import set_blas_threads
    from scratchllm.sampling import SamplingParams

    require_at_least_one(args, "rounds", "threads", "short", "long", "new_tokens", "batch", "kernel_calls")
    shapes = kernel_shapes(args.kernel_shapes)
    set_blas_threads(args.threads)
    model, _ = load_weights(args.model, "auto", tokenizer=False)  # one model; an engine (a pool) per dtype
    engines = {d: LLMEngine(model, EngineConfig(kv_cache_dtype=d, max_num_seqs=args.batch, num_threads=args.threads))
               for d in DTYPES}
    vocab = model.config.vocab_size
    short, long_ = _ids(vocab, args.short, 0), _ids(vocab, args.long, 1)
    batch = [_ids(vocab, 32, 10 + i) for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    rounds: dict[str, list[dict[str, float]]] = {d: [] for d in DTYPES}
    loads = []
    for r in range(args.rounds):
        for d in DTYPES if r % 2 == 0 else DTYPES[::-1]:
            engine = engines[d]
            out = {"decode_short_tok_s": _decode(model, short, args.new_tokens, d)[0],
                   "decode_long_tok_s": _decode(model, long_, args.new_tokens, d)[0]}
            t = time.perf_counter()
            done = engine.generate(batch, params)
            out["aggregate_tok_s"] = sum(len(o.token_ids) for o in done) / (time.perf_counter() - t)
            out["peak_kv_mb"] = (engine.stats().kv_bytes_peak or 0) / 1e6
            engine.block_manager.stats.peak_bytes = 0  # the next round's own peak
            rounds[d].append(out)
            loads.append(os.getloadavg()[0])
    _, path, _ = _decode(model, long_, args.new_tokens, "float32")
    _, _, ref_rows = _decode(model, long_, args.new_tokens, "float32", follow=path)
    closeness = {}
    for d in DTYPES:
        _, _, rows = _decode(model, long_, args.new_tokens, d, follow=path)
        own = _decode(model, long_, args.new_tokens, d)[1]
        agree = next((i for i, (a, b) in enumerate(zip(own, path, strict=True)) if a != b), len(path))
        diff = max(float(np.abs(a - b).max()) for a, b in zip(rows, ref_rows, strict=True))
        closeness[d] = {"max_abs_logit_diff": diff, "greedy_agree_steps": agree}
    figures = {d: {k: median([x[k] for x in runs]) for k, _ in ROWS} for d, runs in rounds.items()}
    for d in DTYPES:
        figures[d]["kv_bytes_per_token"] = kv_bytes_per_token(model.config, d)
        figures[d].update(closeness[d])
    kernel = kernel_times(model.config, args.threads, args.kernel_calls, shapes)
    loads.append(os.getloadavg()[0])
    return {"bench": "kv_dtype", "default": DEFAULT_KV_DTYPE,
            "inputs": {"model": args.model, "threads": args.threads, "short": args.short, "long": args.long,
                       "new_tokens": args.new_tokens, "batch": args.batch, "rounds": args.rounds,
                       "kernel_calls": args.kernel_calls},
            "figures": figures, "kernel_us": kernel, "rounds": rounds,
            "machine": {**machine_facts(), "loadavg_1min": loads}}


def render(r: dict[str, Any]) -> str:
    f, i = r["figures"], r["inputs"]
    lines = [f"model {i['model']}, {i['threads']} threads, medians of {i['rounds']} interleaved rounds; "
             f"auto = {r['default']}", "",
             f"{'row':<34}" + "".join(f"{d:>16}" for d in DTYPES)]
    lines.append(f"{'KV bytes per token':<34}" + "".join(f"{f[d]['kv_bytes_per_token']:>16.0f}" for d in DTYPES))
    for key, label in ROWS:
        cells = "".join(f"{f[d][key]:>9.1f} {f[d][key] / f['float32'][key]:>5.2f}x" for d in DTYPES)
        lines.append(f"{label:<34}{cells}")
    lines.append(f"{'max |logit - float32 cache|':<34}"
                 + "".join(f"{f[d]['max_abs_logit_diff']:>16.3g}" for d in DTYPES))
    lines.append(f"{'greedy ids agree with float32':<34}"
                 + "".join(f"{f[d]['greedy_agree_steps']:>13}/{i['new_tokens']:<2}" for d in DTYPES))
    lines.append(f"decode: {i['new_tokens']} steps after {i['short']} / {i['long']} prompt ids; aggregate: "
                 f"{i['batch']} prompts of 32 ids x {i['new_tokens']}; logits compared along float32's path after "
                 f"{i['long']} ids")
    lines += ["", "paged attention alone, one layer of a decode step (sequences x positions), median us:"]
    for shape, row in r["kernel_us"].items():
        lines.append(f"{shape:<34}" + "".join(f"{row[d]:>9.1f} {row[d] / row['float32']:>5.2f}x" for d in DTYPES))
    loads = r["machine"]["loadavg_1min"]
    lines.append(f"machine: {r['machine']['cpu']}, load average {min(loads):.1f}-{max(loads):.1f} during the rounds")
    return "\n".join(lines)
