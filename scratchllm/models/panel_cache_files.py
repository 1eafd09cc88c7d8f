"""The panel cache folder as a whole (models/panel_cache.py writes one file per model file and
kernel build): what is there, how large, and keeping it in bounds.

- `stale`: a cache whose model file (or a shard of a split one) is gone or has changed since it
  was packed; no load can ever use it again (a load keys its cache on the files' paths, sizes
  and times).
- A size cap evicts the least recently used caches first. A load records its use in the cache
  file's access time (panel_cache._mark_used), so the order holds on file systems that do not
  update access times themselves (noatime, relatime).
Another process may be writing or deleting a cache meanwhile: a file that vanishes or cannot be
read whole is skipped, never an error.
"""

import struct
from dataclasses import dataclass
from pathlib import Path

from scratchllm.models.panel_cache import cache_dir, read_source, source_stat


@dataclass(frozen=True)
class CacheFile:
    path: Path
    source: str | None  # the model file the panels came from (None: a cache without one)
    size: int  # bytes on disk
    last_used_ns: int  # when a load last mapped it (its access time), or when it was written
    stale: bool  # the source is gone or has changed since: no load will read it again


def cache_files(directory: Path | None = None) -> list[CacheFile]:
    """Every whole panel cache in the folder, least recently used first."""
    found = []
    for path in (directory or cache_dir()).glob("*.panels"):
        try:
            sources, packed_stat = read_source(path)
            st = path.stat()
        except (OSError, ValueError, struct.error):
            continue
        try:
            stale = not sources or packed_stat != source_stat(*map(Path, sources))
        except OSError:
            stale = True
        found.append(CacheFile(path, sources[0] if sources else None, st.st_size,
                               max(st.st_atime_ns, st.st_mtime_ns), stale))
    return sorted(found, key=lambda c: (c.last_used_ns, c.path.name))


def _delete(files: list[CacheFile]) -> list[CacheFile]:
    gone = []
    for f in files:
        try:
            f.path.unlink()
            gone.append(f)
        except FileNotFoundError:  # another process pruned it first
            continue
    return gone


def prune(directory: Path | None = None) -> list[CacheFile]:
    """Delete the stale caches; returns them."""
    return _delete([f for f in cache_files(directory) if f.stale])


def cap(max_bytes: int, directory: Path | None = None) -> list[CacheFile]:
    """Delete the least recently used caches until the rest hold at most max_bytes; returns them."""
    assert max_bytes >= 0, "a size cap below zero would mean nothing"
    files = cache_files(directory)
    total, evict = sum(f.size for f in files), []
    for f in files:  # least recently used first
        if total <= max_bytes:
            break
        evict.append(f)
        total -= f.size
    return _delete(evict)
