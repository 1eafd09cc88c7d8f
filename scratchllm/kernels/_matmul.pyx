# distutils: extra_compile_args = -mprefer-vector-width=512 -ffp-contract=fast
"""fp32 GEMM, C = A @ B, in the Goto/BLIS shape: cache blocks, packed panels, a register micro-kernel.

Loop nest (outer to inner) and where each piece is meant to live:

    jc  (nc columns of B)
     pc (kc deep)                  B block kc x nc, packed                 -> L3
      ic (mc rows of A)            A block mc x kc, packed                 -> L2 (one per core)
       jr (NR columns)             B micro-panel kc x NR, reused by every ir -> L1 if kc <= 128
        ir (MR rows)               A micro-panel MR x kc                   -> streamed from L2
         micro-kernel              MR x NR accumulators                    -> registers

With several threads, each runs this whole nest on its own slice of C (see gemm).

(With the default kc = 512 the B micro-panel is 64 KiB and streams from L2; the sweep in
docs/kernels.md shows that is faster than keeping it in L1, because 12 FMAs per 152 bytes loaded
is well within L2's bandwidth and a long kc amortizes the load and store of the C tile.)

Why packing: after it, the micro-kernel reads both operands with unit stride from 64-byte aligned
buffers whatever the caller's strides were (a transposed view costs nothing extra), and ragged
edges are zero-padded so the micro-kernel never branches on the shape.

Why MR x NR = 6 x 32: Zen 4 has 32 zmm registers of 16 floats. 6 x 32 accumulators are 12 zmm,
plus 2 for a row of B and 1 broadcast of A: 15 live registers, no spills, and 12 independent FMA
chains hide the FMA latency (4 cycles x 2 pipes needs >= 8 chains).
"""

import numpy as np

cimport cython
from cython.parallel cimport prange
from libc.stdint cimport uintptr_t
from libc.stdlib cimport free
from libc.string cimport memset


cdef extern from "stdlib.h" nogil:
    void *aligned_alloc(size_t alignment, size_t size)


cdef enum:
    MR = 6        # rows of the register tile (broadcasts of A)
    NR = 32       # columns of the register tile (two 16-float vectors of B)
    ALIGN = 64    # bytes: one cache line, one zmm register


MICRO_TILE = (MR, NR)


