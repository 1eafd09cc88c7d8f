"""A trace-driven cache simulator: set-associative, LRU, several levels, and the address streams
of the matrix-multiply loop orders it is fed with.

Why a simulator: `perf` cannot read hardware cache counters inside this container, so the miss
rates the matmul benchmark prints come from here, labelled as simulated. It is validated against
pycachesim (tests) on the same traces: equal hit and miss counts per level.

Model: every access is a load of one element (stores are write-allocate, so for hit/miss counting
they behave as loads). A miss at level i becomes an access at level i+1, and every level allocates
the line it missed (non-exclusive, like pycachesim's load_from chain). Write-backs are not modelled.

Speed, without changing any count: the sets of an LRU cache are independent, so each level
groups the accesses by set (stable, so time order within a set is kept); within a set, an access
to the line touched just before is an access to the most recently used line, always a hit that
leaves the LRU order as it was, so those are counted without the Python loop.
"""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CacheConfig:
    name: str
    size_bytes: int
    line_bytes: int = 64
    ways: int = 8

    def __post_init__(self) -> None:
        # Invariant: size = sets x ways x line, with a whole number of sets.
        if self.size_bytes <= 0 or self.line_bytes <= 0 or self.ways <= 0:
            raise ValueError(f"{self.name}: sizes and ways must be positive")
        if self.size_bytes % (self.line_bytes * self.ways):
            raise ValueError(f"{self.name}: {self.size_bytes} B is not sets x {self.ways} ways x {self.line_bytes} B")

    @property
    def sets(self) -> int:
        return self.size_bytes // (self.line_bytes * self.ways)


@dataclass(frozen=True)
class LevelStats:
    name: str
    accesses: int
    hits: int
    misses: int

    @property
    def miss_rate(self) -> float:
        return self.misses / self.accesses if self.accesses else 0.0


def _lru_hits(lines: np.ndarray, sets: int, ways: int) -> np.ndarray:
    """lines [N] (line numbers, time order) -> hit [N] bool for one LRU level with `sets` x `ways`."""
    set_of = lines % sets
    order = np.argsort(set_of, kind="stable")  # group by set, time order kept inside each set
    s_lines = lines[order]
    s_sets = set_of[order]
    hit_sorted = np.zeros(len(lines), dtype=bool)
    if len(lines) == 0:
        return hit_sorted
    # Same set and same line as the access before it: the MRU line, a hit that changes nothing.
    repeat = np.zeros(len(lines), dtype=bool)
    repeat[1:] = (s_sets[1:] == s_sets[:-1]) & (s_lines[1:] == s_lines[:-1])
    hit_sorted[repeat] = True
    idx = np.flatnonzero(~repeat)
    rest_lines = s_lines[idx].tolist()
    rest_sets = s_sets[idx].tolist()
    rest_hit = []
    current_set = None
    lru: list[int] = []  # the lines of the current set, least recently used first
    for line, s in zip(rest_lines, rest_sets, strict=True):
        if s != current_set:
            current_set, lru = s, []
        if line in lru:
            lru.remove(line)
            lru.append(line)
            rest_hit.append(True)
        else:
            lru.append(line)
            if len(lru) > ways:
                del lru[0]
            rest_hit.append(False)
        # Invariant: a set never holds more lines than it has ways.
        assert len(lru) <= ways
    hit_sorted[idx] = np.array(rest_hit, dtype=bool)
    hit = np.empty_like(hit_sorted)
    hit[order] = hit_sorted
    return hit


