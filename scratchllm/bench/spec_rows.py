"""`bench spec --row-cost`: what a verification row costs. One forward of the target (and of the
draft model) over 1, 2, 3, 4, 6 and 8 new rows after a context of --row-context tokens, in a
child process of its own, each size in turn for --row-repeats rounds: the median wall and CPU
time (every thread of the process: on a shared machine the CPU time is the steadier). A row past
the first costing a small share of the first says drafting is nearly free; a large share says
only drafts that are likely accepted pay (docs/speculative-decoding.md, "When it pays").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from scratchllm.bench.common import median

ROWS = (1, 2, 3, 4, 6, 8)


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    from scratchllm.engine.load import load_weights
    from scratchllm.engine.paged_attention import PagedSequence
    from scratchllm.models.threads import set_blas_threads

    set_blas_threads(spec["threads"])
    model, _ = load_weights(spec["model"], "auto", False)
    n = spec["context"]
    ids = np.random.default_rng(0).integers(100, min(20000, model.config.vocab_size), n + max(ROWS))
    # each forward appends its rows: the context grows from n by the rows measured before it
    cache = PagedSequence(model.config, n + spec["repeats"] * sum(ROWS) + 1, num_threads=spec["threads"],
                          kv_dtype="float16")
    model.forward(ids[:n], np.arange(n), cache, logits_rows=[n - 1])
    wall: dict[int, list[float]] = {r: [] for r in ROWS}
    cpu: dict[int, list[float]] = {r: [] for r in ROWS}
    for _ in range(spec["repeats"]):
        for r in ROWS:
            t, c = time.perf_counter(), time.process_time()
            model.forward(ids[n : n + r], np.arange(cache.length, cache.length + r), cache, logits_rows=list(range(r)))
            wall[r].append(time.perf_counter() - t)
            cpu[r].append(time.process_time() - c)
    return {"wall_ms": {r: 1e3 * median(v) for r, v in wall.items()},
            "cpu_ms": {r: 1e3 * median(v) for r, v in cpu.items()}, "dtype": model.dtype}


def child_main() -> None:
    print(json.dumps(_child(json.loads(sys.argv[1]))))


def measure(models: list[str], threads: int, context: int, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {"context": context, "repeats": repeats, "models": {}, "loadavg_1min": []}
    for model in dict.fromkeys(models):
        code = "from scratchllm.bench.spec_rows import child_main; child_main()"
        spec = {"model": model, "threads": threads, "context": context, "repeats": repeats}
        done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True,
                              timeout=3600, check=True)
        out["models"][model] = json.loads(done.stdout.strip().splitlines()[-1])
        out["loadavg_1min"].append(os.getloadavg()[0])
    return out


def render(s: dict[str, Any]) -> list[str]:
    lines = ["", f"a forward's time by rows, after {s['context']} tokens of context (medians of {s['repeats']}; "
                 "CPU: every thread's):", f"{'model':<24}{'':<6}" + "".join(f"{r:>8}" for r in ROWS)]
    for model, m in s["models"].items():
        for kind in ("wall_ms", "cpu_ms"):
            values = [m[kind][str(r)] if str(r) in m[kind] else m[kind][r] for r in ROWS]
            lines.append(f"{model:<24}{kind[:-3]:<6}" + "".join(f"{v:>8.1f}" for v in values))
        cpu = m["cpu_ms"]
        first = cpu.get("1", cpu.get(1))
        last = cpu.get(str(ROWS[-1]), cpu.get(ROWS[-1]))
        lines.append(f"{'':<24}a row past the first: {(last - first) / (ROWS[-1] - 1) / first:.0%} of the first "
                     "(CPU)")
    return lines
