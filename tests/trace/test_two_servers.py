"""Two servers on one machine, each with the trace as it comes by default: each writes a ring of
its own (named after its port, the one its chat page names), one is SIGKILLed mid-stream, and afterwards both rings read
whole: the killed server's last tokens are there, nothing was rotated, and `trace watch` lists
both rings and asks which."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from scratchllm.trace import TokenFlag, request_key
from scratchllm.trace.views.analysis import Trace

ROOT = Path(__file__).resolve().parents[2]


def start_server(env: dict, log: Path) -> tuple[subprocess.Popen, str, Path]:
    """`scratchllm serve default` with the trace's defaults; (process, URL, its ring) once it
    says both (its stderr goes to `log`, read as it grows)."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "scratchllm.cli.main", "serve", "default", "--port", "0",
                                 "--embedding-model", "none", "--threads", "1"], stderr=out, env=env, cwd=ROOT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        text = log.read_text()
        url, ring = re.search(r"on (http://\S+)", text), re.search(r"token trace in (\S+) ", text)
        if url and ring:
            return proc, url.group(1), Path(ring.group(1))
        assert proc.poll() is None, f"the server exited: {text}"
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"the server did not start: {log.read_text()}")


@pytest.mark.slow
def test_two_default_servers_keep_their_own_rings_and_a_killed_one_s_last_tokens(tmp_path):
    folder = tmp_path / "tmp"
    folder.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "SCRATCHLLM_TRACE"}
    env.update(TMPDIR=str(folder), PYTHONPATH=str(ROOT))
    a, url_a, ring_a = start_server(env, tmp_path / "a.log")
    b = None
    try:
        b, url_b, ring_b = start_server(env, tmp_path / "b.log")
        port_a, port_b = (int(u.rsplit(":", 1)[1]) for u in (url_a, url_b))
        assert ring_a == folder / f"scratchllm-trace-{os.getuid()}-{port_a}.ring"
        assert ring_b == folder / f"scratchllm-trace-{os.getuid()}-{port_b}.ring"
        for url, ring in ((url_a, ring_a), (url_b, ring_b)):  # each chat page names the ring its server writes
            assert json.dumps({"trace_ring": str(ring)}) in httpx.get(url + "/", timeout=10).text
        done = httpx.post(url_a + "/v1/completions", json={"model": "default", "prompt": "The capital of France is",
                                                           "max_tokens": 8, "temperature": 0, "ignore_eos": True},
                          timeout=60).json()
        # B streams a long answer; it is killed after ten tokens reached the client
        body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        received, rid = 0, None
        with httpx.stream("POST", url_b + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    rid = chunk["id"]
                    received += 1 if chunk["choices"][0]["text"] else 0
                    if received >= 10:
                        b.send_signal(signal.SIGKILL)
                        break
        b.wait(30)
        assert b.returncode == -signal.SIGKILL
        watch = subprocess.run([sys.executable, "-m", "scratchllm.cli.main", "trace", "watch", "--once"],
                               capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
        assert watch.returncode == 2 and "2 trace rings, which one?" in watch.stderr
        assert f"{ring_a}  pid {a.pid}, port {port_a}, default; started" in watch.stderr
        assert f"{ring_b}  pid {b.pid}, port {port_b}, default; started" in watch.stderr
        assert "died without closing it" in watch.stderr and "; running" in watch.stderr
        a.send_signal(signal.SIGTERM)
        assert a.wait(60) == 0
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert sorted(p.name for p in folder.iterdir()) == sorted([ring_a.name, ring_b.name])  # no .prev: none rotated
    killed, kept = Trace.load(ring_b), Trace.load(ring_a)
    assert (killed.pid, killed.writer_state, kept.pid, kept.writer_state) == (b.pid, "died", a.pid, "closed")
    assert killed.models == kept.models == {1: "default"}
    mine = killed.tokens[killed.tokens["request"] == request_key(rid)]
    assert len(mine) >= received and mine["position"].tolist() == list(range(len(mine)))
    assert not (mine["flags"] & TokenFlag.FINISHED).any() and set(mine["model"].tolist()) == {1}
    theirs = kept.tokens[kept.tokens["request"] == request_key(done["id"])]
    assert len(theirs) == done["usage"]["completion_tokens"] == 8
    assert theirs["flags"][-1] & TokenFlag.FINISHED and np.all(np.diff(theirs["position"]) == 1)
