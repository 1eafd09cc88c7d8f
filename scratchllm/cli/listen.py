"""The listening socket of a command that serves HTTP (`serve`, `eval annotate`), bound before
anything is loaded or written: a port in use is one clear error at once, not a traceback after
the model has loaded.

Invariant: the address a command prints is accepting connections. A bound socket that does not
yet listen refuses them, and the server's loop (uvicorn) only calls listen() once it runs, a
moment after the line; so `ready_url` listens first, and a client that connects as soon as it
reads the line waits in the backlog until the loop accepts it."""

import socket

from scratchllm.errors import ConfigError


def listen(host: str, port: int, what: str) -> socket.socket:
    """A socket bound to host:port (0 picks a free port), or ConfigError naming the address."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        hint = " (another server is there: stop it, or pick another --port)" if port else ""
        raise ConfigError(f"{what} cannot listen on {host}:{port}: {err.strerror}{hint}") from None
    return sock


def ready_url(sock: socket.socket) -> str:
    """Start queueing connections on a bound socket and return its http://HOST:PORT (the port it
    really got) for the line that tells scripts the server is ready."""
    sock.listen(socket.SOMAXCONN)
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
