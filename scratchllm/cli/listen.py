"""The listening socket of a command that serves HTTP (`serve`, `eval annotate`), bound before
anything is loaded or written: a port in use is one clear error at once, not a traceback after
the model has loaded."""

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


def url(sock: socket.socket) -> str:
    """http://HOST:PORT of a bound socket (the port it really got)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
