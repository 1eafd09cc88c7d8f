"""The cache simulator against pycachesim on shared traces, and against counts worked out by hand."""

import numpy as np
import pytest

from scratchllm.kernels import cachesim
from scratchllm.kernels.cachesim import CacheConfig, simulate


def _reference(trace: np.ndarray, levels: list[CacheConfig], elem_bytes: int) -> list[tuple[int, int, int]]:
    """(accesses, hits, misses) per level from pycachesim, the same hierarchy loading through."""
    cachesim_ref = pytest.importorskip("cachesim", reason="pycachesim is a test requirement")
    memory = cachesim_ref.MainMemory()
    below, caches = None, []
    for level in reversed(levels):  # pycachesim builds from the last level up
        below = cachesim_ref.Cache(level.name, level.sets, level.ways, level.line_bytes, "LRU",
                                   load_from=below, store_to=below)
        caches.insert(0, below)
    memory.load_to(caches[-1])
    memory.store_from(caches[-1])
    sim = cachesim_ref.CacheSimulator(caches[0], memory)
    for address in trace.tolist():
        sim.load(address, length=elem_bytes)
    return [(c.stats()["LOAD_count"], c.stats()["HIT_count"], c.stats()["MISS_count"]) for c in caches]


HIERARCHIES = {
    "direct-mapped L1": [CacheConfig("L1", 1024, 64, 1)],
    "fully associative": [CacheConfig("L1", 2048, 64, 32)],
    "two levels": [CacheConfig("L1", 1024, 64, 2), CacheConfig("L2", 4096, 64, 4)],
    "three levels, 32 B lines": [CacheConfig("L1", 512, 32, 2), CacheConfig("L2", 2048, 32, 4),
                                 CacheConfig("L3", 8192, 32, 8)],
    "Zen 4 shape, scaled down": [CacheConfig("L1", 4096, 64, 8), CacheConfig("L2", 16384, 64, 8)],
}

TRACES = {
    "naive n=24 fp32": lambda: (cachesim.naive_trace(24, 4), 4),
    "naive n=20 fp64": lambda: (cachesim.naive_trace(20, 8), 8),
    "blocked n=24 T=8": lambda: (cachesim.blocked_trace(24, 8, 4), 4),
    "blocked n=30 T=7 fp64": lambda: (cachesim.blocked_trace(30, 7, 8), 8),
    "packed n=37": lambda: (cachesim.packed_trace(37, mc=12, kc=16, nc=32), 4),
}


def _all_references() -> dict:
    out = {}
    for trace_name, make in TRACES.items():
        trace, elem = make()
        for hierarchy, levels in HIERARCHIES.items():
            out[(hierarchy, trace_name)] = _reference(trace, levels, elem)
    return out


@pytest.fixture(scope="module")
def references():
    """pycachesim's counts, computed in a fresh process: inside the full suite's process (torch,
    Ray and the rest loaded) its C simulator returned counts that changed from run to run, while
    a fresh process gives the same counts every time."""
    pytest.importorskip("cachesim", reason="pycachesim is a test requirement")
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_all_references)


@pytest.mark.parametrize("hierarchy", list(HIERARCHIES))
@pytest.mark.parametrize("trace_name", list(TRACES))
def test_equal_counts_to_pycachesim(hierarchy, trace_name, references):
    levels = HIERARCHIES[hierarchy]
    trace, elem = TRACES[trace_name]()
    ours = [(s.accesses, s.hits, s.misses) for s in simulate(trace, levels)]
    assert ours == references[(hierarchy, trace_name)]


