"""CPU time of a single-stream decode step: the model's forward (the step's workspace, fused
norms; scratchllm/models/workspace.py; its blocks in one C call, kernels/llama_blocks.pyx)
against the same forward with the blocks looped in Python (`python_loop`) and the
block-by-block forward (`block_by_block`), which both must equal.

Both run in this process on one thread, on caches of their own, in alternating chunks of a few
steps (which one goes first alternates too), so that both meet the same machine: on cores
shared with other jobs wall time says little, and a step's CPU time (time.thread_time, one BLAS
thread: all of the step's work is this thread's) is what the step would take with a core to
itself. Every step's logits of the two are compared with np.array_equal; a difference stops the
run. Prints ms per step of each (mean, median, best chunk) and the median of the paired
differences, which the machine's drift affects least.

Usage: python scripts/decode_workspace_ab.py [--model default] [--chunks 100] [--chunk-steps 10]
"""

import argparse
import json
import time

import numpy as np

from scratchllm.engine.paged_attention import PagedSequence
from scratchllm.models import load_model
from scratchllm.models.llama import llama
from scratchllm.models.threads import set_blas_threads, single_blas_thread

PROMPT = 16  # prompt tokens before decoding; contexts then run from PROMPT to PROMPT + MAX_NEW
MAX_NEW = 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--chunks", type=int, default=100, help="chunks per variant")
    parser.add_argument("--chunk-steps", type=int, default=10, help="decode steps per chunk")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    set_blas_threads(1)
    model = load_model(args.model, dtype=args.dtype)

    def block_by_block(ids, pos, cache, logits_rows=None):
        with single_blas_thread():
            return llama(ids, pos, cache, model.params, model.config, logits_rows)  # no workspace

    def python_loop(ids, pos, cache, logits_rows=None):  # the workspace, its blocks called from Python
        blocks, model.params.blocks = model.params.blocks, None
        try:
            return model.forward(ids, pos, cache, logits_rows)
        finally:
            model.params.blocks = blocks

    variants = {"workspace": model.forward, "python_loop": python_loop, "block_by_block": block_by_block}
    prompt = np.arange(PROMPT) % model.config.vocab_size

    def start(forward):  # a new sequence: its cache and the logits of its prompt
        cache = PagedSequence(model.config, PROMPT + MAX_NEW + 1)
        return cache, forward(prompt, np.arange(PROMPT), cache, logits_rows=[-1])

    state = {name: start(f) for name, f in variants.items()}
    ms = {name: [] for name in variants}
    for c in range(args.chunks):
        if state["workspace"][0].length + args.chunk_steps > PROMPT + MAX_NEW:
            state = {name: start(f) for name, f in variants.items()}
        logits = {}
        for name in list(variants)[:: 1 if c % 2 else -1]:  # the order alternates
            cache, out = state[name]
            steps = []
            t = time.thread_time()
            for _ in range(args.chunk_steps):
                out = variants[name](np.array([int(np.argmax(out[-1]))]), np.array([cache.length]), cache)
                steps.append(out)
            ms[name].append(1e3 * (time.thread_time() - t) / args.chunk_steps)
            state[name], logits[name] = (cache, out), steps
        for other in ("python_loop", "block_by_block"):
            for a, b in zip(logits["workspace"], logits[other], strict=True):
                if not np.array_equal(a, b):
                    raise SystemExit(f"logits differ from {other}'s (max {np.abs(a - b).max()}): the forward is wrong")
    diff = np.array(ms["block_by_block"]) - np.array(ms["workspace"])
    c_diff = np.array(ms["python_loop"]) - np.array(ms["workspace"])
    result = {name: {"mean_ms": float(np.mean(v)), "median_ms": float(np.median(v)), "best_chunk_ms": float(np.min(v))}
              for name, v in ms.items()}
    result["saved_ms_median_of_pairs"] = float(np.median(diff))
    result["c_blocks_saved_ms_median_of_pairs"] = float(np.median(c_diff))  # against python_loop
    result["steps_each"] = args.chunks * args.chunk_steps
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for name in variants:
        r = result[name]
        print(f"{name:<15} CPU ms per decode step: mean {r['mean_ms']:.3f}, median {r['median_ms']:.3f}, "
              f"best chunk {r['best_chunk_ms']:.3f}")
    print(f"saved against block by block: {result['saved_ms_median_of_pairs']:.3f} ms per step, against the "
          f"Python loop over the blocks: {result['c_blocks_saved_ms_median_of_pairs']:.3f} (medians of "
          f"{args.chunks} paired chunks; every step's logits equal)")


if __name__ == "__main__":
    main()
