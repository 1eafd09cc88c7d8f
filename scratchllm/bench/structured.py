"""Structured output: what a grammar mask costs per token, and throughput with and without it.

mask: over the 50 schemas of scratchllm/bench/schemas.py, a seeded random walk through each
grammar (each token drawn uniformly from the allowed ones, at most --walk tokens), timing per
token the mask computation (llguidance + unpacking the bitmask to [V] bools, on the matcher's
background thread), applying it to a [V] logits row, and consuming the token. No model: this
is the grammar's own cost.

engine (--engine N, 0 = skip): N concurrent requests on the default model, the same chat prompt,
greedy, once unconstrained and once each with a JSON schema, in the same run. Reports generated
tokens/s of both and their ratio, and for the constrained run the time the sampler waited for
masks against the time spent computing them (masks are computed on a background thread while
the forward runs, so waiting should be a small part of computing).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from scratchllm.bench.common import machine_facts, median
from scratchllm.bench.schemas import schemas

if TYPE_CHECKING:
    from scratchllm.llm import LLM
    from scratchllm.structured.grammar import CompiledGrammar, GrammarCompiler
    from scratchllm.structured.matcher import GrammarMatcher
    from scratchllm.tokenizer import Tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--walk", type=int, default=48, help="tokens per schema in the mask walk (default 48)")
    parser.add_argument("--engine", type=int, default=0, help="concurrent requests for the engine run (0 = skip)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per request in the engine run")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the generated inputs")


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else 0.0


def mask_walk(tok: Tokenizer, compiler: GrammarCompiler, walk: int, seed: int) -> dict[str, Any]:
    from scratchllm.structured import apply_mask

    rng = np.random.default_rng(seed)
    compute: list[float] = []
    apply: list[float] = []
    consume: list[float] = []
    compile_ms: list[float] = []
    row = np.zeros(tok.vocab_size, dtype=np.float32)
    for schema in schemas():
        t = time.perf_counter()
        m = compiler.json_schema(schema).new_matcher()
        compile_ms.append((time.perf_counter() - t) * 1e3)
        for _ in range(walk):
            before = m.compute_s
            allowed = m.allowed()  # waits for the background computation: compute_s is final
            compute.append(m.compute_s - before)
            t = time.perf_counter()
            apply_mask(row.copy(), allowed)
            apply.append(time.perf_counter() - t)
            token = int(rng.choice(np.nonzero(allowed)[0]))
            if token == tok.eos_token_id:
                break
            t = time.perf_counter()
            m.consume(token)
            consume.append(time.perf_counter() - t)
    us = 1e6
    return {"tokens": len(compute), "compile_ms_median": median(compile_ms),
            "compute_us_median": median(compute) * us, "compute_us_p90": _pct(compute, 90) * us,
            "apply_us_median": median(apply) * us, "consume_us_median": median(consume) * us}


def engine_run(llm: LLM, compiler: GrammarCompiler, n: int, max_tokens: int) -> dict[str, Any]:
    from scratchllm.sampling import SamplingParams
    from scratchllm.structured import guide_for

    prompt = llm.apply_chat_template([{"role": "user", "content": "Give an example JSON value."}])
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    grammars = [compiler.json_schema(s) for s in schemas()[:n]]
    engine = llm.engine
    # Warm the prompt's prefix cache first, so neither timed run pays a prefill the other skips.
    engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
    out: dict[str, Any] = {}
    grammar_of: Callable[[int], CompiledGrammar | None]
    for name, grammar_of in (("unconstrained", lambda i: None), ("json_schema", lambda i: grammars[i])):
        t = time.perf_counter()
        reqs = [engine.add_request(None, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                             grammar=grammar_of(i)))
                for i in range(n)]
        while engine.has_work():
            engine.step()
        wall = time.perf_counter() - t
        tokens = sum(r.num_output_tokens for r in reqs)
        out[name] = {"tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall}
        if name == "json_schema":
            matchers: list[GrammarMatcher] = []
            for r in reqs:
                m = guide_for(r)
                assert m is not None, "a request with a grammar has its matcher"
                matchers.append(m)
            out[name]["mask_compute_s"] = sum(m.compute_s for m in matchers)
            out[name]["mask_wait_s"] = sum(m.wait_s for m in matchers)
            out[name]["masks"] = sum(m.num_masks for m in matchers)
            out[name]["masks_late"] = sum(m.num_late for m in matchers)
            # a matcher made at its request's first sample cannot have its first mask early
            out[name]["masks_late_after_first"] = sum(m.num_late - m.first_late for m in matchers)
    out["throughput_ratio"] = out["json_schema"]["tok_per_s"] / out["unconstrained"]["tok_per_s"]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from scratchllm.structured import GrammarCompiler

    if args.engine:
        from scratchllm.llm import LLM

        llm = LLM("default")
        tok = llm.tokenizer
    else:
        from scratchllm.tokenizer import Tokenizer

        llm, tok = None, Tokenizer.from_pretrained("default")
    compiler = GrammarCompiler(tok)
    inputs = {"walk": args.walk, "engine": args.engine, "max_tokens": args.max_tokens, "seed": args.seed}
    result: dict[str, Any] = {"inputs": inputs,
                              "mask": mask_walk(tok, compiler, args.walk, args.seed), "machine": machine_facts()}
    if llm is not None:
        result["engine"] = engine_run(llm, compiler, args.engine, args.max_tokens)
    return result


def render(result: dict[str, Any]) -> str:
    m = result["mask"]
    lines = [f"grammar masks over 50 JSON schemas, {m['tokens']} tokens (vocabulary of the default model)",
             f"  compile per schema   {m['compile_ms_median']:8.2f} ms (median)",
             f"  mask per token       {m['compute_us_median']:8.1f} us median, {m['compute_us_p90']:.1f} us p90",
             f"  apply to logits row  {m['apply_us_median']:8.1f} us median",
             f"  consume a token      {m['consume_us_median']:8.1f} us median"]
    e = result.get("engine")
    if e:
        u, j = e["unconstrained"], e["json_schema"]
        lines += [f"engine, {result['inputs']['engine']} concurrent requests, greedy:",
                  f"  unconstrained  {u['tok_per_s']:8.1f} tok/s ({u['tokens']} tokens, {u['wall_s']:.1f} s)",
                  f"  json_schema    {j['tok_per_s']:8.1f} tok/s ({j['tokens']} tokens, {j['wall_s']:.1f} s)",
                  f"  ratio          {e['throughput_ratio']:8.3f}",
                  f"  masks: computed {j['mask_compute_s'] * 1e3:.1f} ms, "
                  f"sampler waited {j['mask_wait_s'] * 1e3:.1f} ms; late: {j['masks_late']} of {j['masks']} "
                  f"({j['masks_late_after_first']} after each request's first)"]
    return "\n".join(lines)
