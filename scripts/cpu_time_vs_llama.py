"""Ours against llama-bench on one thread each, by CPU time per token: a comparison that other jobs
on the cores do not distort the way they distort wall time (llama.cpp's threads wait for each
other at every operation, so a busy machine slows its two-thread figures many times over).

    PYTHONPATH=. python scripts/cpu_time_vs_llama.py qwen2.5-coder-1.5b --mode prefill --rounds 3
    PYTHONPATH=. python scripts/cpu_time_vs_llama.py FILE.gguf --mode decode --dtype int8

Ours: the forward's thread CPU time (time.thread_time; one kernel thread, so all of a step's work
is this thread's). llama.cpp: `llama-bench -t 1`'s user + system time as a child process, the
difference of two runs of different lengths (8 and 40 generated tokens, or prompts of 64 and
320), so that its load, warm-up and exit cancel; ours takes the same difference for a prefill and
times the 32 tokens after a 16-token prompt for a decode (nothing to cancel there). Rounds
alternate which side goes first; the last line gives the medians and the speed ratio
(ours / llama.cpp > 1: ours is faster). CPU time still counts the cycles a core waits for memory,
so a memory-bound decode is measured as it runs; it does not show how two threads share the
memory system (`scratchllm bench peers` does, on a quiet machine). Needs `make peers`.
"""

import argparse
import os
import resource
import subprocess
import sys
import time

import numpy as np

LENGTHS = {"decode": (8, 40), "prefill": (64, 320)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a GGUF model reference or file")
    parser.add_argument("--mode", choices=sorted(LENGTHS), default="decode")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto", help="ours: the weights' dtype (default auto)")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from scratchllm.bench import llama_tools
    from scratchllm.engine.paged_attention import PagedSequence
    from scratchllm.formats.refs import resolve_model
    from scratchllm.kernels import pool
    from scratchllm.models import load_model
    from scratchllm.models.bert import BertModel
    from scratchllm.models.threads import set_blas_threads

    exe = llama_tools.tool("llama-bench")
    if exe is None:
        print("llama-bench is not built: run `make peers`", file=sys.stderr)
        return 2
    path = str(resolve_model(args.model))
    set_blas_threads(1)
    pool.set_num_threads(1)
    model = load_model(path, dtype=args.dtype)
    if isinstance(model, BertModel):
        print(f"{args.model} is an encoder: nothing to decode", file=sys.stderr)
        return 2
    short, long = LENGTHS[args.mode]

    def ours() -> float:  # CPU seconds per token
        if args.mode == "decode":
            cache = PagedSequence(model.config, 16 + long + 2)
            logits = model.forward(np.arange(16), np.arange(16), cache, logits_rows=[-1])
            t = time.thread_time()
            for _ in range(long - short):
                logits = model.forward(np.array([int(np.argmax(logits[-1]))]), np.array([cache.length]), cache)
            return (time.thread_time() - t) / (long - short)
        spent = []
        for n in (short, long):
            cache = PagedSequence(model.config, n + 2)
            t = time.thread_time()
            model.forward(np.arange(n) * 7919 % model.config.vocab_size, np.arange(n), cache, logits_rows=[-1])
            spent.append(time.thread_time() - t)
        return (spent[1] - spent[0]) / (long - short)

    def cpu_seconds(n: int) -> float:
        lengths = ["-p", "0", "-n", str(n)] if args.mode == "decode" else ["-p", str(n), "-n", "0"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([str(exe), "-m", path, "-t", "1", "-r", "1", "--no-warmup", *lengths], capture_output=True,
                       check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime

    def theirs() -> float:
        return (cpu_seconds(long) - cpu_seconds(short)) / (long - short)

    ours()  # warm: the panels in memory, buffers made
    got: dict[str, list[float]] = {"ours": [], "llama.cpp": []}
    for r in range(args.rounds):
        sides = [("ours", ours), ("llama.cpp", theirs)]
        for name, fn in sides if r % 2 == 0 else sides[::-1]:
            got[name].append(fn())
        print(f"round {r}: ms per token, ours {1e3 * got['ours'][-1]:.2f}, llama.cpp {1e3 * got['llama.cpp'][-1]:.2f}"
              f" (load average {os.getloadavg()[0]:.1f})", flush=True)
    o, l = float(np.median(got["ours"])), float(np.median(got["llama.cpp"]))
    print(f"{args.mode}, one thread, CPU ms per token (medians of {args.rounds}): ours ({model.dtype}) {1e3 * o:.2f}, "
          f"llama.cpp {1e3 * l:.2f}; ours / llama.cpp speed {l / o:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
