"""A writer process for the cross-process tests: writes token records whose every field is a
function of the record's own index, so a reader can tell a torn record from a whole one.

    python writer_child.py RING RING_BYTES STEPS SLEEP_S SEED PROGRESS

Writes STEPS steps of 1-32 token records each (seeded sizes), sleeping SLEEP_S between steps.
Prints "ready" after the first step; after each step it writes the number of records committed
so far into the 8-byte file PROGRESS (a lower bound the parent can check against the ring after
killing this process; a file, not a pipe, so nobody has to drain it).
"""

import os
import struct
import sys
import time

import numpy as np

from scratchllm.trace import TraceWriter


def fields(index: np.ndarray) -> dict:  # [k] uint64 record indices -> the values those records hold
    v = index.astype(np.uint64)
    return {"requests": v * np.uint64(0x9E3779B97F4A7C15), "positions": (v % np.uint64(2**32)).astype(np.uint32),
            "token_ids": (v % np.uint64(2**31)).astype(np.int32), "latency_ns": (v * np.uint64(3)).astype(np.int64),
            "kv_blocks": (v % np.uint64(1000)).astype(np.uint32)}


def consistent(tokens: np.ndarray) -> np.ndarray:  # TOKEN_DTYPE records -> [n] bool: fields agree with seq
    want = fields(tokens["seq"] - np.uint64(1))
    ok = np.ones(len(tokens), bool)
    for name, key in (("request", "requests"), ("position", "positions"), ("token_id", "token_ids"),
                      ("latency_ns", "latency_ns"), ("kv_blocks", "kv_blocks")):
        ok &= tokens[name] == want[key]
    return ok


def main(argv) -> None:
    path, ring_bytes, steps, sleep_s = argv[0], int(argv[1]), int(argv[2]), float(argv[3])
    rng = np.random.default_rng(int(argv[4]))
    progress = os.open(argv[5], os.O_RDWR | os.O_CREAT, 0o644)
    w = TraceWriter(path, ring_bytes=ring_bytes)
    for step in range(steps):
        k = int(rng.integers(1, 33))
        idx = np.arange(w.written, w.written + k, dtype=np.uint64)
        f = fields(idx)
        w.tokens(f["requests"], f["positions"], f["token_ids"], f["latency_ns"], kv_blocks=f["kv_blocks"],
                 step=step)
        os.pwrite(progress, struct.pack("<Q", w.written), 0)
        if step == 0:
            print("ready", flush=True)
        if sleep_s:
            time.sleep(sleep_s)
    w.close()


if __name__ == "__main__":
    main(sys.argv[1:])
