"""The gateway's HTTP socket, bound before anything else (torch- and starlette-free: `llmbus up`
checks its port with it before it starts the stack)."""

from __future__ import annotations

import socket


def bind(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound before the bus is touched: a port in use or a host that is not this
    machine's is a one-line error (uvicorn's own bind failure exits from inside its task, in tracebacks)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a restart reuses the port
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock
