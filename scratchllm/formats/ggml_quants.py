"""GGML tensor types: their block sizes, and vectorized dequantization of the ones we read.

A quantized GGML tensor is a run of fixed-size blocks; each block holds `block_size` consecutive
elements of the innermost dimension (ne[0], which must be a multiple of the block size). Every
type we read comes down to groups of `GROUP[type]` elements sharing a float32 scale d and,
for some types, an offset m:

    value = d * q + m        (the product rounded, then the sum: ggml's and gguf-py's order)

with q a small integer. Per type, the block (bytes) and what d, q and m are:

    Q8_0    34 B / 32: f16 d, 32 x int8                    q as stored
    Q4_0    18 B / 32: f16 d, 16 B 4-bit                   q = nibble - 8
    Q4_1    20 B / 32: f16 d, f16 m, 16 B 4-bit            q = nibble
    Q5_0    22 B / 32: f16 d, u32 high bits, 16 B 4-bit    q = (nibble | bit << 4) - 16
    Q5_1    24 B / 32: f16 d, f16 m, u32 high bits, 16 B   q = nibble | bit << 4
    IQ4_NL  18 B / 32: f16 d, 16 B 4-bit                   q = KVALUES[nibble]
    Q4_K   144 B / 256: f16 D, f16 Dmin, 12 B of 8 x (6-bit sc, 6-bit mn), 128 B 4-bit
                        per 32: d = D * sc, m = -(Dmin * mn), q = nibble
    Q5_K   176 B / 256: Q4_K's, plus 32 B of high bits     q = nibble | bit << 4
    IQ4_XS 136 B / 256: f16 D, u16 + 4 B of 8 x 6-bit ls, 128 B 4-bit
                        per 32: d = D * (ls - 32), q = KVALUES[nibble]
    Q6_K   210 B / 256: 128 B low 4 bits, 64 B high 2 bits, 16 x int8 sc, f16 D
                        per 16: d = D * sc, q = (low | high << 4) - 32
    Q3_K   110 B / 256: 32 B high-bit mask, 64 B 2-bit, 12 B of 16 x 6-bit sc, f16 D
                        per 16: d = D * (sc - 32), q = low - (0 if the mask bit is set else 4)
    Q2_K    84 B / 256: 16 x (4-bit sc | 4-bit mn << 4), 64 B 2-bit, f16 D, f16 Dmin
                        per 16: d = D * sc, m = -(Dmin * mn), q = 2 bits

(A - B and A + (-B) are the same IEEE operation, signed zeros included, so the K-quants'
"d * q - Dmin * mn" is d * q + m exactly.) In the 4-bit types a run of 2k bytes holds 4k
elements: its low nibbles first, then its high nibbles (not element j*2, j*2+1 per byte).

Dequantization works on the whole tensor at once: the bytes are viewed as an array of blocks (a
NumPy structured dtype, zero-copy), and each step is one ufunc over every block of a cache-sized
chunk. There is no Python loop over blocks.

Which types the quantized GEMM kernels keep as they are (`KERNEL_TYPES`): those whose groups
are 32 wide, the kernels' group. Their (q, d, m) go to the kernels as they come from `groups`
(`as_q8`, or `as_q4` for Q4_0 / Q4_1), and the kernels compute d * q + m with the same two
roundings, so the product equals the float32 product on `dequantize`'s matrix bit for bit. The
16-wide types have no 8-bit form: Q6_K has panels of its own (kernels/kpanels.py, which reads
the blocks themselves), and so have Q3_K and Q2_K.
"""

from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

# type id -> (name, elements per block, bytes per block). The full table, so that every tensor of
# a file can be sized and bounds-checked even when we cannot decode its type.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}

# Plain element types: the file's bytes are the array (zero-copy view), except BF16 which NumPy
# lacks and which we widen to float32.
PLAIN_DTYPES: dict[str, np.dtype[Any]] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "F64": np.dtype("<f8"),
    "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
}

