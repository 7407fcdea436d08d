"""Free loopback TCP ports for the servers a test starts (sidecars, routers, Redis, receivers).

A port is free when asked; the server the test starts next binds it (a race with another process
is possible, and rare enough on a test machine). Scripts that run under another project's
interpreter (tests/e2e/drive_scheduler.py, in vLLM's venv) keep their own copy.
"""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports (all held open until every one is found)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """One free port."""
    (port,) = free_ports(1)
    return port
