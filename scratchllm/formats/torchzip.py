"""torch.save zip checkpoints (`pytorch_model.bin`), read without torch.

Since torch 1.6 the file is an ordinary zip archive, every entry STORED (uncompressed) and its
data 64-byte aligned:

    <archive>/data.pkl            the state dict, pickled; tensors are persistent ids -> storages
    <archive>/data/<key>          one storage: raw little-endian elements, nothing else
    <archive>/byteorder, version, .format_version, .storage_alignment, .data/serialization_id

So a storage is one contiguous run of bytes at a known file offset (no chunks, no per-chunk
length headers), and a tensor is (storage, offset, size, stride) over it. The pickle is read by
scratchllm.formats.unpickle, which can build only tensor references. Each tensor is a zero-copy
`as_strided` view of the mapped storage bytes, after checking that every element its strides
reach lies inside the storage; non-contiguous tensors (a saved transpose) stay views.
"""

import pickletools
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from scratchllm.errors import FormatError
from scratchllm.formats import ggml_quants as gq
from scratchllm.formats.checkpoint import Checkpoint, TensorInfo, row_major_strides
from scratchllm.formats.mapped import map_file
from scratchllm.formats.unpickle import StorageRef, TensorRef, load_state_dict_pickle

MAX_PICKLE = 256 * 1024 * 1024  # a state dict's pickle is KBs to a few MBs; more is a zip bomb
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1}
# What the stdlib zip reader raises on a damaged archive (it runs nothing from the file).
ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, struct.error,
              NotImplementedError, OverflowError, KeyError, IndexError, RuntimeError, zlib.error)
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, then file name and extra field lengths at 26


def _entry_span(data: np.ndarray, info: zipfile.ZipInfo, path: str) -> tuple[int, int]:
    """(absolute offset, size) of a STORED entry's bytes, from its local header."""
    start = info.header_offset
    if start + 30 > data.size:
        raise FormatError(path, f"zip entry '{info.filename}': local header past the end of the file")
    sig, name_len, extra_len = _LOCAL_HEADER.unpack(data[start:start + 30].tobytes())
    if sig != b"PK\x03\x04":
        raise FormatError(path, f"zip entry '{info.filename}': no local header at offset {start}")
    begin = start + 30 + name_len + extra_len
    if begin + info.compress_size > data.size:
        raise FormatError(path, f"zip entry '{info.filename}' ends at byte {begin + info.compress_size} "
                                f"but the file has {data.size} bytes (truncated?)")
    return begin, info.compress_size


def _flatten(obj: object, prefix: str, tensors: dict[str, TensorRef], other: dict[str, Any], path: str) -> None:
    """Nested dicts -> dotted names; tensors to `tensors`, plain values (ints, strings) to `other`."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, str | int):
                raise FormatError(path, f"data.pkl: a dict key of type {type(key).__name__}")
            _flatten(value, f"{prefix}{key}" if not prefix else f"{prefix}.{key}", tensors, other, path)
    elif isinstance(obj, TensorRef):
        tensors[prefix] = obj
    elif isinstance(obj, StorageRef):
        raise FormatError(path, f"data.pkl: '{prefix}' is a bare storage, not a tensor")
    elif obj is None or isinstance(obj, bool | int | float | str | bytes | list | tuple):
        other[prefix] = obj if not isinstance(obj, bytes) else obj.hex()
    else:
        raise FormatError(path, f"data.pkl: '{prefix}' is a {type(obj).__name__}, not a tensor or plain value")


def _span(ref: TensorRef) -> tuple[int, int]:
    """(first, one past last) element index of the storage that the tensor reaches."""
    if any(d == 0 for d in ref.shape):
        return ref.offset, ref.offset
    last = ref.offset + sum((d - 1) * s for d, s in zip(ref.shape, ref.strides, strict=True))
    return ref.offset, last + 1


def _is_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Row-major dense, ignoring the strides of size-1 dimensions (as torch does)."""
    if 0 in shape:
        return True
    expected = row_major_strides(shape)
    return all(d == 1 or s == e for d, s, e in zip(shape, strides, expected, strict=True))


