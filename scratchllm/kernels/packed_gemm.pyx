# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: extra_compile_args = -ffp-contract=fast
"""y = x @ W for a weight matrix packed once, at load time: the GEMM of every linear layer.

Why not NumPy's `x @ w`: OpenBLAS copies ("packs") the whole of B into its panel layout on
*every* call. For a prefill of 512 rows that copy is noise; for a decode step of 1-64 rows it is
the main cost: the weights are read, written and read again, and at 16 rows OpenBLAS reaches
about 68 GFLOP/s on this machine's two cores, a third of what the FMA units can do. Weights never
change, so we pack them once and the kernel streams them exactly once per call.

Packed layouts (one panel = NR output columns, zero-padded at the right edge). NR is two native
vectors, fixed when the extension is compiled: 32 with AVX-512 (two zmm), 16 with AVX2 (two ymm).
The packing functions below follow the NR of the build, so panels are made and used by one build.
  float32:  [P, K, NR]        panel p, row k holds W[k, NR p : NR p + NR]: two vectors per k.
  bfloat16: [P, K/2, NR, 2]   uint16; row k2 holds, for each of the NR columns, the pair
                              (W[2 k2, j], W[2 k2 + 1, j]) side by side: the operand order of
                              AVX512-BF16's vdpbf16ps, which multiplies 16 such pairs by one
                              broadcast pair of x and adds both products into 16 fp32 lanes.
                              (K is zero-padded to even.)

Loop nest of `matmul`. Panels are the tasks of our own thread pool (scratchllm/kernels/pool.pyx),
not of OpenMP: a thread descheduled by another process just takes fewer panels instead of
stalling every matmul at a barrier.

    for panel p (NR columns of y)                       -> a pool task
      for kc block of K (the panel's kc x NR rows)      -> L1: 256 rows x NR x 4 B = 32 / 16 KiB
        for row tile of x (<= MAXR rows)                -> the block is re-read from L1
          micro-kernel: R x NR accumulators in 2R vector registers, one pass over the block

Why R <= MAXR: the 2R accumulators, the panel row's 2 vectors and 1 broadcast of x must fit the
register file or the accumulators spill to the stack on every k. AVX-512 has 32 zmm: R <= 12,
27 live. AVX2 has 16 ymm: R <= 6, 15 live (a 12 x 16 tile of ymm halves would need 48 and runs
30x slower). Rows are split into balanced tiles (16 rows = 8 + 8, not 12 + 4).
Every weight element loaded feeds R FMAs, so at R = 1 (single-stream decode) the kernel streams
memory and at R >= MAXR / 2 it is FMA-bound.

Every output element is one chain of FMAs over k in order, block by block (kc = 256), whatever NR
and MAXR are: the tile shape changes which elements are computed together, never the sums, so
float32 results are the same on both instruction sets.

bfloat16 keeps fp32's 8-bit exponent and cuts the mantissa to 8 bits (relative rounding
error <= 2^-9). In this mode x is rounded to bfloat16 too (round to nearest even) and the
products are summed in fp32: half the weight bytes and twice the multiplies per instruction.
Without AVX512-BF16 the same numbers come from a plain C loop (slow, for correctness only).

Quantized panels (Q4Panels, Q8Panels, KPanels: a GGUF file's blocks) multiply x two ways. The
exact path (activations "float32") widens them in registers to exactly the float32 values the
float32 path holds, and then multiplies by the float32 kernel's FMAs, in its order. So a weight
costs two FMAs (d * q + m, then the product's), plus the unpacking: about 6 cycles per 32 weights
of one row on Zen 3 (4-bit); the price of logits equal to float32's bit for bit. The integer path
(activations "int8" or "int16", packed_int8.h) rounds x to integers per 32 values and multiplies
the panels' integers with integer dot products (llama.cpp's way), a quarter of an instruction per
weight: at one row the product is bound by memory again, and its logits are close to float32's,
not equal.
"""

from typing import NamedTuple

import numpy as np

from scratchllm.kernels import kpanels
from scratchllm.kernels import pool as pool_module
from scratchllm.kernels.kpanels import KPanels

from scratchllm.kernels cimport pool
from libc.stdint cimport int8_t, int32_t, uint8_t, uint16_t, uint32_t
from libc.stdlib cimport free, malloc


cdef extern from "packed_gemm.h":
    int SCRATCHLLM_BF16_DOT
    const char *SCRATCHLLM_COMPILED_FEATURES
    int PG_NR
    int PG_MAXR
    void pg_micro_f32(int R, const float *x, long lda, const float *panel, long kc, float *c, long ldc,
                      int cols, int first) noexcept nogil
    void pg_micro_bf16(int R, const uint32_t *x2, long lda2, const uint16_t *panel, long kc2, float *c, long ldc,
                       int cols, int first) noexcept nogil
    uint16_t pg_f32_to_bf16(float f) noexcept nogil
    ctypedef struct pg_gemm_job:
        const float *x
        const uint32_t *x2
        const void *panels
        float *c
        long M, K, K2, n, kc
    void pg_gemm_f32_task(void *ctx, long p) noexcept nogil
    void pg_gemm_bf16_task(void *ctx, long p) noexcept nogil
    void pg_round_x(const float *x, uint32_t *x2, long M, long K, long K2) noexcept nogil
    ctypedef struct pg_kq:
        int kind
        const uint8_t *qh
        const void *sc
        const uint8_t *mn
        const uint16_t *D
        const uint16_t *Dmin
    int PG_K_NONE, PG_K_Q4K, PG_K_Q5K, PG_K_Q6K, PG_K_Q3K, PG_K_Q2K, PG_K_Q50, PG_K_Q51
    ctypedef struct pg_q8_job:
        const float *x
        const void *q
        const void *d
        const void *m
        float *c
        long M, K, n, ldc, kc, P, chunk, fused_tiles
        int bits, exact, half
        pg_kq k
    void pg_gemm_q8_task(void *ctx, long p) noexcept nogil
    int PG_Q4_0, PG_Q4_1, PG_Q8_0
    ctypedef struct pg_repack_job:
        const uint8_t *const *rows
        const uint8_t *types
        long N, K
        uint8_t *q
        uint16_t *d
        uint16_t *m
        int overflow
    void pg_repack_task(void *ctx, long p) noexcept nogil


