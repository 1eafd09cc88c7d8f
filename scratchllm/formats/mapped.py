"""A model file as a read-only, memory-mapped uint8 array: the one way every parser touches bytes.

Mapping costs nothing up front: the kernel loads a 4 KiB page when it is first touched, so a
parser that reads only the table of contents reads only those pages, and a tensor's bytes are
read when (and only when) that tensor is looked up. Views of this array are zero-copy and
read-only; they keep the mapping alive for as long as they live.
"""

import mmap
from pathlib import Path

import numpy as np
import numpy.typing as npt

from scratchllm.errors import FormatError


def map_file(path: Path) -> npt.NDArray[np.uint8]:
    """uint8 [file_size], backed by mmap. An empty or unreadable file is a FormatError."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise FormatError(path, "empty file")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as err:
        raise FormatError(path, f"cannot read: {err.strerror or err}") from None
    return np.frombuffer(mm, dtype=np.uint8)



def _mapping_of(view: np.ndarray) -> tuple[mmap.mmap | None, int]:
    """(the mmap behind a `map_file` array or a view of one, the view's byte offset in it), or (None, 0)."""
    root: np.ndarray = view
    mm: object = view
    while isinstance(mm, (np.ndarray, memoryview)):
        if isinstance(mm, np.ndarray):
            root = mm
        mm = mm.base if isinstance(mm, np.ndarray) else mm.obj
    if not isinstance(mm, mmap.mmap):
        return None, 0
    return mm, view.__array_interface__["data"][0] - root.__array_interface__["data"][0]


def release_range(view: np.ndarray) -> None:
    """`release_pages` for the whole pages inside one view (a tensor's bytes) only: during loading,
    a matrix's file pages can go as soon as it is packed, so the file and the panels are not
    resident together. Pages the view shares with its neighbours stay."""
    mm, start = _mapping_of(view)
    if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    first, end = -(-start // page) * page, (start + view.nbytes) // page * page
    if end > first:
        mm.madvise(mmap.MADV_DONTNEED, first, end - first)


def release_pages(mapped: np.ndarray) -> None:
    """Unmap from this process the pages it has read of the file a `map_file` array (or any view
    of one) maps: MADV_DONTNEED over the whole mapping.
    The file stays mapped and the page cache keeps its pages: a later read faults them back in
    from memory, not from disk. For a model whose weights were moved into panels at load time:
    the file's copy stops counting in the process's resident memory."""
    mm, _ = _mapping_of(mapped)
    if isinstance(mm, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        mm.madvise(mmap.MADV_DONTNEED)
