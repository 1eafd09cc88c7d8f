"""A full disk under each of the server's writers: the trace ring, the capture folder, the panel
cache and the evaluation run file. Each keeps serving (or stops with one clear error), says once
what it could not write, and leaves no cut or corrupt file behind.

The disk is a 256 KiB tmpfs mounted for the test (root only; skipped elsewhere), filled to the
last byte by a filler file."""

import json
import logging
import sqlite3
import subprocess
import sys
import textwrap
from argparse import Namespace
from pathlib import Path

import httpx
import numpy as np
import pytest

from scratchllm.cli.serve_cmd import trace_writer
from scratchllm.evaluate.capture import CaptureWriter
from scratchllm.evaluate.store import RunFileError, RunStore
from scratchllm.kernels import packed_gemm
from scratchllm.models.panel_cache import PanelCache
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend
from scratchllm.trace.format import Kind
from scratchllm.trace.reader import RingReader
from scratchllm.trace.writer import TraceWriter


@pytest.fixture
def disk(tmp_path):
    """A fresh 256 KiB tmpfs."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip() or r.returncode}): needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(disk: Path) -> Path:
    """Fill the disk to its last byte; returns the filler (unlink it to free the space)."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass
    return filler


# --- the trace ring ----------------------------------------------------------------------------
def test_trace_ring_on_a_full_disk_fails_at_creation_and_serve_runs_without_one(disk, capsys):
    fill(disk)
    path = disk / "trace.ring"
    with pytest.raises(OSError):
        TraceWriter(path, ring_bytes=64 << 10)
    assert not path.exists()  # no half-made ring for a reader to trust
    args = Namespace(trace=str(path), trace_ring_mb=1)
    assert trace_writer(args) is None  # serve goes on without a ring ...
    err = capsys.readouterr().err
    assert err.count("no token trace") == 1 and str(path) in err  # ... and says so, once


