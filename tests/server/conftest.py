"""A live server on loopback: uvicorn in a thread, on an ephemeral port, over the fake engine."""

import contextlib
import socket
import threading
import time

import pytest
import uvicorn

from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend


@contextlib.contextmanager
def live_server(app):
    """Serve `app` on 127.0.0.1:<free port> in a thread; yield the base URL; stop and join."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "server did not start in 10 s"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture(scope="module")
def fake_server():
    """(base_url, app) of a server over a fast fake engine."""
    model, embedder = fake_backend(step_ms=1.0, max_running=8)
    app = create_app(model, embedder, ServerConfig(max_in_flight=32, max_body_bytes=64 * 1024))
    with live_server(app) as url:
        yield url, app


@pytest.fixture
def serve():
    """The live_server context manager, for tests that need an app of their own."""
    return live_server


@pytest.fixture(scope="module")
def serve_module():
    """live_server for module-scoped fixtures (a real model is loaded once per module)."""
    return live_server
