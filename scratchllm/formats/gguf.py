"""GGUF v2/v3, read by hand: header, metadata key/values, tensor infos, aligned tensor data.

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count x (string key, u32 value_type, value)          string = u64 length + UTF-8 bytes
    tensor_count x (string name, u32 n_dims, n_dims x u64 ne, u32 ggml_type, u64 offset)
    padding to `general.alignment` (default 32)  <- data_offset
    tensor data; each tensor at data_offset + offset, offsets multiples of the alignment

Everything is little-endian. `ne` lists dimensions innermost first, so the NumPy shape is its
reverse: a linear weight with ne = [in, out] becomes [out, in], like Hugging Face.

What the parser does NOT do: undo llama.cpp's Q/K rotary permutation. convert_hf_to_gguf.py
permutes the rows of attn_q / attn_k so that llama.cpp's RoPE can rotate adjacent pairs; the
parser returns the file's truth and scratchllm.models un-permutes when it maps GGUF names to
Hugging Face names (docs/model-files.md).

Opening a file reads only the header pages (the file is memory-mapped); tensor bytes are read
when a tensor is looked up. `header_checkpoint` reads the header alone from a file that holds
only the beginning of a GGUF file (a package model's first chunk, before its chunks are joined).
"""

import functools
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from scratchllm.errors import FormatError
from scratchllm.formats import ggml_quants as gq
from scratchllm.formats._gguf_strings import read_strings
from scratchllm.formats.checkpoint import Checkpoint, TensorInfo, row_major_strides
from scratchllm.formats.mapped import map_file

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

# metadata value type id -> (name, struct format or None for string/array)
VALUE_TYPES = {
    0: ("UINT8", "<B"),
    1: ("INT8", "<b"),
    2: ("UINT16", "<H"),
    3: ("INT16", "<h"),
    4: ("UINT32", "<I"),
    5: ("INT32", "<i"),
    6: ("FLOAT32", "<f"),
    7: ("BOOL", "<?"),
    8: ("STRING", None),
    9: ("ARRAY", None),
    10: ("UINT64", "<Q"),
    11: ("INT64", "<q"),
    12: ("FLOAT64", "<d"),
}
# NumPy dtypes for arrays of fixed-size values: a 49152-entry int array is one frombuffer.
ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
                10: "<u8", 11: "<i8", 12: "<f8"}

# Asked once per tensor (272 for a small Llama); NumPy's dtype.name costs ~15 us a call.
_out_dtype = functools.cache(gq.out_dtype)

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class _Cursor:
    """Reads little-endian values from a buffer; running past the end is a FormatError, never IndexError."""

    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf, self.pos, self.end, self.path = buf, 0, len(buf), path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.end:
            raise FormatError(self.path, f"truncated: {what} needs {n} bytes at offset {self.pos}, "
                                         f"the file has {self.end}")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return cast(int, v)

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return cast(int, v)

    def string(self, what: str) -> str:
        n = self.u64(f"{what} length")
        self.need(n, what)
        # surrogateescape keeps non-UTF-8 bytes (some vocabularies have them) round-trippable.
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", "surrogateescape")
        self.pos += n
        return s

    def value(self, vtype: int, what: str) -> int | float | bool | str | list[Any]:
        if vtype not in VALUE_TYPES:
            raise FormatError(self.path, f"{what}: unknown metadata value type {vtype}")
        name, fmt = VALUE_TYPES[vtype]
        if name == "STRING":
            return self.string(what)
        if name == "ARRAY":
            return self.array(what)
        assert fmt is not None  # every other type has a struct format
        size = struct.calcsize(fmt)
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return cast(int | float | bool, v)

    def array(self, what: str) -> list[Any]:
        etype = self.u32(f"{what} element type")
        count = self.u64(f"{what} element count")
        if etype in ARRAY_DTYPES:
            dtype = np.dtype(ARRAY_DTYPES[etype])
            self.need(count * dtype.itemsize, f"{what} ({count} elements)")
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            return cast(list[Any], values.astype(bool).tolist() if etype == 7 else values.tolist())
        if etype == 8:
            return self._strings(count, what)
        if etype == 9:
            # Each nested array takes at least 12 bytes: refuse counts the file cannot hold.
            self.need(count * 12, f"{what} ({count} nested arrays)")
            return [self.array(f"{what}[{i}]") for i in range(count)]
        raise FormatError(self.path, f"{what}: unknown array element type {etype}")

    def _strings(self, count: int, what: str) -> list[str]:
        # The hot path of a GGUF header (49152 tokens, 48900 merges): one C pass, see _gguf_strings.
        self.need(count * 8, f"{what} ({count} strings)")
        try:
            out, self.pos = read_strings(self.buf, self.pos, count)
        except ValueError as err:
            part, i, pos, *n = err.args
            if part == "length":
                raise FormatError(self.path, f"truncated: {what}[{i}] at offset {pos}") from None
            raise FormatError(self.path, f"truncated: {what}[{i}] needs {n[0]} bytes at offset {pos}") from None
        return out


