"""One row of x against each weight matrix of a model's first block and its LM head, one thread:
microseconds per product and CPU cycles per 32 weights, the unit the 4-bit kernel's notes use
(docs/kernels.md). The matrices stay in cache between repeats (the first block's fit in L2 on the
default model), so this is the kernel's arithmetic, not the memory system; `bench generate`
measures a whole decode step.

    PYTHONPATH=. python scripts/gemv_cycles.py [MODEL] [--ghz 3.05] [--rounds 9] [--json]

Cycles are time x --ghz: a virtual machine does not let us read the clock it runs at, so the
figure is only as true as the clock given. Each row is the fastest of --rounds timings (each
long enough for about 20 M weights), which is the least disturbed by other jobs on the core.
"""

import argparse
import json
import time

import numpy as np


def measure(model_ref: str, rounds: int, ghz: float) -> list[dict]:
    from scratchllm.kernels import pool
    from scratchllm.llm import LLM

    params = LLM(model_ref, threads=1).model.params
    weights = params.layers[0].matrices() | {"lm_head": params.lm_head}
    pool.set_num_threads(1)
    rows = []
    for name, w in weights.items():
        K, N = w.shape
        x = np.random.default_rng(0).standard_normal((1, K)).astype(np.float32)
        out = np.empty((1, N), np.float32)
        repeat = max(3, int(2e7 // (K * N)))
        for _ in range(3):  # warm: the panels into cache, the prepared product bound once
            w.matmul_into(x, out)
        best = float("inf")
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(repeat):
                w.matmul_into(x, out)
            best = min(best, (time.perf_counter() - t) / repeat)
        rows.append({"matrix": name, "k": K, "n": N, "panels": type(w.panels).__name__, "us": best * 1e6,
                     "cycles_per_32_weights": best * ghz * 1e9 / (K * N / 32)})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="default", help="model reference (default: the default model)")
    parser.add_argument("--ghz", type=float, default=3.05, help="the core's clock, for cycles (default 3.05)")
    parser.add_argument("--rounds", type=int, default=9, help="timings per matrix; the fastest is kept (default 9)")
    parser.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.ghz <= 0:
        parser.error("--rounds must be >= 1 and --ghz > 0")
    rows = measure(args.model, args.rounds, args.ghz)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"one thread, fastest of {args.rounds}, cycles at {args.ghz} GHz")
    for r in rows:
        print(f"{r['matrix']:<13}{r['k']:>6} x {r['n']:<6}{r['panels']:<10}{r['us']:>9.1f} us"
              f"{r['cycles_per_32_weights']:>7.2f} cycles / 32 weights")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
