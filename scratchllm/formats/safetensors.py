"""safetensors, read by hand: an 8-byte header length, a JSON header, then raw tensor bytes.

    u64 N (little-endian) | N bytes of UTF-8 JSON | data
    JSON: {"__metadata__": {str: str}, name: {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}}

Offsets are relative to the first byte after the header. Every tensor is dense row-major and
little-endian, so a lookup is a zero-copy view of the mapped file, except BF16 and the FP8 types,
which NumPy lacks and which come out as float32.

Checked at open, before any tensor is read: the header fits in the file and is a JSON object;
every entry has a known dtype, a shape of non-negative ints and offsets inside the data; the
byte count equals dtype size x number of elements; no two tensors overlap.
"""

import json
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from scratchllm.errors import FormatError
from scratchllm.formats import ggml_quants as gq
from scratchllm.formats.checkpoint import Checkpoint, TensorInfo, row_major_strides
from scratchllm.formats.mapped import map_file

MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's limit; a longer one is a lie

DTYPES = {
    "BOOL": np.dtype("?"),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "C64": np.dtype("<c8"),
    # Widened to float32 on lookup; stored as the bit patterns below.
    "BF16": np.dtype("<u2"),
    "F8_E4M3": np.dtype("u1"),
    "F8_E5M2": np.dtype("u1"),
    "F8_E8M0": np.dtype("u1"),
}
# Not read: the sub-byte types (F4, F6_E2M3, F6_E3M2) pack elements across byte boundaries; they
# are refused as unknown dtypes with their name.
WIDENED = {"BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0"}


def _fp8_table(exp_bits: int, man_bits: int, bias: int, e4m3: bool) -> npt.NDArray[np.float32]:
    """float32 [256]: the value of every 8-bit pattern (FP8 has so few that a table is the decoder)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> man_bits) & ((1 << exp_bits) - 1)
    man = codes & ((1 << man_bits) - 1)
    normal = (1 + man / (1 << man_bits)) * np.exp2(exp - bias)
    subnormal = (man / (1 << man_bits)) * np.exp2(1 - bias)
    value = sign * np.where(exp == 0, subnormal, normal)
    top = (1 << exp_bits) - 1
    if e4m3:  # E4M3 "fn": no infinities; only S.1111.111 is NaN
        value = np.where((exp == top) & (man == (1 << man_bits) - 1), np.nan, value)
    else:  # E5M2: IEEE-like, exponent all ones is inf (mantissa 0) or NaN
        value = np.where(exp == top, np.where(man == 0, sign * np.inf, np.nan), value)
    return value.astype(np.float32)


def _e8m0_table() -> npt.NDArray[np.float32]:
    """E8M0 (microscaling scales): a bare exponent, 2 ** (e - 127); 0xFF is NaN."""
    value: npt.NDArray[np.float64] = np.exp2(np.arange(256) - 127.0)
    value[255] = np.nan
    return value.astype(np.float32)


FP8_TABLES = {"F8_E4M3": _fp8_table(4, 3, 7, True), "F8_E5M2": _fp8_table(5, 2, 15, False),
              "F8_E8M0": _e8m0_table()}


def _widen(dtype: str, raw: np.ndarray) -> np.ndarray:
    if dtype == "BF16":
        return gq.bf16_to_float32(raw)
    decoded: npt.NDArray[np.float32] = FP8_TABLES[dtype][raw]
    return decoded


def read_header(data: npt.NDArray[np.uint8], path: str) -> tuple[dict[str, Any], int]:
    """(parsed JSON header, byte offset where tensor data starts)."""
    if data.size < 8:
        raise FormatError(path, f"truncated: {data.size} bytes, too short for the 8-byte header length")
    n = int(data[:8].view("<u8")[0])
    if n > MAX_HEADER or 8 + n > data.size:
        raise FormatError(path, f"header length {n} runs past the end of the {data.size}-byte file")
    try:
        header = json.loads(data[8:8 + n].tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise FormatError(path, f"header is not valid JSON: {err}") from None
    if not isinstance(header, dict):
        raise FormatError(path, f"header is a JSON {type(header).__name__}, expected an object")
    return header, 8 + n


def _entry(path: str, name: str, entry: object, data_start: int, data_len: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise FormatError(path, f"tensor '{name}': entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise FormatError(path, f"tensor '{name}' has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise FormatError(path, f"tensor '{name}': shape {shape!r} is not a list of non-negative ints")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(o) is int for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
        raise FormatError(path, f"tensor '{name}': data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    if end > data_len:
        raise FormatError(path, f"tensor '{name}' ends at byte {data_start + end} but the file has "
                                f"{data_start + data_len} bytes")
    numel = 1
    for d in shape:
        numel *= d
    expected = numel * DTYPES[dtype].itemsize
    if end - begin != expected:
        raise FormatError(path, f"tensor '{name}': {end - begin} bytes, but {dtype} x {shape} needs {expected}")
    shape = tuple(shape)
    return TensorInfo(
        name=name, dtype=dtype, shape=shape, strides=row_major_strides(shape), offset=data_start + begin,
        nbytes=end - begin, file=path, out_dtype="float32" if dtype in WIDENED else DTYPES[dtype].name,
        contiguous=True,
    )


def load_safetensors(path: str | Path) -> Checkpoint:
    p = str(path)
    data = map_file(Path(path))  # uint8 [file_size]
    header, data_start = read_header(data, p)
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict):
        raise FormatError(p, "__metadata__ is not an object")
    infos = {name: _entry(p, name, entry, data_start, data.size - data_start)
             for name, entry in header.items() if name != "__metadata__"}
    spans = sorted((i.offset, i.offset + i.nbytes, i.name) for i in infos.values() if i.nbytes)
    for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:], strict=False):
        if start_b < end_a:
            raise FormatError(p, f"tensors '{a}' and '{b}' overlap (bytes {start_b}..{end_a})")

    def read(info: TensorInfo) -> np.ndarray:
        raw = data[info.offset:info.offset + info.nbytes].view(DTYPES[info.dtype])  # zero-copy
        if info.dtype in WIDENED:
            raw = _widen(info.dtype, raw)
        return raw.reshape(info.shape)

    def raw(info: TensorInfo) -> npt.NDArray[np.uint8]:
        return data[info.offset:info.offset + info.nbytes]

    return Checkpoint(
        format="safetensors",
        path=p,
        metadata=metadata,
        infos=infos,
        readers=dict.fromkeys(infos, read),
        raw_readers=dict.fromkeys(infos, raw),
        container={"kind": "safetensors", "header_length": data_start - 8, "data_offset": data_start,
                   "file_size": int(data.size), "header": header},
    )