def test_trace_ring_made_before_the_disk_fills_takes_records_without_sigbus(disk):
    # A sparse ring would die of SIGBUS here, at the first store into a page the disk cannot back:
    # run the writer in its own process so the test reports that instead of dying with it.
    path = disk / "trace.ring"
    script = textwrap.dedent(f"""
        import numpy as np, os
        from scratchllm.trace.writer import TraceWriter
        w = TraceWriter({str(path)!r}, ring_bytes=128 << 10)
        with open({str(disk / "filler")!r}, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\\0" * 4096)
            except OSError:
                pass
        for step in range(100):  # 6400 records: the 2000-slot ring wraps three times
            ids = np.arange(64, dtype=np.uint64) + 1
            w.tokens(ids, np.full(64, step), np.arange(64), 1000, step=step)
        w.close()
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, f"writer died ({run.returncode}): {run.stderr[-2000:]}"
    with RingReader(path) as reader:
        got = reader.read_new()
        tokens = got.of(Kind.TOKEN)
        assert got.torn == 0 and len(tokens) == reader.capacity
        assert int(tokens["step"].max()) == 99  # the newest records are there, whole
        assert reader.writer_state() == "closed"


# --- the capture folder ------------------------------------------------------------------------
def _lines(folder: Path) -> list[dict]:
    out = []
    for p in sorted(folder.glob("capture-*.jsonl")):
        data = p.read_bytes()
        assert not data or data.endswith(b"\n"), f"{p.name} ends in a cut line"
        out += [json.loads(line) for line in data.splitlines()]
    return out


def test_capture_on_a_full_disk_drops_lines_warns_once_and_keeps_whole_lines(disk, caplog):
    w = CaptureWriter(disk / "capture", rate=1.0, key="k")
    body = {"model": "m", "prompt": "x" * 300}
    for _ in range(5):
        w.record(body, "m", "10.0.0.1", [1, 2], None)
    filler = fill(disk)
    with caplog.at_level(logging.WARNING, logger="scratchllm.evaluate.capture"):
        for _ in range(40):
            w.record(body, "m", "10.0.0.1", [1, 2], None)  # never raises
        # the file's last page may still take a line or two; then nothing fits
        assert w.num_dropped >= 35 and w.num_written + w.num_dropped == 45
        assert sum("could not write" in r.message for r in caplog.records) == 1
        assert len(_lines(disk / "capture")) == w.num_written
        filler.unlink()
        w.record(body, "m", "10.0.0.1", [1, 2], None)
        assert sum("again" in r.message for r in caplog.records) == 1
    w.close()
    assert len(_lines(disk / "capture")) == w.num_written == 46 - w.num_dropped


def test_capture_cut_line_is_cut_off_again(disk):
    # a line bigger than the room left: the write gets part of it in, then ENOSPC
    w = CaptureWriter(disk / "capture", rate=1.0, key="k", max_bytes=1 << 20)
    w.record({"model": "m", "prompt": "first"}, "m", None, None, None)
    fill(disk)
    (disk / "filler").write_bytes(b"\0" * ((disk / "filler").stat().st_size - 8192))  # 8 KiB of room
    w.record({"model": "m", "prompt": "y" * 50_000}, "m", None, None, None)
    assert w.num_dropped == 1
    w.close()
    assert [line["body"]["prompt"] for line in _lines(disk / "capture")] == ["first"]


def test_server_with_capture_on_a_full_disk_answers_every_request(disk, serve):
    capture = CaptureWriter(disk / "capture", rate=1.0, key="k")
    fill(disk)
    model, embedder = fake_backend(step_ms=1.0, max_running=4)
    app = create_app(model, embedder, ServerConfig(max_in_flight=32), capture=capture)
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        statuses = []
        for i in range(12):
            body = {"model": "fake", "prompt": f"p{i}", "max_tokens": 4, "stream": i % 2 == 0}
            statuses.append(c.post("/v1/completions", json=body).status_code)
    assert statuses == [200] * 12
    assert capture.num_dropped == 12 and _lines(disk / "capture") == []


# --- the panel cache ---------------------------------------------------------------------------
def _panels(rows: int) -> packed_gemm.Q8Panels:
    rng = np.random.default_rng(0)
    q = rng.integers(-127, 128, size=(4, rows, packed_gemm.NR), dtype=np.int8)
    return packed_gemm.Q8Panels(q, np.ones((4, rows // 32, packed_gemm.NR), np.float32), None, True)


def test_panel_cache_on_a_full_disk_leaves_no_file_and_later_loads_pack_again(disk, tmp_path, caplog):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"not really a model")
    (disk / "panels").mkdir()
    fill(disk)
    cache = PanelCache(model, disk / "panels")
    cache.put("w", _panels(1024))  # 4 * 1024 * NR bytes: more than the whole disk
    with caplog.at_level(logging.WARNING, logger="scratchllm.models.panel_cache"):
        cache.save()  # never raises: loading works without a cache
    assert sum("could not write the panel cache" in r.message for r in caplog.records) == 1
    assert list((disk / "panels").iterdir()) == []  # neither a cache nor its temporary file
    assert PanelCache(model, disk / "panels").hits == {}


def test_panel_cache_cut_short_is_not_trusted(tmp_path, caplog):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"not really a model")
    cache = PanelCache(model, tmp_path / "panels")
    cache.put("w", _panels(64))
    cache.save()
    assert set(PanelCache(model, tmp_path / "panels").hits) == {"w"}
    data = cache.path.read_bytes()
    cache.path.write_bytes(data[: len(data) - 4096])  # what a half-written file would look like
    with caplog.at_level(logging.WARNING, logger="scratchllm.models.panel_cache"):
        assert PanelCache(model, tmp_path / "panels").hits == {}
    assert any("unreadable panel cache" in r.message for r in caplog.records)


# --- the evaluation run file -------------------------------------------------------------------
def test_run_file_on_a_full_disk_keeps_its_committed_rows(disk, caplog):
    path = disk / "run.db"
    store = RunStore(path, create=True)
    store.create_run("capture", "http://a", "http://b", "http://c", {})
    body = {"model": "m", "prompt": "z" * 2000}
    committed = 0
    with caplog.at_level(logging.WARNING, logger="scratchllm.evaluate.store"), \
            pytest.raises(RunFileError, match="run.db"):
        for i in range(10_000):
            store.add_request(i, "/v1/completions", "capture", body, body, "k")
            committed += 1
    assert committed > 10
    with pytest.raises(RunFileError):  # every later write says so too, but the log only once
        store.add_request(-1, "/v1/completions", "capture", body, body, "k")
    assert sum("cannot write" in r.message for r in caplog.records) == 1
    assert len(store.requests()) == committed  # reads go on
    store.close()
    again = RunStore(path)
    assert len(again.requests()) == committed
    again.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
