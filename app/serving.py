"""The HTTP listener of kvdepot's processes (`serve`, `directory`, `route`): the socket bound before
anything starts (a taken port is one ConfigError line) and uvicorn without its own signal handling
(each process owns SIGTERM/SIGINT and stops its server itself). The sidecar's and the directory's
client connections are bounded by their `http` settings (httpkit/connections.py: headers within
`header_timeout_s`, what is left of an answered body within `body_timeout_s`, `max_connections`
open at once); the router builds its own from its settings.

Primitives: bind_listener(host, port, keys) -> socket; QuietUvicorn(config).serve(sockets=[...]);
guarded_http(http_settings, on_cut) -> the protocol class for uvicorn.Config(http=...).
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Callable, Generator

import uvicorn

from app.errors import ConfigError
from app.settings import HttpSettings
from httpkit.connections import ConnectionLimits, GuardedH11Protocol


def _ignore(kind: str) -> None:
    return None


def guarded_http(
    http: HttpSettings, on_cut: Callable[[str], None] = _ignore
) -> type[GuardedH11Protocol]:
    """uvicorn's h11 protocol with the deadlines and the connection cap of `http`."""
    limits = ConnectionLimits(http.header_timeout_s, http.max_connections, on_cut, http.body_timeout_s)
    return GuardedH11Protocol.with_limits(limits)


class QuietUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling (it would re-raise the signal at exit): the process
    stops it with `request_exit` (or by setting `should_exit`)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    def request_exit(self) -> None:
        self.should_exit = True


def bind_listener(host: str, port: int, keys: str = "http.") -> socket.socket:
    """A TCP socket bound to host:port (IPv6 when the host has a colon), inheritable, not yet
    listening; ConfigError naming the settings (`keys` + host/port) when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"{keys}port: {host}:{port} is already in use") from None
        raise ConfigError(f"{keys}host/{keys}port: cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock
