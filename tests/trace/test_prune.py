"""Default rings outlive their writers, so they are pruned: a server that makes a default ring
removes the finished ones beyond the newest few (before it reserves its own space: the disk the
old ones filled is where the new one goes), never one a live writer holds, never a file
that is not a ring, never a ring named by the user; and a writer rotating a ring that was
removed (or replaced by a live one) meanwhile leaves the live one where it is."""

import errno
import os
import tempfile

import pytest

from scratchllm.cli.main import build_parser, main
from scratchllm.trace import RingReader, TraceWriter
from scratchllm.trace import writer as writer_module
from scratchllm.trace.format import HEADER_SIZE, RECORD_SIZE, ring_prefix
from scratchllm.trace.rings import KEEP_FINISHED, prune_rings
from scratchllm.trace.writer import RingInUse

SMALL = HEADER_SIZE + 16 * RECORD_SIZE


def finished_ring(path):
    """A ring whose writer closed it (a run that ended)."""
    TraceWriter(path, ring_bytes=SMALL).close()
    return path


def test_prune_keeps_the_newest_finished_rings_and_every_live_one(tmp_path):
    name = ring_prefix()
    live = TraceWriter(tmp_path / f"{name}pid-1.ring", ring_bytes=SMALL)  # the oldest of all, but running
    try:
        finished_ring(tmp_path / f"{name}8000.ring")
        finished_ring(tmp_path / f"{name}8000.ring")  # the first moves to ...8000.ring.prev: both count
        newer = [finished_ring(tmp_path / f"{name}{port}.ring") for port in (8001, 8002, 8003, 8004)]
        not_a_ring = tmp_path / f"{name}notes.ring"
        not_a_ring.write_bytes(b"not a ring at all" * 300)
        user_named = finished_ring(tmp_path / "mine.ring")

        removed = prune_rings(tmp_path, keep=4)

        assert sorted(removed) == [tmp_path / f"{name}8000.ring", tmp_path / f"{name}8000.ring.prev"]
        assert all(p.exists() for p in newer) and not_a_ring.exists() and user_named.exists()
        assert live.path.exists()
        live.tokens([1], [0], [5], [10], step=1)  # the live writer goes on writing its ring
        assert sorted(prune_rings(tmp_path, keep=0)) == newer  # a live ring stays even with none kept
        assert live.path.exists() and not_a_ring.exists() and user_named.exists()
    finally:
        live.close()
    with RingReader(live.path) as reader:
        assert reader.writer_state() == "closed" and reader.head() == 1


def test_a_ring_removed_while_a_writer_waits_for_its_lock_leaves_the_new_live_ring_in_place(tmp_path, monkeypatch):
    """Writer W opens the old ring at PATH to rotate it and waits for its lock; meanwhile the
    old ring is pruned and another writer L links its live ring at PATH. W must not rename L's
    ring to PATH.prev: it finds PATH taken by a live writer (RingInUse)."""
    path = finished_ring(tmp_path / f"{ring_prefix()}9000.ring")
    real_try_lock = writer_module._try_lock
    others: list[TraceWriter] = []

    def meanwhile(fd):
        if not others:
            assert prune_rings(tmp_path, keep=0) == [path]
            others.append(TraceWriter(path, ring_bytes=SMALL))  # L: a new live ring at the same path
        return real_try_lock(fd)

    monkeypatch.setattr(writer_module, "_try_lock", meanwhile)
    try:
        with pytest.raises(RingInUse):
            TraceWriter(path, ring_bytes=SMALL)
        assert path.exists() and not path.with_name(path.name + ".prev").exists()
        with RingReader(path) as reader:
            assert reader.writer_state() == "running"  # still L's ring, under its name
    finally:
        for other in others:
            other.close()


def test_serve_with_the_default_ring_prunes_the_rings_of_earlier_runs(tmp_path, monkeypatch, capsys):
    import uvicorn

    monkeypatch.delenv("SCRATCHLLM_TRACE", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the temporary directory, where default rings go
    earlier = [finished_ring(tmp_path / f"{ring_prefix()}pid-{n}.ring") for n in range(KEEP_FINISHED + 2)]
    seen = []

    def run(self, sockets=None):  # instead of serving: what the folder holds once the server is up
        seen.append(sorted(tmp_path.iterdir()))
        for sock in sockets:
            sock.close()

    monkeypatch.setattr(uvicorn.Server, "run", run)
    real_fallocate = os.posix_fallocate

    def disk_full_of_old_rings(fd, offset, size):  # the earlier rings filled the disk: no room while 5 are left
        if len(list(tmp_path.glob(f"{ring_prefix()}*.ring"))) > KEEP_FINISHED:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fallocate(fd, offset, size)

    monkeypatch.setattr(os, "posix_fallocate", disk_full_of_old_rings)
    assert main(["serve", "default", "--embedding-model", "none", "--threads", "1", "--port", "0"]) == 0

    assert len(seen) == 1  # the server ran with the two oldest rings gone and its own made
    assert [p for p in earlier if p.exists()] == earlier[2:]
    own = [p for p in seen[0] if p not in earlier]
    assert len(own) == 1 and own[0].name.startswith(ring_prefix())
    err = capsys.readouterr().err
    assert f"removed 2 trace ring(s) of earlier runs from {tmp_path}" in err
    assert f"token trace in {own[0]}" in err and "no token trace" not in err  # pruned first, then made
    serve_help = build_parser(only="serve")._subparsers._group_actions[0].choices["serve"].format_help()
    assert f"the newest {KEEP_FINISHED} are kept" in " ".join(serve_help.split())


def test_a_ring_rotated_while_prune_opens_it_leaves_the_new_live_ring_in_place(tmp_path, monkeypatch):
    """prune_rings reads a finished ring at PATH and opens it; before it takes the lock, a new
    writer rotates that ring to PATH.prev and links its live ring at PATH. prune must not remove
    the name of the live ring: the file it locked is no longer the one at PATH."""
    import fcntl

    from scratchllm.trace import rings

    path = finished_ring(tmp_path / f"{ring_prefix()}9100.ring")
    real_flock = fcntl.flock
    others: list[TraceWriter] = []
    started = []

    def meanwhile(fd, op):
        if op == fcntl.LOCK_EX | fcntl.LOCK_NB and not started:  # prune's lock (the writer's own go straight on)
            started.append(True)
            others.append(TraceWriter(path, ring_bytes=SMALL))  # rotates the old ring, links a live one
        return real_flock(fd, op)

    monkeypatch.setattr(rings.fcntl, "flock", meanwhile)
    try:
        assert prune_rings(tmp_path, keep=0) == []
        monkeypatch.undo()
        assert path.exists() and path.with_name(path.name + ".prev").exists()
        with RingReader(path) as reader:
            assert reader.writer_state() == "running" and reader.pid == os.getpid()
        assert prune_rings(tmp_path, keep=0) == [path.with_name(path.name + ".prev")]  # now the old one goes
    finally:
        for other in others:
            other.close()
