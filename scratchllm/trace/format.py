"""The trace ring's on-disk format: one page of header, then `capacity` records of 64 bytes.

    offset 0      header (HEADER_DTYPE, padded to HEADER_SIZE = 4096 bytes)
    offset 4096   record 0, record 1, ... record capacity-1 (RECORD_SIZE = 64 bytes each)

Record i of the whole run (0-based, counting every record ever written) lives in slot
i % capacity and carries the stamp i + 1 in its last 8 bytes; stamp 0 means "empty, or being
written". Every kind of record shares two fields: `kind` (byte 0) and `seq` (bytes 56-63, the
stamp); the 55 bytes between are the kind's own (TOKEN_DTYPE, STEP_DTYPE, SPAN_DTYPE,
NAME_DTYPE, VERIFY_DTYPE below), each with a `model` byte: the index of the model that wrote it in the
header's table of model names (0: none named). docs/tracing.md has the tables, the stamp
protocol and the arithmetic.

Speculative decoding added, within version 2, the VERIFY kind (a step's drafted and accepted
token counts: the STEP record has no free byte for them), TokenFlag.DRAFTED and StepFlag.VERIFY.
A reader that predates them skips the kind and the bits, so they needed no new version.

Version 1 rings (no model byte, no port, no model table; a STEP record's `preempted` two bytes
wide) are still read: `upgrade` turns their records into this version's.

Times are `time.monotonic_ns()` values; the header's clock origin pairs one monotonic reading
with the wall clock taken at the same moment, so a reader can print either.
"""

import enum
import hashlib
import mmap
import os
import tempfile
from pathlib import Path

import numpy as np
import numpy.typing as npt

from scratchllm.errors import FormatError

MAGIC = b"SLLMTRC1"
VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1: before records carried their model (see `upgrade`)
RECORD_SIZE = 64
HEADER_SIZE = 4096  # one page: the records start page-aligned
DEFAULT_RING_BYTES = 128 * 2**20
STAMP_OFFSET = 56  # the stamp is the record's last 8 bytes, written after the other 56
NAME_BYTES = 40  # a NAME record holds this many bytes of UTF-8 of the request's string id
# The header's table of model names: record byte `model` = i >= 1 names slot i - 1 of the table
MODEL_TABLE_OFFSET = 1024
MODEL_NAME_BYTES = 64
MAX_MODELS = (HEADER_SIZE - MODEL_TABLE_OFFSET) // MODEL_NAME_BYTES  # 48
NO_MODEL = 0  # the model byte of a record no model wrote (the server's own spans), and of version 1
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
    VERIFY = 5  # one step's speculative decoding: drafted and accepted tokens (after the step's STEP record)


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
    DRAFTED = 16  # a drafted token verification accepted: emitted by the step of its request's next token


class StepFlag(enum.IntFlag):
    PREEMPTION = 1  # the scheduler preempted at least one request in this step
    PREFILL = 2  # the step computed at least one prefill chunk
    VERIFY = 4  # the step verified drafted tokens (speculative decoding): a VERIFY record has its counts


HEADER_DTYPE = np.dtype({
    "names": ["magic", "version", "record_size", "capacity", "header_size", "write_counter", "dropped",
              "clock_origin_ns", "wall_origin_ns", "pid", "closed", "port", "models"],
    "formats": ["S8", "<u4", "<u4", "<u8", "<u8", "<u8", "<u8", "<i8", "<i8", "<u4", "<u4", "<u4", "<u4"],
    "offsets": [0, 8, 12, 16, 24, 32, 40, 48, 56, 64, 68, 72, 76],
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
PID_OFFSET = field_offset(HEADER_DTYPE, "pid")
MODELS_OFFSET = field_offset(HEADER_DTYPE, "models")  # names in the model table (written after the name)


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
    ("batch_size", "<u4", 44), ("step_tokens", "<u4", 48), ("model", "u1", 52),
])
STEP_DTYPE = _record([
    ("flags", "u1", 1), ("waiting", "<u2", 2), ("step", "<u4", 4), ("start_ns", "<i8", 8), ("end_ns", "<i8", 16),
    ("matmul_ns", "<i8", 24), ("attention_ns", "<i8", 32), ("batch_size", "<u2", 40), ("preempted", "u1", 42),
    ("model", "u1", 43), ("step_tokens", "<u4", 44), ("kv_blocks", "<u4", 48), ("kv_total", "<u4", 52),
])
SPAN_DTYPE = _record([
    ("phase", "u1", 1), ("flags", "<u2", 2), ("index", "<u4", 4), ("request", "<u8", 8), ("start_ns", "<i8", 16),
    ("end_ns", "<i8", 24), ("count", "<u8", 32), ("model", "u1", 40),
])
NAME_DTYPE = _record([("length", "u1", 1), ("model", "u1", 2), ("request", "<u8", 8), ("text", f"S{NAME_BYTES}", 16)])
VERIFY_DTYPE = _record([
    ("model", "u1", 1), ("requests", "<u2", 2), ("step", "<u4", 4), ("time_ns", "<i8", 8), ("drafted", "<u4", 16),
    ("accepted", "<u4", 20), ("draft_ns", "<i8", 24),
])
RECORD_DTYPES = {Kind.TOKEN: TOKEN_DTYPE, Kind.STEP: STEP_DTYPE, Kind.SPAN: SPAN_DTYPE, Kind.NAME: NAME_DTYPE,
                 Kind.VERIFY: VERIFY_DTYPE}
