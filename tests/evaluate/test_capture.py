"""Capture: deterministic keyed sampling within binomial bounds, no raw IP on disk, rotation,
and a writer killed with SIGKILL mid-write read back with its partial line skipped and counted."""

import ipaddress
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from scratchllm.errors import ConfigError
from scratchllm.evaluate.capture import CaptureWriter, anonymize_ip
from scratchllm.evaluate.sources import read_traffic
from scratchllm.server.access import client_ip

KEY = "test-key"


def bodies(n):
    return [{"model": "m", "prompt": f"request number {i}", "max_tokens": 8} for i in range(n)]


@pytest.mark.parametrize("rate", [0.01, 0.1, 0.5])
def test_sampling_rate_holds_within_binomial_bounds(tmp_path, rate):
    n = 20000
    w = CaptureWriter(tmp_path, rate=rate, key=KEY)
    k = sum(w.should_capture(b) for b in bodies(n))
    sd = math.sqrt(n * rate * (1 - rate))
    assert abs(k - n * rate) < 4.5 * sd, (k, n * rate, sd)  # P(fail) < 1e-5 for a fair coin


def test_sampling_is_deterministic_keyed_and_order_free(tmp_path):
    items = bodies(3000)
    a = [CaptureWriter(tmp_path, rate=0.1, key=KEY).should_capture(b) for b in items]
    again = [CaptureWriter(tmp_path, rate=0.1, key=KEY).should_capture(b) for b in items]
    other_key = [CaptureWriter(tmp_path, rate=0.1, key="another").should_capture(b) for b in items]
    assert a == again
    assert a != other_key
    w = CaptureWriter(tmp_path, rate=0.1, key=KEY)
    reordered = [dict(reversed(list(b.items()))) for b in items]
    assert [w.should_capture(b) for b in reordered] == a
    assert [w.should_capture(json.dumps(b, indent=2).encode()) for b in items] == a
    assert CaptureWriter(tmp_path, rate=1.0, key=KEY).should_capture(items[0])
    assert not CaptureWriter(tmp_path, rate=0.0, key=KEY).should_capture(items[0])


def test_a_key_is_required(tmp_path, monkeypatch):
    monkeypatch.delenv("SCRATCHLLM_CAPTURE_KEY", raising=False)
    with pytest.raises(ConfigError, match="SCRATCHLLM_CAPTURE_KEY"):
        CaptureWriter(tmp_path)
    monkeypatch.setenv("SCRATCHLLM_CAPTURE_KEY", "from-env")
    assert CaptureWriter(tmp_path).key == b"from-env"
    with pytest.raises(ConfigError, match="rate"):
        CaptureWriter(tmp_path, rate=1.5, key=KEY)


ADDRESSES = {
    "203.0.113.77": "203.0.113.0/24",
    "2001:db8:abcd:12:34:56:78:9a": "2001:db8:abcd::/48",
    "::ffff:198.51.100.9": "198.51.100.0/24",
}


def _spellings(ip):
    addr = ipaddress.ip_address(ip)
    forms = {ip, str(addr)}
    if addr.version == 6:
        forms.add(addr.exploded)
        if addr.ipv4_mapped:
            forms.add(str(addr.ipv4_mapped))
    return forms


def test_no_raw_ip_is_written(tmp_path):
    w = CaptureWriter(tmp_path, rate=1.0, key=KEY)
    for ip in ADDRESSES:
        w.record({"model": "m", "prompt": "hi"}, "m", ip, [1, 2], {"e2e_ms": 3.0})
    w.close()
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir())
    for ip in ADDRESSES:
        for form in _spellings(ip):
            assert form.encode() not in raw, form
    clients = [r.client for r in read_traffic(tmp_path).requests]
    assert [c["network"] for c in clients] == list(ADDRESSES.values())
    assert all(len(c["ip_hmac"]) == 64 for c in clients)
    # the mapped address is its IPv4 address: the same client joins across both spellings
    assert anonymize_ip("::ffff:198.51.100.9", b"k") == anonymize_ip("198.51.100.9", b"k")
    assert anonymize_ip("203.0.113.77", b"k")["ip_hmac"] != anonymize_ip("203.0.113.78", b"k")["ip_hmac"]
    assert anonymize_ip("203.0.113.77", b"k")["ip_hmac"] != anonymize_ip("203.0.113.77", b"j")["ip_hmac"]
    assert anonymize_ip("testclient", b"k")["network"] is None


