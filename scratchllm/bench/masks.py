"""The attention mask generator: 3-D masks [batch, q_len, k_len] for variable-length
batches. Three implementations of each mask (scratchllm/engine/masks.py, tested equal):
  python     - the starting point, as the design article writes it: a nested list comprehension, one Python bool each
  row loop   - a Python loop over (sequence, query row) filling slices
  vectorized - NumPy broadcasting, one comparison pass over the output
Times are medians of interleaved runs (all three see the same noise from other jobs); ratios are
python / vectorized and row loop / vectorized. The element-wise python version is skipped above
--python-max-elements (it needs about a second per 2M elements).

Cases: the packed prefill and decode (right-aligned variable lengths, `varlen_causal_mask`) and
the static baseline's left-padded prefill (`left_padded_causal_mask`).
"""

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from scratchllm.bench.common import machine_facts, median
from scratchllm.engine import masks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", default="8,64", help="batch sizes (default 8,64)")
    parser.add_argument("--max-len", type=int, default=512, help="longest sequence (default 512)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per figure (median)")
    parser.add_argument("--python-max-elements", type=int, default=2_000_000,
                        help="largest mask timed with the element-wise Python version")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the generated inputs")


def _once(fn: Callable[..., object], *a: Any) -> float:
    t = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    rows: list[dict[str, Any]] = []
    for B in [int(b) for b in str(args.batch).split(",") if b]:
        k_lens = rng.integers(16, args.max_len + 1, B)
        K = int(k_lens.max())
        cases = {
            "varlen prefill": ("varlen_causal_mask", (k_lens, k_lens)),
            "varlen decode": ("varlen_causal_mask", (np.ones(B, int), k_lens)),
            "left-padded prefill": ("left_padded_causal_mask", (K - k_lens, K, K)),
        }
        for name, (fn, a) in cases.items():
            impls: dict[str, Callable[..., np.ndarray]] = {"vectorized": getattr(masks, fn),
                                                            "row loop": getattr(masks, fn + "_loop")}
            shape = impls["vectorized"](*a).shape
            if np.prod(shape) <= args.python_max_elements:
                impls["python"] = getattr(masks, fn + "_python")
                pa = tuple(x.tolist() if isinstance(x, np.ndarray) else x for x in a)
            want = impls["vectorized"](*a)
            for label, impl in impls.items():
                got = impl(*(pa if label == "python" else a))
                assert np.array_equal(got, want), f"{label} disagrees with vectorized"
            times: dict[str, list[float]] = {label: [] for label in impls}
            repeat = args.repeat
            for _ in range(repeat):
                for label, impl in impls.items():
                    if label == "python" and len(times["python"]) >= 1 and repeat > 3:
                        continue  # seconds per run: one is enough beside the others' medians
                    times[label].append(_once(impl, *(pa if label == "python" else a)))
            ms = {label: median(t) * 1e3 for label, t in times.items()}
            row = {"case": name, "batch": B, "shape": list(shape), "ms": ms,
                   "loop_over_vectorized": ms["row loop"] / ms["vectorized"]}
            if "python" in ms:
                row["python_over_vectorized"] = ms["python"] / ms["vectorized"]
            rows.append(row)
    ratios: dict[str, float] = {}
    for r in rows:
        key = f"{r['case']} B={r['batch']}"
        ratios[key + " row loop/vectorized"] = r["loop_over_vectorized"]
        if "python_over_vectorized" in r:
            ratios[key + " python/vectorized"] = r["python_over_vectorized"]
    return {"inputs": {"batch": args.batch, "max_len": args.max_len, "repeat": args.repeat, "seed": args.seed},
            "figures": rows, "ratios": ratios,
            "goal": "masks on the CPU, vectorized NumPy instead of a Python list comprehension (no figure given)",
            "machine": machine_facts()}


def render(result: dict[str, Any]) -> str:
    lines = ["3-D attention masks [batch, q_len, k_len]: medians, ms (lower is better)",
             f"{'case':<21}{'batch':>6}  {'shape':<16}{'vectorized':>11}{'row loop':>10}{'python':>10}"
             f"{'loop/vec':>10}{'python/vec':>11}"]
    for r in result["figures"]:
        ms = r["ms"]
        shape = "x".join(map(str, r["shape"]))
        py = f"{ms['python']:>10.1f}" if "python" in ms else f"{'-':>10}"
        pr = f"{r['python_over_vectorized']:>10.0f}x" if "python_over_vectorized" in r else f"{'-':>11}"
        lines.append(f"{r['case']:<21}{r['batch']:>6}  {shape:<16}{ms['vectorized']:>11.3f}{ms['row loop']:>10.3f}"
                     f"{py}{r['loop_over_vectorized']:>9.1f}x{pr}")
    return "\n".join(lines)
