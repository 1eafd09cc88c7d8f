"""The panel cache folder as a whole (models/panel_cache.py writes one file per model content and
kernel build): what is there, for which model files, how large, and keeping it in bounds.

- `stale`: a cache none of whose model files (each path it served, recorded in its `.uses`; a
  split model's every shard) is still there as it was, or one of another format than this
  version reads; no load can use it again.
- A size cap, by default DEFAULT_MAX_BYTES ($SCRATCHLLM_PANEL_CACHE_MAX: bytes, or a size such
  as 4GiB), evicts the least recently used caches first. A load records its use in the cache
  file's access time (panel_cache._mark_used), so the order holds on file systems that do not
  update access times themselves (noatime, relatime). A load that writes a cache prunes the stale
  ones, this file's caches of older kernel builds but the newest (two installs that load one file
  keep a cache each instead of repacking in turn), then applies the cap, never to its own.
Another process may be writing or deleting a cache meanwhile: a file that vanishes or cannot be
read whole is skipped, never an error.
"""

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from scratchllm.models.panel_cache import FORMAT, USES, PanelCache, cache_dir, read_format, read_uses, source_stat

DEFAULT_MAX_BYTES = 8 << 30
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


@dataclass(frozen=True)
class CacheFile:
    path: Path
    sources: tuple[str, ...]  # the model files it serves (each use's first file), there as they were
    gone: tuple[str, ...]  # the model files it served that are gone or changed since
    size: int  # bytes on disk
    last_used_ns: int  # when a load last mapped it (its access time), or when it was written
    current: bool = True  # of the format this version reads (panel_cache.FORMAT)

    @property
    def stale(self) -> bool:
        """None of its model files is there as it was, or it is of another format: no load will
        read it again."""
        return not self.sources or not self.current

    @property
    def source(self) -> str | None:
        """The model file it serves (the first), None for a cache that names none."""
        return (self.sources + self.gone)[0] if self.sources + self.gone else None


def max_bytes() -> int:
    """The folder's size cap: $SCRATCHLLM_PANEL_CACHE_MAX, else DEFAULT_MAX_BYTES. A value that is
    not a size is the default (a load never fails over its cache)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", os.environ.get("SCRATCHLLM_PANEL_CACHE_MAX", ""))
    if m is None or m.group(2).lower() not in _UNITS:
        return DEFAULT_MAX_BYTES
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _live(files: list[str], stamp: list[int] | None) -> bool:
    try:
        return stamp == source_stat(*map(Path, files))
    except OSError:
        return False


def cache_files(directory: Path | None = None) -> list[CacheFile]:
    """Every whole panel cache in the folder, least recently used first."""
    found = []
    for path in (directory or cache_dir()).glob("*.panels"):
        try:
            uses = read_uses(path)
            current = read_format(path) == FORMAT
            st = path.stat()
        except (OSError, ValueError, struct.error):
            continue
        live = [files[0] for files, stamp in uses if _live(files, stamp)]
        gone = [files[0] for files, stamp in uses if files[0] not in live]
        found.append(CacheFile(path, tuple(live), tuple(gone), st.st_size, max(st.st_atime_ns, st.st_mtime_ns),
                               current))
    return sorted(found, key=lambda c: (c.last_used_ns, c.path.name))


def _delete(files: list[CacheFile]) -> list[CacheFile]:
    gone = []
    for f in files:
        try:
            f.path.unlink()
            gone.append(f)
        except FileNotFoundError:  # another process pruned it first
            continue
        f.path.with_suffix(USES).unlink(missing_ok=True)
    return gone


def prune(directory: Path | None = None) -> list[CacheFile]:
    """Delete the stale caches; returns them."""
    return _delete([f for f in cache_files(directory) if f.stale])


def cap(max_size: int, directory: Path | None = None, keep: Path | None = None) -> list[CacheFile]:
    """Delete the least recently used caches (never `keep`) until the rest hold at most max_size;
    returns them."""
    assert max_size >= 0, "a size cap below zero would mean nothing"
    files = cache_files(directory)
    total, evict = sum(f.size for f in files), []
    for f in files:  # least recently used first
        if total <= max_size:
            break
        if f.path != keep:
            evict.append(f)
            total -= f.size
    return _delete(evict)


def after_write(cache: PanelCache) -> list[CacheFile]:
    """The folder kept in bounds after `cache` wrote its file (the module doc); returns what went."""
    folder = cache.path.parent
    mine = str(cache.model_path.resolve())
    files = cache_files(folder)
    stale = [f for f in files if f.stale and f.path != cache.path]
    other_builds = [f for f in files if not f.stale and f.path != cache.path and mine in f.sources]
    older = sorted(other_builds, key=lambda f: f.path.stat().st_mtime_ns if f.path.exists() else 0)[:-1]
    return _delete(stale + older) + cap(max_bytes(), folder, keep=cache.path)
