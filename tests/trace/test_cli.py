"""`scratchllm trace watch|heatmap|export` end to end, on simulated rings and on bad files."""

import json
import re
import subprocess
import sys

import pytest
from matplotlib import image

from scratchllm.cli.main import main

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
