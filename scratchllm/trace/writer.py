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
"""

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
    NAME_BYTES,
    RECORD_SIZE,
    STAMP_OFFSET,
    TOKEN_DTYPE,
    VERSION,
    WRITE_COUNTER_OFFSET,
    Kind,
    Phase,
    capacity_for,
    request_key,
)

logger = logging.getLogger(__name__)

MIN_RING_BYTES = HEADER_SIZE + 16 * RECORD_SIZE
# The 56 bytes before the stamp of each single-record kind, field for field as in format.py.
_STEP = struct.Struct("<BBHIqqqqHHIII")
_SPAN = struct.Struct("<BBHIQqqQ16x")
_NAME = struct.Struct(f"<BB6xQ{NAME_BYTES}s")
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
Column = npt.NDArray[Any] | Sequence[int]  # one value per record of a tokens() call
_KIND_STEP, _KIND_SPAN, _KIND_NAME = int(Kind.STEP), int(Kind.SPAN), int(Kind.NAME)  # plain ints pack faster
assert _STEP.size == _SPAN.size == _NAME.size == STAMP_OFFSET


class TraceWriter:
    """Owns one ring file. `path` is created (an existing ring there is kept as PATH.prev, so
    a restart does not wipe the record of the run that crashed). `clock`: the nanosecond clock
    the callers' times come from (its reading now is the ring's clock origin). Raises OSError
    when the file cannot be made or its space reserved (a full disk): no ring file is left."""

    def __init__(self, path: str | os.PathLike[str], ring_bytes: int = DEFAULT_RING_BYTES, max_batch: int = 4096,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        if ring_bytes < MIN_RING_BYTES:
            raise ConfigError(f"a trace ring needs at least {MIN_RING_BYTES} bytes, got {ring_bytes}")
        self.path = Path(path)
        self.capacity = capacity_for(ring_bytes)
        self.max_batch = min(max_batch, self.capacity)
        self.clock = clock
        if self.path.exists():
            os.replace(self.path, self.path.with_name(self.path.name + ".prev"))
        size = HEADER_SIZE + self.capacity * RECORD_SIZE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            # every block reserved now (zeros: stamp 0 = empty), so no store into the mapping can fail
            os.posix_fallocate(fd, 0, size)
            self._mm = mmap.mmap(fd, size)
        except OSError:
            self.path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        header = np.ndarray((), HEADER_DTYPE, buffer=self._mm)
        header[()] = (MAGIC, VERSION, RECORD_SIZE, self.capacity, HEADER_SIZE, 0, 0, clock(), time.time_ns(),
                      os.getpid(), 0)
        self._counter = np.ndarray((1,), "<u8", buffer=self._mm, offset=WRITE_COUNTER_OFFSET)
        self._dropped = np.ndarray((1,), "<u8", buffer=self._mm, offset=DROPPED_OFFSET)
        self._slots = np.ndarray((self.capacity, RECORD_SIZE), np.uint8, buffer=self._mm, offset=HEADER_SIZE)
        self._stamps = np.ndarray((self.capacity,), "<u8", buffer=self._mm, offset=HEADER_SIZE + STAMP_OFFSET,
                                  strides=(RECORD_SIZE,))
        self._n = 0  # records ever written = the next record's index
        self.dropped = 0
        self._lock = threading.Lock()
        # staging: token records are filled field by field, one NumPy call per field per step
        self._tok = np.zeros(self.max_batch, TOKEN_DTYPE)
        self._tok["kind"] = Kind.TOKEN
        assert TOKEN_DTYPE.names is not None  # a structured dtype
        self._tok_fields = {name: self._tok[name] for name in TOKEN_DTYPE.names}
        self._tok_bytes = self._tok.view(np.uint8).reshape(self.max_batch, RECORD_SIZE)
        self._iota = np.arange(1, self.max_batch + 1, dtype=np.uint64)
        self._seqs = np.empty(self.max_batch, np.uint64)
        logger.info("trace ring %s: %d records of %d bytes", self.path, self.capacity, RECORD_SIZE)

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
        used of kv_total, requests waiting, requests preempted by it, StepFlag bits."""
        self._write_one(_STEP, _KIND_STEP, flags, min(waiting, 0xFFFF), step, start_ns, end_ns, matmul_ns,
                        attention_ns, min(batch_size, 0xFFFF), min(preempted, 0xFFFF), step_tokens, kv_blocks,
                        kv_total)

    def span(self, request: int | str, phase: Phase, start_ns: int, end_ns: int, *, count: int = 0, index: int = 0,
             flags: int = 0) -> None:
        """One phase of one request (a key, or its string id): QUEUED, PREFILL, DECODE,
        DETOKENIZE, SERIALIZE, NETWORK_SEND or REQUEST. `count`: what the phase handled (prompt
        tokens when queued, bytes serialized or sent); `index`: the chunk's number in its stream."""
        if type(request) is str:
            request = request_key(request)
        self._write_one(_SPAN, _KIND_SPAN, phase, flags, index, request, start_ns, end_ns, count)

    def register(self, request_id: str) -> int:
        """The request's key (format.request_key), after writing a NAME record that maps it back
        to the string: call once per request, at arrival. Ids longer than 40 UTF-8 bytes are cut
        (at a character boundary); the key is the whole id's."""
        key = request_key(request_id)
        text = str(request_id).encode()[:NAME_BYTES].decode(errors="ignore").encode()
        self._write_one(_NAME, _KIND_NAME, len(text), key, text)
        return key

    # --- the ring ---
    def _write_one(self, payload: struct.Struct, *values: Any) -> None:
        """One record straight into the mapping with struct: a third of the cost of NumPy's
        per-call overhead, which dominates for a single record."""
        if not self._lock.acquire(False):
            self._drop(1)
            return
        try:
            n = self._n
            at = HEADER_SIZE + (n % self.capacity) * RECORD_SIZE
            mm = self._mm
            _U64.pack_into(mm, at + STAMP_OFFSET, 0)
            payload.pack_into(mm, at, *values)
            _U64.pack_into(mm, at + STAMP_OFFSET, n + 1)
            self._n = n + 1
            _U64.pack_into(mm, WRITE_COUNTER_OFFSET, n + 1)
        finally:
            self._lock.release()

    def _commit(self, staged: npt.NDArray[np.uint8], k: int) -> None:  # [>=k, 64] uint8; caller holds the lock
        assert 0 < k <= self.max_batch <= self.capacity
        n, cap = self._n, self.capacity
        s = n % cap
        a = min(k, cap - s)  # records [0, a) go to slots [s, s + a), the rest wrap to [0, k - a)
        stamps, seqs = self._stamps, self._seqs[:k]
        np.add(self._iota[:k], n, out=seqs)  # stamps n + 1 .. n + k
        stamps[s : s + a] = 0
        self._slots[s : s + a, :STAMP_OFFSET] = staged[:a, :STAMP_OFFSET]
        if a < k:
            stamps[: k - a] = 0
            self._slots[: k - a, :STAMP_OFFSET] = staged[a:k, :STAMP_OFFSET]
        stamps[s : s + a] = seqs[:a]
        if a < k:
            stamps[: k - a] = seqs[a:]
        self._n = n + k
        self._counter[0] = n + k

    def _drop(self, k: int) -> None:
        # a lost update here (two threads dropping at once) undercounts by one: acceptable for a counter
        self.dropped += k
        self._dropped[0] = self.dropped

    @property
    def written(self) -> int:
        return self._n

    def flush(self) -> None:
        """Force the ring's pages to disk (survive a machine crash, not just a process death)."""
        self._mm.flush()

    def close(self) -> None:
        if not self._mm.closed:
            _U32.pack_into(self._mm, CLOSED_OFFSET, 1)
            del self._counter, self._dropped, self._slots, self._stamps  # views keep the mapping open
            self._mm.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _part(value: Any, sl: slice) -> Any:
    return value[sl] if isinstance(value, (np.ndarray, list, tuple)) else value
