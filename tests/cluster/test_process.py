"""`scratchllm serve --replicas 2` as a process, on a Ray cluster of its own (`--ray-address
local`): SIGTERM drains the open streams and exits 0 with a message, not Ray's stack dump; a model
that fails to load in the replicas is one line and a non-zero exit, not pages of tracebacks."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import scratchllm

pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(scratchllm.__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(*argv):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.Popen([sys.executable, "-m", "scratchllm.cli.main", "serve", "--replicas", "2",
                             "--ray-address", "local", *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_sigterm_drains_the_open_stream_and_exits_0_with_a_message():
    port = _free_port()
    proc = _serve("--fake-engine", "--fake-step-ms", "20", "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the cluster did not come up"
            time.sleep(0.5)
        lines: list[str] = []

        def read() -> None:  # 100 tokens at 20 ms: ~2 s of stream, cut in the middle by SIGTERM
            body = {"model": "fake", "prompt": "drain me", "max_tokens": 100, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                lines.extend(line for line in r.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.6)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        reader.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)  # drained, whole
    assert '"finish_reason":"length"' in lines[-2]  # all 100 tokens
    assert "SIGTERM: draining" in err and "stopped (drained)" in err, err
    assert "Traceback" not in err and "Stack (most recent call first)" not in err, err


def test_a_model_that_fails_to_load_in_the_replicas_is_one_line(tmp_path):
    from scratchllm.formats.refs import resolve_model

    # the header (config, tokenizer, tensor table) is whole, so the checks before Ray starts and
    # the ingress pass; one layer's tensor is renamed, so the model is missing it when a replica loads
    data = Path(resolve_model("default")).read_bytes()
    name = b"blk.15.attn_output.weight"
    assert data.count(name) == 1
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data.replace(name, b"blk.15.attn_outpuX.weight"))
    started = time.monotonic()
    proc = _serve(str(cut), "--embedding-model", "none", "--port", str(_free_port()))
    out, err = proc.communicate(timeout=280)
    print(f"failed deploy: exit {proc.returncode} after {time.monotonic() - started:.0f} s; stderr:\n{err}")
    assert proc.returncode == 2
    errors = [line for line in err.splitlines() if line.startswith("scratchllm serve: error:")]
    assert len(errors) == 1 and "the cluster did not start" in errors[0] and "cut.gguf" in errors[0], err
    assert "Traceback" not in err and len(err.splitlines()) < 15, err
