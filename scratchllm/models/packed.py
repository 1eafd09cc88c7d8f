"""A weight matrix stored once in the panel layout of our GEMM kernel, used as `x @ w`.

`PackedWeight` stands where a [in, out] NumPy matrix stood: `x @ w` calls
scratchllm.kernels.packed_gemm.matmul (NumPy defers to `__rmatmul__` because the class sets
`__array_ufunc__ = None`), so the model code reads the same whether weights are packed or not.
Why pack at all, and the layouts: see the kernel's docstring.

dtype "float32" keeps every weight bit; "bfloat16" rounds weights (and, inside the kernel, the
activations they multiply) to bfloat16 for half the bytes and twice the multiply rate;
"quantized" keeps a GGUF file's quantized blocks (packed_gemm.Q4Panels for Q4_0 / Q4_1: two
4-bit values per byte plus a float16 scale and offset per 32 weights of a column, the file's
bytes; kernels/kpanels.KPanels for the K-quants, Q4_K, Q5_K and Q6_K at about the file's bits
per weight, Q3_K and Q2_K in 4-bit words, and for Q5_0 and Q5_1 in the same words;
packed_gemm.Q8Panels for Q8_0 and for IQ4_NL and IQ4_XS: int8 plus a float32 scale and offset,
see formats.ggml_quants.as_q8; a fused matrix of parts of several types,
packed_gemm.SegmentedPanels, each run of one type in its own panels) and computes with exactly
the float32 values they stand for. A fused matrix whose parts cannot be kept so (a run before
the last that is not whole panels wide) is float32 (the loader logs which). `activations`
"int8" or "int16" multiplies the same panels by x rounded to integers instead (dtypes.ACTIVATIONS).
Norms, rotary embeddings, attention and the KV cache stay float32 in every mode.
"""

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from scratchllm.dtypes import WEIGHT_DTYPES as DTYPES
from scratchllm.formats.ggml_quants import KERNEL_TYPES
from scratchllm.kernels import packed_gemm
from scratchllm.kernels.kpanels import PANEL_BYTES, SUPER, KPanels
from scratchllm.kernels.kpanels import TYPES as KPANEL_TYPES

__all__ = ["DTYPES", "PackedWeight", "panel_bytes_per_weight"]  # DTYPES re-exported: models.llama checks against it

F32 = npt.NDArray[np.float32]
# (q, d, m) of one quantized part: formats.ggml_quants.as_q8 / as_q4
QuantizedPart = tuple[npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any]]


def panel_bytes_per_weight(type_name: str) -> float | None:
    """Bytes per weight a matrix of this GGUF type takes in its quantized panels (the layouts of
    packed_gemm and kpanels), or None where the model keeps it in float32 (plain types). For a
    matrix of one type, or of K-quants in parts; a part fused with parts of another
    type may take more (Q8_0 beside the 32-wide types: 40 / 32), or less (Q4_0 alone: 18 / 32)."""
    if type_name in KPANEL_TYPES:
        return PANEL_BYTES[type_name] / SUPER
    if type_name in ("Q4_0", "Q4_1"):
        return 20 / 32  # 16 bytes of nibbles, float16 d and m
    if type_name == "Q8_0":
        return 34 / 32  # int8, a float16 d
    if type_name in KERNEL_TYPES:
        return 40 / 32  # int8 and float32 d and m per 32
    return None


