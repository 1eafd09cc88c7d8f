"""GGUF models split into shards, as llama.cpp's gguf-split tool (and gguf-py's writer, given a
split size) writes them: NAME-00001-of-00003.gguf, NAME-00002-of-00003.gguf, NAME-00003-of-00003.gguf.

Each shard is a whole GGUF file (gguf.py reads it: its own header, alignment and tensor data)
holding some of the tensors. The first holds the model's metadata (architecture, tokenizer, ...);
every shard carries three keys:
    split.no             u16  the shard's place, from 0 (its name counts from 1)
    split.count          u16  how many shards there are
    split.tensors.count  i32  tensors in all the shards together
The other shards are found by name from the first, as llama.cpp finds them. Opened as one
Checkpoint: one tensor table in shard order, each tensor read in place from its own shard's
mapping (TensorInfo.file names the shard); the metadata is the first shard's. A file without
`split.count` is a plain GGUF and loads as one.
"""

import re
from collections.abc import Iterable
from pathlib import Path, PurePath
from typing import TypeVar

from scratchllm.errors import FormatError
from scratchllm.formats.checkpoint import Checkpoint, merge
from scratchllm.formats.gguf import GGUFFile, file_checkpoint

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
SHARD_NAME = re.compile(r"(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
P = TypeVar("P", bound=PurePath)


def shard_name(stem: str, no: int, count: int) -> str:
    """The file name of shard `no` (from 1) of `count`."""
    return f"{stem}-{no:05d}-of-{count:05d}.gguf"


def parse_name(path: PurePath) -> tuple[str, int, int] | None:
    """(NAME, the shard's number from 1, the shard count) a shard's file name says; None for any other name."""
    m = SHARD_NAME.fullmatch(path.name)
    return (m["stem"], int(m["no"]), int(m["count"])) if m else None


def shard_path(path: P, k: int) -> P:
    """Shard `k` (from 1) of the split model that `path`'s name says it is a shard of (no file is
    looked at); `path` for any other name."""
    named = parse_name(path)
    return path if named is None else path.with_name(shard_name(named[0], k, named[2]))


def group_shards(paths: Iterable[P]) -> dict[P, list[P | None]]:
    """GGUF files as models, by their names alone: a split model's shards (NAME-0000K-of-0000N.gguf
    in one folder) under its first shard's path, whether that file is there or not, as N entries in
    shard order, None where a shard is missing; any other file under itself, alone. Models come in
    the order their first file came."""
    models: dict[P, list[P | None]] = {}
    for path in paths:
        named = parse_name(path)
        if named is None or named[2] < 2 or not 1 <= named[1] <= named[2]:  # one file, or no shard's number
            models[path] = [path]
            continue
        stem, no, count = named
        shards = models.setdefault(shard_path(path, 1), [None] * count)
        shards[no - 1] = path
    return models


def first_shard(path: Path) -> Path:
    """The first shard of the split model that `path`'s name says it is a later shard of, where that
    file exists; else `path` itself (whose own header then says what it is)."""
    first = shard_path(path, 1)
    return first if first != path and first.is_file() else path


def load_gguf(path: str | Path) -> Checkpoint:
    """A GGUF model from its file, or from any shard of a split one: every shard, as one Checkpoint."""
    first = GGUFFile(first_shard(Path(path)))
    if SPLIT_COUNT not in first.metadata:
        return file_checkpoint(first)
    no, count, total = _split_keys(first)
    p, named = first.path, parse_name(first.path)
    if named is not None and named[1:] != (no + 1, count):
        raise FormatError(p, f"{SPLIT_NO} {no} and {SPLIT_COUNT} {count} make it shard {no + 1} of {count}, "
                             f"but its name says shard {named[1]} of {named[2]}")
    if no != 0:
        which = f", {shard_name(named[0], 1, count)}, which is missing" if named else ""
        raise FormatError(p, f"shard {no + 1} of a split model of {count} ({SPLIT_NO} {no}): the model "
                             f"opens from its first shard{which}")
    if count > 1 and named is None:
        raise FormatError(p, f"the first shard of a split model of {count} ({SPLIT_COUNT}) must be named "
                             f"NAME-00001-of-{count:05d}.gguf: its other shards are found by that name")
    shards = [first] + [_open_shard(p, named[0], k, count, total) for k in range(2, count + 1) if named]
    assert len(shards) == count, "one GGUFFile per shard, in shard order"
    parts = [file_checkpoint(s) for s in shards]
    container = parts[0].container | {
        "tensor_count": sum(len(part) for part in parts),
        "file_size": sum(int(s.bytes.size) for s in shards),
        "shards": [{"file": str(s.path), "tensors": len(s.tensors), "file_size": int(s.bytes.size),
                    "data_offset": s.data_offset, "alignment": s.alignment} for s in shards],
    }
    ckpt = merge(str(p), parts, container=container)  # a tensor name in two shards is refused here
    ckpt.metadata = first.metadata  # the model's metadata: later shards hold only their split keys
    if len(ckpt) != total:
        raise FormatError(p, f"{SPLIT_TENSORS} is {total}, but the {count} shards hold {len(ckpt)} tensors")
    return ckpt


def _open_shard(first: Path, stem: str, k: int, count: int, total: int) -> GGUFFile:
    """Shard `k` (from 1) beside `first`, its split keys checked against the first shard's."""
    path = first.with_name(shard_name(stem, k, count))
    if not path.is_file():
        raise FormatError(path, f"missing: it is shard {k} of the {count} shards the split model {first.name} "
                                f"expects ({shard_name(stem, 1, count)} .. {shard_name(stem, count, count)})")
    shard = GGUFFile(path)
    no, its_count, its_total = _split_keys(shard)
    if its_count != count:
        raise FormatError(path, f"{SPLIT_COUNT} is {its_count}, but the first shard {first.name} says {count}")
    if no != k - 1:
        raise FormatError(path, f"{SPLIT_NO} is {no} (shard {no + 1}), but the file's name says shard {k} of {count}")
    if its_total != total:
        raise FormatError(path, f"{SPLIT_TENSORS} is {its_total}, but the first shard {first.name} says {total}")
    return shard


def _split_keys(gguf: GGUFFile) -> tuple[int, int, int]:
    """(split.no, split.count, split.tensors.count) of a shard, each a whole number in range."""
    values = []
    for key, low in ((SPLIT_NO, 0), (SPLIT_COUNT, 1), (SPLIT_TENSORS, 0)):
        if key not in gguf.metadata:
            raise FormatError(gguf.path, f"a split model's shard without the key {key}")
        value = gguf.metadata[key]
        if type(value) is not int or value < low:
            raise FormatError(gguf.path, f"{key} must be a whole number >= {low}, got {value!r}")
        values.append(value)
    no, count, total = values
    if no >= count:
        raise FormatError(gguf.path, f"{SPLIT_NO} is {no}, past the last of {count} shards ({SPLIT_COUNT})")
    return no, count, total