def test_forwarded_for_is_trusted_only_when_told():
    xff = "1.2.3.4, 10.0.0.5"  # the client wrote 1.2.3.4 itself; the trusted proxy appended 10.0.0.5
    assert client_ip("192.0.2.1", xff) == "192.0.2.1"
    assert client_ip("192.0.2.1", xff, trusted_proxies=1) == "10.0.0.5"
    assert client_ip("192.0.2.1", xff, trusted_proxies=2) == "1.2.3.4"
    assert client_ip("192.0.2.1", None, trusted_proxies=1) == "192.0.2.1"


def test_lines_round_trip_and_files_rotate(tmp_path):
    w = CaptureWriter(tmp_path, rate=1.0, key=KEY, max_bytes=2048)
    for i, b in enumerate(bodies(40)):
        w.record(b, "m", "203.0.113.1", [i, i + 1], {"e2e_ms": float(i)}, response_text=f"out {i}",
                 finish_reason="length")
    w.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) > 1 and all(p.stat().st_size <= 2048 for p in tmp_path.iterdir())
    traffic = read_traffic(tmp_path)
    assert traffic.partial_lines == 0
    assert [r.body for r in traffic.requests] == bodies(40)
    assert [r.response["token_ids"] for r in traffic.requests][:2] == [[0, 1], [1, 2]]
    # a second writer starts a new file rather than appending after another's last line
    CaptureWriter(tmp_path, rate=1.0, key=KEY).record(bodies(1)[0], "m", None, None, None)
    assert len(list(tmp_path.iterdir())) == len(files) + 1


WRITER = """
import sys
from scratchllm.evaluate.capture import CaptureWriter
w = CaptureWriter(sys.argv[1], rate=1.0, key="k", max_bytes=1 << 40)
big = "x" * (8 << 20)
while True:
    w.record({"model": "m", "prompt": big}, "m", "203.0.113.9", [1], None)
"""


def test_sigkill_mid_write_leaves_a_partial_line_that_is_skipped_and_counted(tmp_path):
    """The kernel stops a large write(2) at a fatal signal, so a kill during one leaves part of a
    line; a kill between writes leaves none. Retried until a kill lands mid-write."""
    seen_partial = False
    for attempt in range(8):
        d = tmp_path / f"run{attempt}"
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(d)], cwd=os.getcwd())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            files = list(d.glob("*.jsonl")) if d.exists() else []
            if files and files[0].stat().st_size > (24 << 20) + attempt * (3 << 20):
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        data = b"".join(p.read_bytes() for p in sorted(d.glob("*.jsonl")))
        complete = data.count(b"\n")
        traffic = read_traffic(d)
        assert len(traffic.requests) == complete
        assert traffic.partial_lines == (0 if data.endswith(b"\n") else 1)
        if traffic.partial_lines:
            seen_partial = True
            break
    assert seen_partial, "no kill landed mid-write in 8 tries"


def test_batch_api_input_is_read(tmp_path):
    path = tmp_path / "batch.jsonl"
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}},
             {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "x"}}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    traffic = read_traffic(path)
    assert [(r.custom_id, r.endpoint, r.model) for r in traffic.requests] == [
        ("a", "/v1/chat/completions", "m"), ("b", "/v1/completions", "m")]


@pytest.mark.parametrize("line, problem", [
    ('{"custom_id": "a", "url": "/v1/embeddings", "body": {}}', "cannot be replayed"),
    ("not json", "not a JSON line"),
    ('{"body": {}}', "neither a capture line"),
    ('{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}', "must be POST"),
])
def test_bad_lines_are_errors_naming_the_line(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"custom_id": "ok", "url": "/v1/completions", "body": {"prompt": "x"}}\n' + line + "\n")
    with pytest.raises(ConfigError, match=f"bad.jsonl:2: .*{problem}"):
        read_traffic(path)


def test_serve_options_build_the_writer(tmp_path):
    import argparse

    from scratchllm.evaluate.capture import add_capture_arguments, capture_writer_from_args

    p = argparse.ArgumentParser()
    add_capture_arguments(p)
    assert capture_writer_from_args(p.parse_args([])) is None
    w = capture_writer_from_args(p.parse_args(["--capture", str(tmp_path), "--capture-rate", "0.5",
                                               "--capture-key", "k", "--capture-max-mb", "1"]))
    assert (w.rate, w.key, w.max_bytes) == (0.5, b"k", 1 << 20)
