"""Loopback networking helpers, importable without the runtime (tests, benchmarks, the launcher)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` free now (the OS picks it): a rendezvous or server port for a process started here."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port
