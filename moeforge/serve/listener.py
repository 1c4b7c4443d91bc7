"""``bind_listeners(host, port)``: the server's listening sockets, bound before the model loads (and before a sharded
artifact's ranks start), so that an address the server cannot have (a port in use or privileged, a host that is not
this machine's, a port out of range) is a ``MoeforgeError`` at once (exit code 2), not a uvicorn log line or an
``OverflowError`` traceback after the load. uvicorn then serves on exactly these sockets (``Server.run(sockets)``).

The sockets are bound as asyncio's ``create_server(host, port)`` binds them, which uvicorn would otherwise call:
every address the host resolves to (``localhost``: IPv4 and IPv6), ``SO_REUSEADDR`` (a restart does not wait out
TIME_WAIT), IPv6 sockets IPv6-only (the IPv4 address has its own), and no host (``""``) for every interface.
"""

from __future__ import annotations

import errno
import socket

from moeforge.core.errors import MoeforgeError

MAX_PORT = 65535
_WHY = {errno.EADDRINUSE: "the port is in use (by another server, or one that is still closing): pick another "
                          "--port, or stop that server",
        errno.EACCES: "permission denied (ports below 1024 need privileges): pick --port 1024 or above",
        errno.EADDRNOTAVAIL: "the address is not one of this machine's: pick another --host (127.0.0.1: this machine "
                             "only; 0.0.0.0: every interface)"}


def bind_listeners(host: str, port: int) -> list[socket.socket]:
    """Bound (not yet listening) TCP sockets for ``host``:``port`` (0: a free port); a ``MoeforgeError`` naming
    --host / --port when the address cannot be had. The caller closes them (uvicorn does once it serves on them)."""
    where = f"{host or '*'}:{port}"
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= MAX_PORT:
        raise MoeforgeError(f"--port must be in 0..{MAX_PORT} (0: any free port), got {port!r:.24}")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:  # socket.gaierror is an OSError; UnicodeError: a label over 63 chars
        raise MoeforgeError(f"cannot listen on {where}: --host {host!r} is not an address or a name this machine "
                            f"resolves ({exc}); use e.g. 127.0.0.1 or 0.0.0.0") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):  # in order, each address once
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                why = _WHY.get(exc.errno or 0, exc.strerror or str(exc))
                raise MoeforgeError(f"cannot listen on {where}: {why}") from None
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets
