"""GGML tensor types: their block sizes, and vectorized dequantization of the ones we read.

A quantized GGML tensor is a run of fixed-size blocks; each block holds `block_size` consecutive
elements of the innermost dimension (ne[0], which must be a multiple of the block size):

    Q8_0  34 bytes = f16 d,          32 x int8 q     value = d * q
    Q4_0  18 bytes = f16 d,          16 bytes qs     value = d * (q - 8)
    Q4_1  20 bytes = f16 d, f16 m,   16 bytes qs     value = d * q + m

In the 4-bit types byte j of `qs` holds element j in its low nibble and element j + 16 in its
high nibble (not j*2, j*2+1): the first half of the block is all low nibbles.

Dequantization works on the whole tensor at once: the bytes are viewed as an array of blocks
(a NumPy structured dtype, zero-copy), and each step is one ufunc over every block. There is no
Python loop over blocks; the cost is a few passes over the float32 output.
"""

import numpy as np

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
PLAIN_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "F64": np.dtype("<f8"),
    "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
}

BLOCK_DTYPES = {
    "Q8_0": np.dtype([("d", "<f2"), ("qs", "i1", (32,))]),
    "Q4_0": np.dtype([("d", "<f2"), ("qs", "u1", (16,))]),
    "Q4_1": np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))]),
}

QUANT_LAYOUT = {
    "Q8_0": "blocks of 32: f16 scale + 32 x int8",
    "Q4_0": "blocks of 32: f16 scale + 32 x 4-bit (offset 8)",
    "Q4_1": "blocks of 32: f16 scale + f16 min + 32 x 4-bit",
}

SUPPORTED = set(PLAIN_DTYPES) | set(BLOCK_DTYPES) | {"BF16"}


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


# Blocks per step: 8192 blocks = 256K elements = 1 MiB of float32, so each chunk's output stays in
# L2 between the passes (convert, scale, offset) instead of streaming 3x through memory.
CHUNK_BLOCKS = 8192


def dequantize(type_name: str, data: np.ndarray, numel: int, out: np.ndarray | None = None) -> np.ndarray:
    """Raw block bytes (uint8 [nbytes]) -> float32 [numel], in file element order.

    Bit-identical to ggml's reference dequantization: each value is computed with the same float32
    operations in the same order (int -> float, times d, plus m).
    """
    block = BLOCK_DTYPES[type_name]
    n_blocks = numel // 32
    # Invariant: the parser sized the tensor as whole blocks; anything else is a parser bug.
    assert numel % 32 == 0 and data.nbytes == n_blocks * block.itemsize, (type_name, numel, data.nbytes)
    blocks = data.view(block)  # [n_blocks] structured, zero-copy
    if out is None:
        out = np.empty((n_blocks, 32), dtype=np.float32)
    else:  # a caller's buffer (an arena slot): must be dense float32 of the right size
        assert out.dtype == np.float32 and out.size == numel and out.flags.c_contiguous
        out = out.reshape(n_blocks, 32)
    for start in range(0, n_blocks, CHUNK_BLOCKS):  # a loop over cache-sized chunks, not over blocks
        stop = min(start + CHUNK_BLOCKS, n_blocks)
        _dequantize_chunk(type_name, blocks[start:stop], out[start:stop])
    return out.reshape(numel)


def _dequantize_chunk(type_name: str, blocks: np.ndarray, out: np.ndarray) -> None:
    """blocks [n] structured -> out [n, 32] float32, in place."""
    d = blocks["d"].astype(np.float32)[:, None]  # [n, 1]
    if type_name == "Q8_0":
        out[...] = blocks["qs"]  # int8 -> float32, exact
        out *= d
        return
    qs = np.ascontiguousarray(blocks["qs"])  # [n, 16] uint8: two elements per byte
    q = np.empty((len(blocks), 2, 16), dtype=np.uint8)  # [n, low|high nibbles, 16]
    np.bitwise_and(qs, 0x0F, out=q[:, 0])  # elements 0..15
    np.right_shift(qs, 4, out=q[:, 1])  # elements 16..31
    out[...] = q.reshape(len(blocks), 32)  # exact in float32
    if type_name == "Q4_0":
        out -= 8.0  # (q - 8) is exact in float32, as ggml's int subtraction is
        out *= d
        return
    out *= d  # Q4_1: d * q + m, rounded after the product and after the sum, as ggml does
    out += blocks["m"].astype(np.float32)[:, None]


def as_q8(type_name: str, data: np.ndarray, shape: tuple[int, int]):
    """Raw Q8_0 / Q4_0 / Q4_1 blocks of a [rows, cols] tensor -> (q int8 [rows, cols], d float32
    [rows, cols/32], m float32 [rows, cols/32]) with value = d * q + m, each operation rounded as
    `dequantize` rounds it (so the two agree bit for bit): Q8_0 q as stored, m = 0; Q4_0 q - 8
    (exact), m = 0; Q4_1 q in 0..15, m as stored. For kernels that keep the weights quantized."""
    rows, cols = shape
    block = BLOCK_DTYPES[type_name]
    assert cols % 32 == 0 and data.nbytes == rows * cols // 32 * block.itemsize, (type_name, shape, data.nbytes)
    blocks = data.view(block).reshape(rows, cols // 32)
    d = blocks["d"].astype(np.float32)
    m = blocks["m"].astype(np.float32) if type_name == "Q4_1" else np.zeros_like(d)
    if type_name == "Q8_0":
        return np.ascontiguousarray(blocks["qs"]).reshape(rows, cols), d, m
    qs = np.ascontiguousarray(blocks["qs"])  # [rows, cols/32, 16]: low nibbles first, then high
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8)  # [rows, cols/32, 32]
    if type_name == "Q4_0":
        q -= 8
    return q.reshape(rows, cols), d, m


def as_q4(type_name: str, data: np.ndarray, shape: tuple[int, int]):
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
