"""The router's client connections: a header deadline and a connection cap on uvicorn's h11 protocol.

Role: uvicorn (h11) bounds the size of a request's headers (h11's 16 KiB) and the idle time between
two requests (`timeout_keep_alive`), but not the time a request's headers take: a client that sends
a header byte every few seconds holds its connection for ever, and `limit_concurrency` refuses
work only once headers are complete. `GuardedH11Protocol` adds both:

- a request's headers must all be in `header_timeout_s` after the connection opens (or after the
  first byte of a kept-alive connection's next request); past it the client gets a 408 and the
  connection is closed;
- a connection that would make more than `max_connections` open at once gets a 503 and is closed
  before anything of it is read.

Each cut is reported to `on_cut(kind)` (`header_timeout`, `connection_limit`: the router counts them
in `kvdepot_route_errors_total`). The body's deadline is the RequestGuard's (api/http/guard.py):
an ASGI app sees the body, not the headers.

State: per connection, the header timer; the connection set is uvicorn's (shared by the server).
Runs on the server's event loop.

Primitives: GuardedH11Protocol.with_limits(ConnectionLimits(...)) -> a protocol class for
uvicorn.Config(http=...).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["ConnectionLimits", "GuardedH11Protocol"]


def _ignore(kind: str) -> None:
    return None


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout_s: float
    max_connections: int
    on_cut: Callable[[str], None] = _ignore


def _answer(status: int, reason: str, code: str, message: str) -> bytes:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    limits: ClassVar[ConnectionLimits] = ConnectionLimits(header_timeout_s=10.0, max_connections=1024)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    @classmethod
    def with_limits(cls, limits: ConnectionLimits) -> type[GuardedH11Protocol]:
        return type("GuardedH11Protocol", (cls,), {"limits": limits})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.limits.on_cut("connection_limit")
            message = f"more than {self.limits.max_connections} connections are open (max_connections)"
            transport.write(_answer(503, "Service Unavailable", "overloaded", message))
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE:  # a request begun, its headers not all in
            self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # still answering the previous request: its deadlines are the app's
        self.limits.on_cut("header_timeout")
        message = f"the request's headers did not arrive within {self.limits.header_timeout_s} s"
        self.transport.write(_answer(408, "Request Timeout", "header_timeout", message))
        self.transport.close()