cdef extern from "packed_int8.h":
    ctypedef struct pg_x8:
        int8_t *q
        int8_t *q2
        float *d
        float *s
        int32_t *sum
        int32_t *sum16
        long M, K
    int PG_X8_NATURAL, PG_X8_EVEN_ODD
    const char *PG_INT8_DOT
    int PG_INT_DOT_INSTR
    int pg_x8_reserve(pg_x8 *x, long M, long K, int two, int slot) noexcept nogil
    ctypedef struct pg_x8_job:
        const float *x
        pg_x8 out
        int order
        long rows_per_task
    void pg_x8_task(void *ctx, long t) noexcept nogil
    ctypedef struct pg_i8_job:
        const pg_x8 *x
        const void *q
        const void *d
        const void *m
        float *c
        long n, ldc, P, chunk
        int bits, half
        pg_kq k
    void pg_i8_task(void *ctx, long t) noexcept nogil


NR = PG_NR
MAXR = PG_MAXR
HAVE_AVX512_BF16 = bool(SCRATCHLLM_BF16_DOT)
COMPILED_FEATURES = tuple(SCRATCHLLM_COMPILED_FEATURES.decode().split())  # as /proc/cpuinfo names them
DTYPES = ("float32", "bfloat16")
# How a quantized matrix multiplies x: exactly ("float32"), or with x rounded to integers per 32 values and
# integer dot products (packed_int8.h): 8 bits ("int8", llama.cpp's arithmetic) or 16 bits in two 8-bit levels
# ("int16": two dot products per weight byte, about 256 times finer)
ACTIVATIONS = ("float32", "int8", "int16")
INT8_DOT = PG_INT8_DOT.decode()  # the integer dot product this build uses
INT_DOT_INSTRUCTION = bool(PG_INT_DOT_INSTR)  # a vpdpbusd: the integer products beat the exact path at every batch

set_num_threads, get_num_threads = pool_module.set_num_threads, pool_module.get_num_threads  # the pool's


