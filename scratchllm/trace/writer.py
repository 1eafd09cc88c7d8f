"""TraceWriter: appends records to the memory-mapped ring; what the engine and the server call.

Cost model: one call writes a whole step's tokens (NumPy fills a preallocated staging buffer,
then three slice copies into the mapping), so a step of 16 tokens costs a few microseconds and
nothing is allocated per token. Nothing is ever flushed: the pages belong to the kernel's page
cache the moment they are written, so they outlive this process (a SIGKILL, an OOM kill) but
not the machine (call flush() to force them to disk).

Disk space: the whole file is reserved when the ring is made (posix_fallocate), so a full disk
fails the constructor with an OSError and nothing is left behind. A sparse file would fail later
instead, at the first store into a page the file system can no longer back, and a store into a
mapping that fails is a SIGBUS that kills the process mid-traffic, not an exception.

The write protocol, per record (the reader's side is in reader.py):
    1. stamp := 0                (the slot is "being written": a reader discards it)
    2. bytes [0, 56) := payload
    3. stamp := index + 1        (committed)
    4. header.write_counter := index + 1
Stores become visible in program order on x86-64 (TSO), which is all the protocol needs; on a
weakly ordered CPU a reader may discard a committed record (never accept a torn one) because
it checks the stamp before and after its copy.

Threads: one lock, taken without waiting. A thread that finds it held (the engine thread is
mid-write while the event loop wants to write a span) drops its record and counts it in the
header's `dropped` instead of waiting: waiting could mean waiting a whole GIL switch
interval (5 ms) for the holder to be scheduled again.

Models: one ring serves every engine of a process (a server of several models). `for_model`
gives a writer bound to a model: the model's name goes into the header's table once, and every
record that writer makes carries the model's index (format.py), over the same ring, lock and
counter.

Processes: a ring belongs to one live writer. The writer holds an exclusive flock on its file
from before the file appears under its name until it closes or dies (the kernel drops the
lock of a killed process), so another process never rotates or truncates a ring in use: a
second writer on the same path gets RingInUse and takes a name of its own
(format.own_ring_path). A dead or closed writer's ring is renamed to PATH.prev by the next
writer on its path, never overwritten: the record of a crash outlives a restart.
"""

import errno
import fcntl
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from scratchllm.errors import ConfigError
from scratchllm.trace.format import (
    CLOSED_OFFSET,
    DEFAULT_RING_BYTES,
    DROPPED_OFFSET,
    HEADER_DTYPE,
    HEADER_SIZE,
    MAGIC,
    MAX_MODELS,
    MODEL_NAME_BYTES,
    MODEL_TABLE_OFFSET,
    MODELS_OFFSET,
    NAME_BYTES,
    NO_MODEL,
    PID_OFFSET,
    RECORD_SIZE,
    STAMP_OFFSET,
    TOKEN_DTYPE,
    VERSION,
    WRITE_COUNTER_OFFSET,
    Kind,
    Phase,
    capacity_for,
    model_names,
    model_slot,
    request_key,
)

logger = logging.getLogger(__name__)

MIN_RING_BYTES = HEADER_SIZE + 16 * RECORD_SIZE
# The 56 bytes before the stamp of each single-record kind, field for field as in format.py.
_STEP = struct.Struct("<BBHIqqqqHBBIII")
_SPAN = struct.Struct("<BBHIQqqQB15x")
_NAME = struct.Struct(f"<BBB5xQ{NAME_BYTES}s")
_VERIFY = struct.Struct("<BBHIqIIq24x")
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
Column = npt.NDArray[Any] | Sequence[int]  # one value per record of a tokens() call
_KIND_STEP, _KIND_SPAN, _KIND_NAME = int(Kind.STEP), int(Kind.SPAN), int(Kind.NAME)  # plain ints pack faster
_KIND_VERIFY = int(Kind.VERIFY)
assert _STEP.size == _SPAN.size == _NAME.size == _VERIFY.size == STAMP_OFFSET
LOCK_TRIES = 20  # a reader's probe holds a shared lock for microseconds: try again before calling a ring in use
LOCK_WAIT_S = 0.01


class RingInUse(ConfigError):
    """The ring file is held by another live writer (its pid, when the header says)."""

    def __init__(self, path: Path, pid: int) -> None:
        super().__init__(f"trace ring {path} is in use by a live writer (pid {pid})")
        self.path, self.pid = path, pid