def load_torch(path: str | Path) -> Checkpoint:
    p = str(path)
    data = map_file(Path(path))  # uint8 [file_size]
    try:
        archive = zipfile.ZipFile(path)
        entries = archive.infolist()
    except ZIP_ERRORS as err:
        raise FormatError(p, f"not a readable zip archive: {err}") from None
    pickle_entry = _data_pickle(entries, p)
    prefix = pickle_entry.filename[: -len("data.pkl")]
    by_name = {e.filename: e for e in entries}
    byteorder = _byteorder(archive, by_name.get(prefix + "byteorder"), p)
    if pickle_entry.file_size > MAX_PICKLE:
        raise FormatError(p, f"data.pkl claims {pickle_entry.file_size} bytes; a state dict pickle is far smaller")
    pickle_bytes = _read_small(archive, pickle_entry, p)
    obj, storages = load_state_dict_pickle(pickle_bytes, p)
    tensors: dict[str, TensorRef] = {}
    other: dict[str, Any] = {}
    _flatten(obj, "", tensors, other, p)
    spans = _storage_spans(data, storages, by_name, prefix, p)
    infos = {name: _tensor_info(name, ref, spans[ref.storage.key][0], p) for name, ref in tensors.items()}

    swap = byteorder != "little"

    def storage_bytes(key: str) -> np.ndarray:
        begin, size, entry = spans[key]
        if entry.compress_type == zipfile.ZIP_STORED:
            return data[begin:begin + size]  # zero-copy
        return np.frombuffer(_read_small(archive, entry, p), dtype=np.uint8)  # compressed: a copy, rare

    def read(info: TensorInfo) -> np.ndarray:
        ref = tensors[info.name]
        dtype = np.dtype(ref.dtype if ref.dtype != "bfloat16" else "<u2")
        dtype = dtype.newbyteorder(">" if swap else "<") if dtype.itemsize > 1 else dtype
        raw = storage_bytes(ref.storage.key)
        elements = raw[: raw.size - raw.size % dtype.itemsize].view(dtype)  # [capacity]
        view = np.lib.stride_tricks.as_strided(
            elements[ref.offset:], shape=ref.shape, strides=tuple(s * dtype.itemsize for s in ref.strides),
            writeable=False,
        )
        if swap:
            view = view.astype(dtype.newbyteorder("<"))
        if ref.dtype == "bfloat16":
            view = gq.bf16_to_float32(view)  # any strides in, a dense float32 array out
        return view

    return Checkpoint(
        format="torch",
        path=p,
        metadata=other,
        infos=infos,
        readers=dict.fromkeys(infos, read),
        container={
            "kind": "zip",
            "archive": prefix.rstrip("/"),
            "byteorder": byteorder,
            "file_size": int(data.size),
            "entries": [_describe(data, e, p) for e in entries],
            "pickle": _pickle_summary(pickle_bytes),
            "storages": {k: {"dtype": r.dtype, "numel": r.numel, "location": r.location}
                         for k, r in storages.items()},
        },
    )


def _data_pickle(entries: list[zipfile.ZipInfo], path: str) -> zipfile.ZipInfo:
    """The one <archive>/data.pkl entry."""
    pickles = [e for e in entries if e.filename.endswith("data.pkl") and e.filename.count("/") == 1]
    if len(pickles) != 1:
        raise FormatError(path, "zip has no <archive>/data.pkl: not a torch.save checkpoint"
                          if not pickles else "zip has more than one data.pkl")
    return pickles[0]


def _byteorder(archive: zipfile.ZipFile, entry: zipfile.ZipInfo | None, path: str) -> str:
    """What the byteorder entry says; an archive without one is read as little-endian."""
    if entry is None:
        return "little"
    byteorder = _read_small(archive, entry, path).decode("ascii", "replace")
    if byteorder not in ("little", "big"):
        raise FormatError(path, f"byteorder entry says {byteorder!r}")
    return byteorder


