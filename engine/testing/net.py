"""Free local ports and ZeroMQ endpoints for tests and benchmarks (the OS picks a port nobody holds).

The port is free when this returns; another process may take it before the caller binds it (the usual
race of this idiom, which tests and benchmarks on one machine accept)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_endpoint() -> str:
    """tcp://127.0.0.1:<a free port>."""
    return f"tcp://127.0.0.1:{free_port()}"
