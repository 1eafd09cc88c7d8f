"""Continuous vs static batching on one seeded mixed workload, in the same run; the admission
policies side by side (--policies); batched decode vs a single stream; and a chat batch (16
prompts x 128 new tokens), with --peer llama.cpp beside llama.cpp's on the same token ids.

1. Mixed workload: --requests requests (default 64), prompt and output lengths drawn uniformly
   from --prompt-len and --output-len (default 16-512 each), random token ids, seeded; all
   arrive at t=0 (an offline batch), greedy with ignore_eos so every mode makes exactly the same
   tokens. Three runs:
   - static: batches of --batch-size (16): pad to the longest, reserve [batch, longest prompt +
     longest output] of KV, run each batch to completion;
   - continuous, same concurrency: the engine (paged KV, chunked prefill, one packed forward per
     step) capped at --batch-size sequences. Its peak KV against static's reservation is the
     memory paging saves for the same work (the KV goal);
   - continuous, same KV memory: the engine given a pool of exactly the bytes static reserved,
     capped at --max-seqs (64). This is the design article's argument ("no padding saves 37% of the KV
     memory, which allows more concurrency"): the same memory serves more sequences at once.
     Its throughput and p99 against static are the throughput and latency goals.
   - continuous, a fraction of the KV memory: the same, with a pool of --kv-fraction (0.5) of
     the bytes static reserved. The memory a server must set aside for KV is its pool; if the
     engine serves the workload from half of static's reservation as fast as static or faster,
     with the same outputs, paging has saved at least half the KV memory. (The peak of the
     same-concurrency run is the other reading of the KV goal; both print.) When the pool runs
     short the engine preempts by recompute; the count prints. The pool is never smaller than
     the longest request needs (the engine would refuse that request); the fraction printed is
     the one used.
   Per run: output tokens/s, requests/s, p50/p99 latency (finish - arrival), peak KV bytes
   (continuous: blocks in use at the peak; static: the padded reservation), and whether the
   outputs agree. With --rate, requests arrive as a seeded Poisson process instead, in real
   time: continuous admits them into the running batch, static starts a new batch only when the
   last one ended.
   Offline, every request waits from t=0, so p99 is about the time the last one finishes: it
   measures throughput again, not latency. Latency is measured under load: the first
   --latency-requests (32) requests arrive as a seeded Poisson process at --load (0.8) times the
   requests/s static managed offline, and static and continuous (same KV memory) serve them in
   real time. A request that arrives while a static batch runs waits for the whole batch; the
   engine admits it at the next step.
2. Batched decode: decode-only tokens/s of --decode-seqs sequences (default 32) vs one.
   With --policies priority,fcfs the same-KV run is repeated under each admission policy (the
   priority policy: short requests first; FCFS: arrival order), offline and under load.
3. Chat batch: 16 chat prompts x 128 new tokens, aggregate tokens/s with prefill included.
   --peer llama.cpp also runs llama.cpp (llama-cpp-python, built for this CPU by `make peers`)
   on the same GGUF file, token ids and thread count, in a child process before ours and one
   after (median of the two; its high-level API serves one sequence at a time). Without it no
   llama.cpp figure prints: none from another machine.

Timings on a shared machine are noisy: every figure is one run unless stated; ratios are
taken within the run. The design article's figures (an A10G GPU, its own workload) print
beside ours, labelled as such (docs/references.md).
"""

import argparse
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from scratchllm.bench.common import LoadedModel, machine_facts, median, require_at_least_one
from scratchllm.bench.engine_report import render as render  # the report of these runs
from scratchllm.bench.references import ARTICLE_SERVING
from scratchllm.dtypes import DTYPE_HELP, DTYPES
from scratchllm.engine.config import POLICY_NAMES
from scratchllm.errors import ConfigError

if TYPE_CHECKING:  # for the annotation only: the checkpoint is opened where the benchmark runs
    from scratchllm.formats import Checkpoint

PUBLISHED = ARTICLE_SERVING
SHORT_MAX_TOKENS = 256  # the priority policy's high queue: max_tokens below this
GOALS = {"throughput_ratio": 2.0, "p99_ratio": 3.0, "kv_saving": 0.50, "decode_scaling": 8.0,
         "chat_over_llama_cpp": 2.0}
QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in one paragraph.",
    "Write a haiku about the sea.", "How do I reverse a list in Python?",
    "Give three tips for a job interview.", "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet.", "What is a prime number? Give examples.",
    "Translate 'good morning' into Spanish, French and German.", "Why is the sky blue?",
    "Describe how a bicycle works.", "What are the benefits of regular exercise?",
    "Write a short story about a robot who learns to paint.", "How does a compiler differ from an interpreter?",
    "List five animals that live in the Arctic.", "What is the difference between weather and climate?",
]


# The static baseline keeps float32 K/V (engine/static.py): the engine runs at the same KV-cache
# dtype here, so that outputs compare token for token and KV memory byte for byte.
BASELINE_KV_DTYPE = "float32"


def _range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"expected LO,HI, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ConfigError(f"expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="model reference (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--requests", type=int, default=64, help="requests in the mixed workload (default 64)")
    parser.add_argument("--prompt-len", default="16,512", help="prompt lengths LO,HI (default 16,512)")
    parser.add_argument("--output-len", default="16,512", help="output lengths LO,HI (default 16,512)")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="static batch size, and the cap of the same-concurrency continuous run (default 16)")
    parser.add_argument("--max-seqs", type=int, default=64,
                        help="concurrency cap of the same-KV-memory continuous run (default 64)")
    parser.add_argument("--kv-fraction", type=float, default=0.5,
                        help="the small-KV continuous run: a pool of this fraction of static's KV (default 0.5; "
                             "0 skips)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="continuous: token budget per step")
    parser.add_argument("--decode-seqs", type=int, default=32, help="batched-decode figure: sequences (default 32)")
    parser.add_argument("--chat-new-tokens", type=int, default=128, help="chat batch: new tokens (default 128)")
    parser.add_argument("--peer", choices=["llama.cpp"], default=None,
                        help="chat batch: also measure llama.cpp (llama-cpp-python; `make peers` builds it) on the "
                             "same GGUF file and token ids, in child processes before and after ours")
    parser.add_argument("--policies", default="priority",
                        help="admission policies to run the same-KV continuous case under, comma list of "
                             f"{','.join(POLICY_NAMES)} (default priority; several: side by side)")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="Poisson arrivals, requests/s (default 0: all at t=0, an offline batch)")
    parser.add_argument("--load", type=float, default=0.8,
                        help="latency under load: Poisson arrivals at this fraction of static's offline "
                             "requests/s (default 0.8; 0 skips)")
    parser.add_argument("--latency-requests", type=int, default=32,
                        help="latency under load: how many of the workload's requests (default 32)")
    parser.add_argument("--threads", type=int, default=0,
                        help="BLAS and attention-kernel threads (default 0: all cores); 1 is often faster "
                             "when other jobs share the cores")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the generated inputs")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="draw the mixed runs' latency CDFs, output tokens/s and KV use over time into a PNG")
    parser.add_argument("--skip", default="",
                        help="comma list of parts to skip: mixed,static,same-seqs,latency,decode,chat")
    parser.add_argument("--quick", action="store_true",
                        help="a minute or two: 16 requests of 16-128 + 16-128 tokens, 16 decode steps, "
                             "the chat batch with 32 new tokens")


