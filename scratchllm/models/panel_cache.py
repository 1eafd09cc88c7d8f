"""A model file's packed panels, kept on disk beside nothing the user owns: packing is done once
per file and build, and every later load maps the result.

Why: packing moves the bytes of a GGUF file's blocks into the kernel's panel layout in fresh
memory, and on a virtual machine fresh memory is the expensive part (the kernel zeroes every page
the host first backs: a third of the default model's load). A cache file of the panels is read
through the page cache instead: the first load packs and writes it, later loads (and other
processes serving the same file) map it, pages shared, nothing copied or zeroed.

Where: $SCRATCHLLM_CACHE_DIR, else $XDG_CACHE_HOME/scratchllm, else ~/.cache/scratchllm, in
`panels/`. SCRATCHLLM_PANEL_CACHE=0 turns it off. The key is the file's content, not its path
(`content_key`): its size, its first HEAD_BYTES (a GGUF file's header: metadata and the tensor
table, every tensor's type, shape and offset) and SAMPLES pieces of its tensor data, each
shard's for a split GGUF; with the kernel build (panel width, the compiled extension's size and
time) and this format's version. So the same bytes reached through an Ollama blob, a Hugging
Face snapshot and a folder share one cache, packed once, while a changed file or a rebuilt kernel
never meets stale panels; the key costs a read of about 9 MB per load, not the whole file. Each
path a cache served is recorded beside it (`<key>.uses`), for `scratchllm models cache` and for
pruning (models/panel_cache_files.py, which also keeps the folder under a size cap).
A cache that cannot be written (read-only, full disk) is logged and skipped: loading still works.

Layout: magic, the length of a JSON index, the index (name -> arrays with dtype, shape, offset;
the panel kind; whether 8-bit products are exact), then the arrays, 64-byte aligned.
"""

import hashlib
import json
import logging
import mmap
import os
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from scratchllm.kernels import kpanels, packed_gemm
from scratchllm.kernels.kpanels import KPanels
from scratchllm.models import progress

logger = logging.getLogger(__name__)

# what the cache keeps: a file's blocks, packed
QuantizedPanels = packed_gemm.Q8Panels | packed_gemm.Q4Panels | KPanels | packed_gemm.SegmentedPanels

MAGIC = b"SLLMPNL1"
SOURCE = "__source__"  # index entry: the model file the panels came from (for pruning)
SOURCE_STAT = "__source_stat__"  # index entry: that file's size and modification time when packed
# (then each later shard's, for a split model)
SHARDS = "__shards__"  # index entry: a split model's later shards, beside SOURCE (its first)
FORMAT = 8  # 2: Q8_0 panels without offsets; 3: Q4_0 panels without offsets; 4: 4-bit panels in words;
# 5: format 4's bytes, written so that loads map them in huge pages (_drop_from_page_cache): a
# cache written before is written once more instead of being read in small pages for ever;
# 6: 8-bit panels in words of 4 rows, bytes biased by 128 (packed_gemm.Q8Panels); 7: K-quant panels
# (kernels/kpanels.py), where format 6 had Q4_K in 8-bit panels; 8: keyed by the files' content
HEAD_BYTES = 8 << 20  # of each file, hashed whole into the key (a GGUF header is a few MB)
SAMPLES, SAMPLE_BYTES = 16, 64 << 10  # pieces of the rest, evenly spread, hashed too
FORMAT_KEY = "__format__"  # index entry: FORMAT
USES = ".uses"  # beside KEY.panels: the model files it served, [{"files": [...], "stat": [...]}, ...]
ALIGN = 64
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+; Python 3.11 lacks the name


