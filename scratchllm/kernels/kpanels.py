"""K-quant panels: a GGUF file's K-quant blocks in the packed GEMM's panel layout, Q4_K, Q5_K and
Q6_K at about the file's bits per weight (Q4_K: 4.625, the file 4.5; Q5_K: 5.625, the file 5.5;
Q6_K: 6.5625, the file's own); Q3_K and Q2_K with their few bits in the 4-bit words (4.5625 and
5.125, the files 3.4375 and 2.625), a seventh of the float32 they were widened to before.

The K-quants (llama.cpp's Q4_K_M files: Q4_K for most matrices, Q6_K for some; Q5_K_M: Q5_K and
Q6_K) keep, per super-block of 256 weights of a row, a float16 scale D (Q4_K, Q5_K: and Dmin), and
per group (Q4_K, Q5_K: 32 weights, Q6_K: 16) a small integer scale sc (Q4_K, Q5_K: and min mn). A
weight is (formats/ggml_quants.py)
    Q4_K: w = (D sc) u - (Dmin mn),   u the 4-bit value in 0..15
    Q5_K: the same,                   u the 5-bit value in 0..31
    Q6_K: w = (D sc) (u - 32),        u the 6-bit value in 0..63
    Q3_K: w = (D sc) (u - 4),         u the 3-bit value in 0..7, sc in -32..31, groups of 16
    Q2_K: w = (D sc) u - (Dmin mn),   u the 2-bit value in 0..3, sc and mn in 0..15, groups of 16
each product of the reference's float32 operations exact (D sc has at most 11 + 7 significant
bits, times u at most 24), so one FMA gives ggml's value and the kernels can be exact.

Layout (P panels of NR columns, as packed_gemm's panels; row k of W is input k):
  q4    uint8 [P, K/2, NR]: the low 4 bits of u in Q4Panels' words (8 rows of k per 32-bit word
        and column, row t in bits 4t..4t+3)
  qh    Q6_K: uint8 [P, K/4, NR]: the high 2 bits, one 32-bit word per 16 rows and column: row
        8 r + 2 j + p (r, p in 0..1, j in 0..3) in bits 2 v, 2 v + 1 of byte j, v = 2 r + p, so
        that one shift and one AND put the high bits of a word's even (p = 0) or odd rows under
        their low nibbles (kernels/packed_int8.h)
        Q5_K: uint8 [P, K/8, NR]: the high bit, one 32-bit word per 32 rows and column: row
        8 r + 2 j + p (r in 0..3) in bit v of byte j, v = 2 r + p (again one shift and one AND)
        Q4_K: None
  sc    Q4_K, Q5_K: uint8 [P, K/32, NR] (6 bits); Q6_K, Q3_K: int8 [P, K/16, NR]; Q2_K: uint8
        [P, K/16, NR]
  mn    Q4_K, Q5_K: uint8 [P, K/32, NR] (6 bits); Q2_K: uint8 [P, K/16, NR]; Q6_K, Q3_K: None
  d     float16 [P, K/256, NR]: D
  dmin  Q4_K, Q5_K, Q2_K: float16 [P, K/256, NR]: Dmin; Q6_K, Q3_K: None
Columns past the matrix's last (the right edge of the last panel) are all zeros: weight 0.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from scratchllm.formats import ggml_quants as gq

KTYPES = ("Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K")
FIVE = ("Q5_0", "Q5_1")  # 5-bit types of 32-weight blocks, in the same words (see below)
TYPES = (*KTYPES, *FIVE)  # what KPanels hold
SUPER = 256  # weights per super-block (K-quants' block)
GROUP = {"Q4_K": 32, "Q5_K": 32, "Q6_K": 16, "Q3_K": 16, "Q2_K": 16, "Q5_0": 32, "Q5_1": 32}
ZERO = {"Q6_K": 32, "Q3_K": 4, "Q5_0": 16}  # w = d (u - ZERO); the others have mins (offsets) instead
# a file's bytes per 256 weights of a row
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q3_K": 110, "Q2_K": 84, "Q5_0": 8 * 22, "Q5_1": 8 * 24}
# the panels' bytes per 256 rows and column: the low nibbles (128), the high bits (Q5_K 32, Q6_K
# 64), the group scales (8 or 16) and mins (8 or 16), D and Dmin (2 each); Q5_0 / Q5_1: the
# nibbles, the high bits, a float16 d (and m) per 32: the file's own size
PANEL_BYTES = {"Q4_K": 128 + 8 + 8 + 2 + 2, "Q5_K": 128 + 32 + 8 + 8 + 2 + 2, "Q6_K": 128 + 64 + 16 + 2,
               "Q3_K": 128 + 16 + 2, "Q2_K": 128 + 16 + 16 + 2 + 2, "Q5_0": 128 + 32 + 16, "Q5_1": 128 + 32 + 32}
ARRAYS = ("q4", "qh", "sc", "mn", "d", "dmin")  # KPanels' fields that are arrays (or None), in order


class KPanels(NamedTuple):
    """The fields of the layout above; q4 first, as every quantized panel type's data is."""

    q4: npt.NDArray[np.uint8]  # [P, K/2, NR] low 4 bits, in words
    qh: npt.NDArray[np.uint8] | None  # high bits, in words: Q6_K [P, K/4, NR], Q5_K [P, K/8, NR]
    sc: npt.NDArray[Any] | None  # group scales [P, K/GROUP, NR]: int8 (Q6_K, Q3_K) or uint8; Q5_0, Q5_1: None
    mn: npt.NDArray[np.uint8] | None  # Q4_K, Q5_K, Q2_K: [P, K/GROUP, NR]
    d: npt.NDArray[np.float16]  # [P, K/256, NR]; Q5_0, Q5_1: their d per 32 [P, K/32, NR]
    dmin: npt.NDArray[np.float16] | None  # Q4_K, Q5_K, Q2_K: [P, K/256, NR]; Q5_1: its m per 32
    kind: str  # one of TYPES

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self[:6] if a is not None)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.q4.dtype

    def values(self) -> npt.NDArray[np.uint8]:
        """u [P, K, NR] (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63, Q3_K 0..7, Q2_K 0..3), a copy."""
        P, K2, NR = self.q4.shape
        rows = self.q4.reshape(P, K2 // 4, NR, 4).transpose(0, 1, 3, 2).reshape(P, K2, NR)  # byte rows
        u = np.stack([rows & 0x0F, rows >> 4], axis=2).reshape(P, 2 * K2, NR)
        if self.qh is not None:
            u |= _high_bits(self.qh, self.kind) << 4
        return u

    def dequantize(self) -> npt.NDArray[np.float32]:
        """[P, K, NR] float32: ggml's values, bit for bit."""
        return _weights(self.kind, self.values(), self.sc, self.mn, self.d, self.dmin)

    def columns(self, p: npt.NDArray[np.integer[Any]], j: npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.float32]:
        """Columns j of panels p (arrays of equal length L) -> [L, K] float32."""
        u = self.values()[p, :, j][..., None]  # [L, K, 1]
        pick = (lambda a: None if a is None else a[p, :, j][..., None])  # noqa: E731
        return _weights(self.kind, u, pick(self.sc), pick(self.mn), self.d[p, :, j][..., None], pick(self.dmin))[..., 0]


def _weights(kind: str, u: npt.NDArray[np.uint8], sc: npt.NDArray[Any] | None, mn: npt.NDArray[Any] | None,
             d: npt.NDArray[np.float16], dmin: npt.NDArray[np.float16] | None) -> npt.NDArray[np.float32]:
    """[A, K, C] weights from u [A, K, C] and the scales [A, groups, C]: ggml's float32 operations."""
    A, K, C = u.shape
    g = GROUP[kind]  # Q4_K and Q5_K alike: (D sc) u - (Dmin mn)
    if kind in FIVE:  # Q5_0: d (u - 16), Q5_1: d u + m, d and m per group
        w = u.astype(np.int8).astype(np.float32).reshape(A, K // g, g, C)
        if kind == "Q5_0":
            w -= 16
        w *= d.astype(np.float32)[:, :, None]
        if dmin is not None:
            w += dmin.astype(np.float32)[:, :, None]
        return w.reshape(A, K, C)
    assert sc is not None
    big = np.repeat(d.astype(np.float32), SUPER // g, axis=1)  # D per group: [A, K/g, C]
    scale = big * sc.astype(np.float32)  # exact
    if kind in ZERO:
        w = (u.astype(np.int8).astype(np.float32) - ZERO[kind]).reshape(A, K // g, g, C) * scale[:, :, None]
        return w.reshape(A, K, C)
    assert mn is not None and dmin is not None
    offset = np.repeat(dmin.astype(np.float32), SUPER // g, axis=1) * mn.astype(np.float32)
    w = u.astype(np.float32).reshape(A, K // g, g, C) * scale[:, :, None]
    w -= offset[:, :, None]
    return w.reshape(A, K, C)


def _high_bits(qh: npt.NDArray[np.uint8], kind: str) -> npt.NDArray[np.uint8]:
    """The high-bit words (Q6_K [P, K/4, NR], Q5_K [P, K/8, NR]) -> the high bits per row [P, K, NR]."""
    run, width, shift = (16, 3, _SHIFT6) if kind == "Q6_K" else (32, 1, _SHIFT5)
    P, rows, NR = qh.shape
    words = qh.reshape(P, rows // 4, NR * 4).view("<u4")  # [P, K/run, NR]
    out = np.empty((P, rows // 4, run, NR), dtype=np.uint8)
    for i in range(run):
        out[:, :, i] = (words >> shift[i]) & width
    return out.reshape(P, rows // 4 * run, NR)


# Where row i of a run keeps its high bits in the word: byte j = (i % 8) // 2, and v = 2 (i // 8)
# + i % 2: Q6_K (16 rows, 2 bits) at bit 2 v of the byte, Q5_K (32 rows, 1 bit) at bit v
_SHIFT6 = [8 * ((i % 8) // 2) + 2 * (2 * (i // 8) + i % 2) for i in range(16)]
_SHIFT5 = [8 * ((i % 8) // 2) + 2 * (i // 8) + i % 2 for i in range(32)]


def _panels(a: npt.NDArray[Any], nr: int, dtype: npt.DTypeLike) -> npt.NDArray[Any]:
    """[N, rows] (output columns first, as a file's tensor rows) -> [P, rows, NR] of `dtype`."""
    N, rows = a.shape
    P = -(-N // nr)
    out = np.zeros((P * nr, rows), dtype=dtype)
    out[:N] = a
    return np.ascontiguousarray(out.reshape(P, nr, rows).transpose(0, 2, 1))


def _low_words(u: npt.NDArray[np.uint8], nr: int) -> npt.NDArray[np.uint8]:
    """u [N, K] -> its low 4 bits as Q4Panels' words [P, K/2, NR]."""
    qp = _panels(u & 0x0F, nr, np.uint8)  # [P, K, NR]
    P, K, _ = qp.shape
    rows = qp[:, 0::2] | (qp[:, 1::2] << 4)  # [P, K/2, NR] byte rows
    return np.ascontiguousarray(rows.reshape(P, K // 8, 4, nr).transpose(0, 1, 3, 2)).reshape(P, K // 2, nr)


def _high_words(u: npt.NDArray[np.uint8], nr: int, kind: str) -> npt.NDArray[np.uint8]:
    """u [N, K] -> its high bits (u >> 4) as Q6_K's [P, K/4, NR] or Q5_K's [P, K/8, NR] words."""
    run, shift = (16, _SHIFT6) if kind == "Q6_K" else (32, _SHIFT5)
    hp = _panels(u >> 4, nr, np.uint32)  # [P, K, NR]
    P, K, _ = hp.shape
    runs = hp.reshape(P, K // run, run, nr)
    words = np.zeros((P, K // run, nr), dtype=np.uint32)
    for i in range(run):
        words |= runs[:, :, i] << np.uint32(shift[i])
    return np.ascontiguousarray(words.astype("<u4")).view(np.uint8).reshape(P, K // run * 4, nr)


def row_bytes(kind: str, K: int) -> int:
    """A file's bytes of one row of K weights of a TYPES type."""
    return K * BLOCK_BYTES[kind] // SUPER


def pack(kind: str, raw: npt.NDArray[np.uint8], K: int, nr: int) -> KPanels:
    """A [N, K] tensor's blocks of a TYPES type (raw uint8 [N, row_bytes(kind, K)], rows already in
    the order wanted) -> its KPanels for panels of nr columns."""
    block = gq.BLOCK_SIZE.get(kind, 0)
    if kind not in TYPES or K % block:
        raise ValueError(f"these panels take {', '.join(TYPES)} rows of whole blocks, not {kind} of {K}")
    N, nb = raw.shape[0], K // block
    blocks = np.ascontiguousarray(raw).view(gq.BLOCK_DTYPES[kind]).reshape(N * nb)
    d = _panels(blocks["d"].reshape(N, nb), nr, np.float16)
    if kind in FIVE:  # u = q (+ 16 for Q5_0, whose q is in -16..15)
        q, _, _ = gq.groups(kind, blocks)
        u = (q.view(np.uint8) + (16 if kind == "Q5_0" else 0)).astype(np.uint8).reshape(N, K)
        m = _panels(blocks["m"].reshape(N, nb), nr, np.float16) if kind == "Q5_1" else None
        return KPanels(_low_words(u, nr), _high_words(u, nr, kind), None, None, d, m, kind)
    if kind in ("Q4_K", "Q5_K"):
        sc, mn = gq._scale_min_k4(np.ascontiguousarray(blocks["scales"]))  # [N nb, 8] each
        groups = gq._nibbles(np.ascontiguousarray(blocks["qs"]), 32).reshape(N * nb, 8, 32)
        if kind == "Q5_K":  # group j's high bits: bit j of qh's 32 bytes
            groups |= gq._bits(np.ascontiguousarray(blocks["qh"]), range(8), 1) << 4
        u = groups.reshape(N, K)
        return KPanels(_low_words(u, nr), _high_words(u, nr, kind) if kind == "Q5_K" else None,
                       _panels(sc.reshape(N, K // 32), nr, np.uint8), _panels(mn.reshape(N, K // 32), nr, np.uint8),
                       d, _panels(blocks["dmin"].reshape(N, nb), nr, np.float16), kind)
    if kind in ("Q3_K", "Q2_K"):  # u in the nibbles: q + 4 (Q3_K's q is in -4..3) or q
        q, _, _ = gq.groups(kind, blocks)
        u = (q.view(np.uint8) + (4 if kind == "Q3_K" else 0)).astype(np.uint8).reshape(N, K)
        s = np.ascontiguousarray(blocks["scales"])
        if kind == "Q3_K":
            return KPanels(_low_words(u, nr), None, _panels(gq.scales_q3k(s).reshape(N, K // 16), nr, np.int8),
                           None, d, None, kind)
        return KPanels(_low_words(u, nr), None, _panels((s & 0x0F).reshape(N, K // 16), nr, np.uint8),
                       _panels((s >> 4).reshape(N, K // 16), nr, np.uint8), d,
                       _panels(blocks["dmin"].reshape(N, nb), nr, np.float16), kind)
    low = gq._nibbles(np.ascontiguousarray(blocks["ql"]), 64)  # [N nb, 256]
    high = gq._bits(np.ascontiguousarray(blocks["qh"]).reshape(N * nb * 2, 32), (0, 2, 4, 6), 3)
    u = (low | (high.reshape(N * nb, 256) << 4)).reshape(N, K)
    sc = blocks["scales"].reshape(N, K // 16)
    return KPanels(_low_words(u, nr), _high_words(u, nr, kind), _panels(sc, nr, np.int8), None, d, None, kind)


CHUNK_WEIGHTS = 1 << 20  # weights `pack_parts` packs at a time: its temporaries are a few times this


def pack_parts(parts: list[tuple[str, npt.NDArray[np.uint8], npt.ArrayLike | None]], K: int, nr: int,
               alloc: Callable[..., npt.NDArray[Any]] = np.zeros) -> KPanels:
    """`pack` of parts of one TYPES type fused along the output columns ((type, raw [rows, row
    bytes], row order or None) each, as packed_gemm.pack_blocks takes them), written chunk by chunk
    of whole panels into arrays from `alloc(shape, dtype)`. `pack` works on whole arrays, and its
    temporaries (the values, a byte each, and their high bits as 32-bit words) come to several
    times the matrix's panels: 2.3 GB for a 151,936 x 1,536 Q6_K LM head whose panels are 191 MB.
    In chunks of about CHUNK_WEIGHTS weights they are a few tens of MB, whatever the matrix."""
    kind = parts[0][0]
    assert all(p[0] == kind for p in parts), "parts of one type"
    N = sum(raw.shape[0] for _, raw, _ in parts)
    step = max(1, CHUNK_WEIGHTS // (K * nr)) * nr  # output rows per chunk: whole panels
    out: list[npt.NDArray[Any] | None] = []
    for start in range(0, N, step):
        packed = pack(kind, _rows(parts, start, min(N, start + step)), K, nr)
        if not out:  # the whole matrix's arrays: P panels of the chunk's shape
            P = -(-N // nr)
            out = [None if a is None else alloc((P, *a.shape[1:]), a.dtype) for a in packed[:6]]
        for whole, a in zip(out, packed[:6], strict=True):
            if whole is not None and a is not None:
                whole[start // nr:start // nr + a.shape[0]] = a
    q4, qh, sc, mn, d, dmin = out
    assert q4 is not None and d is not None, "every type has its low bits and scales"
    return KPanels(q4, qh, sc, mn, d, dmin, kind)


def _rows(parts: list[tuple[str, npt.NDArray[np.uint8], npt.ArrayLike | None]], start: int,
          stop: int) -> npt.NDArray[np.uint8]:
    """Rows start..stop of the parts fused along the output columns, each part's row order applied."""
    pieces, offset = [], 0
    for _, raw, order in parts:
        a, b = max(start, offset) - offset, min(stop, offset + raw.shape[0]) - offset
        if a < b:
            pieces.append(raw[a:b] if order is None else raw[np.asarray(order)[a:b]])
        offset += raw.shape[0]
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
