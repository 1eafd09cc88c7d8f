"""The trace ring's on-disk format: one page of header, then `capacity` records of 64 bytes.

    offset 0      header (HEADER_DTYPE, padded to HEADER_SIZE = 4096 bytes)
    offset 4096   record 0, record 1, ... record capacity-1 (RECORD_SIZE = 64 bytes each)

Record i of the whole run (0-based, counting every record ever written) lives in slot
i % capacity and carries the stamp i + 1 in its last 8 bytes; stamp 0 means "empty, or being
written". Every kind of record shares two fields: `kind` (byte 0) and `seq` (bytes 56-63, the
stamp); the 55 bytes between are the kind's own (TOKEN_DTYPE, STEP_DTYPE, SPAN_DTYPE,
NAME_DTYPE below). docs/tracing.md has the tables, the stamp protocol and the arithmetic.

Times are `time.monotonic_ns()` values; the header's clock origin pairs one monotonic reading
with the wall clock taken at the same moment, so a reader can print either.
"""

import enum
import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np
import numpy.typing as npt

from scratchllm.errors import FormatError

MAGIC = b"SLLMTRC1"
VERSION = 1
RECORD_SIZE = 64
HEADER_SIZE = 4096  # one page: the records start page-aligned
DEFAULT_RING_BYTES = 128 * 2**20
STAMP_OFFSET = 56  # the stamp is the record's last 8 bytes, written after the other 56
NAME_BYTES = 40  # a NAME record holds this many bytes of UTF-8 of the request's string id
# The request key of a span that belongs to an engine step, not to one request (DETOKENIZE: the
# step's detokenization of all its tokens; the span's index is the step). No id hashes to it
# but with probability 2^-64.
STEP_KEY = 0


class Kind(enum.IntEnum):
    EMPTY = 0
    TOKEN = 1  # one generated token of one request
    STEP = 2  # one engine step: its duration and split, batch, KV use, queue
    SPAN = 3  # one phase of one request: [start, end]
    NAME = 4  # the string id behind a request key


class Phase(enum.IntEnum):
    """A token's phase (PREFILL: the token sampled right after a prefill chunk; DECODE: the
    rest), and a span's phase (the request's life in order, then the server's work per chunk)."""

    PREFILL = 1
    DECODE = 2
    QUEUED = 3
    DETOKENIZE = 4
    SERIALIZE = 5
    NETWORK_SEND = 6
    REQUEST = 7  # the whole request, arrival to finish


class TokenFlag(enum.IntFlag):
    FIRST = 1  # the request's first token: its latency_ns is the time to first token
    PREEMPTED = 2  # the request was preempted (its KV freed) since its previous token
    RESUMED = 4  # the request re-prefilled after a preemption to make this token
    FINISHED = 8  # the request's last token


class StepFlag(enum.IntFlag):
    PREEMPTION = 1  # the scheduler preempted at least one request in this step
    PREFILL = 2  # the step computed at least one prefill chunk


HEADER_DTYPE = np.dtype({
    "names": ["magic", "version", "record_size", "capacity", "header_size", "write_counter", "dropped",
              "clock_origin_ns", "wall_origin_ns", "pid", "closed"],
    "formats": ["S8", "<u4", "<u4", "<u8", "<u8", "<u8", "<u8", "<i8", "<i8", "<u4", "<u4"],
    "offsets": [0, 8, 12, 16, 24, 32, 40, 48, 56, 64, 68],
    "itemsize": 128,
})


def field_offset(dtype: np.dtype[np.void], name: str) -> int:
    """The byte offset of field `name` in the structured dtype `dtype`."""
    assert dtype.fields is not None, "a structured dtype"
    offset: int = dtype.fields[name][1]
    return offset


WRITE_COUNTER_OFFSET = field_offset(HEADER_DTYPE, "write_counter")
DROPPED_OFFSET = field_offset(HEADER_DTYPE, "dropped")
CLOSED_OFFSET = field_offset(HEADER_DTYPE, "closed")  # 1 once the writer closed the ring: it did not crash


