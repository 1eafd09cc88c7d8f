"""Do a GGUF model's logits on the exact path equal float32's bit for bit? Loads the file twice
(dtype `quantized`: the file's quantized blocks, exact float32 products; and float32: every matrix
widened), runs the same prefill and greedy decode steps through both on the engine's paged
attention, and compares every logit with np.array_equal. Exits 1 at the first difference. (The
default dtype, `auto`, is `int8` for such a file: close to float32, not equal; `scratchllm bench
accuracy` measures how close.)

    PYTHONPATH=. python scripts/check_bit_equal.py FILE.gguf [--prompt-tokens 40] [--steps 4]

float32 needs 4 bytes per weight of memory: a 1.1B model takes about 4.5 GB.
"""

import argparse
import json
import sys
import time

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a GGUF file (or `default`)")
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--steps", type=int, default=4, help="greedy decode steps after the prefill")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from scratchllm.engine.paged_attention import PagedSequence
    from scratchllm.models import load_model

    t = time.perf_counter()
    models = {dtype: load_model(args.model, dtype=dtype) for dtype in ("quantized", "float32")}
    load_s = time.perf_counter() - t
    cfg = models["quantized"].config
    ids = np.random.default_rng(0).integers(min(100, cfg.vocab_size // 2), cfg.vocab_size, args.prompt_tokens)
    caches = {d: PagedSequence(cfg, args.prompt_tokens + args.steps + 1) for d in models}
    logits = {d: m.forward(ids, np.arange(len(ids)), caches[d]) for d, m in models.items()}
    report = {"model": str(args.model), "dtype": models["quantized"].dtype, "prompt_tokens": args.prompt_tokens,
              "steps": args.steps, "load_s": round(load_s, 1), "rows_compared": 0, "equal": True}
    for step in range(args.steps + 1):
        a, b = logits["quantized"], logits["float32"]
        report["rows_compared"] += a.shape[0]
        if not np.array_equal(a, b):
            report.update(equal=False, first_difference={"step": step, "max_abs": float(np.abs(a - b).max())})
            break
        if step == args.steps:
            break
        token = np.array([int(np.argmax(a[-1]))])
        pos = np.array([caches["quantized"].length])
        logits = {d: m.forward(token, pos, caches[d]) for d, m in models.items()}
    if args.json:
        print(json.dumps(report))
    else:
        verdict = "equal bit for bit" if report["equal"] else f"DIFFER: {report['first_difference']}"
        print(f"{report['model']} ({report['dtype']} vs float32): {report['rows_compared']} rows of logits "
              f"({args.prompt_tokens}-token prefill, {args.steps} decode steps) {verdict}")
    return 0 if report["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
