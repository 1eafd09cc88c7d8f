"""`Checkpoint`: what every parser hands up: a lazy mapping of tensor name -> NumPy array.

A parser reads only the file's table of contents (GGUF tensor infos, the safetensors JSON header,
the torch pickle) and builds one `TensorInfo` per tensor. The bytes of a tensor are touched only
when that tensor is looked up: the value is a view of the memory-mapped file where the bytes
already are the array (F32, F16, safetensors, torch storages), or a freshly decoded array where
they are not (quantized blocks, BF16 -> float32).

Each lookup decodes again; nothing is cached here, so the caller owns the memory it keeps.
"""

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class TensorInfo:
    """One row of a checkpoint's tensor table: where a tensor's bytes are and what they mean."""

    name: str
    dtype: str  # the file's own name for the element type: "Q4_1", "F32", "BF16", "torch.float16", ...
    shape: tuple[int, ...]  # NumPy row-major, e.g. a linear weight is [out_features, in_features]
    strides: tuple[int, ...]  # in elements, as stored (row-major unless a torch tensor is a view)
    offset: int  # absolute byte offset of the tensor's first byte in `file`
    nbytes: int  # bytes the tensor spans in `file` (first to last byte it touches)
    file: str  # the file that holds the bytes (shards of one checkpoint differ)
    out_dtype: str  # NumPy dtype of the array a lookup returns
    contiguous: bool  # row-major and dense: a lookup can be a zero-copy view
    quantization: str | None = None  # block layout of quantized types, e.g. "32 x 4-bit, f16 scale+min"

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "strides": list(self.strides),
            "offset": self.offset,
            "nbytes": self.nbytes,
            "file": self.file,
            "out_dtype": self.out_dtype,
            "contiguous": self.contiguous,
            "quantization": self.quantization,
        }


def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a dense row-major array of `shape`."""
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


@dataclass
class Checkpoint(Mapping[str, np.ndarray]):
    """name -> np.ndarray, read on lookup. Names are the file's own names, in file order.

    `readers[name](info)` produces the array; parsers supply them so that this class knows no format.
    `container` describes the file's structure for `scratchllm inspect` (JSON-able).
    """

    format: str  # "gguf" | "safetensors" | "torch"
    path: str  # the file or folder the user named
    metadata: dict[str, Any]  # the file's own key/values: GGUF metadata, safetensors __metadata__, ...
    infos: dict[str, TensorInfo]
    readers: dict[str, Callable[[TensorInfo], np.ndarray]] = field(repr=False)
    container: dict[str, Any] = field(default_factory=dict, repr=False)
    raw_readers: dict[str, Callable[[TensorInfo], np.ndarray]] = field(default_factory=dict, repr=False)
    # name -> reader(info, out) that decodes straight into a caller's buffer (no temporary)
    into_readers: dict[str, Callable[[TensorInfo, np.ndarray], np.ndarray]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # Invariant: every tensor has exactly one reader; a missing one would be a parser bug.
        assert self.infos.keys() == self.readers.keys()

    def __getitem__(self, name: str) -> np.ndarray:
        info = self.infos[name]  # KeyError for unknown names, as a Mapping should
        array = self.readers[name](info)
        assert array.shape == info.shape, (name, array.shape, info.shape)
        return array

    def __iter__(self) -> Iterator[str]:
        return iter(self.infos)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read (decode) the tensor to answer
        return name in self.infos

    def __len__(self) -> int:
        return len(self.infos)

    def __repr__(self) -> str:
        return f"Checkpoint(format={self.format!r}, path={self.path!r}, tensors={len(self)})"

    def tensor_info(self, name: str) -> TensorInfo:
        return self.infos[name]

    def read_into(self, name: str, out: np.ndarray) -> np.ndarray:
        """Write tensor `name` into `out` (dense, its out_dtype and shape): an arena slot, say."""
        info = self.infos[name]
        assert out.shape == info.shape and out.dtype == np.dtype(info.out_dtype), (name, out.shape, out.dtype)
        if name in self.into_readers:
            return self.into_readers[name](info, out)
        np.copyto(out, self[name])
        return out

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes exactly as stored (uint8 view), e.g. Q4_1 blocks for a quantized kernel."""
        info = self.infos[name]
        if name in self.raw_readers:
            return self.raw_readers[name](info)
        raise KeyError(f"{name}: raw bytes are not available for this format")

    @property
    def files(self) -> list[str]:
        """The files the tensors are read from, in table order: one, or a sharded checkpoint's shards."""
        return list(dict.fromkeys(info.file for info in self.infos.values()))

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in the file(s)."""
        return sum(info.nbytes for info in self.infos.values())


def merge(path: str, parts: list[Checkpoint], container: dict[str, Any] | None = None) -> Checkpoint:
    """One checkpoint from several shards of the same format; a name in two shards is an error."""
    from scratchllm.errors import FormatError

    assert parts, "merge needs at least one shard"
    infos: dict[str, TensorInfo] = {}
    readers: dict[str, Callable[[TensorInfo], np.ndarray]] = {}
    raw_readers: dict[str, Callable[[TensorInfo], np.ndarray]] = {}
    into_readers: dict[str, Callable[[TensorInfo, np.ndarray], np.ndarray]] = {}
    metadata: dict[str, Any] = {}
    for part in parts:
        for name, info in part.infos.items():
            if name in infos:
                raise FormatError(path, f"tensor '{name}' is in both {infos[name].file} and {info.file}")
            infos[name] = info
            readers[name] = part.readers[name]
            if name in part.raw_readers:
                raw_readers[name] = part.raw_readers[name]
            if name in part.into_readers:
                into_readers[name] = part.into_readers[name]
        metadata.update(part.metadata)
    return Checkpoint(
        format=parts[0].format,
        path=str(path),
        metadata=metadata,
        infos=infos,
        readers=readers,
        container=container or {"shards": [p.container for p in parts]},
        raw_readers=raw_readers,
        into_readers=into_readers,
    )