BLOCK_DTYPES: dict[str, np.dtype[np.void]] = {
    "Q8_0": np.dtype([("d", "<f2"), ("qs", "i1", (32,))]),
    "Q4_0": np.dtype([("d", "<f2"), ("qs", "u1", (16,))]),
    "Q4_1": np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))]),
    "Q5_0": np.dtype([("d", "<f2"), ("qh", "<u4"), ("qs", "u1", (16,))]),
    "Q5_1": np.dtype([("d", "<f2"), ("m", "<f2"), ("qh", "<u4"), ("qs", "u1", (16,))]),
    "IQ4_NL": np.dtype([("d", "<f2"), ("qs", "u1", (16,))]),
    "Q2_K": np.dtype([("scales", "u1", (16,)), ("qs", "u1", (64,)), ("d", "<f2"), ("dmin", "<f2")]),
    "Q3_K": np.dtype([("hmask", "u1", (32,)), ("qs", "u1", (64,)), ("scales", "u1", (12,)), ("d", "<f2")]),
    "Q4_K": np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)), ("qs", "u1", (128,))]),
    "Q5_K": np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)), ("qh", "u1", (32,)),
                      ("qs", "u1", (128,))]),
    "Q6_K": np.dtype([("ql", "u1", (128,)), ("qh", "u1", (64,)), ("scales", "i1", (16,)), ("d", "<f2")]),
    "IQ4_XS": np.dtype([("d", "<f2"), ("scales_h", "<u2"), ("scales_l", "u1", (4,)), ("qs", "u1", (128,))]),
}
_BY_NAME = {name: (size, nbytes) for name, size, nbytes in GGML_TYPES.values()}
BLOCK_SIZE = {name: _BY_NAME[name][0] for name in BLOCK_DTYPES}  # elements per block
# Invariant: each block dtype is exactly the file's block (NumPy packs structured fields).
assert all(BLOCK_DTYPES[n].itemsize == _BY_NAME[n][1] for n in BLOCK_DTYPES), "block layouts"

GROUP = {name: 16 if name in ("Q2_K", "Q3_K", "Q6_K") else 32 for name in BLOCK_DTYPES}  # elements per scale
KERNEL_TYPES = frozenset(n for n, g in GROUP.items() if g == 32)  # kept quantized by the GEMM kernels

# IQ4_NL's and IQ4_XS's 16 levels (ggml's kvalues_iq4nl)
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)

QUANT_LAYOUT = {
    "Q8_0": "blocks of 32: f16 scale + 32 x int8",
    "Q4_0": "blocks of 32: f16 scale + 32 x 4-bit (offset 8)",
    "Q4_1": "blocks of 32: f16 scale + f16 min + 32 x 4-bit",
    "Q5_0": "blocks of 32: f16 scale + 32 x 5-bit (offset 16)",
    "Q5_1": "blocks of 32: f16 scale + f16 min + 32 x 5-bit",
    "IQ4_NL": "blocks of 32: f16 scale + 32 x 4-bit index into 16 fixed levels",
    "Q2_K": "blocks of 256: f16 scale + f16 min, 16 x (4-bit scale, 4-bit min) per 16 + 256 x 2-bit",
    "Q3_K": "blocks of 256: f16 scale, 16 x 6-bit scale per 16 + 256 x 3-bit",
    "Q4_K": "blocks of 256: f16 scale + f16 min, 8 x (6-bit scale, 6-bit min) per 32 + 256 x 4-bit",
    "Q5_K": "blocks of 256: f16 scale + f16 min, 8 x (6-bit scale, 6-bit min) per 32 + 256 x 5-bit",
    "Q6_K": "blocks of 256: f16 scale, 16 x int8 scale per 16 + 256 x 6-bit",
    "IQ4_XS": "blocks of 256: f16 scale, 8 x 6-bit scale per 32 + 256 x 4-bit index into 16 fixed levels",
}

SUPPORTED = set(PLAIN_DTYPES) | set(BLOCK_DTYPES) | {"BF16"}

