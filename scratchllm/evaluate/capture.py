"""Traffic capture: a deterministic, keyed sample of requests appended to JSONL files.

Sampling: a request is captured when HMAC-SHA256(key, canonical body) read as a number in [0, 1)
is below `rate`. The same body under the same key is always in or always out (reruns pick the
same requests), and over distinct bodies the decision is a fair coin of bias `rate`, so the
captured count is Binomial(n, rate). The canonical body is its JSON with sorted keys and no
spaces: key order and whitespace do not change the decision.

Privacy: the raw client IP is never written. A line holds `client.ip_hmac` (HMAC-SHA256 of the
address under the same key, for joining one client's requests; without the key the 2^32 IPv4
space cannot be brute-forced back to addresses) and `client.network`, the address truncated to
its /24 (IPv4) or /48 (IPv6) for analysis. An IPv4-mapped IPv6 address (::ffff:a.b.c.d) is
treated as the IPv4 address it carries. X-Forwarded-For is client-controlled: it is used only
when the server is told how many proxies in front of it to trust (`serve --trusted-proxies N`,
scratchllm.server.access.client_ip), and then the N-th address from the right is taken (the
one the outermost trusted proxy saw).

Crash safety: every line is one os.write() of the whole line on an O_APPEND descriptor, so
concurrent appends never interleave and a process killed mid-write leaves at most a partial
last line, which `read_capture` skips and counts. A writer always starts a new file (never
appends after another process's possibly partial line); files rotate at `max_bytes`.

A full disk (or any other write error) never reaches the request: the line is dropped and
counted (`num_dropped`), a line cut by a short write is cut off the file again (ftruncate back
to the last whole line), one warning says so, and one line says when writing works again.
"""

import argparse
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Self

from scratchllm.errors import ConfigError

logger = logging.getLogger(__name__)

CAPTURE_KEY_ENV = "SCRATCHLLM_CAPTURE_KEY"
FORMAT_VERSION = 1
FILE_PATTERN = re.compile(r"^capture-(\d{6})\.jsonl$")


def capture_key(key: str | bytes | None = None) -> bytes:
    """The secret key: the option if given, else $SCRATCHLLM_CAPTURE_KEY. Refused if neither:
    an unkeyed hash of an IPv4 address is reversible by trying all 2^32 of them."""
    key = key if key is not None else os.environ.get(CAPTURE_KEY_ENV)
    if not key:
        raise ConfigError(f"capture needs a secret key: pass one, or set {CAPTURE_KEY_ENV}")
    return key.encode() if isinstance(key, str) else bytes(key)


def check_capture_settings(rate: float, key: str | bytes | None, max_bytes: int) -> bytes:
    """The capture settings checked before anything is written: the key's bytes, or ConfigError."""
    if not 0.0 <= rate <= 1.0:
        raise ConfigError(f"capture rate must be in [0, 1], got {rate}")
    if max_bytes < 1024:
        raise ConfigError(f"capture file size limit must be >= 1024 bytes, got {max_bytes}")
    return capture_key(key)


def canonical_body(body: dict[str, Any] | bytes | str) -> bytes:
    """The body as sorted-key, space-free JSON: the bytes that are hashed for sampling."""
    if isinstance(body, (bytes, str)):
        try:
            body = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"request body is not JSON: {err}") from None
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def anonymize_ip(ip: str | None, key: bytes) -> dict[str, str | None]:
    """{"ip_hmac": hex, "network": "a.b.c.0/24" | "x:y:z::/48" | None}. Never the address itself."""
    if not ip:
        return {"ip_hmac": None, "network": None}
    try:
        addr = ipaddress.ip_address(ip.strip().strip("[]"))
    except ValueError:  # not an address (a Unix socket, a test client's name): keyed hash only
        return {"ip_hmac": _hmac(key, b"ip", ip.encode()), "network": None}
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    prefix = 24 if addr.version == 4 else 48
    network = ipaddress.ip_network(f"{addr}/{prefix}", strict=False)
    return {"ip_hmac": _hmac(key, b"ip", addr.packed), "network": str(network)}


def _hmac(key: bytes, domain: bytes, data: bytes) -> str:
    # The domain tag keeps the sampling hash and the IP hash independent under one key.
    return hmac.new(key, domain + b"\0" + data, hashlib.sha256).hexdigest()


class CaptureWriter:
    """Appends captured requests to DIR/capture-NNNNNN.jsonl. Thread-safe; see the module doc.

    Call from the request path: ``if w.should_capture(body): ... w.record(body, model, ip,
    token_ids, timings, ...)`` after the response is complete. `should_capture` costs one
    HMAC-SHA256 of the canonical body; `record` one json.dumps and one write(2).
    """

    def __init__(self, directory: str | Path, rate: float = 0.01, key: str | bytes | None = None,
                 max_bytes: int = 64 << 20):
        self.rate, self.key, self.max_bytes = rate, check_capture_settings(rate, key, max_bytes), max_bytes
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._threshold = int(rate * 2**64)  # capture iff the hash's top 64 bits < this
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._size = 0
        self._index = max((int(m.group(1)) for p in self.directory.iterdir()
                           if (m := FILE_PATTERN.match(p.name))), default=0)
        self.num_written = 0
        self.num_dropped = 0  # lines that could not be written (a full disk)
        self._failing = False  # the last write failed: warned once, until one succeeds

    @property
    def path(self) -> Path:
        return self.directory / f"capture-{self._index:06d}.jsonl"

    def should_capture(self, body: dict[str, Any] | bytes | str) -> bool:
        digest = hmac.new(self.key, b"sample\0" + canonical_body(body), hashlib.sha256).digest()
        return int.from_bytes(digest[:8], "big") < self._threshold

    def record(self, body: dict[str, Any] | bytes | str, model: str | None, client_ip: str | None,
               response_token_ids: list[int] | None, timings: dict[str, Any] | None, *,
               endpoint: str = "/v1/completions",
               response_text: str | None = None, finish_reason: str | None = None,
               time_s: float | None = None, translated_from: str | None = None) -> None:
        """`translated_from`: the route a request came in on when `body` is its equivalent on
        `endpoint` (an Ollama request), written as the line's `translated_from`."""
        if not isinstance(body, dict):
            body = json.loads(body)
        line = {"v": FORMAT_VERSION, "time": time.time() if time_s is None else time_s, "endpoint": endpoint,
                "model": model, "body": body, "client": anonymize_ip(client_ip, self.key),
                "response": {"token_ids": list(response_token_ids) if response_token_ids is not None else None,
                             "text": response_text, "finish_reason": finish_reason},
                "timings": timings}
        if translated_from is not None:
            line["translated_from"] = translated_from
        data = (json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        with self._lock:
            try:
                if self._fd is None or self._size + len(data) > self.max_bytes:
                    self._rotate()
                self._write_all(data)
            except OSError as err:
                self._dropped(err)
                return
            self._size += len(data)
            self.num_written += 1
            if self._failing:
                self._failing = False
                logger.warning("capture: writing %s again (%d captured requests were dropped)", self.path,
                               self.num_dropped)

    def _dropped(self, err: OSError) -> None:
        """A line not written: the file is cut back to its last whole line; warned once."""
        self.num_dropped += 1
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, self._size)  # only this writer appends to its file
            except OSError:
                os.close(self._fd)  # cannot repair it: never append after a cut line
                self._fd = None
        if not self._failing:
            self._failing = True
            logger.warning("capture: could not write to %s (%s); dropping captured requests until it can",
                           self.directory, err.strerror or err)

    def _rotate(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        while True:  # O_EXCL: another writer in this directory may have just taken the next name
            self._index += 1
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o600)
                break
            except FileExistsError:
                continue
        self._size = 0
        logger.info("capture: writing %s", self.path)

    def _write_all(self, data: bytes) -> None:
        # One write(2) for the whole line is the normal case; a short write (disk full, signal)
        # is continued so the line is never left cut while this process lives.
        assert self._fd is not None, "_rotate opens the file before the first write"
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def add_capture_arguments(p: argparse.ArgumentParser) -> None:
    """`serve`'s capture options: --capture DIR --capture-rate --capture-key --capture-max-mb
    --trusted-proxies."""
    p.add_argument("--capture", default=None, metavar="DIR", help="append a sample of requests to DIR/*.jsonl")
    p.add_argument("--capture-rate", type=float, default=0.01,
                   help="share of requests captured, chosen by a keyed hash of the body (0.01 = 1 in 100; 1 = all)")
    p.add_argument("--capture-key", default=None,
                   help=f"secret key of the sample and of the client IP hash (default: ${CAPTURE_KEY_ENV})")
    p.add_argument("--capture-max-mb", type=float, default=64.0, help="rotate capture files at this size")
    p.add_argument("--trusted-proxies", type=int, default=0,
                   help="proxies in front of the server whose X-Forwarded-For is trusted (default: none)")


def check_capture_args(args: argparse.Namespace) -> None:
    """`serve`'s capture options checked without creating the folder (a start that fails later
    on another argument leaves nothing behind)."""
    if args.capture:
        check_capture_settings(args.capture_rate, args.capture_key, int(args.capture_max_mb * (1 << 20)))


def capture_writer_from_args(args: argparse.Namespace) -> CaptureWriter | None:
    if not args.capture:
        return None
    return CaptureWriter(args.capture, args.capture_rate, args.capture_key, int(args.capture_max_mb * (1 << 20)))
