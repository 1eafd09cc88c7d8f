"""A model file as a read-only, memory-mapped uint8 array: the one way every parser touches bytes.

Mapping costs nothing up front: the kernel loads a 4 KiB page when it is first touched, so a
parser that reads only the table of contents reads only those pages, and a tensor's bytes are
read when (and only when) that tensor is looked up. Views of this array are zero-copy and
read-only; they keep the mapping alive for as long as they live.
"""

import mmap
from pathlib import Path

import numpy as np

from scratchllm.errors import FormatError


def map_file(path: Path) -> np.ndarray:
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



def release_pages(mapped: np.ndarray) -> None:
    """Unmap from this process the pages it has read of the file a `map_file` array (or any view
    of one) maps: MADV_DONTNEED over the whole mapping.
    The file stays mapped and the page cache keeps its pages: a later read faults them back in
    from memory, not from disk. For a model whose weights were moved into panels at load time:
    the file's copy stops counting in the process's resident memory."""
    mm = mapped
    while isinstance(mm, (np.ndarray, memoryview)):
        mm = mm.base if isinstance(mm, np.ndarray) else mm.obj
    if isinstance(mm, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        mm.madvise(mmap.MADV_DONTNEED)