def test_counts_worked_out_by_hand():
    # 2 sets x 2 ways x 64 B lines. Line L goes to set L % 2.
    # addr: 0    64   128  0    256  64   192  128  8    320
    # line: 0    1    2    0    4    1    3    2    0    5
    # set:  0    1    0    0    0    1    1    0    0    1
    # set 0 LRU, oldest first: [0] [0,2] hit0->[2,0] [0,4] evicts 2; then 2 misses, evicts 0 -> [4,2];
    #                          line 0 (addr 8) misses, evicts 4 -> [2,0]
    # set 1: [1] hit1 [1] [1,3]; line 5 misses, evicts 1 -> [3,5]
    trace = np.array([0, 64, 128, 0, 256, 64, 192, 128, 8, 320])
    hits = [False, False, False, True, False, True, False, False, False, False]
    [l1] = simulate(trace, [CacheConfig("L1", 256, 64, 2)])
    assert (l1.accesses, l1.hits, l1.misses) == (10, sum(hits), 10 - sum(hits))
    # The same trace through a second, fully associative level of 4 lines: it sees the 8 misses,
    # lines 0 1 2 4 3 2 0 5. LRU: [0 1 2 4], 3 evicts 0 -> [1 2 4 3], 2 hits -> [1 4 3 2],
    # 0 misses (evicts 1), 5 misses: one hit.
    _, l2 = simulate(trace, [CacheConfig("L1", 256, 64, 2), CacheConfig("L2", 256, 64, 4)])
    assert (l2.accesses, l2.hits, l2.misses) == (8, 1, 7)


def test_warmup_removes_exactly_the_prefix():
    # A prefix runs identically inside a longer trace, so counting after `warmup` must equal the
    # whole run's counts minus the prefix's own counts, at every level.
    levels = HIERARCHIES["two levels"]
    trace = cachesim.naive_trace(16, 4)
    w = 1000
    whole, prefix, after = simulate(trace, levels), simulate(trace[:w], levels), simulate(trace, levels, warmup=w)
    for x, p, a in zip(whole, prefix, after, strict=True):
        assert (a.accesses, a.hits, a.misses) == (x.accesses - p.accesses, x.hits - p.hits, x.misses - p.misses)


def test_naive_trace_is_the_i_j_k_loop():
    n, e = 5, 8
    trace = cachesim.naive_trace(n, e)
    a0, b0, c0 = cachesim._bases(n, e)
    assert len(trace) == n * n * (2 * n + 1)
    i, j = 2, 3  # the (i, j) step starts after i*n + j earlier steps of 2n + 1 accesses
    step = trace[(i * n + j) * (2 * n + 1):][: 2 * n + 1]
    k = np.arange(n)
    np.testing.assert_array_equal(step[0:2 * n:2], a0 + (i * n + k) * e)
    np.testing.assert_array_equal(step[1:2 * n:2], b0 + (k * n + j) * e)
    assert step[-1] == c0 + (i * n + j) * e
    np.testing.assert_array_equal(cachesim.naive_trace(n, e, rows=2), trace[: 2 * n * (2 * n + 1)])


def test_blocked_trace_visits_every_product_once():
    n, t, e = 13, 4, 4
    trace = cachesim.blocked_trace(n, t, e)
    a0, b0, c0 = cachesim._bases(n, e)
    a = trace[(trace >= a0) & (trace < b0)]
    b = trace[(trace >= b0) & (trace < c0)]
    # n^3 multiply-adds: every A[i, k] is read n times, and so is every B[k, j].
    assert len(a) == len(b) == n**3
    assert np.all(np.bincount((a - a0) // e, minlength=n * n) == n)
    assert np.all(np.bincount((b - b0) // e, minlength=n * n) == n)


def test_packed_trace_reads_each_input_as_the_kernel_does():
    n, mc, kc, nc = 50, 12, 16, 32  # ragged everywhere: 50 = 4 x 12 + 2 = 3 x 16 + 2 = 32 + 18
    trace = cachesim.packed_trace(n, mc, kc, nc)
    a0, b0, c0, bb0, _ = cachesim._bases(n, 4, count=5)
    a = trace[(trace >= a0) & (trace < b0)]
    b = trace[(trace >= b0) & (trace < c0)]
    c = trace[(trace >= c0) & (trace < bb0)]
    n_jc, n_pc = -(-n // nc), -(-n // kc)
    # A is packed once per column block of B; B once in all; C is updated once per depth block.
    assert np.all(np.bincount((a - a0) // 4, minlength=n * n) == n_jc)
    assert np.all(np.bincount((b - b0) // 4, minlength=n * n) == 1)
    assert np.all(np.bincount((c - c0) // 4, minlength=n * n) == n_pc)


def test_bad_geometry_is_refused():
    with pytest.raises(ValueError, match="sets"):
        CacheConfig("L1", 1000, 64, 8)
    with pytest.raises(ValueError, match="positive"):
        CacheConfig("L1", 1024, 0, 8)
