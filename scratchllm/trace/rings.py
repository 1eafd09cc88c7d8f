"""The trace rings on this machine: what `scratchllm trace` reads when no ring is named.

Every writer names its ring after itself (format.default_ring_path: the server's port, else the
process id) in the temporary directory, or at $SCRATCHLLM_TRACE; a second writer on a path in
use takes PATH.pid-PID. So the rings of this user are the files
`scratchllm-trace-UID-*.ring` there, and $SCRATCHLLM_TRACE with its `.pid-*` siblings. Each is
described from its header alone: who writes it (pid, port, models), since when, and whether that
writer is still running (it holds the file's lock), died without closing it (a crash: its
records are the flight recorder's), or closed it.

Rings outlive their writers, so the default ones are pruned (prune_rings): every server that
makes a default ring removes this user's default rings whose writers are gone, all but the
newest KEEP_FINISHED, and never one a live writer holds. Without it every run on port 0 (a
test, a script) would leave its ring behind, 128 MiB of reserved disk each, for good.
"""

import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path

from scratchllm.errors import FormatError
from scratchllm.trace.format import ring_folder, ring_prefix
from scratchllm.trace.reader import RingReader
from scratchllm.trace.writer import same_file

CURRENT = ("running", "died")  # the rings a reader is asked about; a closed ring is a finished run
KEEP_FINISHED = 4  # default rings kept whose writers are gone (closed or died), newest first


@dataclass(frozen=True)
class RingInfo:
    """One ring file, as its header describes it."""

    path: Path
    pid: int
    port: int  # 0: its writer had no port (LLM(trace=...), a bench)
    models: tuple[str, ...]
    started_ns: int  # wall clock, when the writer made it
    state: str  # "running", "died" (gone without closing: killed, crashed) or "closed"
    records: int  # records committed so far

    def describe(self) -> str:
        """One line: path, pid, port, models, start time, state."""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started_ns / 1e9))
        port = f"port {self.port}" if self.port else "no port"
        models = ", ".join(self.models) if self.models else "no models named"
        state = {"running": "running", "died": "died without closing it", "closed": "closed"}[self.state]
        return f"{self.path}  pid {self.pid}, {port}, {models}; started {started}; {self.records:,} records; {state}"


def describe_ring(path: Path) -> RingInfo | None:
    """The ring at `path`, or None when the file is not a ring this code reads."""
    try:
        with RingReader(path, from_start=False) as reader:
            return RingInfo(path, reader.pid, reader.port, tuple(reader.models.values()), reader.wall_origin_ns,
                            reader.writer_state(), reader.head())
    except (FormatError, OSError):
        return None


def ring_files(folder: str | os.PathLike[str] | None = None) -> list[Path]:
    """This user's ring files: the default rings in `folder` (the temporary directory), and
    $SCRATCHLLM_TRACE with the rings second writers took beside it."""
    found = sorted(Path(folder or ring_folder()).glob(f"{ring_prefix()}*.ring"))
    env = os.environ.get("SCRATCHLLM_TRACE")
    if env:
        path = Path(env)
        suffix = path.suffix or ".ring"
        siblings = sorted(path.parent.glob(f"{path.stem if path.suffix else path.name}.pid-*{suffix}"))
        found += [p for p in ([path] if path.exists() else []) + siblings if p not in found]
    return found


def find_rings(folder: str | os.PathLike[str] | None = None) -> list[RingInfo]:
    """Every ring of this user (ring_files), described; newest first."""
    rings = [info for info in map(describe_ring, ring_files(folder)) if info is not None]
    return sorted(rings, key=lambda r: r.started_ns, reverse=True)


def prune_rings(folder: str | os.PathLike[str] | None = None, keep: int = KEEP_FINISHED) -> list[Path]:
    """Remove this user's default rings in `folder` (the temporary directory), their `.prev`
    copies included, whose writers are gone, all but the `keep` newest (by the time their
    writers started); return the paths removed. A ring is removed only while this process
    holds its exclusive lock, so a live writer's ring (or one a reader is probing this
    instant) is never touched, and a writer rotating the same file meanwhile finds it gone
    (writer._Ring._rotate). Files with the prefix that are not rings are left alone. Errors
    removing one file (another user's folder rights, a race) skip that file."""
    assert keep >= 0
    where = Path(folder or ring_folder())
    paths = sorted({*where.glob(f"{ring_prefix()}*.ring"), *where.glob(f"{ring_prefix()}*.ring.prev")})
    finished = [info for info in map(describe_ring, paths) if info is not None and info.state != "running"]
    finished.sort(key=lambda r: r.started_ns, reverse=True)
    removed = []
    for info in finished[keep:]:
        try:
            fd = os.open(info.path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not same_file(fd, info.path):
                continue  # moved while we opened it (a writer rotated it); what is there now is not what we read
            os.unlink(info.path)
            removed.append(info.path)
        except OSError:
            continue  # held meanwhile (a new writer linked its ring there, a reader's probe), or gone
        finally:
            os.close(fd)
    return removed
