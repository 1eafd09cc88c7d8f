"""Everything `scratchllm inspect` shows about a model file, as one JSON-able dict.

Built from the parsers' own table of contents: no tensor data is read (only the first 64 bytes,
for the hex dump), so describing a multi-GB file is as fast as opening it.
"""

from pathlib import Path
from typing import Any

import numpy as np

from scratchllm.formats import load_checkpoint
from scratchllm.formats.checkpoint import TensorInfo
from scratchllm.formats.layout import PAGE, loaded_nbytes, plan_arena, shared_pages

# The files' own dtype names that mean exactly the NumPy dtype a lookup returns (no conversion).
SAME_AS_NUMPY = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64", "I32": "int32",
                 "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
                 "BOOL": "bool"}
LONG_ARRAY = 8  # metadata arrays longer than this are summarized: count, type, first few
LONG_STRING = 120


def first_bytes(path: str | Path, n: int = 64) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def summarize(value: object, limit: int = LONG_ARRAY) -> object:
    """A metadata value fit for a screen: long lists and strings cut, with their true size said."""
    if isinstance(value, list):
        if len(value) <= limit:
            return [summarize(v, limit) for v in value]
        return {"count": len(value), "first": [summarize(v, limit) for v in value[:limit // 2]],
                "last": [summarize(v, limit) for v in value[-2:]]}
    if isinstance(value, str) and len(value) > LONG_STRING:
        return {"chars": len(value), "start": value[:LONG_STRING]}
    if isinstance(value, float) and not np.isfinite(value):
        return str(value)
    return value


def widened(info: TensorInfo) -> bool:
    """True when a lookup converts the stored elements (dequantization, BF16/FP8 -> float32)."""
    return SAME_AS_NUMPY.get(info.dtype, info.dtype) != info.out_dtype


def describe(ref: str | Path, tensor_align: int = 64, page: int = PAGE) -> dict[str, Any]:
    ckpt = load_checkpoint(ref)
    infos = list(ckpt.infos.values())
    first_file = infos[0].file if infos else ckpt.path
    head = first_bytes(first_file) if Path(first_file).is_file() else b""
    container = dict(ckpt.container)
    if container.get("kind") == "safetensors":
        header = container.pop("header")
        container["header_entries"] = len(header)
        container["header_first"] = dict(list(header.items())[:6])
    plan = plan_arena(infos, page=page, tensor_align=tensor_align)
    shared = shared_pages(plan)
    by_dtype: dict[str, dict[str, int]] = {}
    for info in infos:
        row = by_dtype.setdefault(info.dtype, {"tensors": 0, "elements": 0, "stored_bytes": 0, "loaded_bytes": 0})
        row["tensors"] += 1
        row["elements"] += info.numel
        row["stored_bytes"] += info.nbytes
        row["loaded_bytes"] += loaded_nbytes(info)
    return {
        "path": ckpt.path,
        "format": ckpt.format,
        "file": first_file,
        "first_bytes": head.hex(),
        "container": container,
        "metadata": {k: summarize(v) for k, v in ckpt.metadata.items()},
        "tensors": [info.as_dict() | {"loaded_bytes": loaded_nbytes(info), "widened": widened(info)}
                    for info in infos],
        "totals": {
            "tensors": len(infos),
            "elements": sum(i.numel for i in infos),
            "stored_bytes": sum(i.nbytes for i in infos),
            "loaded_bytes": sum(loaded_nbytes(i) for i in infos),
            "by_dtype": by_dtype,
        },
        "arena": {
            "page": plan.page,
            "tensor_align": plan.tensor_align,
            "bytes": plan.nbytes,
            "pages": plan.pages,
            "padding": plan.padding,
            "shared_pages": len(shared),
            "placements": [
                {"name": p.name, "offset": p.offset, "bytes": p.nbytes, "first_page": p.first_page,
                 "pages": p.pages, "shares_page": bool({p.first_page, p.last_page} & shared)}
                for p in plan.placements
            ],
        },
    }