def workload(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
             seed: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    lo = min(100, vocab // 4)  # above the special tokens of real vocabularies
    prompts = [rng.integers(lo, vocab - 1, int(rng.integers(prompt_len[0], prompt_len[1] + 1))).tolist()
               for _ in range(n)]
    outputs = [int(rng.integers(output_len[0], output_len[1] + 1)) for _ in range(n)]
    return prompts, outputs


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals at `rate` requests/s (seeded); rate 0: everyone at t=0 (an offline batch)."""
    if rate <= 0:
        return [0.0] * n
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, n)
    times: list[float] = np.cumsum(gaps).tolist()
    return times


def _wait_until(t0: float, t: float) -> None:
    delay = t0 + t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def _summary(prompts: Sequence[Sequence[int]], outputs: Sequence[int], arrivals: Sequence[float],
             finish: Sequence[float], wall: float) -> dict[str, Any]:
    lat = [(f - a) * 1e3 for f, a in zip(finish, arrivals, strict=True)]
    short = [x for x, o in zip(lat, outputs, strict=True) if o < SHORT_MAX_TOKENS]
    return {"wall_s": wall, "output_tokens": sum(outputs), "output_tok_s": sum(outputs) / wall,
            "requests_per_s": len(prompts) / wall, "p50_ms": _pct(lat, 50), "p99_ms": _pct(lat, 99),
            "short_p99_ms": _pct(short, 99) if short else None}


def run_continuous(model: LoadedModel, prompts: Sequence[Sequence[int]], outputs: Sequence[int],
                   arrivals: Sequence[float], args: argparse.Namespace, max_num_seqs: int,
                   kv_bytes: int | None = None, policy: str = "priority") -> dict[str, Any]:
    """The engine on the workload, at most max_num_seqs at once; a KV pool of kv_bytes (default:
    the memory plan's); the admission policy named."""
    from scratchllm.engine import EngineConfig, LLMEngine
    from scratchllm.engine.kv_sizing import block_bytes
    from scratchllm.sampling import SamplingParams

    blocks = None
    if kv_bytes is not None:
        blocks = kv_bytes // block_bytes(model.config, EngineConfig.block_size, kv_dtype=BASELINE_KV_DTYPE)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=max_num_seqs, num_threads=args.threads, num_kv_blocks=blocks,
                                           max_num_batched_tokens=args.max_num_batched_tokens, policy=policy,
                                           kv_cache_dtype=BASELINE_KV_DTYPE))
    n = len(prompts)
    tokens: list[list[int | None]]  # None: a request that ended without a token (an abort; none here)
    tokens, finish = [[] for _ in range(n)], [0.0] * n
    token_times: list[float] = []
    kv_samples: list[tuple[float, int]] = []
    t0 = time.monotonic()
    nxt = 0
    while nxt < n or engine.has_work():
        now = time.monotonic() - t0
        while nxt < n and arrivals[nxt] <= now:  # requests join the running batch as they arrive
            engine.add_request(str(nxt), prompts[nxt], SamplingParams(max_tokens=outputs[nxt], temperature=0.0,
                                                                       ignore_eos=True))
            nxt += 1
        if not engine.has_work():
            _wait_until(t0, arrivals[nxt])
            continue
        for o in engine.step():
            i = int(o.request_id)
            tokens[i].append(o.token_id)
            token_times.append(time.monotonic() - t0)
            if o.finish_reason:
                finish[i] = time.monotonic() - t0
        kv_samples.append((time.monotonic() - t0, engine.block_manager.num_used))
    result = _summary(prompts, outputs, arrivals, finish, time.monotonic() - t0)
    result["series"] = {"arrivals": list(arrivals), "finish": finish, "token_times": token_times,
                        "kv_samples": kv_samples}
    stats = engine.stats()
    result.update(peak_kv_bytes=stats.kv_bytes_peak, steps=stats.steps, preemptions=stats.preemptions,
                  max_num_seqs=max_num_seqs, kv_pool_bytes=engine.plan.kv_block_bytes * engine.block_manager.num_blocks,
                  token_ids=tokens)
    return result


def run_static_mode(model: LoadedModel, prompts: Sequence[Sequence[int]], outputs: Sequence[int],
                    arrivals: Sequence[float], args: argparse.Namespace) -> dict[str, Any]:
    """Static batching as served (static.run_static, given the arrivals): when idle, take up to
    batch-size requests that have arrived, run them to completion; whoever arrives meanwhile
    waits for the whole batch."""
    from scratchllm.engine.static import run_static

    t0 = time.monotonic()
    res = run_static(model, prompts, outputs, args.batch_size, arrivals=arrivals)
    finish = [f - t0 for f in res.finish_times]
    result = _summary(prompts, outputs, arrivals, finish, time.monotonic() - t0)
    result.update(peak_kv_bytes=res.peak_kv_bytes, padded_tokens=res.padded_tokens, token_ids=res.token_ids)
    result["series"] = {"arrivals": list(arrivals), "finish": finish, "token_times": [], "kv_samples": []}
    return result


def under_load(model: LoadedModel, prompts: Sequence[Sequence[int]], outputs: Sequence[int], args: argparse.Namespace,
               static_rps: float, kv_bytes: int | None, policies: Sequence[str] = ("priority",)) -> dict[str, Any]:
    """Static and continuous (the same KV memory, under each admission policy; the first is
    "continuous") serving the first --latency-requests requests, arriving as a Poisson process
    at --load x static's offline requests/s, in real time."""
    n = min(args.latency_requests, len(prompts))
    rate = args.load * static_rps
    arrivals = arrival_times(n, rate, args.seed)
    lat: dict[str, Any]
    lat = {"requests": n, "load": args.load, "rate": rate,
           "static": run_static_mode(model, prompts[:n], outputs[:n], arrivals, args)}
    for i, policy in enumerate(policies):
        lat["continuous" if i == 0 else f"continuous_{policy}"] = run_continuous(
            model, prompts[:n], outputs[:n], arrivals, args, args.max_seqs, kv_bytes, policy)
    same = sum(a == b for a, b in zip(lat["static"]["token_ids"], lat["continuous"]["token_ids"], strict=True))
    lat["identical_outputs"] = f"{same}/{n}"
    for run in lat.values():
        if isinstance(run, dict):
            del run["token_ids"], run["series"]
    return lat


def decode_rate(model: LoadedModel, n_seqs: int, prompt_len: int, steps: int, seed: int, threads: int = 0) -> float:
    """Decode-only tokens/s of n_seqs sequences: prefill first (untimed), then time `steps` steps."""
    from scratchllm.engine import EngineConfig, LLMEngine
    from scratchllm.sampling import SamplingParams

    prompts, _ = workload(n_seqs, (prompt_len, prompt_len), (1, 1), model.config.vocab_size, seed)
    # room for the tokens the first-admitted make while the last ones still prefill
    max_tokens = steps + 2 + n_seqs * prompt_len // 512 + 2
    engine = LLMEngine(model, EngineConfig(max_num_seqs=n_seqs, max_num_batched_tokens=max(512, n_seqs),
                                           num_threads=threads,
                                           num_kv_blocks=n_seqs * (-(-(prompt_len + max_tokens) // 16) + 1)))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while any(r.num_output_tokens == 0 for r in engine.requests.values()):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out = engine.step()
        times.append(time.perf_counter() - t)
        assert len(out) == n_seqs, "every sequence decodes every step"
    return n_seqs / median(times)


def chat_prompts(ref: str, checkpoint: "Checkpoint | None" = None) -> list[list[int]]:
    """The chat batch's 16 prompts as token ids (the model's chat template around each question).
    `checkpoint`: `ref` already opened (formats.load_checkpoint), so that its tokenizer is read
    without parsing the file again."""
    from scratchllm.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(ref, checkpoint=checkpoint)
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]


def run_chat(model: LoadedModel, prompts: list[list[int]], new_tokens: int, threads: int = 0) -> dict[str, Any]:
    from scratchllm.engine import EngineConfig, LLMEngine
    from scratchllm.sampling import SamplingParams

    engine = LLMEngine(model, EngineConfig(max_num_seqs=16, max_num_batched_tokens=1024, num_threads=threads))
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    wall = time.perf_counter() - t0
    return {"sequences": 16, "new_tokens": new_tokens, "prompt_tokens": [len(p) for p in prompts],
            "wall_s": wall, "aggregate_tok_s": 16 * new_tokens / wall}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads > 0:
        from scratchllm.models.threads import blas_threads

        with blas_threads(args.threads):
            return _run(args)
    return _run(args)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from scratchllm.formats import load_checkpoint
    from scratchllm.formats.refs import resolve_model
    from scratchllm.models import load_model
    from scratchllm.models.bert import BertModel

    skip, policies = _settle(args)
    t = time.perf_counter()
    checkpoint = load_checkpoint(resolve_model(args.model))  # one header parse for the model and its tokenizer
    if args.peer and checkpoint.format != "gguf":
        raise ConfigError(f"--peer llama.cpp runs on a GGUF file; {checkpoint.path} is {checkpoint.format}")
    loaded = load_model(args.model, dtype=args.dtype, checkpoint=checkpoint)
    if not loaded.config.is_decoder:
        raise ConfigError(f"{args.model} is an encoder; bench engine needs a decoder")
    assert not isinstance(loaded, BertModel), "BERT is the one encoder family"
    model: LoadedModel = loaded
    result: dict[str, Any]
    result = {"inputs": {k: v for k, v in vars(args).items() if k != "func"}, "load_s": time.perf_counter() - t,
              "figures": {}, "ratios": {}, "published": PUBLISHED, "goals": GOALS, "peer": None}
    figs, ratios = result["figures"], result["ratios"]
    if "mixed" not in skip:
        _mixed(model, args, skip, policies, figs, ratios)
    if len(policies) > 1 and "continuous" in figs:
        figs["policies"] = _policy_table(figs, policies)
    if "decode" not in skip:
        steps = 16 if args.quick else 32
        one = decode_rate(model, 1, 64, steps, args.seed, args.threads)
        many = decode_rate(model, args.decode_seqs, 64, steps, args.seed, args.threads)
        figs["decode"] = {"single_tok_s": one, "batched_tok_s": many, "sequences": args.decode_seqs,
                          "prompt_tokens": 64, "steps": steps}
        ratios["decode_batched_over_single"] = many / one
    if "chat" not in skip:
        _chat(model, args, checkpoint, result)
    result["machine"] = machine_facts()
    return result


def _settle(args: argparse.Namespace) -> tuple[set[str], list[str]]:
    """--quick applied, every option checked (ConfigError before any work): (parts skipped, policies)."""
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.quick:
        args.requests, args.prompt_len, args.output_len = min(args.requests, 16), "16,128", "16,128"
        args.chat_new_tokens = min(args.chat_new_tokens, 32)
    for lengths in (args.prompt_len, args.output_len):
        _range(lengths)  # LO,HI refused before any work
    require_at_least_one(args, "requests", "batch_size", "max_seqs", "latency_requests", "decode_seqs",
                         "chat_new_tokens")
    if args.load < 0 or args.rate < 0:
        raise ConfigError("--load and --rate must be >= 0")
    if not 0 <= args.kv_fraction <= 1:
        raise ConfigError(f"--kv-fraction must be in [0, 1], got {args.kv_fraction}")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or any(p not in POLICY_NAMES for p in policies):
        raise ConfigError(f"--policies takes a comma list of {', '.join(POLICY_NAMES)}, got {args.policies!r}")
    if args.peer:
        from scratchllm.bench import peers

        if "chat" in skip:
            raise ConfigError("--peer llama.cpp measures the chat batch; drop chat from --skip")
        if not peers.peer_installed():
            raise ConfigError("--peer llama.cpp needs llama-cpp-python, which is not installed: `make peers` builds "
                              "it from source for this CPU")
    return skip, policies


def _mixed(model: LoadedModel, args: argparse.Namespace, skip: set[str], policies: list[str], figs: dict[str, Any],
           ratios: dict[str, float]) -> None:
    """Part 1: the mixed workload's runs into figs (and its latency under load), their ratios."""
    prompts, outputs = workload(args.requests, _range(args.prompt_len), _range(args.output_len),
                                model.config.vocab_size, args.seed)
    arrivals = arrival_times(args.requests, args.rate, args.seed)
    runs: dict[str, dict[str, Any]] = {}
    if "static" not in skip:
        runs["static"] = run_static_mode(model, prompts, outputs, arrivals, args)
    if "same-seqs" not in skip:
        runs["continuous_same_seqs"] = run_continuous(model, prompts, outputs, arrivals, args, args.batch_size)
    # same KV memory as static reserved (without a static run: the engine's memory plan)
    budget = runs["static"]["peak_kv_bytes"] if "static" in runs else None
    for i, policy in enumerate(policies):
        runs["continuous" if i == 0 else f"continuous_{policy}"] = run_continuous(
            model, prompts, outputs, arrivals, args, args.max_seqs, budget, policy)
    if budget is not None and args.kv_fraction > 0:
        runs["continuous_small_kv"] = run_continuous(model, prompts, outputs, arrivals, args, args.max_seqs,
                                                     max(int(budget * args.kv_fraction),
                                                         _kv_floor(model, prompts, outputs)))
    if "static" in runs:
        _mixed_ratios(runs, ratios)
        same = sum(all(r["token_ids"][i] == runs["static"]["token_ids"][i] for r in runs.values())
                   for i in range(len(prompts)))
        figs["identical_outputs"] = f"{same}/{len(prompts)}"
    for r in runs.values():
        del r["token_ids"]
    _plot(args, runs)
    figs.update(runs)
    if args.rate <= 0 and args.load > 0 and "latency" not in skip and "static" in runs:
        figs["latency"] = lat = under_load(model, prompts, outputs, args, runs["static"]["requests_per_s"], budget,
                                           policies)
        st, co = lat["static"], lat["continuous"]
        ratios["p99_under_load_static_over_continuous"] = st["p99_ms"] / co["p99_ms"]
        ratios["p50_under_load_static_over_continuous"] = st["p50_ms"] / co["p50_ms"]
        ratios["kv_saving_under_load"] = 1.0 - co["peak_kv_bytes"] / st["peak_kv_bytes"]


def _kv_floor(model: LoadedModel, prompts: Sequence[Sequence[int]], outputs: Sequence[int]) -> int:
    """The smallest pool the engine takes the workload in: the longest request's whole blocks
    (it would refuse that request in less)."""
    from scratchllm.engine import EngineConfig
    from scratchllm.engine.kv_sizing import block_bytes

    bs = EngineConfig.block_size
    longest = max(-(-(len(p) + o) // bs) for p, o in zip(prompts, outputs, strict=True))
    return longest * block_bytes(model.config, bs, kv_dtype=BASELINE_KV_DTYPE)


def _mixed_ratios(runs: dict[str, dict[str, Any]], ratios: dict[str, float]) -> None:
    """Every continuous run against static: throughput, latency, KV."""
    stat, cont = runs["static"], runs["continuous"]
    ratios["throughput_continuous_over_static"] = cont["output_tok_s"] / stat["output_tok_s"]
    ratios["p99_static_over_continuous"] = stat["p99_ms"] / cont["p99_ms"]
    ratios["p50_static_over_continuous"] = stat["p50_ms"] / cont["p50_ms"]
    if "continuous_same_seqs" in runs:
        alike = runs["continuous_same_seqs"]
        ratios["kv_saving"] = 1.0 - alike["peak_kv_bytes"] / stat["peak_kv_bytes"]
        ratios["throughput_same_seqs_over_static"] = alike["output_tok_s"] / stat["output_tok_s"]
        ratios["p99_static_over_same_seqs"] = stat["p99_ms"] / alike["p99_ms"]
    if "continuous_small_kv" in runs:
        small = runs["continuous_small_kv"]
        ratios["kv_pool_small_over_static"] = small["kv_pool_bytes"] / stat["peak_kv_bytes"]
        ratios["throughput_small_kv_over_static"] = small["output_tok_s"] / stat["output_tok_s"]
        ratios["p99_static_over_small_kv"] = stat["p99_ms"] / small["p99_ms"]


def _policy_table(figs: dict[str, Any], policies: list[str]) -> dict[str, dict[str, Any]]:
    """The same-KV run under each admission policy, offline and under load, side by side."""
    table: dict[str, dict[str, Any]] = {}
    for i, policy in enumerate(policies):
        key = "continuous" if i == 0 else f"continuous_{policy}"
        run, load = figs[key], figs.get("latency", {}).get(key, {})
        table[policy] = {"output_tok_s": run["output_tok_s"], "p50_ms": run["p50_ms"], "p99_ms": run["p99_ms"],
                         "short_p99_ms": run["short_p99_ms"], "load_p99_ms": load.get("p99_ms"),
                         "load_short_p99_ms": load.get("short_p99_ms")}
    return table


def _chat(model: LoadedModel, args: argparse.Namespace, checkpoint: "Checkpoint", result: dict[str, Any]) -> None:
    """Part 3: the chat batch; with --peer, llama.cpp in a child before ours and one after (drift
    on a shared machine hits both sides)."""
    figs, ratios = result["figures"], result["ratios"]
    prompts = chat_prompts(args.model, checkpoint)
    peer_runs = []
    threads = args.threads or os.cpu_count() or 1
    if args.peer:
        from scratchllm.bench import peers

        peer_runs.append(peers.peer_batch(model.path, threads, prompts, args.chat_new_tokens))
    figs["chat"] = run_chat(model, prompts, args.chat_new_tokens, args.threads)
    if args.peer:
        peer_runs.append(peers.peer_batch(model.path, threads, prompts, args.chat_new_tokens))
        result["peer"] = {"name": args.peer, "version": peer_runs[0]["version"], "threads": threads,
                          "child_runs": len(peer_runs),
                          "chat_aggregate_tok_s": median([r["aggregate_tok_s"] for r in peer_runs])}
        ratios["chat_over_llama_cpp"] = figs["chat"]["aggregate_tok_s"] / result["peer"]["chat_aggregate_tok_s"]


def _plot(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> None:
    """--plot FILE.png: latency CDFs, output tokens/s and KV blocks over time of each mixed run.
    The per-request and per-token series are dropped from the result after (they are long)."""
    series = {name: run.pop("series") for name, run in runs.items() if "series" in run}
    if not args.plot:
        return
    from scratchllm.bench.plots import plot_runs, series_from_times

    names = {"static": "static", "continuous_same_seqs": "continuous (same seqs)",
             "continuous": "continuous (same KV)", "continuous_small_kv": "continuous (small KV)"}
    plot_runs([series_from_times(names.get(name, name.replace("_", " ")), s["arrivals"], s["finish"],
                                 s["token_times"], s["kv_samples"]) for name, s in series.items()],
              args.plot, title=f"bench engine: {args.requests} requests, {args.model}")