class GGUFFile:
    """A parsed GGUF file: `.metadata`, `.tensors` (name -> TensorInfo), `.version`, `.alignment`,
    `.data_offset`. Reading it does not read tensor data; `.tensor(name)` does, for one tensor."""

    def __init__(self, path: str | Path, size: int | None = None) -> None:
        """`size`: the whole file's size when `path` holds only its beginning; the tensors are
        checked against it, and their bytes are not there to read (header_checkpoint)."""
        self.path = Path(path)
        self.bytes = map_file(self.path)  # uint8 [file_size]
        buf = self.bytes.data  # a memoryview of the mapping
        cur = _Cursor(buf, str(self.path))
        p = str(self.path)
        if size is not None and size < cur.end:
            raise FormatError(p, f"holds {cur.end} bytes, more than the {size} of the file it begins")

        cur.need(4, "magic")
        magic = bytes(buf[:4])
        if magic != MAGIC:
            raise FormatError(p, f"not a GGUF file: magic is {magic!r}, expected {MAGIC!r}")
        cur.pos = 4
        self.version = cur.u32("version")
        if self.version not in SUPPORTED_VERSIONS:
            hint = " (a big-endian file?)" if self.version > 0xFFFF else ""
            raise FormatError(p, f"GGUF version {self.version}{hint} is not supported; we read versions 2 and 3")
        tensor_count = cur.u64("tensor count")
        kv_count = cur.u64("metadata count")
        # Each key/value needs >= 12 bytes and each tensor info >= 24: a count the file cannot
        # hold is a lying header, refused before we loop over it.
        if kv_count * 12 + tensor_count * 24 > cur.end - cur.pos:
            raise FormatError(p, f"header claims {kv_count} metadata entries and {tensor_count} tensors, "
                                 f"more than the file's {cur.end} bytes can hold")

        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, str] = {}  # key -> "UINT32", "ARRAY[STRING]", ... for inspect
        for i in range(kv_count):
            key = cur.string(f"metadata key #{i}")
            vtype = cur.u32(f"type of '{key}'")
            if key in self.metadata:
                raise FormatError(p, f"metadata key '{key}' appears twice")
            start = cur.pos
            self.metadata[key] = cur.value(vtype, f"metadata '{key}'")
            tname = VALUE_TYPES[vtype][0]
            if tname == "ARRAY":  # an array starts with its element type
                etype = _U32.unpack_from(buf, start)[0]
                tname = f"ARRAY[{VALUE_TYPES[etype][0]}]"
            self.metadata_types[key] = tname

        self.alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(self.alignment) is not int or self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise FormatError(p, f"general.alignment must be a positive power of two, got {self.alignment!r}")

        raw_infos = []
        for i in range(tensor_count):
            name = cur.string(f"tensor name #{i}")
            n_dims = cur.u32(f"dimension count of '{name}'")
            if n_dims > MAX_DIMS:
                raise FormatError(p, f"tensor '{name}' has {n_dims} dimensions; GGUF allows at most {MAX_DIMS}")
            ne = [cur.u64(f"dimension {d} of '{name}'") for d in range(n_dims)]
            ggml_type = cur.u32(f"type of '{name}'")
            offset = cur.u64(f"offset of '{name}'")
            raw_infos.append((name, ne, ggml_type, offset))

        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        file_size = cur.end if size is None else size
        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, ggml_type, offset in raw_infos:
            self.tensors[name] = self._info(name, ne, ggml_type, offset, file_size)
        _check_no_overlap(p, self.tensors.values())

    def _info(self, name: str, ne: list[int], ggml_type: int, offset: int, file_size: int) -> TensorInfo:
        p = str(self.path)
        if name in self.tensors:
            raise FormatError(p, f"tensor '{name}' appears twice")
        if ggml_type not in gq.GGML_TYPES:
            raise FormatError(p, f"tensor '{name}' has unknown GGML type {ggml_type}")
        type_name, block_size, block_bytes = gq.GGML_TYPES[ggml_type]
        numel = 1
        for dim in ne:
            numel *= dim
        # Each dimension too: (0, 2**62) holds no element, but no array can have that shape.
        if numel > file_size * max(block_size, 1) or any(dim > file_size * max(block_size, 1) for dim in ne):
            raise FormatError(p, f"tensor '{name}' claims {numel} elements, more than the file can hold")
        if (ne[0] if ne else 1) % block_size:  # a quantized scalar (no dimension) is one element
            raise FormatError(p, f"tensor '{name}': innermost dimension {ne[0] if ne else 1} is not a "
                                 f"multiple of the {type_name} block size {block_size}")
        nbytes = numel // block_size * block_bytes
        if offset % self.alignment:
            raise FormatError(p, f"tensor '{name}': offset {offset} is not a multiple of the alignment "
                                 f"{self.alignment}")
        start = self.data_offset + offset
        if start + nbytes > file_size:
            raise FormatError(p, f"tensor '{name}' ends at byte {start + nbytes} but the file has "
                                 f"{file_size} bytes (truncated?)")
        shape = tuple(int(d) for d in reversed(ne))
        return TensorInfo(
            name=name, dtype=type_name, shape=shape, strides=row_major_strides(shape), offset=start,
            nbytes=nbytes, file=p, out_dtype=_out_dtype(type_name), contiguous=True,
            quantization=gq.QUANT_LAYOUT.get(type_name),
        )

    def raw(self, name: str) -> npt.NDArray[np.uint8]:
        """uint8 [nbytes]: the tensor's bytes as stored, a view of the mapped file."""
        info = self.tensors[name]
        return self.bytes[info.offset:info.offset + info.nbytes]

    def tensor(self, name: str) -> np.ndarray:
        """The tensor as NumPy: a zero-copy view for F32/F16/ints, float32 for BF16 and quantized types."""
        return read_tensor(self, self.tensors[name])