# A GGUF file's `general.file_type` (llama.cpp's llama_ftype: the mix a quantizer wrote, e.g.
# Q4_K_M = Q4_K for most matrices and Q6_K for some) -> the name Ollama and llama.cpp show for it.
# The types of single tensors do not tell the mix apart: a Q4_K_M file of a model whose rows are
# not a multiple of 256 holds more Q5_0 tensors than Q4_K ones.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS",
    20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M",
    28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
}


def out_dtype(type_name: str) -> str:
    """NumPy dtype name a lookup of a tensor of this GGML type returns."""
    if type_name in PLAIN_DTYPES:
        return PLAIN_DTYPES[type_name].name
    return "float32"  # quantized and BF16 are widened


def bf16_to_float32(raw: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """uint16 bfloat16 bit patterns [...] -> float32 [...]: bf16 is the top half of a float32."""
    out = np.empty(raw.shape, dtype=np.float32) if out is None else out.reshape(raw.shape)
    np.left_shift(raw, 16, out=out.view(np.uint32), dtype=np.uint32)
    return out


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """uint8 [n, B] -> uint8 [n, 2B]: each run of `run` bytes becomes its low nibbles, then its high."""
    n, B = qs.shape
    qs = qs.reshape(n, B // run, 1, run)
    out = np.empty((n, B // run, 2, run), dtype=np.uint8)
    np.bitwise_and(qs[:, :, 0], 0x0F, out=out[:, :, 0])
    np.right_shift(qs[:, :, 0], 4, out=out[:, :, 1])
    return out.reshape(n, 2 * B)


def _bits(packed: np.ndarray, shifts: Iterable[int], mask: int) -> npt.NDArray[np.uint8]:
    """uint [n, B] -> uint8 [n, len(shifts), B]: field (x >> shift) & mask of every element, per shift."""
    by = np.asarray(shifts, dtype=packed.dtype)[:, None]
    fields: npt.NDArray[np.uint8] = ((packed[:, None, :] >> by) & mask).astype(np.uint8)
    return fields


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> 8 scales and 8 mins (uint8 [n, 8] each), 6 bits each:
    bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same
    for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high)."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _f32(a: npt.ArrayLike) -> npt.NDArray[np.float32]:
    return np.asarray(a).astype(np.float32)


Groups = tuple[npt.NDArray[np.int8], npt.NDArray[np.float32], npt.NDArray[np.float32] | None]


def scales_q3k(s: npt.NDArray[np.uint8]) -> npt.NDArray[np.int8]:
    """Q3_K's 12 bytes of scales [n, 12] -> its 16 scales less 32, int8 [n, 16]: scale j is the
    nibble of byte j % 8 (low half first) and 2 bits of byte 8 + j % 4."""
    n = len(s)
    low = _bits(s[:, 0:8], (0, 4), 0x0F).reshape(n, 16)
    high = _bits(s[:, 8:12], (0, 2, 4, 6), 3).reshape(n, 16)
    sc: npt.NDArray[np.int8] = (low | (high << 4)).view(np.int8) - np.int8(32)
    return sc


def groups(type_name: str, blocks: np.ndarray) -> Groups:
    """Structured blocks [n] -> (q int8 [n, G, g], d float32 [n, G], m float32 [n, G] or None): value
    = d * q + m for the g = GROUP[type] consecutive elements of each of a block's G groups, d and m
    made with the reference's float32 operations (so d * q + m rounds as it does)."""
    n = len(blocks)
    d = _f32(blocks["d"])
    if type_name == "Q8_0":
        return blocks["qs"].reshape(n, 1, 32), d[:, None], None
    if type_name in ("Q4_0", "Q4_1", "IQ4_NL"):
        nib = _nibbles(np.ascontiguousarray(blocks["qs"]), 16).reshape(n, 1, 32)
        if type_name == "IQ4_NL":
            return KVALUES[nib], d[:, None], None
        if type_name == "Q4_0":
            return nib.view(np.int8) - np.int8(8), d[:, None], None
        return nib.view(np.int8), d[:, None], _f32(blocks["m"])[:, None]
    if type_name in ("Q5_0", "Q5_1"):
        high = _bits(blocks["qh"][:, None], range(32), 1)[:, :, 0]  # [n, 32]: bit i of qh is element i's
        q = (_nibbles(np.ascontiguousarray(blocks["qs"]), 16) | (high << 4)).view(np.int8).reshape(n, 1, 32)
        if type_name == "Q5_0":
            return q - np.int8(16), d[:, None], None
        return q, d[:, None], _f32(blocks["m"])[:, None]
    if type_name in ("Q4_K", "Q5_K"):
        sc, mn = _scale_min_k4(np.ascontiguousarray(blocks["scales"]))
        scale = d[:, None] * _f32(sc)  # [n, 8]: an f16 times a 6-bit integer, exact in float32
        offset = -(_f32(blocks["dmin"])[:, None] * _f32(mn))
        q = _nibbles(np.ascontiguousarray(blocks["qs"]), 32).reshape(n, 8, 32)  # runs of 32 bytes: 2 groups
        if type_name == "Q5_K":
            q |= _bits(np.ascontiguousarray(blocks["qh"]), range(8), 1) << 4  # group j's high bit: bit j
        return q.view(np.int8), scale, offset
    if type_name == "IQ4_XS":
        low = _nibbles(np.ascontiguousarray(blocks["scales_l"]), 4)  # [n, 8]: nibbles of 4 bytes, low first
        low = low.reshape(n, 2, 4).transpose(0, 2, 1).reshape(n, 8)  # byte j holds groups 2j and 2j + 1
        high = _bits(blocks["scales_h"][:, None], range(0, 16, 2), 3)[:, :, 0]  # [n, 8]
        ls = (low | (high << 4)).view(np.int8) - np.int8(32)
        q = KVALUES[_nibbles(np.ascontiguousarray(blocks["qs"]), 16)].reshape(n, 8, 32)
        return q, d[:, None] * _f32(ls), None
    if type_name == "Q6_K":
        low = _nibbles(np.ascontiguousarray(blocks["ql"]), 64)  # [n, 256]
        high = _bits(np.ascontiguousarray(blocks["qh"]).reshape(n * 2, 32), (0, 2, 4, 6), 3).reshape(n, 256)
        q = (low | (high << 4)).view(np.int8) - np.int8(32)
        return q.reshape(n, 16, 16), d[:, None] * _f32(blocks["scales"]), None
    if type_name == "Q3_K":
        sc = scales_q3k(np.ascontiguousarray(blocks["scales"]))
        q2 = _bits(np.ascontiguousarray(blocks["qs"]).reshape(n * 2, 32), (0, 2, 4, 6), 3).reshape(n, 256)
        mask = _bits(np.ascontiguousarray(blocks["hmask"]), range(8), 1).reshape(n, 256)
        q = q2.view(np.int8) - ((mask ^ 1) << 2).view(np.int8)  # a clear mask bit subtracts 4
        return q.reshape(n, 16, 16), d[:, None] * _f32(sc), None
    if type_name == "Q2_K":
        s = np.ascontiguousarray(blocks["scales"])
        q = _bits(np.ascontiguousarray(blocks["qs"]).reshape(n * 2, 32), (0, 2, 4, 6), 3)
        scale = d[:, None] * _f32(s & 0x0F)
        offset = -(_f32(blocks["dmin"])[:, None] * _f32(s >> 4))
        return q.view(np.int8).reshape(n, 16, 16), scale, offset
    raise AssertionError(f"no decoder for {type_name}")  # callers check BLOCK_DTYPES first


# Elements per step: 256K elements = 1 MiB of float32, so each chunk's output stays in L2 between
# the passes (convert, scale, offset) instead of streaming 3x through memory.
CHUNK_ELEMENTS = 1 << 18


def _check(type_name: str, data: np.ndarray, numel: int) -> int:
    """The number of blocks; asserts the parser sized the tensor as whole blocks (else its bug)."""
    size = BLOCK_SIZE[type_name]
    n_blocks = numel // size
    assert numel % size == 0 and data.nbytes == n_blocks * BLOCK_DTYPES[type_name].itemsize, \
        (type_name, numel, data.nbytes)
    return n_blocks


def dequantize(type_name: str, data: np.ndarray, numel: int, out: np.ndarray | None = None) -> np.ndarray:
    """Raw block bytes (uint8 [nbytes]) -> float32 [numel], in file element order.

    Bit-identical to ggml's reference dequantization (gguf-py's `gguf.quants.dequantize`): each
    value is computed with the same float32 operations in the same order (d * q, then + m)."""
    n_blocks = _check(type_name, data, numel)
    size, g = BLOCK_SIZE[type_name], GROUP[type_name]
    blocks = data.view(BLOCK_DTYPES[type_name])  # [n_blocks] structured, zero-copy
    if out is None:
        out = np.empty((n_blocks, size // g, g), dtype=np.float32)
    else:  # a caller's buffer (an arena slot): must be dense float32 of the right size
        assert out.dtype == np.float32 and out.size == numel and out.flags.c_contiguous
        out = out.reshape(n_blocks, size // g, g)
    step = max(1, CHUNK_ELEMENTS // size)
    for start in range(0, n_blocks, step):  # a loop over cache-sized chunks, not over blocks
        stop = min(start + step, n_blocks)
        q, d, m = groups(type_name, blocks[start:stop])
        chunk = out[start:stop]
        chunk[...] = q  # int8 -> float32, exact
        chunk *= d[:, :, None]
        if m is not None:
            chunk += m[:, :, None]
    return out.reshape(numel)


def as_q8(type_name: str, data: np.ndarray, shape: tuple[int, int]
          ) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Raw blocks of a [rows, cols] tensor of a KERNEL_TYPES type -> (q int8 [rows, cols], d float32
    [rows, cols/32], m float32 [rows, cols/32]) with value = d * q + m, each operation rounded as
    `dequantize` rounds it (the two agree bit for bit; m = 0 where the type has none). For
    kernels that keep the weights quantized."""
    rows, cols = shape
    assert type_name in KERNEL_TYPES, type_name
    n_blocks = _check(type_name, data, rows * cols)
    q, d, m = groups(type_name, data.view(BLOCK_DTYPES[type_name]))
    assert q.shape[0] == n_blocks
    d = d.reshape(rows, cols // 32)
    m = np.zeros_like(d) if m is None else m.reshape(rows, cols // 32)
    return np.ascontiguousarray(q).reshape(rows, cols), d, m


def as_q4(type_name: str, data: np.ndarray, shape: tuple[int, int]
          ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float16], npt.NDArray[np.float16]] | None:
    """Raw Q4_0 / Q4_1 blocks of a [rows, cols] tensor -> (q uint8 in 0..15 [rows, cols], d and m
    float16 [rows, cols/32]) with value = d * q + m, equal to `dequantize`'s floats bit for bit:
    Q4_1 as stored; Q4_0 with m = -8 d, because d * q and d * (q - 8) are exact in float32 (an
    11-bit d times a 4-bit q), so d * q + (-8 d) rounds to exactly d * (q - 8). For kernels that
    keep 4 bits per weight. None where -8 d overflows float16 (|d| > 8188): use `as_q8` then."""
    rows, cols = shape
    block = BLOCK_DTYPES[type_name]
    assert type_name in ("Q4_0", "Q4_1") and cols % 32 == 0, (type_name, shape)
    assert data.nbytes == rows * cols // 32 * block.itemsize, (type_name, shape, data.nbytes)
    blocks = data.view(block).reshape(rows, cols // 32)
    d = np.ascontiguousarray(blocks["d"]).view(np.float16)
    if type_name == "Q4_1":
        m = np.ascontiguousarray(blocks["m"]).view(np.float16)
    else:
        if np.abs(d.astype(np.float32)).max(initial=0) * 8 > np.finfo(np.float16).max:
            return None
        m = -8 * d  # a power of two times a half: exact
    qs = np.ascontiguousarray(blocks["qs"])  # [rows, cols/32, 16]: low nibbles first, then high
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, cols/32, 32] uint8
    return q.reshape(rows, cols), d, m