class PackedWeight:
    __array_ufunc__ = None  # `ndarray @ PackedWeight` -> PackedWeight.__rmatmul__

    shape: tuple[int, int]
    panels: "packed_gemm.Panels"  # a stub-only alias (kernels/packed_gemm.pyi)
    # How quantized panels multiply x (dtypes.ACTIVATIONS): "float32" (exact), "int8" or "int16" (x
    # rounded to integers per 32 values, integer dot products; kernels/packed_int8.h). Set before the first
    # product: the kernel binding reads it once. Float32 and bfloat16 panels ignore it.
    activations: str = "float32"

    def __init__(self, w: npt.NDArray[Any], dtype: str = "float32") -> None:
        """w: the [in, out] matrix, any strides (a transposed [out, in] checkpoint tensor is fine)."""
        if w.ndim != 2:
            raise ValueError(f"a weight matrix must be 2-D, got shape {w.shape}")
        self.shape = (int(w.shape[0]), int(w.shape[1]))  # (in, out): y = x @ w
        self.dtype = dtype
        self.panels = packed_gemm.pack(w, dtype)

    @classmethod
    def from_rows(cls, parts: Sequence[npt.NDArray[Any]], dtype: str = "float32") -> "PackedWeight":
        """Checkpoint tensors [out_i, in] (Hugging Face's nn.Linear layout), fused along out:
        one matrix y = x @ [p_0; p_1; ...].T, as q|k|v or gate|up."""
        rows = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        return cls(np.asarray(rows, dtype=np.float32).T, dtype)

    @classmethod
    def from_quantized_rows(cls, parts: Sequence[QuantizedPart]) -> "PackedWeight":
        """Quantized checkpoint tensors (q int8 [out_i, in], d and m float32 [out_i, in/32], value
        = d * q + m; see formats.ggml_quants.as_q8; or Q4_0 / Q4_1's 4-bit form, as_q4), fused
        along out like `from_rows`. The matrix stays quantized; the kernel dequantizes a block at
        a time, with the float32 path's values."""
        four_bit = all(p[0].dtype == np.uint8 for p in parts)  # every part 4-bit: stays 4-bit
        if not four_bit:  # a mix (Q4 beside Q8_0, Q4_K...): 8-bit for all, the same values (see as_q4)
            parts = [(q.astype(np.int8), d.astype(np.float32), m.astype(np.float32)) for q, d, m in parts]
        q, d, m = (np.concatenate([p[i] for p in parts], axis=0) for i in range(3))
        self = cls.__new__(cls)
        self.shape = (q.shape[1], q.shape[0])
        self.dtype = "quantized"
        self.panels = (packed_gemm.pack_q4 if four_bit else packed_gemm.pack_q8)(q.T, d.T, m.T)
        return self

    @classmethod
    def from_panels(cls, panels: "packed_gemm.Panels", shape: tuple[int, int]) -> "PackedWeight":
        """Quantized panels made earlier (models/panel_cache.py), as the [in, out] matrix `shape`."""
        self = cls.__new__(cls)
        self.shape = (int(shape[0]), int(shape[1]))
        self.dtype = "quantized"
        self.panels = panels
        return self

    @classmethod
    def from_blocks(cls, parts: Sequence[tuple[str, npt.NDArray[np.uint8], npt.ArrayLike | None]],
                    shape: tuple[int, int], alloc: Callable[..., npt.NDArray[Any]] = np.zeros,
                    release: Callable[[npt.NDArray[np.uint8]], None] | None = None) -> "PackedWeight | None":
        """A GGUF file's Q4_0 / Q4_1 (or Q8_0) blocks, moved straight into panels (see
        packed_gemm.pack_blocks; `parts` from GGUFAsHF.blocks, fused along out like `from_rows`).
        `shape`: (in, out). Parts of types that share no panels (a K-quant or Q5_0 beside another
        type, Q8_0 beside a 4-bit type): packed_gemm.SegmentedPanels, each run of parts of one kind
        in panels of its own. None where the blocks cannot be kept as they are (a Q4_0 scale whose
        -8 d overflows float16; a run of parts that is not whole panels wide before another):
        `from_quantized_rows` handles those. `release(rows)`: called with each run of rows of the
        file's blocks once they are packed (a few MB at a time: `_streamed`), so that the file's
        pages of a matrix and its panels are not resident together."""
        kinds = {kind for kind, _, _ in parts}
        if len({_family(kind) for kind in kinds}) > 1:
            segmented = _segments(parts, shape[0], alloc, release)
            return None if segmented is None else cls.from_panels(segmented, shape)
        panels = _streamed(parts, shape[0], alloc, release)
        return None if panels is None else cls.from_panels(panels, shape)

    def matmul_into(self, x: F32, out: F32) -> F32:
        """out = x @ self, x and out C-contiguous float32 (the decode step's buffers)."""
        if self.dtype != "quantized":
            return packed_gemm.matmul(x, self.panels, self.shape[1], out=out)
        gemm: packed_gemm.QuantizedGemm | None = getattr(self, "_gemm", None)
        if gemm is None:  # checked and bound once (packed_gemm.QuantizedGemm)
            assert not isinstance(self.panels, np.ndarray), "quantized weights have quantized panels"
            gemm = self._gemm = packed_gemm.QuantizedGemm(self.panels, self.shape[1], self.activations)
        gemm(x, out)
        return out

    def __rmatmul__(self, x: npt.NDArray[Any]) -> F32:  # [N, in] -> [N, out]
        if x.shape[-1] != self.shape[0]:
            raise ValueError(f"x of shape {x.shape} @ a [{self.shape[0]}, {self.shape[1]}] weight")
        if self.dtype == "quantized" and isinstance(x, np.ndarray) and x.ndim == 2 and x.dtype == np.float32 \
                and x.flags.c_contiguous:  # the LM head of a decode step: the product bound once (matmul_into)
            return self.matmul_into(x, np.empty((x.shape[0], self.shape[1]), dtype=np.float32))
        return packed_gemm.matmul(x, self.panels, self.shape[1], activations=self.activations)

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes

    def numpy(self) -> np.ndarray:
        """The [in, out] float32 matrix (a copy; bfloat16 values widen exactly)."""
        return packed_gemm.unpack(self.panels, *self.shape)

    def columns(self, ids: npt.ArrayLike) -> np.ndarray:
        """w[:, ids].T as a new [len(ids), in] float32 array: a tied LM head serving as the embedding."""
        return packed_gemm.columns(self.panels, self.shape[0], ids)

    def __repr__(self) -> str:
        x8 = f", {self.activations} activations" if self.activations != "float32" else ""
        return f"PackedWeight(shape={self.shape}, dtype={self.dtype}{x8}, {self.nbytes / 2**20:.1f} MiB)"