def to_bfloat16(x) -> np.ndarray:
    """float32 array -> uint16 array of its bfloat16 bits (round to nearest even)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
    return rounded


def from_bfloat16(h) -> np.ndarray:
    """uint16 bfloat16 bits -> float32 (exact)."""
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def pack(w, str dtype="float32") -> np.ndarray:
    """The [K, N] matrix w (any strides, e.g. a transposed view) -> its panels (layouts above)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    K, N = w.shape
    P = -(-N // PG_NR)
    if dtype == "float32":
        panels = np.zeros((P, K, PG_NR), dtype=np.float32)
        full = N // PG_NR
        panels[:full] = w[:, : full * PG_NR].reshape(K, full, PG_NR).transpose(1, 0, 2)
        if full < P:
            panels[full, :, : N - full * PG_NR] = w[:, full * PG_NR :]
        return panels
    K2 = -(-K // 2)
    padded = np.zeros((2 * K2, P * PG_NR), dtype=np.float32)
    padded[:K, :N] = w
    return to_bfloat16(padded.reshape(K2, 2, P, PG_NR).transpose(2, 0, 3, 1))  # [P, K2, NR, 2]


def _scaled(q, d, m) -> np.ndarray:
    """q [A, K, C] (any integer type), d and m [A, K/32, C] -> float32 d * q + m, d and m holding one
    value per 32 consecutive k: the kernel's (and ggml's) operations, the product rounded first.
    m None: no offset."""
    A, K, C = q.shape
    w = q.astype(np.float32).reshape(A, K // 32, 32, C)
    w *= d.astype(np.float32)[:, :, None, :]
    if m is not None:
        w += m.astype(np.float32)[:, :, None, :]
    return w.reshape(A, K, C)


def _check_groups(q, d, m) -> tuple[int, int]:
    K, N = q.shape
    if K % 32 or d.shape != (K // 32, N) or m.shape != (K // 32, N):
        raise ValueError(f"q {q.shape} needs K % 32 == 0 and d, m of shape {(K // 32, N)}; got {d.shape}, {m.shape}")
    return K, N


def _column_panels(a, Py_ssize_t P, dtype) -> np.ndarray:
    """[rows, N] -> [P, rows, NR] of `dtype`, columns zero-padded to whole panels."""
    out = np.zeros((a.shape[0], P * PG_NR), dtype=dtype)
    out[:, : a.shape[1]] = a
    return np.ascontiguousarray(out.reshape(a.shape[0], P, PG_NR).transpose(1, 0, 2))


class Q8Panels(NamedTuple):
    """Quantized panels: w[k, j] = d * q + m with q int8 and, per 32 rows of k and per column, a
    float32 scale d and offset m. GGUF's Q8_0 (m = 0), Q4_0 (q - 8, m = 0) and Q4_1 (q in 0..15)
    all fit, value for value: see `pack_q8`.

    Byte order: in words of biased bytes. Each run of 4 rows of k holds NR 32-bit words, one per
    column, byte t of column j's word being q[4 r + t, j] + 128 as an unsigned byte; `rows` gives
    the plain int8 [P, K, NR]. A 32-bit lane then holds 4 consecutive k of a column, as integer
    dot products take them, and the kernel reads a row from a word with one AND."""

    q: np.ndarray  # [P, K, NR] uint8, in words of biased bytes (see above)
    d: np.ndarray  # [P, K/32, NR] float32, or float16 where m is None
    m: np.ndarray | None  # [P, K/32, NR] float32, or None: no offset (GGUF's Q8_0, as pack_blocks keeps it)
    exact: bool = False  # every d is a float16 value, so d * q is exact and the kernel may fuse d * q + m

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.d.nbytes + (0 if self.m is None else self.m.nbytes)

    @property
    def dtype(self):
        return self.q.dtype

    def rows(self) -> np.ndarray:
        """[P, K, NR] int8 in plain row order (a copy)."""
        return _q8_rows(self.q)

    def dequantize(self) -> np.ndarray:
        """[P, K, NR] float32."""
        return _scaled(self.rows(), self.d, self.m)

    def columns(self, p, j) -> np.ndarray:
        """Columns j of panels p (arrays of equal length L) -> [L, K] float32."""
        P, K, _ = self.q.shape
        q = (self.q.reshape(P, K // 4, PG_NR, 4)[p, :, j].reshape(len(p), K) ^ np.uint8(0x80)).view(np.int8)
        m = None if self.m is None else self.m[p, :, j][..., None]
        return _scaled(q[..., None], self.d[p, :, j][..., None], m)[..., 0]


def _q4_offsets(d, m) -> np.ndarray:
    """4-bit panels' offsets m as float32; m None (Q4_0 panels): -8 d, exact, as the kernel makes it."""
    return d.astype(np.float32) * np.float32(-8) if m is None else m.astype(np.float32)


class Q4Panels(NamedTuple):
    """4-bit panels: w[k, j] = d * q + m, q in 0..15 two to a byte (rows 2 k2 and 2 k2 + 1 of a column
    share byte k2), d and m float16 per 32 rows of k and per column. GGUF's Q4_1 value for value, and
    Q4_0 with m = -8 d (exact: d * q and d * (q - 8) are exact in float32, so d * q + m rounds to
    the same float). Half a byte per weight in memory, as in the file: see `pack_q4`. m None: Q4_0
    panels (pack_blocks), whose m = -8 d the kernel makes instead of reading it.

    Byte order: in words. Each run of 4 byte rows (8 rows of k) holds NR 32-bit words, one per
    column, the 4 bytes of column j's word being its byte rows in order; `byte_rows` gives the
    plain [P, K/2, NR] order. The kernel reads a row of k from a word with one AND."""

    q4: np.ndarray  # [P, K/2, NR] uint8, in words (see above)
    d: np.ndarray  # [P, K/32, NR] float16
    m: np.ndarray | None  # [P, K/32, NR] float16, or None: -8 d (Q4_0)

    @property
    def nbytes(self) -> int:
        return self.q4.nbytes + self.d.nbytes + (0 if self.m is None else self.m.nbytes)

    def offsets(self) -> np.ndarray:
        """m as float32, made from d where the panels store none (-8 d is exact)."""
        return _q4_offsets(self.d, self.m)

    @property
    def dtype(self):
        return self.q4.dtype

    def byte_rows(self) -> np.ndarray:
        """[P, K/2, NR] uint8: byte (k2, j) = q[2 k2, j] | q[2 k2 + 1, j] << 4 (a copy)."""
        return _byte_rows(self.q4)

    def dequantize(self) -> np.ndarray:
        """[P, K, NR] float32."""
        P, K2, _ = self.q4.shape
        b = self.byte_rows()
        nibbles = np.stack([b & 0x0F, b >> 4], axis=2).reshape(P, 2 * K2, PG_NR)
        return _scaled(nibbles, self.d, self.offsets())

    def columns(self, p, j) -> np.ndarray:
        """Columns j of panels p (arrays of equal length L) -> [L, K] float32."""
        P, K2, _ = self.q4.shape
        b = self.q4.reshape(P, K2 // 4, PG_NR, 4)[p, :, j].reshape(len(p), K2)  # [L, K/2] in byte-row order
        nibbles = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(len(b), -1)
        m = _q4_offsets(self.d[p, :, j], None if self.m is None else self.m[p, :, j])
        return _scaled(nibbles[..., None], self.d[p, :, j][..., None], m[..., None])[..., 0]


class SegmentedPanels(NamedTuple):
    """A fused matrix whose parts are of types that share no panels (a Q4_K q|k beside a Q6_K v):
    part i in panels of its own, giving output columns sum(cols[:i]) .. sum(cols[:i+1]) - 1. Every
    part but the last is whole panels wide, so each writes straight into its columns of y."""

    parts: tuple  # Q4Panels, Q8Panels or KPanels each
    cols: tuple  # int each

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def dtype(self):
        return self.parts[0].dtype


def _q8_words(rows) -> np.ndarray:
    """int8 [P, K, NR] in plain row order -> Q8Panels' words of biased bytes (uint8, a copy)."""
    P, K, NR = rows.shape
    biased = rows.view(np.uint8) ^ np.uint8(0x80)
    return np.ascontiguousarray(biased.reshape(P, K // 4, 4, NR).transpose(0, 1, 3, 2)).reshape(P, K, NR)


def _q8_rows(words) -> np.ndarray:
    """Q8Panels' words of biased bytes -> int8 [P, K, NR] in plain row order (a copy)."""
    P, K, NR = words.shape
    rows = np.ascontiguousarray(words.reshape(P, K // 4, NR, 4).transpose(0, 1, 3, 2)).reshape(P, K, NR)
    return (rows ^ np.uint8(0x80)).view(np.int8)


SMALLEST_SCALE = 2.0 ** -100  # 8-bit panels' |d| is 0 or at least this: d 256^-t stays a normal float (the kernel's)


def pack_q8(q, d, m) -> Q8Panels:
    """q int8 [K, N] (any strides), d and m float32 [K/32, N]: w[k, j] = d[k // 32, j] * q[k, j] +
    m[k // 32, j] -> its Q8Panels (columns zero-padded to whole panels: q = d = m = 0)."""
    K, N = _check_groups(q, d, m)
    P = -(-N // PG_NR)
    d32 = np.asarray(d, dtype=np.float32)
    tiny = (d32 != 0) & (np.abs(d32) < SMALLEST_SCALE)
    if tiny.any():
        raise ValueError(f"8-bit panels take scales of 0 or at least {SMALLEST_SCALE} in magnitude, got {d32[tiny][0]}")
    with np.errstate(over="ignore"):
        d16 = d32.astype(np.float16)
    exact = bool(np.array_equal(d16.astype(np.float32), d32))  # 11 bits x 8 bits: exact
    return Q8Panels(_q8_words(_column_panels(q, P, np.int8)), _column_panels(d, P, np.float32),
                    _column_panels(m, P, np.float32), exact)


def _byte_rows(q4) -> np.ndarray:
    """4-bit panels' bytes in words -> [P, K/2, NR] in byte-row order (a copy)."""
    P, K2, NR = q4.shape
    return np.ascontiguousarray(q4.reshape(P, K2 // 4, NR, 4).transpose(0, 1, 3, 2)).reshape(P, K2, NR)


def _words(rows) -> np.ndarray:
    """[P, K/2, NR] bytes in byte-row order -> the same bytes in words (Q4Panels' order)."""
    P, K2, NR = rows.shape
    return np.ascontiguousarray(rows.reshape(P, K2 // 4, 4, NR).transpose(0, 1, 3, 2)).reshape(P, K2, NR)


def pack_q4(q, d, m) -> Q4Panels:
    """q uint8 in 0..15 [K, N] (any strides), d and m float16 [K/32, N]: w = d * q + m -> its
    Q4Panels (columns zero-padded to whole panels)."""
    K, N = _check_groups(q, d, m)
    P = -(-N // PG_NR)
    qp = _column_panels(q, P, np.uint8)  # [P, K, NR]
    assert qp.max(initial=0) < 16, "4-bit values"
    return Q4Panels(_words(qp[:, 0::2] | (qp[:, 1::2] << 4)), _column_panels(d, P, np.float16),
                    _column_panels(m, P, np.float16))


BLOCK_TYPES = {"Q4_0": PG_Q4_0, "Q4_1": PG_Q4_1, "Q8_0": PG_Q8_0}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
PANEL_TYPES = (*BLOCK_TYPES, *kpanels.TYPES)  # the GGUF types pack_blocks keeps in panels of their own


def row_bytes(str type_name, Py_ssize_t K) -> int:
    """Bytes of one row of K weights of a PANEL_TYPES type, as a GGUF file stores it."""
    if type_name in kpanels.TYPES:
        return kpanels.row_bytes(type_name, K)
    return K // 32 * BLOCK_BYTES[type_name]


def _pack_kquant(parts, Py_ssize_t K, alloc) -> KPanels:
    """pack_blocks for parts of one kpanels.TYPES type: kpanels.pack, a few panels at a time, into
    the caller's memory (huge pages: models/arena.py)."""
    return kpanels.pack_parts(parts, K, PG_NR, alloc)


def pack_blocks(parts, Py_ssize_t K, alloc=np.zeros):
    """Panels straight from a GGUF file's blocks: `parts` is a list of (type name, raw uint8 array
    [rows, row_bytes(type, K)] (a view of the mapped file), row order or None), fused along the
    output columns in order; `row order` r means output row i is stored row r[i]. Q4_0 and Q4_1
    parts -> Q4Panels (Q4_0 parts only: no offsets stored, the kernel makes -8 d; Q4_0 beside Q4_1:
    None if a Q4_0 scale's -8 d overflows float16, see ggml_quants.as_q4); Q8_0 parts only ->
    Q8Panels (no offsets); parts of one kpanels.TYPES type (the K-quants, Q5_0, Q5_1) -> KPanels
    (kernels/kpanels.py). The bytes are moved once, by the kernel pool's threads; no
    temporary as large as the matrix is made. `alloc(shape, dtype)` makes the zeroed output arrays
    (models.arena.PanelArena.zeros puts a model's panels in huge pages)."""
    if K % 32:
        raise ValueError(f"K = {K} is not a whole number of 32-weight blocks")
    kinds = {t for t, _, _ in parts}
    one_k = len(kinds) == 1 and kinds <= set(kpanels.TYPES)
    if not (one_k or kinds <= set(BLOCK_TYPES)) or ("Q8_0" in kinds and len(kinds) > 1):
        raise ValueError(f"pack_blocks takes Q4_0/Q4_1 parts, Q8_0 parts, or parts of one type of "
                         f"{', '.join(kpanels.TYPES)}, not {sorted(kinds)}")
    addresses, types = [], []
    for type_name, raw, order in parts:
        nbytes = row_bytes(type_name, K)
        if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != nbytes or not raw.flags.c_contiguous:
            raise ValueError(f"{type_name} rows must be C-contiguous uint8 [rows, {nbytes}], got {raw.shape}")
        rows = np.arange(raw.shape[0]) if order is None else np.asarray(order)
        if rows.shape != (raw.shape[0],) or (len(rows) and (rows.min() < 0 or rows.max() >= raw.shape[0])):
            raise ValueError("the row order must be a permutation of the part's rows")
        if one_k:
            continue
        addresses.append(raw.ctypes.data + rows.astype(np.uint64) * np.uint64(nbytes))
        types.append(np.full(raw.shape[0], BLOCK_TYPES[type_name], dtype=np.uint8))
    if one_k:
        return _pack_kquant(parts, K, alloc)
    cdef const unsigned long long[::1] addr = np.ascontiguousarray(np.concatenate(addresses), dtype=np.uint64)
    type_ids = np.concatenate(types)
    cdef const uint8_t[::1] kind = type_ids
    cdef Py_ssize_t N = addr.shape[0], P = (N + PG_NR - 1) // PG_NR  # C division here: no -(-N // NR)
    q8 = "Q8_0" in kinds
    q = alloc((P, K if q8 else K // 2, PG_NR), np.uint8)  # 8-bit: biased bytes in words
    d = alloc((P, K // 32, PG_NR), np.uint16)
    offsets = "Q4_1" in kinds  # Q8_0 has none and Q4_0's are -8 d: stored only beside Q4_1's
    cdef Py_ssize_t m_panels = P if offsets else 1, m_groups = K // 32 if offsets else 1
    m = alloc((m_panels, m_groups, PG_NR), np.uint16)
    cdef uint8_t[:, :, ::1] qv = q
    cdef uint16_t[:, :, ::1] dv = d, mv = m
    cdef pg_repack_job job
    job.rows, job.types, job.N, job.K = <const uint8_t *const *> &addr[0], &kind[0], N, K
    job.q, job.d, job.m, job.overflow = &qv[0, 0, 0], &dv[0, 0, 0], &mv[0, 0, 0] if offsets else NULL, 0
    with nogil:
        pool.run(pg_repack_task, &job, P, pool.num_threads())
    d16 = d.view(np.float16)
    if q8:  # Q8_0: value = d * q exactly (an 11-bit d times an 8-bit q), no offset: the file's bytes
        return Q8Panels(q, d16, None, True)
    if not offsets:  # Q4_0 only
        return Q4Panels(q, d16, None)
    if job.overflow:  # a Q4_0 row's m = -8 d (exact, as in as_q4) does not fit float16
        return None
    return Q4Panels(q, d16, m.view(np.float16))


def unpack(panels, Py_ssize_t k, Py_ssize_t n) -> np.ndarray:
    """Panels -> the [k, n] float32 matrix they hold (a copy; bfloat16 values widen exactly)."""
    if isinstance(panels, SegmentedPanels):
        return np.concatenate([unpack(p, k, c) for p, c in zip(panels.parts, panels.cols)], axis=1)
    if isinstance(panels, (Q8Panels, Q4Panels, KPanels)):
        panels = panels.dequantize()
    P = panels.shape[0]
    if panels.dtype == np.uint16:
        w = from_bfloat16(panels).transpose(1, 3, 0, 2).reshape(2 * panels.shape[1], P * PG_NR)
    else:
        w = panels.transpose(1, 0, 2).reshape(k, P * PG_NR)
    return np.ascontiguousarray(w[:k, :n])


def columns(panels, Py_ssize_t k, ids) -> np.ndarray:
    """Columns `ids` of the packed [k, n] matrix as rows: [len(ids), k] float32 (W[:, ids].T).
    This is how an embedding lookup reads a tied LM head."""
    ids = np.asarray(ids, dtype=np.int64)
    if isinstance(panels, SegmentedPanels):
        out, start = np.empty((len(ids), k), dtype=np.float32), 0
        for part, cols in zip(panels.parts, panels.cols):
            mine = (ids >= start) & (ids < start + cols)
            if mine.any():
                out[mine] = columns(part, k, ids[mine] - start)
            start += cols
        return out
    p, j = ids // PG_NR, ids % PG_NR
    if isinstance(panels, (Q8Panels, Q4Panels, KPanels)):  # [len, K]: d * q + m, in the kernel's order
        return panels.columns(p, j)
    if panels.dtype == np.uint16:  # [P, K2, NR, 2] -> [len, K2, 2]
        return np.ascontiguousarray(from_bfloat16(panels[p, :, j]).reshape(len(ids), -1)[:, :k])
    return np.ascontiguousarray(panels[p, :, j])


def matmul(x, panels, Py_ssize_t n, out=None, str activations="float32") -> np.ndarray:
    """x [M, K] float32 @ the packed [K, n] matrix -> out [M, n] float32 (new unless given).
    activations "int8" (quantized panels): x rounded to int8 per 32 values, integer dot products
    (packed_int8.h; see quantize_x8); "float32": the exact products."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D, got shape {x.shape}")
    M, K = x.shape
    if out is None:
        out = np.empty((M, n), dtype=np.float32)
    elif out.shape != (M, n) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous float32 [{M}, {n}] array")
    if M == 0:
        return out
    if isinstance(panels, np.ndarray) and panels.dtype == np.uint16:
        if panels.ndim != 4 or panels.shape[1] * 2 not in (K, K + 1) or panels.shape[2:] != (PG_NR, 2):
            raise ValueError(f"bfloat16 panels {panels.shape} do not fit x of shape {x.shape}")
        _matmul_bf16(x, panels, n, out)
    else:
        _matmul(panels, x, n, out, activations)
    return out


cdef enum:
    _Q8_TASKS_PER_THREAD = 8  # quantized GEMM: tasks per thread (each a run of adjacent panels)
    # One row (decode): fewer, longer runs. A thread's next task is rarely the adjacent one (tasks
    # are claimed in turn), so each task start is a stream the prefetchers have not seen; 2 per
    # thread still lets a thread finish another's share when one is slow. Measured alternating in
    # one process (default model, 2 threads): decode +6-10% over 8, also with a busy loop on a core.
    _Q8_TASKS_PER_THREAD_ROW = 2
    _Q8_FUSED_TILES = 2  # up to 2 row tiles dequantize in registers (tile 2 re-reads q from L1); more use the buffer
    _KC = 256  # rows (bfloat16: pairs) of K per block of a panel: 256 x 32 x 4 B = 32 KiB, L1's size
    _X8_SERIAL = 1 << 15  # x of fewer values (M x K) is rounded to int8 by the calling thread alone
Q8_TASKS_PER_THREAD, Q8_FUSED_TILES, KC = _Q8_TASKS_PER_THREAD, _Q8_FUSED_TILES, _KC
assert KC % 32 == 0 and KC <= 256, "blocks of whole quantization groups that fit a task's buffer"


cdef inline int _threads_for(long work) noexcept nogil:
    # a few microseconds of work is not worth waking a helper
    return 1 if work < (1 << 18) else pool.num_threads()


cdef int _bind_part(object panels, GemmPart *w) except -1:
    """One part's fields from its panels; returns K (its rows)."""
    cdef const float[:, :, ::1] f32
    cdef Py_ssize_t width, K  # width: NR of the build that made the panels: it must be this build's
    cdef const uint8_t[:, :, ::1] q4
    cdef const uint8_t[:, :, ::1] q8
    cdef const uint16_t[:, :, ::1] d16, m16
    cdef const float[:, :, ::1] d32, m32
    cdef const uint8_t[:, :, ::1] qh, sc, mn
    w.kq, w.qh, w.sc, w.mn, w.D, w.Dmin = PG_K_NONE, NULL, NULL, NULL, NULL, NULL
    if isinstance(panels, KPanels):
        q4, d16 = panels.q4, panels.d.view(np.uint16)
        w.q, w.d, w.m, w.exact, w.half = &q4[0, 0, 0], NULL, NULL, 1, 0
        w.D = &d16[0, 0, 0]
        if panels.sc is not None:
            sc = panels.sc.view(np.uint8)
            w.sc = &sc[0, 0, 0]
        # kind: the exact path's (4: through the 4-bit words, 5 and 6: a block at a time)
        w.kind, w.kq = {"Q4_K": (4, PG_K_Q4K), "Q5_K": (5, PG_K_Q5K), "Q6_K": (6, PG_K_Q6K), "Q3_K": (6, PG_K_Q3K),
                        "Q2_K": (6, PG_K_Q2K), "Q5_0": (5, PG_K_Q50), "Q5_1": (5, PG_K_Q51)}[panels.kind]
        if panels.mn is not None:
            mn = panels.mn
            w.mn = &mn[0, 0, 0]
        if panels.dmin is not None:
            m16 = panels.dmin.view(np.uint16)
            w.Dmin = &m16[0, 0, 0]
        if panels.qh is not None:
            qh = panels.qh
            w.qh = &qh[0, 0, 0]
        w.P, K, width = q4.shape[0], 2 * q4.shape[1], q4.shape[2]
        if K % (kpanels.SUPER if panels.kind in kpanels.KTYPES else 32):
            raise ValueError(f"{panels.kind} panels of {K} rows: not whole blocks")
    elif isinstance(panels, Q4Panels):
        q4, d16 = panels.q4, panels.d.view(np.uint16)
        w.q, w.d, w.m, w.kind, w.exact, w.half = &q4[0, 0, 0], &d16[0, 0, 0], NULL, 4, 1, 0
        if panels.m is not None:
            m16 = panels.m.view(np.uint16)
            w.m = &m16[0, 0, 0]
        w.P, K, width = q4.shape[0], 2 * q4.shape[1], q4.shape[2]
    elif isinstance(panels, Q8Panels) and panels.m is None:  # float16 d, no offset (Q8_0)
        if panels.d.dtype != np.float16 or not panels.exact:
            raise ValueError("8-bit panels without offsets take float16 scales")
        q8, d16 = panels.q, panels.d.view(np.uint16)
        w.q, w.d, w.m, w.kind, w.exact, w.half = &q8[0, 0, 0], &d16[0, 0, 0], NULL, 8, 1, 1
        w.P, K, width = q8.shape[0], q8.shape[1], q8.shape[2]
    elif isinstance(panels, Q8Panels):
        q8, d32, m32 = panels.q, panels.d, panels.m
        w.q, w.d, w.m, w.kind, w.exact, w.half = &q8[0, 0, 0], &d32[0, 0, 0], &m32[0, 0, 0], 8, panels.exact, 0
        w.P, K, width = q8.shape[0], q8.shape[1], q8.shape[2]
    elif isinstance(panels, np.ndarray) and panels.dtype == np.float32:
        f32 = panels
        w.q, w.d, w.m, w.kind, w.exact, w.half = &f32[0, 0, 0], NULL, NULL, 32, 0, 0
        w.P, K, width = f32.shape[0], f32.shape[1], f32.shape[2]
    else:
        raise TypeError(f"float32, Q8Panels, Q4Panels or KPanels panels, not {type(panels).__name__} "
                        f"{getattr(panels, 'dtype', '')}")
    if width != PG_NR or (w.kind != 32 and K % 32):
        raise ValueError(f"panels of {w.P} x {K} x {width} are not this build's {PG_NR}-wide panels"
                         + ("" if w.kind == 32 else " in whole 32-row groups"))
    return K


cdef int bind_weight(object panels, Py_ssize_t n, GemmWeight *w) except -1:
    activations = "float32"
    if hasattr(panels, "panels"):  # a models.packed.PackedWeight: its panels, multiplied as it says
        activations = panels.activations
        panels = panels.panels
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    parts, cols = (panels.parts, panels.cols) if isinstance(panels, SegmentedPanels) else ((panels,), (n,))
    if not 1 <= len(parts) <= 4 or len(cols) != len(parts) or sum(cols) != n:
        raise ValueError(f"{len(parts)} parts of {list(cols)} columns do not make a matrix of {n} columns")
    cdef Py_ssize_t i, K, col0 = 0
    w.nparts, w.n, w.P = len(parts), n, 0
    for i in range(len(parts)):
        K = _bind_part(parts[i], &w.part[i])
        if i == 0:
            w.K = K
        w.part[i].col0, w.part[i].n = col0, cols[i]
        if K != w.K or not (0 < cols[i] <= w.part[i].P * PG_NR) or (i + 1 < len(parts) and cols[i] % PG_NR):
            raise ValueError(f"panels of {w.part[i].P} x {K} do not fit {cols[i]} of the {n} columns of a "
                             f"[{w.K}, {n}] matrix" + (" in whole panels" if i + 1 < len(parts) else ""))
        if len(parts) > 1 and w.part[i].kind == 32:
            raise TypeError("a matrix in parts has quantized parts")
        col0 += cols[i]
        w.P += w.part[i].P
    w.act8 = 0 if w.part[0].kind == 32 else ACTIVATIONS.index(activations)  # float32 panels: float32 products
    return 0


cdef inline pg_kq _kq(const GemmPart *w) noexcept nogil:
    cdef pg_kq k
    k.kind, k.qh, k.sc, k.mn = w.kq, <const uint8_t *> w.qh, w.sc, <const uint8_t *> w.mn
    k.D, k.Dmin = <const uint16_t *> w.D, <const uint16_t *> w.Dmin
    return k


cdef int _round_x(const float *x, Py_ssize_t M, Py_ssize_t K, int two, int order, int threads,
                  pg_x8 *x8) noexcept nogil:
    """x rounded for the integer products into this thread's buffer of that k order; -1 where
    the buffer cannot be had."""
    cdef pg_x8_job xjob
    if pg_x8_reserve(x8, M, K, two, order) != 0:
        return -1
    xjob.x, xjob.out, xjob.order = x, x8[0], order
    xjob.rows_per_task = (M + 4 * threads - 1) // (4 * threads)
    if M * K < _X8_SERIAL or threads == 1:  # a decode step's rows: not worth waking a helper
        xjob.rows_per_task = M
        pg_x8_task(&xjob, 0)
    else:
        pool.run(pg_x8_task, &xjob, (M + xjob.rows_per_task - 1) // xjob.rows_per_task, threads)
    return 0


cdef int _gemm_int8(const GemmWeight *w, const float *x, Py_ssize_t M, float *c, int threads) noexcept nogil:
    """c = x @ w with x rounded to integers (packed_int8.h); -1 (nothing done) where a buffer for
    the rounded x cannot be had. x is rounded once per k order its parts need: natural for
    8-bit panels, even-odd for the 4-bit words (Q4Panels, KPanels)."""
    cdef pg_x8 x8[2]
    cdef int have[2]
    cdef pg_i8_job job
    cdef const GemmPart *part
    cdef int i, order
    have[0] = have[1] = 0
    for i in range(w.nparts):
        order = PG_X8_NATURAL if w.part[i].kind == 8 else PG_X8_EVEN_ODD
        if not have[order]:
            if _round_x(x, M, w.K, w.act8 == 2, order, threads, &x8[order]) != 0:
                return -1
            have[order] = 1
    for i in range(w.nparts):
        part = &w.part[i]
        order = PG_X8_NATURAL if part.kind == 8 else PG_X8_EVEN_ODD
        job.x, job.q, job.d, job.m, job.bits, job.half = &x8[order], part.q, part.d, part.m, part.kind, part.half
        job.c, job.n, job.ldc, job.P, job.k = c + part.col0, part.n, w.n, part.P, _kq(part)
        job.chunk = job.P // ((_Q8_TASKS_PER_THREAD_ROW if M == 1 else _Q8_TASKS_PER_THREAD) * threads)
        if job.chunk < 1:
            job.chunk = 1
        pool.run(pg_i8_task, &job, (job.P + job.chunk - 1) // job.chunk, threads)
    return 0


cdef void gemm(const GemmWeight *w, const float *x, Py_ssize_t M, float *c) noexcept nogil:
    cdef pg_gemm_job fjob
    cdef pg_q8_job job
    cdef int threads = _threads_for(M * w.K * w.n)
    cdef long step
    cdef const GemmPart *part
    cdef int i
    if M == 0:
        return
    if w.act8 and _gemm_int8(w, x, M, c, threads) == 0:
        return
    if w.part[0].kind == 32:  # float32 panels: one part
        fjob.x, fjob.x2, fjob.panels, fjob.c = x, NULL, w.part[0].q, c
        fjob.M, fjob.K, fjob.K2, fjob.n, fjob.kc = M, w.K, 0, w.n, _KC
        pool.run(pg_gemm_f32_task, &fjob, w.P, threads)
        return
    for i in range(w.nparts):
        part = &w.part[i]
        job.x, job.q, job.d, job.m, job.bits, job.exact, job.half = x, part.q, part.d, part.m, part.kind, part.exact, part.half
        job.k, job.c, job.n, job.ldc = _kq(part), c + part.col0, part.n, w.n
        job.M, job.K, job.kc = M, w.K, _KC  # the float32 kernel's blocks: the same sums
        job.P = part.P
        job.fused_tiles = _Q8_FUSED_TILES
        job.chunk = job.P // ((_Q8_TASKS_PER_THREAD_ROW if M == 1 else _Q8_TASKS_PER_THREAD) * threads)
        if job.chunk < 1:
            job.chunk = 1  # enough tasks to even out the threads
        if job.M == 1 and part.kind not in (5, 6):  # one row: panels in pairs (pg_gemm_q8_pair), fours (_q8h_quad)
            step = 4 if part.half else 2
            job.chunk = (job.chunk + step - 1) // step * step
        pool.run(pg_gemm_q8_task, &job, (job.P + job.chunk - 1) // job.chunk, threads)


def quantize_x8(x, str order="natural", bint two=False):
    """x [M, K] float32 (K a multiple of 32) rounded as the integer products round it
    (packed_int8.h): (q1 int8 [M, K], q2 int8 [M, K] or None, d float32 [M, K/32], s float32
    [M, K/32], sum int32 [M, K/32]): per group of 32, x ~= d Q with Q = q1 (one level) or
    256 q1 + q2 (two, `two`), sum = sum(Q), s = d * sum(Q). order "even-odd": q's k in the order
    of the 4-bit panels' words (rows 0 2 4 6 1 3 5 7 of every 8), "natural": as x's."""
    cdef const float[:, ::1] xv = np.ascontiguousarray(x, dtype=np.float32)
    cdef Py_ssize_t M = xv.shape[0], K = xv.shape[1]
    if K % 32 or order not in ("natural", "even-odd"):
        raise ValueError(f"x needs K % 32 == 0 (got {K}) and order natural or even-odd (got {order!r})")
    q, q2 = np.empty((M, K), dtype=np.int8), np.empty((M, K), dtype=np.int8) if two else None
    d, s = np.empty((M, K // 32), dtype=np.float32), np.empty((M, K // 32), dtype=np.float32)
    total, half = np.empty((M, K // 32), dtype=np.int32), np.empty((M, K // 16), dtype=np.int32)
    if M == 0 or K == 0:
        return q, q2, d, s, total
    cdef int8_t[:, ::1] qv = q, q2v
    cdef float[:, ::1] dv = d, sv = s
    cdef int32_t[:, ::1] tv = total, hv = half
    cdef pg_x8_job job
    job.x, job.order, job.rows_per_task = &xv[0, 0], PG_X8_EVEN_ODD if order == "even-odd" else PG_X8_NATURAL, M
    job.out.q, job.out.d, job.out.s, job.out.sum, job.out.M, job.out.K = &qv[0, 0], &dv[0, 0], &sv[0, 0], &tv[0, 0], M, K
    job.out.q2, job.out.sum16 = NULL, &hv[0, 0]
    if two:
        q2v = q2
        job.out.q2 = &q2v[0, 0]
    with nogil:
        pg_x8_task(&job, 0)
    return q, q2, d, s, total


class _Bound(NamedTuple):  # what bind_weight takes: panels and how they multiply x
    panels: object
    activations: str


cdef void _matmul(panels, const float[:, ::1] x, Py_ssize_t n, float[:, ::1] c, str activations) except *:
    cdef GemmWeight w
    bind_weight(_Bound(panels, activations), n, &w)
    if w.K != x.shape[1]:
        raise ValueError(f"panels of {w.P} panels x {w.K} rows do not fit x of shape {tuple(x.shape)[:2]}")
    with nogil:
        gemm(&w, &x[0, 0], x.shape[0], &c[0, 0])


cdef void _matmul_bf16(const float[:, ::1] x, const uint16_t[:, :, :, ::1] panels, Py_ssize_t n,
                       float[:, ::1] c):
    cdef pg_gemm_job job
    cdef Py_ssize_t M = x.shape[0], K2 = panels.shape[1]
    cdef uint32_t *x2 = <uint32_t *> malloc(M * K2 * sizeof(uint32_t))
    if x2 == NULL:
        raise MemoryError()
    job.x, job.x2, job.panels, job.c = &x[0, 0], x2, &panels[0, 0, 0, 0], &c[0, 0]
    job.M, job.K, job.K2, job.n, job.kc = M, x.shape[1], K2, n, _KC
    try:
        with nogil:
            pg_round_x(&x[0, 0], x2, M, x.shape[1], K2)
            pool.run(pg_gemm_bf16_task, &job, panels.shape[0], _threads_for(job.M * job.K * n))
    finally:
        free(x2)


cdef class QuantizedGemm:
    """`matmul` for one quantized matrix with its checks and buffer lookups done once, at the first
    product: a call then acquires only x and out. At decode sizes the general `matmul` spent about
    5 us per 4-bit call before any arithmetic (121 calls a token), most of it in acquiring the
    three panel arrays and viewing the float16 scales as integers."""
    cdef object panels  # keeps the arrays alive: the pointers in w point into them
    cdef GemmWeight w

    def __init__(self, panels, Py_ssize_t n, str activations="float32"):
        if not isinstance(panels, (Q4Panels, Q8Panels, KPanels, SegmentedPanels)):
            raise TypeError(f"QuantizedGemm takes quantized panels, not {type(panels).__name__}")
        bind_weight(_Bound(panels, activations), n, &self.w)
        self.panels = panels

    @property
    def K(self):
        return self.w.K

    @property
    def parts(self):
        return self.w.nparts

    @property
    def n(self):
        return self.w.n

    @property
    def P(self):
        return self.w.P

    def __call__(self, const float[:, ::1] x, float[:, ::1] out):
        """out [M, n] = x [M, K] @ the matrix (x C-contiguous float32, as the model's buffers are)."""
        if x.shape[1] != self.w.K or out.shape[0] != x.shape[0] or out.shape[1] != self.w.n:
            raise ValueError(f"x {tuple(x.shape)[:2]} and out {tuple(out.shape)[:2]} do not fit a "
                             f"[{self.w.K}, {self.w.n}] matrix")
        if x.shape[0]:
            with nogil:
                gemm(&self.w, &x[0, 0], x.shape[0], &out[0, 0])
        return out.base if out.base is not None else out