cdef float *_alloc_aligned(Py_ssize_t n_floats) noexcept nogil:
    # aligned_alloc wants a size that is a multiple of the alignment.
    cdef size_t nbytes = ((n_floats * sizeof(float) + ALIGN - 1) // ALIGN) * ALIGN
    cdef float *p = <float *> aligned_alloc(ALIGN, nbytes)
    return p


cdef inline Py_ssize_t _round_up(Py_ssize_t x, Py_ssize_t m) noexcept nogil:
    return ((x + m - 1) // m) * m


cdef void _pack_a(const float *a, Py_ssize_t rs, Py_ssize_t cs, Py_ssize_t mcur, Py_ssize_t kcur,
                  float *out) noexcept nogil:
    # a: the mcur x kcur block of A at element strides (rs, cs) -> out: ceil(mcur/MR) micro-panels,
    # each kcur x MR (column p holds MR consecutive rows), rows past mcur zero-padded.
    cdef Py_ssize_t t, ir, p, i, rows
    cdef float *panel
    for t in range((mcur + MR - 1) // MR):
        ir = t * MR
        panel = out + ir * kcur
        rows = min(MR, mcur - ir)
        for p in range(kcur):
            for i in range(rows):
                panel[p * MR + i] = a[(ir + i) * rs + p * cs]
            for i in range(rows, MR):
                panel[p * MR + i] = 0.0


cdef void _pack_b_panel(const float *b, Py_ssize_t rs, Py_ssize_t cs, Py_ssize_t kcur, Py_ssize_t cols,
                        float *panel) noexcept nogil:
    # b: kcur x cols (cols <= NR) at element strides (rs, cs) -> panel: kcur rows of NR, zero-padded.
    cdef Py_ssize_t p, j
    for p in range(kcur):
        for j in range(cols):
            panel[p * NR + j] = b[p * rs + j * cs]
        for j in range(cols, NR):
            panel[p * NR + j] = 0.0


cdef void _micro(Py_ssize_t kcur, const float *ap, const float *bp, float *c, Py_ssize_t ldc,
                 Py_ssize_t rows, Py_ssize_t cols) noexcept nogil:
    # ap: kcur x MR packed, bp: kcur x NR packed -> c[rows, cols] += ap^T bp (c row-major, ldc).
    # The loops over i and j have constant trip counts, so GCC unrolls them fully and keeps acc
    # in registers (checked with objdump: 12 zmm FMAs per p, no stack traffic in the loop).
    cdef float acc[MR * NR]
    cdef Py_ssize_t p, i, j
    cdef float ai
    for i in range(MR * NR):
        acc[i] = 0.0
    for p in range(kcur):
        for i in range(MR):
            ai = ap[p * MR + i]
            for j in range(NR):
                acc[i * NR + j] += ai * bp[p * NR + j]
    if rows == MR and cols == NR:
        for i in range(MR):
            for j in range(NR):
                c[i * ldc + j] += acc[i * NR + j]
    else:
        # Ragged edge: the padded rows/columns were computed (zeros) but are not stored.
        for i in range(rows):
            for j in range(cols):
                c[i * ldc + j] += acc[i * NR + j]


cdef void _gemm_serial(Py_ssize_t m, Py_ssize_t n, Py_ssize_t k,
                       const float *a, Py_ssize_t rsa, Py_ssize_t csa,
                       const float *b, Py_ssize_t rsb, Py_ssize_t csb,
                       float *c, Py_ssize_t ldc, Py_ssize_t mc, Py_ssize_t kc, Py_ssize_t nc,
                       float *abuf, float *bbuf) noexcept nogil:
    # c[m, n] (row stride ldc) += a[m, k] @ b[k, n], one thread, the loop nest of the docstring.
    # abuf holds mc x kc floats and bbuf kc x nc, mc a multiple of MR and nc of NR.
    cdef Py_ssize_t bj, bp, jc, pc, ncur, kcur, n_jr, t, ic, mcur, u, v, jr, ir
    for bj in range((n + nc - 1) // nc):
        jc = bj * nc
        ncur = min(nc, n - jc)
        n_jr = (ncur + NR - 1) // NR
        for bp in range((k + kc - 1) // kc):
            pc = bp * kc
            kcur = min(kc, k - pc)
            for t in range(n_jr):
                _pack_b_panel(b + pc * rsb + (jc + t * NR) * csb, rsb, csb, kcur,
                              min(NR, ncur - t * NR), bbuf + t * NR * kcur)
            for t in range((m + mc - 1) // mc):
                ic = t * mc
                mcur = min(mc, m - ic)
                _pack_a(a + ic * rsa + pc * csa, rsa, csa, mcur, kcur, abuf)
                for u in range(n_jr):
                    jr = u * NR
                    for v in range((mcur + MR - 1) // MR):
                        ir = v * MR
                        _micro(kcur, abuf + ir * kcur, bbuf + jr * kcur, c + (ic + ir) * ldc + jc + jr, ldc,
                               min(MR, mcur - ir), min(NR, ncur - jr))


@cython.boundscheck(False)
@cython.wraparound(False)
def gemm(const float[:, :] a, const float[:, :] b, Py_ssize_t mc=192, Py_ssize_t kc=512,
         Py_ssize_t nc=4096, int threads=1):
    """C = A @ B for float32 A [m, k], B [k, n] with any strides -> new C-contiguous [m, n].

    mc, kc, nc: cache block sizes (rows of A, depth, columns of B); mc is rounded up to a
    multiple of MR and nc to a multiple of NR. threads: OpenMP threads, one slice of C each.
    """
    cdef Py_ssize_t m = a.shape[0], k = a.shape[1], n = b.shape[1]
    if b.shape[0] != k:
        raise ValueError(f"shapes ({m}, {k}) and ({b.shape[0]}, {n}) do not chain")
    if mc < 1 or kc < 1 or nc < 1 or threads < 1:
        raise ValueError(f"block sizes and threads must be >= 1, got mc={mc} kc={kc} nc={nc} threads={threads}")
    c_arr = np.zeros((m, n), dtype=np.float32)
    if m == 0 or n == 0 or k == 0:
        return c_arr
    cdef float[:, ::1] c = c_arr
    # Strides in elements; a float32 view always has strides that are multiples of 4 bytes.
    cdef Py_ssize_t rsa = a.strides[0] // 4, csa = a.strides[1] // 4
    cdef Py_ssize_t rsb = b.strides[0] // 4, csb = b.strides[1] // 4
    mc = _round_up(min(mc, m), MR)
    nc = _round_up(min(nc, n), NR)
    kc = min(kc, k)

    # Threads: C is cut into one slice per thread along its longer side, and each thread runs
    # the whole serial loop nest on its slice, packing its own panels. The price is that every
    # thread packs all of the other operand (the smaller one, by the choice of side); the gain
    # is one fork and one join per call and no barrier between: on a machine shared with other
    # jobs, every barrier waits until the OS runs the slowest thread again (a time slice, ms).
    cdef bint split_cols = n >= m
    cdef Py_ssize_t step = NR if split_cols else MR
    cdef Py_ssize_t extent = n if split_cols else m
    cdef Py_ssize_t units = (extent + step - 1) // step
    cdef Py_ssize_t team = min(<Py_ssize_t> threads, units)
    cdef Py_ssize_t per = ((units + team - 1) // team) * step
    team = (extent + per - 1) // per
    # Invariant: the slices tile C exactly, one per thread, each a whole number of register tiles.
    assert team >= 1 and (team - 1) * per < extent <= team * per

    cdef const float *pa = &a[0, 0]
    cdef const float *pb = &b[0, 0]
    cdef float *pc_ = &c[0, 0]
    cdef float *bbuf = _alloc_aligned(team * kc * nc)
    cdef float *abuf = _alloc_aligned(team * mc * kc)
    if bbuf == NULL or abuf == NULL:
        free(bbuf)
        free(abuf)
        raise MemoryError("cannot allocate packing buffers")
    # Invariant the micro-kernel relies on: every packed panel starts on a 64-byte line, since
    # panel offsets are multiples of MR*kc or NR*kc floats from 64-byte aligned bases.
    assert (<uintptr_t> bbuf) % ALIGN == 0 and (<uintptr_t> abuf) % ALIGN == 0

    cdef Py_ssize_t t, lo, cnt
    if team == 1:
        with nogil:
            _gemm_serial(m, n, k, pa, rsa, csa, pb, rsb, csb, pc_, n, mc, kc, nc, abuf, bbuf)
    else:
        for t in prange(team, nogil=True, num_threads=team, schedule="static"):
            lo = t * per
            cnt = min(per, extent - lo)
            if split_cols:
                _gemm_serial(m, cnt, k, pa, rsa, csa, pb + lo * csb, rsb, csb, pc_ + lo, n,
                             mc, kc, nc, abuf + t * mc * kc, bbuf + t * kc * nc)
            else:
                _gemm_serial(cnt, n, k, pa + lo * rsa, rsa, csa, pb, rsb, csb, pc_ + lo * n, n,
                             mc, kc, nc, abuf + t * mc * kc, bbuf + t * kc * nc)
    free(bbuf)
    free(abuf)
    return c_arr
