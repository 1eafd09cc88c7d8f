"""RingReader: reads a trace ring that another process is writing, or one whose writer died.

Per record the reader expects, at record index i, slot i % capacity to hold stamp i + 1:
    s1 := stamp; copy the 64 bytes; s2 := stamp
    s1 == s2 == i + 1   valid: the copy is exactly what the writer committed
    s1 == i + 1 != s2   torn: the writer began overwriting the slot during the copy
    s1 != i + 1         lapped: the slot already holds (or is being filled with) a newer record
A reader that falls more than `capacity` records behind loses the oldest ones: they are counted
as lapped without being read. The header's write_counter says how far the writer got; records
just past it whose stamps are already in place (the writer was killed between its stamps and
its counter update) are read too, so after a crash every committed record is recovered and
only the write in flight (stamp 0) is lost.
"""

import errno
import fcntl
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from scratchllm.errors import FormatError
from scratchllm.trace.format import (
    HEADER_DTYPE,
    HEADER_SIZE,
    RECORD_DTYPES,
    RECORD_SIZE,
    STAMP_OFFSET,
    VERSION,
    WRITE_COUNTER_OFFSET,
    Kind,
    check_header,
    model_names,
    upgrade,
)


@dataclass
class ReadResult:
    """What one read_new() call found: the valid records (raw [n, 64] bytes, in write order)
    and how many of the records in [first, end) it could not use, and why."""

    raw: npt.NDArray[np.uint8]
    first: int  # index of the first record this read covered
    end: int  # one past the last
    lapped: int = 0
    torn: int = 0
    version: int = VERSION  # the ring's: records of an older one are upgraded as they are taken
    _kinds: npt.NDArray[np.uint8] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._kinds = self.raw[:, 0] if len(self.raw) else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.raw)

    def of(self, kind: Kind) -> npt.NDArray[np.void]:
        """The valid records of one kind as a structured array of that kind's dtype."""
        records = np.ascontiguousarray(self.raw[self._kinds == kind]).view(RECORD_DTYPES[kind]).reshape(-1)
        return upgrade(kind, records, self.version)

    def names(self) -> dict[int, str]:
        names = self.of(Kind.NAME)
        return {int(r["request"]): bytes(r["text"][: r["length"]]).decode(errors="replace") for r in names}

    def request_models(self) -> dict[int, int]:
        """{request key: model byte} from the NAME records (who registered each request)."""
        names = self.of(Kind.NAME)
        return dict(zip(names["request"].tolist(), names["model"].tolist(), strict=True))


class RingReader:
    """Open a ring read-only. `from_start`: begin at the oldest record still in the ring
    (default), else at the newest (only records written from now on)."""

    _header: npt.NDArray[np.void]  # views of the mapped file
    _counter: npt.NDArray[np.uint64]
    _slots: npt.NDArray[np.uint8]  # [capacity, RECORD_SIZE]
    _stamps: npt.NDArray[np.uint64]  # [capacity]: each slot's stamp

    def __init__(self, path: str | os.PathLike[str], from_start: bool = True) -> None:
        self.path = Path(path)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise FormatError(self.path, "no such trace ring (start the writer, or give the ring's path)") from None
        except OSError as err:
            raise FormatError(self.path, f"cannot open: {err.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise FormatError(self.path, f"{size} bytes: too small to be a trace ring ({HEADER_SIZE}-byte header)")
            self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        header: npt.NDArray[np.void] = np.ndarray((), HEADER_DTYPE, buffer=self._mm).copy()
        check_header(self.path, header, size)
        self.version = int(header["version"])
        self.capacity = int(header["capacity"])
        self.pid = int(header["pid"])
        self.port = int(header["port"]) if self.version >= 2 else 0
        self.clock_origin_ns = int(header["clock_origin_ns"])
        self.wall_origin_ns = int(header["wall_origin_ns"])
        self._header = np.ndarray((), HEADER_DTYPE, buffer=self._mm)
        self._counter = np.ndarray((1,), "<u8", buffer=self._mm, offset=WRITE_COUNTER_OFFSET)
        self._slots = np.ndarray((self.capacity, RECORD_SIZE), np.uint8, buffer=self._mm, offset=HEADER_SIZE)
        self._stamps = np.ndarray((self.capacity,), "<u8", buffer=self._mm, offset=HEADER_SIZE + STAMP_OFFSET,
                                  strides=(RECORD_SIZE,))
        head = self.head()
        self.next = max(0, head - self.capacity) if from_start else head
        self.lapped = 0
        self.torn = 0

    def head(self) -> int:
        """Records committed so far (the header's counter, plus committed ones just past it)."""
        head = int(self._counter[0])
        while True:  # a writer killed after its stamps but before its counter: take those too
            probe = np.arange(head, head + 256, dtype=np.uint64)
            ok = self._stamps[probe % self.capacity] == probe + 1
            run = int(np.argmin(ok)) if not ok.all() else len(ok)
            head += run
            if run < len(ok):
                return head

    @property
    def dropped(self) -> int:
        """Records the writer dropped rather than wait (its header counter)."""
        return int(self._header["dropped"])

    @property
    def models(self) -> dict[int, str]:
        """{model byte: name} of the header's table, as it is now (a live writer adds to it)."""
        return model_names(self._mm) if self.version >= 2 else {}

    def writer_state(self) -> str:
        """"closed" (the writer closed the ring), "running", or "died" (gone without closing:
        killed or crashed)."""
        if int(self._header["closed"]):
            return "closed"
        return "running" if self.writer_alive() else "died"

    def writer_alive(self) -> bool:
        """Whether the writer still holds the ring: its lock (writer.py) is held. A version 1
        ring had no lock: there, whether its pid still exists (a pid can be reused)."""
        if self.version >= 2:
            return ring_locked(self.path)
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def read_new(self, max_records: int | None = None) -> ReadResult:
        """Every record committed since the previous call (at most max_records of them)."""
        head = self.head()
        start, lapped = self.next, 0
        if head - start > self.capacity:  # fell more than a ring behind: the oldest are gone
            lapped, start = head - self.capacity - start, head - self.capacity
        end = head if max_records is None else min(head, start + max_records)
        idx = np.arange(start, end, dtype=np.uint64)
        slots = idx % self.capacity
        expected = idx + 1
        s1 = self._stamps[slots]
        raw = self._copy(slots)
        s2 = self._stamps[slots]
        valid = (s1 == expected) & (s2 == expected)
        torn = int(np.count_nonzero((s1 == expected) & (s2 != expected)))
        lapped += len(idx) - int(np.count_nonzero(valid)) - torn
        self.next = end
        self.lapped += lapped
        self.torn += torn
        return ReadResult(raw[valid], start, end, lapped, torn, self.version)

    def _copy(self, slots: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint8]:  # -> [n, 64], a copy (tests interpose)
        return self._slots[slots]

    def close(self) -> None:
        if not self._mm.closed:
            del self._header, self._counter, self._slots, self._stamps
            self._mm.close()

    def __enter__(self) -> "RingReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



def ring_locked(path: str | os.PathLike[str]) -> bool:
    """Whether a live writer holds the ring file at `path` (its exclusive flock): a shared lock
    is tried without waiting, and let go at once."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return True
        raise
    finally:
        os.close(fd)  # the shared lock, if taken, goes with it
    return False