def simulate(addresses: np.ndarray, levels: list[CacheConfig], warmup: int = 0) -> list[LevelStats]:
    """addresses [N] byte addresses in time order -> per level (first to last) hit/miss counts.

    The first `warmup` accesses run through the caches but are not counted, so a sampled trace
    can start from warm caches (steady state) rather than report its cold misses.
    """
    addr = np.asarray(addresses, dtype=np.int64)
    index = np.arange(len(addr))  # original position, to apply `warmup` at every level
    stats = []
    for level in levels:
        hit = _lru_hits(addr // level.line_bytes, level.sets, level.ways)
        counted = index >= warmup
        n_hits = int(np.count_nonzero(hit & counted))
        n_acc = int(np.count_nonzero(counted))
        stats.append(LevelStats(level.name, n_acc, n_hits, n_acc - n_hits))
        addr, index = addr[~hit], index[~hit]
    return stats


# ---- address streams ---------------------------------------------------------------------------
# Matrices are row-major, each starting on its own page, A then B then C (then packing buffers).

def _bases(n: int, elem_bytes: int, count: int = 3) -> list[int]:
    span = -(-n * n * elem_bytes // 4096) * 4096 + 4096
    return [i * span for i in range(count)]


def naive_trace(n: int, elem_bytes: int = 4, rows: int | None = None) -> np.ndarray:
    """The textbook i-j-k loop (the design article's): for i, j: for k: read A[i,k], B[k,j]; then write C[i,j] once.

    C[i, j] is accessed once per (i, j), as a compiled loop keeps the sum in a register.
    rows: simulate only the first `rows` values of i (the loop is the same for every i).
    """
    a0, b0, c0 = _bases(n, elem_bytes)
    r = n if rows is None else min(rows, n)
    i = np.arange(r)[:, None, None]
    j = np.arange(n)[None, :, None]
    k = np.arange(n)[None, None, :]
    a = np.broadcast_to(a0 + (i * n + k) * elem_bytes, (r, n, n))
    b = np.broadcast_to(b0 + (k * n + j) * elem_bytes, (r, n, n))
    ab = np.stack([a, b], axis=-1).reshape(r, n, 2 * n)  # [i, j, (k, A|B)]
    c = (c0 + (np.arange(r)[:, None] * n + np.arange(n)[None, :]) * elem_bytes)[:, :, None]
    return np.concatenate([ab, c], axis=2).reshape(-1)


def blocked_trace(n: int, tile: int, elem_bytes: int = 4, rows: int | None = None) -> np.ndarray:
    """The textbook tiled loop: tiles i0, j0, k0 of `tile`, inside them i, j, k as in naive_trace.

    The order the design article's 24x24 advice is about: a tile each of A, B and C should stay in L1.
    rows: simulate only the tile rows i0 < rows (every band of rows runs the same loop).
    """
    a0, b0, c0 = _bases(n, elem_bytes)
    r = n if rows is None else min(rows, n)
    parts = []
    for i0 in range(0, r, tile):
        i = np.arange(i0, min(i0 + tile, n))[:, None, None]
        for j0 in range(0, n, tile):
            j = np.arange(j0, min(j0 + tile, n))[None, :, None]
            for k0 in range(0, n, tile):
                k = np.arange(k0, min(k0 + tile, n))[None, None, :]
                shape = (i.shape[0], j.shape[1], k.shape[2])
                a = np.broadcast_to(a0 + (i * n + k) * elem_bytes, shape)
                b = np.broadcast_to(b0 + (k * n + j) * elem_bytes, shape)
                ab = np.stack([a, b], axis=-1).reshape(shape[0], shape[1], 2 * shape[2])
                c = np.broadcast_to(c0 + (i * n + j) * elem_bytes, (shape[0], shape[1], 1))
                parts.append(np.concatenate([ab, c], axis=2).reshape(-1))
    return np.concatenate(parts)


def packed_trace(n: int, mc: int, kc: int, nc: int, mr: int = 6, nr: int = 32) -> np.ndarray:
    """The element accesses of the Cython kernel (_matmul.gemm, fp32, one thread), in its order.

    Packing reads A/B at their strides and writes the packed buffers; the micro-kernel reads
    an MR column of packed A and an NR row of packed B per step of p, then updates its C tile
    (one access per element: the read-modify-write touches one line once). Ragged edges are
    padded in the buffers, never stored to C, exactly as the kernel does.
    """
    e = 4
    a0, b0, c0, bb0, ab0 = _bases(n, e, count=5)
    mc = -(-min(mc, n) // mr) * mr
    nc = -(-min(nc, n) // nr) * nr
    kc = min(kc, n)
    parts = []
    for jc in range(0, n, nc):
        ncur = min(nc, n - jc)
        n_jr = -(-ncur // nr)
        for pc in range(0, n, kc):
            kcur = min(kc, n - pc)
            # pack B: panel t, row p, column j -> read B[pc+p, jc+t*nr+j] (if real), write buffer
            t, p, j = np.ix_(np.arange(n_jr), np.arange(kcur), np.arange(nr))
            col = jc + t * nr + j
            src = np.where(col < jc + ncur, b0 + ((pc + p) * n + col) * e, -1)
            dst = bb0 + (t * nr * kcur + p * nr + j) * e
            parts.append(np.stack(np.broadcast_arrays(src, dst), axis=-1).reshape(-1))
            for ic in range(0, n, mc):
                mcur = min(mc, n - ic)
                n_ir = -(-mcur // mr)
                # pack A: panel v, column p, row i -> read A[ic+v*mr+i, pc+p] (if real), write buffer
                v, p, i = np.ix_(np.arange(n_ir), np.arange(kcur), np.arange(mr))
                row = ic + v * mr + i
                src = np.where(row < ic + mcur, a0 + (row * n + pc + p) * e, -1)
                dst = ab0 + (v * mr * kcur + p * mr + i) * e
                parts.append(np.stack(np.broadcast_arrays(src, dst), axis=-1).reshape(-1))
                # micro-kernels: for jr (u), ir (v): for p: A column (mr), B row (nr); then C tile
                u, v, p, q = np.ix_(np.arange(n_jr), np.arange(n_ir), np.arange(kcur), np.arange(mr + nr))
                ab = np.where(q < mr, ab0 + (v * mr * kcur + p * mr + q) * e,
                              bb0 + (u * nr * kcur + p * nr + (q - mr)) * e)
                ab = np.broadcast_to(ab, (n_jr, n_ir, kcur, mr + nr)).reshape(n_jr, n_ir, -1)
                u, v, i, j = np.ix_(np.arange(n_jr), np.arange(n_ir), np.arange(mr), np.arange(nr))
                row, col = ic + v * mr + i, jc + u * nr + j
                c = np.where((row < ic + mcur) & (col < jc + ncur), c0 + (row * n + col) * e, -1)
                c = np.broadcast_to(c, (n_jr, n_ir, mr, nr)).reshape(n_jr, n_ir, -1)
                parts.append(np.concatenate([ab, c], axis=2).reshape(-1))
    trace = np.concatenate(parts)
    return trace[trace >= 0]  # -1 marks padding that is never read from or stored to A, B, C
