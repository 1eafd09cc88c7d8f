"""Giving the heap's free pages back (models/heap.py): a heap with its middle freed shrinks when
asked, and the engine asks each time its work ends (not at every step, not while idle)."""

import subprocess
import sys
import threading
import time

import pytest

from scratchllm.engine import AsyncEngine, EngineConfig, LLMEngine, async_engine
from scratchllm.sampling import SamplingParams
from tests.engine.tiny import tiny_llama

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim: Linux")

FRAGMENTED = """
import re, sys
from scratchllm.models.heap import release_free_heap
def rss_mb():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024
blocks = [bytearray(1000) for _ in range(150_000)]  # 150 MB of heap (each under the mmap threshold)
keep = blocks[-1]  # the top of the heap stays in use, so free() alone cannot shrink it
del blocks
before = rss_mb()
print(release_free_heap(), before, rss_mb())
"""


def test_a_heap_freed_in_the_middle_goes_back_to_the_kernel_when_asked():
    out = subprocess.run([sys.executable, "-c", FRAGMENTED], capture_output=True, text=True, check=True).stdout
    released, before, after = out.split()
    assert released == "True"
    assert float(before) - float(after) > 100, out  # of the 150 MB freed, all but what partly used pages hold


def test_the_engine_releases_the_heap_when_its_work_ends(monkeypatch):
    calls: list[float] = []
    lock = threading.Lock()

    def count() -> bool:
        with lock:
            calls.append(time.monotonic())
        return True

    monkeypatch.setattr(async_engine, "release_free_heap", count)
    engine = AsyncEngine(LLMEngine(tiny_llama(seed=5), EngineConfig(num_kv_blocks=64)))
    try:
        time.sleep(0.1)
        assert calls == []  # idle from the start: nothing ended
        for _ in range(2):
            events = list(engine.submit([1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0)))
            assert events[-1].finish_reason == "length"
            time.sleep(0.1)  # the engine thread sees it has no work left
        assert len(calls) == 2  # once per end of work, not per step (each request ran 8)
        time.sleep(0.1)
        assert len(calls) == 2  # and not while idle
    finally:
        engine.shutdown()