def read_tensor(gguf: GGUFFile, info: TensorInfo, out: np.ndarray | None = None) -> np.ndarray:
    """The tensor as NumPy; with `out` (dense, out_dtype, info.shape) it is written there instead."""
    raw = gguf.bytes[info.offset:info.offset + info.nbytes]  # uint8 [nbytes], zero-copy
    kind = info.dtype
    if kind in gq.PLAIN_DTYPES:
        view = raw.view(gq.PLAIN_DTYPES[kind]).reshape(info.shape)
        if out is None:
            return view
        np.copyto(out, view)
        return out
    if kind == "BF16":
        return gq.bf16_to_float32(raw.view("<u2"), out=out).reshape(info.shape)
    if kind in gq.BLOCK_DTYPES:
        return gq.dequantize(kind, raw, info.numel, out=out).reshape(info.shape)
    raise FormatError(info.file, f"tensor '{info.name}' is {kind}; we decode only "
                                 f"{', '.join(sorted(gq.SUPPORTED))}")


def _check_no_overlap(path: str, infos: Iterable[TensorInfo]) -> None:
    spans = sorted((i.offset, i.offset + i.nbytes, i.name) for i in infos if i.nbytes)
    for (_, end_a, name_a), (start_b, _, name_b) in zip(spans, spans[1:], strict=False):
        if start_b < end_a:
            raise FormatError(path, f"tensors '{name_a}' and '{name_b}' overlap (bytes {start_b}..{end_a})")


def file_checkpoint(gguf: GGUFFile) -> Checkpoint:
    """One parsed file as a Checkpoint, each tensor read in place from its mapping. A split model's
    shards are each one of these, merged (gguf_split.py)."""

    def read(info: TensorInfo, out: np.ndarray | None = None) -> np.ndarray:
        return read_tensor(gguf, info, out)

    def raw(info: TensorInfo) -> npt.NDArray[np.uint8]:
        return gguf.bytes[info.offset:info.offset + info.nbytes]

    return Checkpoint(
        format="gguf",
        path=str(gguf.path),
        metadata=gguf.metadata,
        infos=dict(gguf.tensors),
        readers=dict.fromkeys(gguf.tensors, read),
        into_readers=dict.fromkeys(gguf.tensors, read),
        raw_readers=dict.fromkeys(gguf.tensors, raw),
        container={
            "kind": "gguf",
            "version": gguf.version,
            "alignment": gguf.alignment,
            "data_offset": gguf.data_offset,
            "tensor_count": len(gguf.tensors),
            "metadata_count": len(gguf.metadata),
            "metadata_types": gguf.metadata_types,
            "file_size": int(gguf.bytes.size),
        },
    )


def header_checkpoint(path: Path, size: int, whole: Path) -> Checkpoint:
    """The metadata and tensor table of the GGUF file `whole`, of `size` bytes, read from `path`,
    which holds its beginning (at least the header: a package model's first chunk, before the
    chunks are joined into `whole`), every tensor checked against `size`; for a plan made before
    the file exists. Reading a tensor raises: its bytes are not in `path`."""
    gguf = GGUFFile(path, size=size)

    def elsewhere(info: TensorInfo, out: np.ndarray | None = None) -> np.ndarray:
        raise FormatError(str(path), f"holds the header of {whole.name}, not tensor '{info.name}': load {whole}")

    ckpt = file_checkpoint(gguf)
    ckpt.path = str(whole)
    ckpt.readers = dict.fromkeys(gguf.tensors, elsewhere)
    ckpt.into_readers = dict.fromkeys(gguf.tensors, elsewhere)
    ckpt.raw_readers = dict.fromkeys(gguf.tensors, elsewhere)
    ckpt.container |= {"file_size": size, "header_from": str(path)}
    return ckpt
