"""`scratchllm trace watch|heatmap|export` end to end, on simulated rings and on bad files."""

import json
import os
import re
import subprocess
import sys

import pytest
from matplotlib import image

from scratchllm.cli.main import main
from scratchllm.errors import ConfigError

from .synthetic import Sim
from .test_processes import ROOT, start_writer


@pytest.fixture
def ring(tmp_path):
    path = tmp_path / "sim.ring"
    Sim(lengths=[30 + i for i in range(10)], stalls={8: (150.0, 0, 1)}).write(path)
    return path


def test_watch_once_prints_the_figures_and_the_retention(ring, capsys):
    assert main(["trace", "watch", str(ring), "--once", "--window", "1000"]) == 0
    out = capsys.readouterr().out
    assert "inter-token p50/p99" in out and "TTFT p50/p99" in out and "drops" in out
    assert re.search(r"tokens/s\s+\d+\.\d", out)
    assert "(writer pid" in out and "closed the ring" in out
    assert "retention: at the observed" in out and "at 1,000 tokens/s" in out


def test_watch_sees_a_live_writer_from_another_process(tmp_path):
    path = tmp_path / "live.ring"
    writer = start_writer(path, records=50_000, steps=2000, sleep_s=0.002)
    try:
        out = subprocess.run([sys.executable, "-m", "scratchllm.cli.main", "trace", "watch", str(path), "--once"],
                             capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "running" in out.stdout
        written = int(re.search(r"([\d,]+) records written", out.stdout).group(1).replace(",", ""))
        assert written > 0
    finally:
        writer.kill()
        writer.communicate()


def test_heatmap_writes_the_png_and_prints_the_diagnosis(ring, tmp_path, capsys):
    out = tmp_path / "h.png"
    assert main(["trace", "heatmap", str(ring), "-o", str(out), "--width", "800", "--height", "500"]) == 0
    printed = capsys.readouterr().out
    assert "vertical bands" in printed and "step 8" in printed
    assert image.imread(out).shape[:2] == (500, 800)


def test_export_writes_perfetto_json_within_a_window(ring, tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["trace", "export", str(ring), "-o", str(out), "--last", "0.1"]) == 0
    assert "events" in capsys.readouterr().out
    events = json.loads(out.read_text())["traceEvents"]
    full = tmp_path / "all.json"
    assert main(["trace", "export", str(ring), "-o", str(full)]) == 0
    assert 0 < len(events) < len(json.loads(full.read_text())["traceEvents"])


@pytest.mark.parametrize("content, message", [
    (None, "no such trace ring"),
    (b"not a ring" * 1000, "not a scratchllm trace ring"),
])
def test_bad_rings_are_one_line_errors(tmp_path, capsys, content, message):
    path = tmp_path / "bad.ring"
    if content is not None:
        path.write_bytes(content)
    for action in ("watch", "heatmap", "export"):
        extra = ["--once"] if action == "watch" else ["-o", str(tmp_path / "out")]
        assert main(["trace", action, str(path), *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and str(path) in err and "Traceback" not in err


def test_bad_options_are_named(ring, capsys):
    assert main(["trace", "export", str(ring), "--window", "abc"]) == 2
    assert "START:END" in capsys.readouterr().err
    assert main(["trace", "heatmap", str(ring), "--window", "5:1"]) == 2
    assert "is empty" in capsys.readouterr().err


@pytest.fixture
def ring_folder(tmp_path, monkeypatch):
    """The temporary directory the default rings go to, empty, and no $SCRATCHLLM_TRACE."""
    import tempfile

    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.delenv("SCRATCHLLM_TRACE", raising=False)
    return folder


def test_without_a_ring_the_live_one_is_read_and_several_are_listed_with_how_to_pick(ring_folder, capsys):
    from scratchllm.trace import TraceWriter
    from scratchllm.trace.format import default_ring_path

    assert main(["trace", "watch", "--once"]) == 2
    assert "no trace ring in" in capsys.readouterr().err
    first = TraceWriter(default_ring_path(port=8001), ring_bytes=1 << 20, port=8001)
    first.for_model("default")
    assert first.path.name.endswith("-8001.ring") and first.path.parent == ring_folder
    assert main(["trace", "watch", "--once"]) == 0  # one ring: read, no question
    assert f"{first.path}" in capsys.readouterr().out
    second = TraceWriter(default_ring_path(port=8002), ring_bytes=1 << 20, port=8002)
    second.for_model("gemma3-270m")
    second.for_model("qwen2.5-coder-0.5b")
    try:
        assert main(["trace", "watch", "--once"]) == 2
        err = capsys.readouterr().err
        assert "2 trace rings, which one?" in err and len(err.strip().splitlines()) == 1
        for ring, port, models in ((first, 8001, "default"), (second, 8002, "gemma3-270m, qwen2.5-coder-0.5b")):
            assert f"{ring.path}  pid {os.getpid()}, port {port}, {models}; started " in err
        assert "--port PORT" in err and "running" in err
        assert main(["trace", "watch", "--once", "--port", "8002"]) == 0
        out = capsys.readouterr().out
        assert str(second.path) in out and "port 8002" in out and "models: gemma3-270m, qwen2.5-coder-0.5b" in out
        assert main(["trace", "export", "--pid", "1", "-o", "x.json"]) == 2
        assert "no trace ring of pid 1" in capsys.readouterr().err
        first.close()  # a closed ring is a finished run: the running one is read without asking
        assert main(["trace", "watch", "--once"]) == 0
        assert str(second.path) in capsys.readouterr().out
    finally:
        second.close()


def test_on_a_terminal_the_rings_are_offered_to_choose_from(ring_folder, capsys):
    from scratchllm.cli.trace_cmd import choose_ring
    from scratchllm.trace import TraceWriter
    from scratchllm.trace.format import default_ring_path
    from scratchllm.trace.rings import find_rings

    with TraceWriter(default_ring_path(port=9001), ring_bytes=1 << 20, port=9001) as a, \
            TraceWriter(default_ring_path(), ring_bytes=1 << 20) as b:
        assert b.path.name.endswith(f"-pid-{os.getpid()}.ring")
        rings = find_rings()
        asked = []
        chosen = choose_ring(rings, interactive=True, ask=lambda q: asked.append(q) or "2")
        assert asked == ["which one? [1-2] "] and chosen == rings[1].path
        assert {r.path for r in rings} == {a.path, b.path}
        assert "1. " in capsys.readouterr().err
        with pytest.raises(ConfigError, match="no ring chosen"):
            choose_ring(rings, interactive=True, ask=lambda q: "x")


def test_a_two_model_ring_draws_a_panel_per_model_and_filters_by_model(tmp_path, capsys):
    from .test_views import two_model_ring

    ring = tmp_path / "two.ring"
    two_model_ring(ring)
    out = tmp_path / "h.png"
    assert main(["trace", "heatmap", str(ring), "-o", str(out), "--width", "900", "--height", "700"]) == 0
    printed = capsys.readouterr().out
    assert "'small' 8 x 40, 'large' 6 x 40" in printed
    assert "2 models, typical time per token 'small' 8.0 ms" in printed
    assert "contention" not in printed and "[small] no stalls" in printed and "[large] no stalls" in printed
    assert main(["trace", "heatmap", str(ring), "-o", str(out), "--model", "large"]) == 0
    printed = capsys.readouterr().out
    assert "6 requests x 40 positions" in printed and "2 models" not in printed
    assert main(["trace", "watch", str(ring), "--once", "--window", "1000"]) == 0
    printed = capsys.readouterr().out
    assert "model 'small':" in printed and "model 'large':" in printed
    assert main(["trace", "export", str(ring), "-o", str(tmp_path / "t.json"), "--model", "nope"]) == 2
    assert "no model 'nope' in this ring; its models: 'small', 'large'" in capsys.readouterr().err


def test_a_second_server_on_a_ring_in_use_takes_its_own_and_says_so(tmp_path, capsys):
    import argparse

    from scratchllm.cli.serve_cmd import serve_log, trace_writer
    from scratchllm.trace import TraceWriter

    path = tmp_path / "shared.ring"
    with TraceWriter(path, ring_bytes=1 << 20, port=8001):
        args = argparse.Namespace(trace=str(path), trace_ring_mb=1, _port=8002)
        second = trace_writer(args)
        try:
            assert second.path == tmp_path / f"shared.pid-{os.getpid()}.ring"
            assert capsys.readouterr().err == ""  # said after the address line, which scripts read first
            serve_log(args).ready("fake on http://127.0.0.1:8002")
            err = capsys.readouterr().err.splitlines()
            assert err == ["scratchllm serve: fake on http://127.0.0.1:8002",
                           f"scratchllm serve: the trace ring {path} is in use by another live writer (pid "
                           f"{os.getpid()}); this server writes {second.path}"]
            assert trace_writer(args) is second  # made once
        finally:
            second.close()
        assert not (tmp_path / "shared.ring.prev").exists()