def _try_lock(fd: int) -> bool:
    """An exclusive flock on fd, without waiting long: False when another process holds it."""
    for attempt in range(LOCK_TRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
        if attempt + 1 < LOCK_TRIES:
            time.sleep(LOCK_WAIT_S)
    return False


def _header_pid(fd: int) -> int:
    """The pid a ring file's header names (0 when the file is too short to say)."""
    raw = os.pread(fd, 4, PID_OFFSET)
    return int.from_bytes(raw, "little") if len(raw) == 4 else 0


def same_file(fd: int, path: Path) -> bool:
    """Whether `path` names the file open as `fd` (False when nothing is there). What a process
    that moves or removes a ring checks once it holds the ring's lock: the invariant is that
    whoever moves or removes a ring file holds its lock, and a link never replaces a file, so
    while the lock is held the answer cannot go stale."""
    try:
        at = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (at.st_dev, at.st_ino) == (mine.st_dev, mine.st_ino)


class _Ring:
    """The mapped file, its lock and its counters: what every model's writer of one ring shares."""

    def __init__(self, path: Path, ring_bytes: int, clock: Callable[[], int], port: int) -> None:
        self.path = path
        self.capacity = capacity_for(ring_bytes)
        size = HEADER_SIZE + self.capacity * RECORD_SIZE
        self.fd, self.mm = self._claim(size, clock, port)
        self.counter = np.ndarray((1,), "<u8", buffer=self.mm, offset=WRITE_COUNTER_OFFSET)
        self.dropped_view = np.ndarray((1,), "<u8", buffer=self.mm, offset=DROPPED_OFFSET)
        self.slots = np.ndarray((self.capacity, RECORD_SIZE), np.uint8, buffer=self.mm, offset=HEADER_SIZE)
        self.stamps = np.ndarray((self.capacity,), "<u8", buffer=self.mm, offset=HEADER_SIZE + STAMP_OFFSET,
                                 strides=(RECORD_SIZE,))
        self.n = 0  # records ever written = the next record's index
        self.dropped = 0
        self.lock = threading.Lock()
        self.models: dict[str, int] = {}

    def _claim(self, size: int, clock: Callable[[], int], port: int) -> tuple[int, mmap.mmap]:
        """The new ring's fd (locked) and mapping (its header written) at self.path: the old
        ring there (if its writer is gone) moved to PATH.prev first; RingInUse if a live writer
        holds it. The file is made under a hidden name and linked into place once locked, so no
        other writer can take it in between."""
        for _ in range(LOCK_TRIES):
            self._rotate()
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.new")
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            mm = None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a file nobody else knows of yet
                # every block reserved now (zeros: stamp 0 = empty), so no store into the mapping can fail
                os.posix_fallocate(fd, 0, size)
                mm = mmap.mmap(fd, size)
                header = np.ndarray((), HEADER_DTYPE, buffer=mm)
                header[()] = (MAGIC, VERSION, RECORD_SIZE, self.capacity, HEADER_SIZE, 0, 0, clock(), time.time_ns(),
                              os.getpid(), 0, port, 0)
                del header  # a view would keep the mapping from closing
                os.link(tmp, self.path)  # appears under its name locked; fails if another writer got there first
            except FileExistsError:
                assert mm is not None
                mm.close()
                os.close(fd)
                continue
            except BaseException:
                if mm is not None:
                    mm.close()
                os.close(fd)
                raise
            finally:
                tmp.unlink(missing_ok=True)
            return fd, mm
        raise RingInUse(self.path, 0)

    def _rotate(self) -> None:
        """Move the ring at self.path to PATH.prev unless a live writer holds it (RingInUse)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            if not _try_lock(fd):
                raise RingInUse(self.path, _header_pid(fd))
            # Only the file we locked: while we waited, another writer may have moved it to .prev (or
            # rings.prune_rings removed it) and a new live ring may be at the path now.
            if not same_file(fd, self.path):
                return
            os.replace(self.path, self.path.with_name(self.path.name + ".prev"))
        finally:
            os.close(fd)  # and with it the lock on the old file

    def add_model(self, name: str) -> int:
        """The model's index in the header's table, adding its name the first time."""
        with self.lock:  # rare (once per model and ring): waiting here is fine
            if name not in self.models:
                if len(self.models) >= MAX_MODELS:
                    raise ConfigError(f"a trace ring names at most {MAX_MODELS} models")
                slot = len(self.models)
                at = MODEL_TABLE_OFFSET + slot * MODEL_NAME_BYTES
                self.mm[at:at + MODEL_NAME_BYTES] = model_slot(name)
                _U32.pack_into(self.mm, MODELS_OFFSET, slot + 1)  # after the name: a reader sees it whole
                self.models[name] = slot + 1
            return self.models[name]

    def close(self) -> None:
        if not self.mm.closed:
            _U32.pack_into(self.mm, CLOSED_OFFSET, 1)
            del self.counter, self.dropped_view, self.slots, self.stamps  # views keep the mapping open
            self.mm.close()
            os.close(self.fd)  # the lock goes with it


class TraceWriter:
    """Writes one ring file. `path` is created (an existing ring there whose writer is gone is
    kept as PATH.prev, so a restart does not wipe the record of the run that crashed; one whose
    writer is alive raises RingInUse). `clock`: the nanosecond clock the callers' times come
    from (its reading now is the ring's clock origin). `port`: the port of the server writing
    it, kept in the header for `scratchllm trace` to list. `model`: a name to write records
    under (see for_model). Raises OSError when the file cannot be made or its space reserved
    (a full disk): no ring file is left."""

    def __init__(self, path: str | os.PathLike[str], ring_bytes: int = DEFAULT_RING_BYTES, max_batch: int = 4096,
                 clock: Callable[[], int] = time.monotonic_ns, port: int = 0, model: str | None = None,
                 _ring: _Ring | None = None) -> None:
        if _ring is None:
            if ring_bytes < MIN_RING_BYTES:
                raise ConfigError(f"a trace ring needs at least {MIN_RING_BYTES} bytes, got {ring_bytes}")
            _ring = _Ring(Path(path), ring_bytes, clock, port)
            logger.info("trace ring %s: %d records of %d bytes", _ring.path, _ring.capacity, RECORD_SIZE)
        self._ring = _ring
        self.path = _ring.path
        self.capacity = _ring.capacity
        self.max_batch = min(max_batch, self.capacity)
        self.clock = clock
        self.model = NO_MODEL if model is None else _ring.add_model(model)
        self.model_name = model
        self._lock = _ring.lock
        # staging: token records are filled field by field, one NumPy call per field per step
        self._tok = np.zeros(self.max_batch, TOKEN_DTYPE)
        self._tok["kind"] = Kind.TOKEN
        self._tok["model"] = self.model
        assert TOKEN_DTYPE.names is not None  # a structured dtype
        self._tok_fields = {name: self._tok[name] for name in TOKEN_DTYPE.names}
        self._tok_bytes = self._tok.view(np.uint8).reshape(self.max_batch, RECORD_SIZE)
        self._iota = np.arange(1, self.max_batch + 1, dtype=np.uint64)
        self._seqs = np.empty(self.max_batch, np.uint64)

    def for_model(self, name: str) -> "TraceWriter":
        """A writer over the same ring whose records carry model `name` (the same name, the
        same index): one per engine of a server of several models."""
        return TraceWriter(self.path, max_batch=self.max_batch, clock=self.clock, model=name, _ring=self._ring)

    @property
    def models(self) -> dict[int, str]:
        """{index: name} of the models this ring's header names."""
        return model_names(self._ring.mm) if not self._ring.mm.closed else {}

    # --- the records ---
    def tokens(self, requests: Column, positions: Column, token_ids: Column, latency_ns: Column | int, *,
               step: int, time_ns: int | None = None, kv_blocks: Column | int = 0, phase: Column | int = Phase.DECODE,
               flags: Column | int = 0, batch_size: int | None = None, step_tokens: int = 0) -> None:
        """One token record per element of `requests` (request keys, uint64), all from one step:
        `positions` (index of the token among its request's outputs, 0 = first), `token_ids`,
        `latency_ns` (since the request's previous token; for the first token, since arrival),
        `kv_blocks` (blocks each request holds), `phase` and `flags` (TokenFlag): arrays of the
        same length, or one value for all. `batch_size` defaults to the number of records."""
        k = len(requests)
        if k > self.max_batch:
            for a in range(0, k, self.max_batch):
                sl = slice(a, a + self.max_batch)
                self.tokens(requests[sl], positions[sl], token_ids[sl], _part(latency_ns, sl), step=step,
                            time_ns=time_ns, kv_blocks=_part(kv_blocks, sl), phase=_part(phase, sl),
                            flags=_part(flags, sl), batch_size=k if batch_size is None else batch_size,
                            step_tokens=step_tokens)
            return
        if k == 0:
            return
        if not self._lock.acquire(False):
            self._drop(k)
            return
        try:
            f = self._tok_fields
            f["request"][:k] = requests
            f["position"][:k] = positions
            f["token_id"][:k] = token_ids
            f["latency_ns"][:k] = latency_ns
            f["kv_blocks"][:k] = kv_blocks
            f["phase"][:k] = phase
            f["flags"][:k] = flags
            f["step"][:k] = step
            f["time_ns"][:k] = self.clock() if time_ns is None else time_ns
            f["batch_size"][:k] = k if batch_size is None else batch_size
            f["step_tokens"][:k] = step_tokens
            self._commit(self._tok_bytes, k)
        finally:
            self._lock.release()

    def step(self, step: int, start_ns: int, end_ns: int, *, matmul_ns: int = 0, attention_ns: int = 0,
             batch_size: int = 0, step_tokens: int = 0, kv_blocks: int = 0, kv_total: int = 0, waiting: int = 0,
             preempted: int = 0, flags: int = 0) -> None:
        """One step record: [start_ns, end_ns] with its time in matmuls and in attention (the
        rest is end - start - matmul - attention), requests and tokens in the step, KV blocks
        used of kv_total, requests waiting, requests preempted by it (saturating at 255),
        StepFlag bits."""
        self._write_one(_STEP, _KIND_STEP, flags, min(waiting, 0xFFFF), step, start_ns, end_ns, matmul_ns,
                        attention_ns, min(batch_size, 0xFFFF), min(preempted, 0xFF), self.model, step_tokens,
                        kv_blocks, kv_total)

    def verify(self, step: int, time_ns: int, *, drafted: int, accepted: int, requests: int = 0,
               draft_ns: int = 0) -> None:
        """One VERIFY record: step `step` (ended at time_ns) verified `drafted` drafted tokens
        of `requests` requests and accepted `accepted` of them; drafting them took draft_ns.
        Written after the step's STEP record (flagged StepFlag.VERIFY)."""
        self._write_one(_VERIFY, _KIND_VERIFY, self.model, min(requests, 0xFFFF), step, time_ns, drafted, accepted,
                        draft_ns)

    def span(self, request: int | str, phase: Phase, start_ns: int, end_ns: int, *, count: int = 0, index: int = 0,
             flags: int = 0) -> None:
        """One phase of one request (a key, or its string id): QUEUED, PREFILL, DECODE,
        DETOKENIZE, SERIALIZE, NETWORK_SEND or REQUEST. `count`: what the phase handled (prompt
        tokens when queued, bytes serialized or sent); `index`: the chunk's number in its stream."""
        if type(request) is str:
            request = request_key(request)
        self._write_one(_SPAN, _KIND_SPAN, phase, flags, index, request, start_ns, end_ns, count, self.model)

    def register(self, request_id: str) -> int:
        """The request's key (format.request_key), after writing a NAME record that maps it back
        to the string (and to this writer's model): call once per request, at arrival. Ids
        longer than 40 UTF-8 bytes are cut (at a character boundary); the key is the whole id's."""
        key = request_key(request_id)
        text = str(request_id).encode()[:NAME_BYTES].decode(errors="ignore").encode()
        self._write_one(_NAME, _KIND_NAME, len(text), self.model, key, text)
        return key

    # --- the ring ---
    def _write_one(self, payload: struct.Struct, *values: Any) -> None:
        """One record straight into the mapping with struct: a third of the cost of NumPy's
        per-call overhead, which dominates for a single record."""
        if not self._lock.acquire(False):
            self._drop(1)
            return
        try:
            ring = self._ring
            n = ring.n
            at = HEADER_SIZE + (n % ring.capacity) * RECORD_SIZE
            mm = ring.mm
            _U64.pack_into(mm, at + STAMP_OFFSET, 0)
            payload.pack_into(mm, at, *values)
            _U64.pack_into(mm, at + STAMP_OFFSET, n + 1)
            ring.n = n + 1
            _U64.pack_into(mm, WRITE_COUNTER_OFFSET, n + 1)
        finally:
            self._lock.release()

    def _commit(self, staged: npt.NDArray[np.uint8], k: int) -> None:  # [>=k, 64] uint8; caller holds the lock
        ring = self._ring
        assert 0 < k <= self.max_batch <= ring.capacity
        n, cap = ring.n, ring.capacity
        s = n % cap
        a = min(k, cap - s)  # records [0, a) go to slots [s, s + a), the rest wrap to [0, k - a)
        stamps, slots, seqs = ring.stamps, ring.slots, self._seqs[:k]
        np.add(self._iota[:k], n, out=seqs)  # stamps n + 1 .. n + k
        stamps[s : s + a] = 0
        slots[s : s + a, :STAMP_OFFSET] = staged[:a, :STAMP_OFFSET]
        if a < k:
            stamps[: k - a] = 0
            slots[: k - a, :STAMP_OFFSET] = staged[a:k, :STAMP_OFFSET]
        stamps[s : s + a] = seqs[:a]
        if a < k:
            stamps[: k - a] = seqs[a:]
        ring.n = n + k
        ring.counter[0] = n + k

    def _drop(self, k: int) -> None:
        # a lost update here (two threads dropping at once) undercounts by one: acceptable for a counter
        ring = self._ring
        ring.dropped += k
        ring.dropped_view[0] = ring.dropped

    @property
    def dropped(self) -> int:
        return self._ring.dropped

    @property
    def written(self) -> int:
        return self._ring.n

    def flush(self) -> None:
        """Force the ring's pages to disk (survive a machine crash, not just a process death)."""
        self._ring.mm.flush()

    def close(self) -> None:
        """Close the ring (every model's writer of it): marks it closed, not crashed."""
        self._ring.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _part(value: Any, sl: slice) -> Any:
    return value[sl] if isinstance(value, (np.ndarray, list, tuple)) else value