def _record(fields: list[tuple[str, str, int]]) -> np.dtype[np.void]:
    """A 64-byte record dtype: `kind` at byte 0 and `seq` (the stamp) at byte 56 around `fields`."""
    fields = [("kind", "u1", 0), *fields, ("seq", "<u8", STAMP_OFFSET)]
    dtype = np.dtype({"names": [f[0] for f in fields], "formats": [f[1] for f in fields],
                      "offsets": [f[2] for f in fields], "itemsize": RECORD_SIZE})
    # invariant: no field crosses into the stamp, so writing bytes [0, 56) never touches it
    assert all(field_offset(dtype, n) + dtype[n].itemsize <= STAMP_OFFSET for n in dtype.names or ()
               if n != "seq")
    return dtype


TOKEN_DTYPE = _record([
    ("phase", "u1", 1), ("flags", "<u2", 2), ("step", "<u4", 4), ("request", "<u8", 8), ("time_ns", "<i8", 16),
    ("position", "<u4", 24), ("token_id", "<i4", 28), ("latency_ns", "<i8", 32), ("kv_blocks", "<u4", 40),
    ("batch_size", "<u4", 44), ("step_tokens", "<u4", 48),
])
STEP_DTYPE = _record([
    ("flags", "u1", 1), ("waiting", "<u2", 2), ("step", "<u4", 4), ("start_ns", "<i8", 8), ("end_ns", "<i8", 16),
    ("matmul_ns", "<i8", 24), ("attention_ns", "<i8", 32), ("batch_size", "<u2", 40), ("preempted", "<u2", 42),
    ("step_tokens", "<u4", 44), ("kv_blocks", "<u4", 48), ("kv_total", "<u4", 52),
])
SPAN_DTYPE = _record([
    ("phase", "u1", 1), ("flags", "<u2", 2), ("index", "<u4", 4), ("request", "<u8", 8), ("start_ns", "<i8", 16),
    ("end_ns", "<i8", 24), ("count", "<u8", 32),
])
NAME_DTYPE = _record([("length", "u1", 1), ("request", "<u8", 8), ("text", f"S{NAME_BYTES}", 16)])
RECORD_DTYPES = {Kind.TOKEN: TOKEN_DTYPE, Kind.STEP: STEP_DTYPE, Kind.SPAN: SPAN_DTYPE, Kind.NAME: NAME_DTYPE}


def default_ring_path() -> str:
    """Where a ring goes when no path is given: $SCRATCHLLM_TRACE, else scratchllm-trace-UID.ring
    in the temporary directory (one per user, so two users' servers do not collide)."""
    return os.environ.get("SCRATCHLLM_TRACE") or os.path.join(tempfile.gettempdir(),
                                                             f"scratchllm-trace-{os.getuid()}.ring")


def request_key(request_id: str) -> int:
    """The ring's 64-bit integer for a request's string id: the first 8 bytes of its BLAKE2b
    digest, little-endian. Stable across processes and runs (unlike hash()), so a reader can
    match a key against an id it knows; the ring's NAME records map keys back to strings."""
    return int.from_bytes(hashlib.blake2b(str(request_id).encode(), digest_size=8).digest(), "little")


def capacity_for(ring_bytes: int) -> int:
    """How many records a ring file of ring_bytes holds (the header takes the first page)."""
    return (ring_bytes - HEADER_SIZE) // RECORD_SIZE


def check_header(path: str | Path, header: npt.NDArray[np.void], file_size: int) -> None:
    """Raise FormatError naming the problem unless `header` is a ring this code reads."""
    if bytes(header["magic"]) != MAGIC:
        raise FormatError(path, f"not a scratchllm trace ring (magic {bytes(header['magic'])!r}, expected {MAGIC!r})")
    if int(header["version"]) != VERSION:
        raise FormatError(path, f"trace ring version {int(header['version'])}; this scratchllm reads version {VERSION}")
    if int(header["record_size"]) != RECORD_SIZE or int(header["header_size"]) != HEADER_SIZE:
        raise FormatError(path, f"record size {int(header['record_size'])} / header size {int(header['header_size'])}"
                                f", expected {RECORD_SIZE} / {HEADER_SIZE}")
    need = HEADER_SIZE + int(header["capacity"]) * RECORD_SIZE
    if int(header["capacity"]) < 1 or file_size < need:
        raise FormatError(path, f"truncated: the header promises {int(header['capacity'])} records "
                                f"({need:,} bytes) but the file has {file_size:,} bytes")