def _family(kind: str) -> str:
    """Parts of one family share panels: Q4_0 and Q4_1 (Q4Panels); each other type its own."""
    return "Q4" if kind in ("Q4_0", "Q4_1") else kind


def _segments(parts: Sequence[tuple[str, npt.NDArray[np.uint8], npt.ArrayLike | None]], K: int,
              alloc: Callable[..., npt.NDArray[Any]],
              release: Callable[[npt.NDArray[np.uint8]], None] | None = None) -> "packed_gemm.SegmentedPanels | None":
    """Consecutive parts of one family, each run in its own panels (pack_blocks); None where a run
    before the last is not whole panels wide (its panels could not write straight into its columns)
    or a run cannot be kept as it is."""
    runs: list[list[tuple[str, npt.NDArray[np.uint8], npt.ArrayLike | None]]] = []
    for part in parts:
        if runs and _family(runs[-1][-1][0]) == _family(part[0]):
            runs[-1].append(part)
        else:
            runs.append([part])
    cols = [sum(raw.shape[0] for _, raw, _ in run) for run in runs]
    if any(c % packed_gemm.NR for c in cols[:-1]):
        return None
    panels = []
    for run in runs:
        packed = _streamed(run, K, alloc, release)
        if packed is None:
            return None
        panels.append(packed)
    return packed_gemm.SegmentedPanels(tuple(panels), tuple(cols))


STREAM_BYTES = 16 << 20  # of the file's blocks `_streamed` packs at a time


Part = tuple[str, npt.NDArray[np.uint8], npt.ArrayLike | None]


Leaf = packed_gemm.Q8Panels | packed_gemm.Q4Panels | KPanels  # panels of one family