# Version 1's STEP record: `preempted` two bytes wide where version 2 has preempted and model. In
# the other kinds version 2's model byte was padding, always written as zero: NO_MODEL.
STEP_DTYPE_V1 = _record([
    ("flags", "u1", 1), ("waiting", "<u2", 2), ("step", "<u4", 4), ("start_ns", "<i8", 8), ("end_ns", "<i8", 16),
    ("matmul_ns", "<i8", 24), ("attention_ns", "<i8", 32), ("batch_size", "<u2", 40), ("preempted", "<u2", 42),
    ("step_tokens", "<u4", 44), ("kv_blocks", "<u4", 48), ("kv_total", "<u4", 52),
])


def upgrade(kind: Kind, records: npt.NDArray[np.void], version: int) -> npt.NDArray[np.void]:
    """Records of `kind` read from a ring of `version`, in this version's dtype."""
    if version == VERSION or kind != Kind.STEP:
        return records
    old = records.view(np.uint8).reshape(-1, RECORD_SIZE).copy().view(STEP_DTYPE_V1).reshape(-1)
    new = old.copy().view(STEP_DTYPE)  # the same bytes; then the one field that moved
    new["preempted"] = np.minimum(old["preempted"], 0xFF)
    new["model"] = NO_MODEL
    return new


def ring_folder() -> str:
    """Where rings go when no path is given: the temporary directory ($TMPDIR)."""
    return tempfile.gettempdir()


def ring_prefix() -> str:
    """The start of every default ring's file name: one user's rings (two users never collide)."""
    return f"scratchllm-trace-{os.getuid()}-"


def default_ring_path(port: int | None = None, pid: int | None = None) -> str:
    """Where a writer's ring goes when no path is given: $SCRATCHLLM_TRACE, else a file of the
    temporary directory named after the writer: scratchllm-trace-UID-PORT.ring for a server on
    PORT, scratchllm-trace-UID-pid-PID.ring for a process without one (this one's pid by default),
    so two servers on one machine never share a ring by accident."""
    env = os.environ.get("SCRATCHLLM_TRACE")
    if env:
        return env
    name = f"{port}" if port else f"pid-{pid or os.getpid()}"
    return os.path.join(ring_folder(), f"{ring_prefix()}{name}.ring")


def own_ring_path(path: str | os.PathLike[str], pid: int | None = None) -> Path:
    """The ring a writer takes when `path` is in use by another live writer: the same name with
    `.pid-PID` before its suffix (/tmp/x.ring -> /tmp/x.pid-123.ring)."""
    path = Path(path)
    suffix = path.suffix or ".ring"
    return path.with_name(f"{path.stem if path.suffix else path.name}.pid-{pid or os.getpid()}{suffix}")


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
    if int(header["version"]) not in READABLE_VERSIONS:
        raise FormatError(path, f"trace ring version {int(header['version'])}; this scratchllm reads versions "
                                f"{', '.join(map(str, READABLE_VERSIONS))} (a newer scratchllm wrote it: read it "
                                "with that one)")
    if int(header["record_size"]) != RECORD_SIZE or int(header["header_size"]) != HEADER_SIZE:
        raise FormatError(path, f"record size {int(header['record_size'])} / header size {int(header['header_size'])}"
                                f", expected {RECORD_SIZE} / {HEADER_SIZE}")
    need = HEADER_SIZE + int(header["capacity"]) * RECORD_SIZE
    if int(header["capacity"]) < 1 or file_size < need:
        raise FormatError(path, f"truncated: the header promises {int(header['capacity'])} records "
                                f"({need:,} bytes) but the file has {file_size:,} bytes")


def model_names(header_page: bytes | memoryview | mmap.mmap) -> dict[int, str]:
    """{model byte: name} from the header page's model table (version 1: empty)."""
    count = min(int.from_bytes(bytes(header_page[MODELS_OFFSET:MODELS_OFFSET + 4]), "little"), MAX_MODELS)
    names = {}
    for i in range(count):
        at = MODEL_TABLE_OFFSET + i * MODEL_NAME_BYTES
        raw = bytes(header_page[at:at + MODEL_NAME_BYTES])
        names[i + 1] = raw[1:1 + raw[0]].decode(errors="replace")
    return names


def model_slot(name: str) -> bytes:
    """A model's entry in the table: its length, then up to 63 bytes of UTF-8 (cut on a
    character boundary), zero-padded."""
    text = name.encode()[:MODEL_NAME_BYTES - 1].decode(errors="ignore").encode()
    return bytes([len(text)]) + text.ljust(MODEL_NAME_BYTES - 1, b"\0")
