"""The ring across processes: a reader sees records while another process writes them, never
accepts a torn one, and after the writer is killed with SIGKILL reads every committed record."""

import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from scratchllm.trace import Kind, RingReader
from scratchllm.trace.format import HEADER_SIZE, RECORD_SIZE

from .writer_child import consistent

CHILD = Path(__file__).with_name("writer_child.py")
ROOT = Path(__file__).resolve().parents[2]


def start_writer(path, records: int, steps: int, sleep_s: float, seed: int = 0) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(CHILD), str(path), str(HEADER_SIZE + records * RECORD_SIZE),
                             str(steps), str(sleep_s), str(seed), str(progress_file(path))],
                            stdout=subprocess.PIPE, text=True, env=env)
    first = proc.stdout.readline()  # the ring exists once the first step is done
    assert first.strip() == "ready", first
    return proc


def progress_file(path) -> Path:
    return Path(str(path) + ".progress")


def test_a_reader_in_another_process_sees_records_while_they_are_written(tmp_path):
    path = tmp_path / "live.ring"
    proc = start_writer(path, records=100_000, steps=300, sleep_s=0.005)
    reader = RingReader(path)
    seen, reads_while_alive = [], 0
    while True:
        alive = proc.poll() is None
        got = reader.read_new()
        if len(got) and alive:
            reads_while_alive += 1
        seen.append(got.of(Kind.TOKEN))
        if not alive:
            break
        time.sleep(0.01)
    proc.communicate()
    assert proc.returncode == 0
    tokens = np.concatenate(seen)
    assert reads_while_alive >= 3  # records arrived in several reads, not all at the end
    assert consistent(tokens).all()
    np.testing.assert_array_equal(tokens["seq"], np.arange(1, reader.head() + 1))  # all, once, in order
    assert reader.lapped == reader.torn == 0


def test_a_reader_behind_a_fast_writer_drops_laps_but_never_accepts_a_torn_record(tmp_path):
    path = tmp_path / "small.ring"
    proc = start_writer(path, records=256, steps=20_000, sleep_s=0)
    reader = RingReader(path, from_start=False)
    accepted = 0
    lapped_early = False
    while proc.poll() is None:
        got = reader.read_new()
        tokens = got.of(Kind.TOKEN)
        assert consistent(tokens).all(), "a record whose fields disagree with its stamp got through"
        assert np.all(np.diff(tokens["seq"].astype(np.int64)) > 0)
        accepted += len(tokens)
        if accepted and not lapped_early:
            time.sleep(0.3)  # fall behind on purpose: the writer laps a 256-record ring many times
            lapped_early = True
    proc.communicate()
    assert accepted > 0 and reader.lapped > 256


def test_after_sigkill_every_committed_record_is_read_whole(tmp_path):
    rng = np.random.default_rng(13)
    for trial in range(3):
        path = tmp_path / f"crash{trial}.ring"
        cap = 5_000  # small enough to have wrapped many times by the kill
        proc = start_writer(path, records=cap, steps=10**7, sleep_s=0, seed=trial)
        time.sleep(float(rng.uniform(0.3, 1.0)))
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        (reported,) = struct.unpack("<Q", progress_file(path).read_bytes())
        reader = RingReader(path)
        head = reader.head()
        assert reader.writer_state() == "died"
        assert head >= reported > cap  # everything reported committed is in the ring
        got = reader.read_new()
        tokens = got.of(Kind.TOKEN)
        assert consistent(tokens).all()
        # the write in flight (one step: at most 32 records) may have zeroed the oldest slots it
        # was about to overwrite; every other record of the last `cap` is there, whole, in order
        lost = cap - len(tokens)
        assert 0 <= lost <= 32 and got.torn == 0 and got.lapped == lost
        np.testing.assert_array_equal(tokens["seq"], np.arange(head - len(tokens) + 1, head + 1))


def test_a_ring_in_use_is_never_rotated_nor_truncated_and_a_killed_writers_ring_is_kept(tmp_path):
    """A second writer on a live writer's path is refused (the first holds the file's lock) and
    leaves the file alone; once the first is SIGKILLed the lock is gone, and the next writer
    keeps the dead one's ring, every committed record in it, as PATH.prev."""
    import pytest

    from scratchllm.trace import TraceWriter
    from scratchllm.trace.reader import ring_locked
    from scratchllm.trace.writer import RingInUse

    path = tmp_path / "shared.ring"
    proc = start_writer(path, records=5_000, steps=10**7, sleep_s=0.001)
    try:
        inode = path.stat().st_ino
        assert ring_locked(path)
        with pytest.raises(RingInUse, match=f"in use by a live writer \\(pid {proc.pid}\\)") as err:
            TraceWriter(path, ring_bytes=HEADER_SIZE + 64 * RECORD_SIZE)
        assert err.value.pid == proc.pid
        assert path.stat().st_ino == inode and path.stat().st_size == HEADER_SIZE + 5_000 * RECORD_SIZE
        assert not path.with_name("shared.ring.prev").exists()
        assert RingReader(path).writer_state() == "running"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    (reported,) = struct.unpack("<Q", progress_file(path).read_bytes())
    assert not ring_locked(path) and RingReader(path).writer_state() == "died"
    with TraceWriter(path, ring_bytes=HEADER_SIZE + 64 * RECORD_SIZE) as second:
        assert second.path == path and path.stat().st_ino != inode
        old = RingReader(path.with_name("shared.ring.prev"))
        assert old.pid == proc.pid and old.writer_state() == "died" and old.head() >= reported
        tokens = old.read_new().of(Kind.TOKEN)
        assert consistent(tokens).all() and len(tokens) >= min(reported, 5_000) - 32