def _streamed(parts: Sequence[Part], K: int, alloc: Callable[..., npt.NDArray[Any]],
              release: Callable[[npt.NDArray[np.uint8]], None] | None) -> Leaf | None:
    """packed_gemm.pack_blocks of parts of one panel family, a run of whole panels (about
    STREAM_BYTES of the file) at a time, each written into its panels of the whole matrix's
    arrays, and the file's rows of each run handed to `release` once packed (rows in an order of
    their own (q/k) go at the end). Packed whole, a 178 MB LM head's file pages stay resident
    until its last panel is written: two copies of the largest matrix at the load's peak. Parts
    of two types (Q4_0 beside Q4_1, whose offsets only some runs would have) are packed whole."""
    N = sum(raw.shape[0] for _, raw, _ in parts)
    row_bytes = parts[0][1].shape[1]
    step = max(2, STREAM_BYTES // max(1, row_bytes * packed_gemm.NR)) * packed_gemm.NR
    if release is None or N <= step or len({kind for kind, _, _ in parts}) > 1:
        panels = packed_gemm.pack_blocks(list(parts), K, alloc)
        if panels is not None and release is not None:
            for _, raw, _ in parts:
                release(raw)
        return panels
    into = _Into(-(-N // packed_gemm.NR), alloc)
    panels = None
    for start in range(0, N, step):
        into.start(start // packed_gemm.NR)
        chunk, in_place = _chunk(parts, start, min(N, start + step))
        panels = packed_gemm.pack_blocks(chunk, K, into)
        if panels is None:  # a Q4_0 scale that float16 cannot hold: the caller's other path
            return None
        for rows in in_place:
            release(rows)
    for _, raw, order in parts:
        if order is not None:
            release(raw)
    assert panels is not None
    return into.whole_panels(panels)


def _chunk(parts: Sequence[Part], start: int, stop: int) -> tuple[list[Part], list[npt.NDArray[np.uint8]]]:
    """Output rows start..stop of the fused parts: each part's rows there (a part in a row order of
    its own: those rows gathered, in order), and the views of the file among them."""
    out: list[Part] = []
    in_place = []
    offset = 0
    for kind, raw, order in parts:
        a, b = max(start, offset) - offset, min(stop, offset + raw.shape[0]) - offset
        if a < b and order is None:
            out.append((kind, raw[a:b], None))
            in_place.append(raw[a:b])
        elif a < b:  # the part's stored rows these output rows come from
            out.append((kind, np.ascontiguousarray(raw[np.asarray(order)[a:b]]), None))
        offset += raw.shape[0]
    return out, in_place


class _Into:
    """The `alloc` pack_blocks is handed for each run of panels: its k-th array is panels p0..
    of the k-th array of the whole matrix, made at the first run's call (an array that is not
    per panel, such as Q4_0's one-panel stand-in for offsets, is made once and shared)."""

    def __init__(self, P: int, alloc: Callable[..., npt.NDArray[Any]]) -> None:
        self.P, self.alloc = P, alloc
        self.whole: list[npt.NDArray[Any]] = []
        self.per_panel: list[bool] = []
        self.k = self.p0 = 0

    def start(self, p0: int) -> None:
        self.k, self.p0 = 0, p0

    def __call__(self, shape: tuple[int, ...], dtype: npt.DTypeLike) -> npt.NDArray[Any]:
        k, self.k = self.k, self.k + 1
        if k == len(self.whole):  # the first run: its panels are whole panels, more than one
            per_panel = self.p0 == 0 and shape[0] > 1
            self.whole.append(self.alloc((self.P, *shape[1:]) if per_panel else shape, dtype))
            self.per_panel.append(per_panel)
        whole = self.whole[k]
        return whole[self.p0:self.p0 + shape[0]] if self.per_panel[k] else whole

    def whole_panels(self, last: Leaf) -> Leaf:
        """The panels of the whole matrix: `last` (the last run's) with each array of it replaced
        by the whole array it is a part of (in its dtype: float16 scales are viewed as such)."""
        fields: list[Any] = []
        for value in last:
            if isinstance(value, np.ndarray):
                k = next(i for i, w in enumerate(self.whole) if np.may_share_memory(w, value))
                value = self.whole[k].view(value.dtype)
            fields.append(value)
        return type(last)(*fields)