def _storage_spans(data: np.ndarray, storages: dict[str, StorageRef], by_name: dict[str, zipfile.ZipInfo],
                   prefix: str, path: str) -> dict[str, tuple[int, int, zipfile.ZipInfo]]:
    """key -> (file offset, size, entry) of each storage: one zip entry whose size must be exactly
    numel x itemsize, no two of them overlapping in the file."""
    spans: dict[str, tuple[int, int, zipfile.ZipInfo]] = {}
    for key, st in storages.items():
        entry = by_name.get(f"{prefix}data/{key}")
        if entry is None:
            raise FormatError(path, f"storage '{key}' has no zip entry {prefix}data/{key}")
        if st.dtype not in ITEMSIZE:
            raise FormatError(path, f"storage '{key}' has unknown dtype {st.dtype!r}")
        if entry.file_size != st.numel * ITEMSIZE[st.dtype]:
            raise FormatError(path, f"storage '{key}' claims {st.numel} x {st.dtype} = "
                                    f"{st.numel * ITEMSIZE[st.dtype]} bytes but {entry.filename} holds "
                                    f"{entry.file_size}")
        begin, size = _entry_span(data, entry, path)
        spans[key] = (begin, size, entry)
    placed = sorted((b, b + s, k) for k, (b, s, e) in spans.items() if e.compress_type == zipfile.ZIP_STORED and s)
    for (_, end_a, a), (start_b, _, b) in zip(placed, placed[1:], strict=False):
        if start_b < end_a:
            raise FormatError(path, f"storages '{a}' and '{b}' overlap in the file (bytes {start_b}..{end_a})")
    return spans


def _tensor_info(name: str, ref: TensorRef, storage_begin: int, path: str) -> TensorInfo:
    """Where a tensor's bytes lie, after checking that every element its strides reach is inside
    its storage (which starts at file offset storage_begin)."""
    if ref.dtype not in ITEMSIZE:
        raise FormatError(path, f"tensor '{name}' has unknown dtype {ref.dtype!r}")
    # Offsets and strides count elements of the tensor's dtype (= the storage's, except for an
    # untyped storage of bytes, which _rebuild_tensor_v3 reinterprets).
    itemsize = ITEMSIZE[ref.dtype]
    capacity = ref.storage.numel * ITEMSIZE[ref.storage.dtype] // itemsize
    first, end = _span(ref)
    if end > capacity:
        raise FormatError(path, f"tensor '{name}' reaches element {end - 1} of storage '{ref.storage.key}', "
                                f"which has {capacity}")
    return TensorInfo(
        name=name, dtype=ref.dtype, shape=ref.shape, strides=ref.strides, offset=storage_begin + first * itemsize,
        nbytes=(end - first) * itemsize, file=path, out_dtype="float32" if ref.dtype == "bfloat16" else ref.dtype,
        contiguous=_is_contiguous(ref.shape, ref.strides),
    )


def _pickle_summary(data: bytes) -> dict[str, Any]:
    """What data.pkl asks for, read opcode by opcode (pickletools only parses; it runs nothing)."""
    globals_used: dict[str, int] = {}
    counts = {"opcodes": 0, "REDUCE": 0, "BINPERSID": 0}
    protocol: object = 0
    strings: list[str] = []
    for op, arg, _ in pickletools.genops(data):
        counts["opcodes"] += 1
        if op.name == "PROTO":
            protocol = arg
        elif op.name == "GLOBAL":
            name = str(arg).replace(" ", ".")  # GLOBAL's argument is 'module name'
            globals_used[name] = globals_used.get(name, 0) + 1
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            name = f"{strings[-2]}.{strings[-1]}"
            globals_used[name] = globals_used.get(name, 0) + 1
        elif op.name in counts:
            counts[op.name] += 1
        if isinstance(arg, str):
            strings.append(arg)
    return {"bytes": len(data), "protocol": protocol, "globals": globals_used, **counts}


def _read_small(archive: zipfile.ZipFile, entry: zipfile.ZipInfo, path: str) -> bytes:
    try:
        return archive.read(entry)
    except ZIP_ERRORS as err:
        raise FormatError(path, f"zip entry '{entry.filename}' is unreadable: {err}") from None


def _describe(data: np.ndarray, entry: zipfile.ZipInfo, path: str) -> dict[str, Any]:
    begin, size = _entry_span(data, entry, path)
    return {"name": entry.filename, "header_offset": entry.header_offset, "data_offset": begin,
            "size": entry.file_size, "stored": entry.compress_type == zipfile.ZIP_STORED}