def _advise_huge_pages(mm: mmap.mmap) -> None:
    """Ask for the cache's pages in 2 MiB page-cache folios, mapped whole (one TLB entry per 2 MiB).
    Pages read from disk after this advice come in as such folios (on a file system with large
    folios, Linux 6.x: ext4, xfs); pages already cached stay as they are, hence the write path's
    `_drop_from_page_cache`. Measured on this machine (2 threads, one process alternating the
    two): a default-model decode step mapped in 4 KiB pages was 4-8% slower than the same panels
    in huge anonymous pages; mapped through this advice, the same (0.98-1.0)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mm.madvise(advice)
        except OSError:  # a kernel without transparent huge pages
            pass


def _drop_from_page_cache(fd: int) -> None:
    """Write the new cache file (open as `fd`, all of it written) out and drop its pages from the
    page cache. The writes left it there in small folios, which no later mapping could map in huge
    pages; read back after `_advise_huge_pages`, it comes in whole 2 MiB folios. Costs the first
    load a disk sync (10-60 ms for the default model's 96 MB here); the load itself uses the panels
    it just packed. Synced before the rename, a crash never leaves a renamed file half written."""
    os.fdatasync(fd)  # only clean pages can be dropped; a failed sync (EIO, ENOSPC) fails the save
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):  # no such call here: the cache still works, in small pages
        pass


Leaf = packed_gemm.Q8Panels | packed_gemm.Q4Panels | KPanels  # panels of one kind


def _leaf_entry(panels: Leaf) -> tuple[dict[str, Any], list[npt.NDArray[Any]]]:
    """An index entry for panels of one kind (its arrays' places still to be filled) and the arrays."""
    if isinstance(panels, KPanels):
        fields = [f for f in kpanels.ARRAYS if getattr(panels, f) is not None]
        return ({"kind": "k", "ktype": panels.kind, "fields": fields, "arrays": []},
                [getattr(panels, f) for f in fields])
    if isinstance(panels, packed_gemm.Q8Panels):
        parts = [panels.q, panels.d, panels.m]
        entry: dict[str, Any] = {"kind": "q8", "exact": bool(panels.exact), "arrays": []}
    else:
        parts = [panels.q4, panels.d, panels.m]
        entry = {"kind": "q4", "exact": False, "arrays": []}
    return entry, [a for a in parts if a is not None]  # Q8_0 and Q4_0 panels have no offsets


Leaves = list[tuple[dict[str, Any], list[npt.NDArray[Any]]]]  # (a part's index entry, its arrays) each


def _entry(panels: QuantizedPanels) -> tuple[dict[str, Any], Leaves]:
    """The index entry of panels, and its leaves: (a part's entry, its arrays) for each part."""
    if not isinstance(panels, packed_gemm.SegmentedPanels):
        entry, arrays = _leaf_entry(panels)
        return entry, [(entry, arrays)]
    leaves = [_leaf_entry(p) for p in panels.parts]
    return {"kind": "seg", "cols": list(panels.cols), "parts": [e for e, _ in leaves]}, leaves


def _panels(entry: dict[str, Any], mm: mmap.mmap) -> QuantizedPanels:
    """The panels an index entry describes, as arrays over the mapped file."""
    if entry["kind"] == "seg":
        parts = tuple(_leaf_panels(p, mm) for p in entry["parts"])
        return packed_gemm.SegmentedPanels(parts, tuple(entry["cols"]))
    return _leaf_panels(entry, mm)


def _leaf_panels(entry: dict[str, Any], mm: mmap.mmap) -> Leaf:
    arrays = []
    for dtype, shape, offset in entry["arrays"]:
        count = int(np.prod(shape))
        if offset + count * np.dtype(dtype).itemsize > len(mm):
            raise ValueError("an array past the end of the file")
        arrays.append(np.frombuffer(mm, dtype=dtype, count=count, offset=offset).reshape(shape))
    if entry["kind"] == "k":  # K-quant panels: the fields present, by name
        named = dict(zip(entry["fields"], arrays, strict=True))
        return KPanels._make([*(named.get(f) for f in kpanels.ARRAYS), entry["ktype"]])
    if entry["kind"] == "q4":  # q4, d (Q4_0: no m) or q4, d, m
        return packed_gemm.Q4Panels(*arrays, *([None] if len(arrays) == 2 else []))
    # q, d (float16 and no m: a file's Q8_0) or q, d, m
    return packed_gemm.Q8Panels._make([*arrays, *([None] if len(arrays) == 2 else []), entry["exact"]])


def cache_dir() -> Path:
    base = os.environ.get("SCRATCHLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "scratchllm")
    return Path(base) / "panels"


def enabled() -> bool:
    return os.environ.get("SCRATCHLLM_PANEL_CACHE", "1").lower() not in ("0", "false", "no", "off")


def source_stat(*files: Path) -> list[int]:
    """[size, mtime_ns] of each model file, one after another. OSError if one is gone."""
    stats = [f.stat() for f in files]
    return [n for st in stats for n in (st.st_size, st.st_mtime_ns)]


def content_key(files: Sequence[Path]) -> str:
    """The cache's name for these model files (a file, or a split model's shards in order): a hash
    of what determines their panels (the module doc), the same wherever the bytes lie."""
    h = hashlib.sha256()
    for f in files:  # a change to any shard is a new key
        with open(f, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            h.update(f"{size}|".encode())
            h.update(fh.read(min(size, HEAD_BYTES)))
            rest = size - HEAD_BYTES - SAMPLE_BYTES
            for i in range(SAMPLES if rest > 0 else 0):
                h.update(os.pread(fh.fileno(), SAMPLE_BYTES, HEAD_BYTES + rest * i // (SAMPLES - 1)))
    so = Path(packed_gemm.__file__).stat()
    h.update(f"|{packed_gemm.NR}|{so.st_size}|{so.st_mtime_ns}|{FORMAT}".encode())
    return h.hexdigest()[:32]


def read_uses(path: Path) -> list[tuple[list[str], list[int] | None]]:
    """The model files a cache served ((files, their source_stat when last used) each), from the
    USES file beside it, and its index's source (what it was packed from) where that lists it
    not. Raises OSError, ValueError or struct.error on a file that is not a whole panel cache."""
    sources, stat = read_source(path)
    try:
        recorded = json.loads(path.with_suffix(USES).read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # none yet, or another process mid-write
        recorded = []
    uses: list[tuple[list[str], list[int] | None]] = []
    for use in recorded if isinstance(recorded, list) else []:
        if not isinstance(use, dict):
            continue
        files, stamp = use.get("files"), use.get("stat")
        if isinstance(files, list) and files and all(isinstance(f, str) for f in files):
            uses.append((files, stamp if isinstance(stamp, list) else None))
    if sources and sources not in [files for files, _ in uses]:
        uses.insert(0, (sources, stat))
    return uses


def record_use(path: Path, files: Sequence[Path]) -> None:
    """Add `files` (as they are now) to the uses beside cache `path`, unless it lists them so."""
    use = {"files": [str(f.resolve()) for f in files], "stat": source_stat(*files)}
    target = path.with_suffix(USES)
    try:
        recorded = json.loads(target.read_text())
        recorded = recorded if isinstance(recorded, list) else []
    except (OSError, json.JSONDecodeError):
        recorded = []
    if use in recorded:
        return
    recorded = [u for u in recorded if isinstance(u, dict) and u.get("files") != use["files"]] + [use]
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(recorded))
        os.replace(tmp, target)
    except OSError:  # a read-only cache: still used, just not recorded
        tmp.unlink(missing_ok=True)


def _read_index(path: Path) -> dict[str, Any]:
    """A cache file's index. Raises OSError, ValueError or struct.error on a file that is not a
    whole panel cache (another process's, mid-write). Read without touching the file's access
    time where the system allows (O_NOATIME: the file's owner), so looking at a cache is not
    using it (see _mark_used)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOATIME", 0))
    except PermissionError:  # not the owner: O_NOATIME is refused, a plain read is not
        fd = os.open(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        head = f.read(16)
        if head[:8] != MAGIC:
            raise ValueError(f"{path} is not a panel cache")
        index: dict[str, Any] = json.loads(f.read(struct.unpack_from("<Q", head, 8)[0]))
    return index


def read_format(path: Path) -> int | None:
    """The format a cache file was written in (None: before formats were recorded, 7 or older);
    a load reads only FORMAT's."""
    value = _read_index(path).get(FORMAT_KEY)
    return value if isinstance(value, int) else None


def read_source(path: Path) -> tuple[list[str], list[int] | None]:
    """The model files a cache file's panels came from (one, or a split model's shards, first
    first; none if its index names none), and their source_stat when they were packed, from the
    file's index (_read_index)."""
    index = _read_index(path)
    source, shards = index.get(SOURCE), index.get(SHARDS, [])
    if not isinstance(shards, list) or not all(isinstance(f, str) for f in [source or "", *shards]):
        raise ValueError(f"{path}: its index does not name its model files as paths")
    return ([source, *shards] if source else []), index.get(SOURCE_STAT)


def _mark_used(path: Path) -> None:
    """Set the cache file's access time to now (its modification time kept): the last use that
    a size cap evicts by (panel_cache_files.py), whatever the file system's atime policy."""
    try:
        os.utime(path, ns=(time.time_ns(), path.stat().st_mtime_ns))
    except OSError:  # a read-only cache: still used, just not recorded
        pass


class PanelCache:
    """The cached panels of one model file: `get(name)` before packing a matrix, `put(name, panels)`
    after, `save()` once the model is packed (writes only if something was packed). `shards`: a
    split model's later shards (`model_path` is its first), which the key covers too."""

    def __init__(self, model_path: str | os.PathLike[str], directory: Path | None = None,
                 shards: Sequence[str | os.PathLike[str]] = ()) -> None:
        self.model_path = Path(model_path)
        self.files = [self.model_path, *map(Path, shards)]
        self.path = (directory or cache_dir()) / f"{content_key(self.files)}.panels"
        self.hits: dict[str, QuantizedPanels] = {}  # name -> panels mapped from the cache file
        self.fresh: dict[str, QuantizedPanels] = {}  # name -> panels this load packed
        self._read()

    def _read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return  # no cache yet (or an empty file)
        _advise_huge_pages(mm)  # before the first read: the header's fault reads ahead megabytes
        try:
            if mm[:8] != MAGIC:
                raise ValueError("not a panel cache")
            (n,) = struct.unpack_from("<Q", mm, 8)
            index = json.loads(bytes(mm[16:16 + n]))
            for meta in (SOURCE, SOURCE_STAT, SHARDS, FORMAT_KEY):
                index.pop(meta, None)
            for name, entry in index.items():
                self.hits[name] = _panels(entry, mm)
            _mark_used(self.path)
            record_use(self.path, self.files)
            try:  # map every page now (from the page cache), as llama.cpp's loader does with MAP_POPULATE
                mm.madvise(MADV_POPULATE_READ)
            except OSError:
                mm.madvise(mmap.MADV_WILLNEED)
        except (ValueError, KeyError, TypeError, struct.error, json.JSONDecodeError) as err:
            logger.warning("ignoring the unreadable panel cache %s (%s); packing instead", self.path, err)
            self.hits = {}

    def get(self, name: str, shape: tuple[int, ...]) -> QuantizedPanels | None:
        """The cached panels of matrix `name`, if they have the panel shape `shape` [P, rows, NR]
        (in parts: P panels in all, the first part's rows, every part's NR)."""
        panels = self.hits.get(name)
        if panels is None:
            return None
        parts: tuple[Leaf, ...] = panels.parts if isinstance(panels, packed_gemm.SegmentedPanels) else (panels,)
        if (sum(p[0].shape[0] for p in parts), parts[0][0].shape[1]) != tuple(shape[:2]) or \
                any(p[0].shape[2] != shape[2] for p in parts):
            return None
        return panels

    def put(self, name: str, panels: QuantizedPanels) -> None:
        self.fresh[name] = panels

    def save(self) -> None:
        if not self.fresh:
            return
        everything = {**self.hits, **self.fresh}
        index: dict[str, Any] = {}  # name -> entry, and SOURCE, SOURCE_STAT (and SHARDS)
        offset, blobs = 0, []
        for name, panels in everything.items():
            entry, leaves = _entry(panels)
            for leaf, arrays in leaves:
                for a in arrays:
                    leaf["arrays"].append([a.dtype.str, list(a.shape), offset])  # relative for now
                    blobs.append(a)
                    offset += -(-a.nbytes // ALIGN) * ALIGN
            index[name] = entry
        index[FORMAT_KEY] = FORMAT
        index[SOURCE] = str(self.model_path.resolve())
        index[SOURCE_STAT] = source_stat(*self.files)
        if len(self.files) > 1:
            index[SHARDS] = [str(f.resolve()) for f in self.files[1:]]
        body = json.dumps(index).encode()
        # the data starts on a page; each offset grows by at most 12 digits when made absolute
        start = -(-(16 + len(body) + 12 * len(blobs)) // 4096) * 4096
        for name, entry in index.items():
            if name in (SOURCE, SOURCE_STAT, SHARDS, FORMAT_KEY):
                continue
            parts: list[dict[str, Any]] = entry["parts"] if entry["kind"] == "seg" else [entry]
            for arr in (a for part in parts for a in part["arrays"]):
                arr[2] += start
        body = json.dumps(index).encode()
        assert 16 + len(body) <= start, "the index outgrew its room"
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<Q", len(body)) + body)
                f.write(b"\0" * (start - 16 - len(body)))
                for i, a in enumerate(blobs):
                    f.write(np.ascontiguousarray(a).data.cast("B"))  # its own buffer: no copy to free
                    f.write(b"\0" * (-(-a.nbytes // ALIGN) * ALIGN - a.nbytes))
                    progress.report(progress.WRITING_CACHE, i + 1, len(blobs))
                f.flush()
                _drop_from_page_cache(f.fileno())
            os.replace(tmp, self.path)  # atomic: a reader sees the old file or the whole new one
            logger.info("packed panels of %s cached in %s", self.model_path, self.path)
            record_use(self.path, self.files)
        except OSError as err:
            logger.warning("could not write the panel cache %s (%s); loads will pack again", self.path, err)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:  # e.g. the directory is not one: nothing was written
                pass
