"""Client connections of kvdepot's HTTP servers (the sidecar's control plane, the directory, the
router): a header deadline, a deadline on a body left unread, and a connection cap on uvicorn's h11
protocol.

Role: uvicorn (h11) bounds the size of a request's headers (h11's 16 KiB) and the idle time between
two requests (`timeout_keep_alive`), but not the time a request's headers take: a client that sends
a header byte every few seconds holds its connection for ever, and `limit_concurrency` refuses
work only once headers are complete. Nor does it bound the rest of a body the app answered without
reading (a mutation refused 401, a GET that declared a body): each byte of it cancels uvicorn's
keep-alive timer. `GuardedH11Protocol` adds:

- a request's headers must all be in `header_timeout_s` after the connection opens (or after the
  first byte of a kept-alive connection's next request); past it the client gets a 408 and the
  connection is closed;
- once a request is answered, what is left of its body must be in within `body_timeout_s` (the
  header deadline when unset) of the answer; past it the connection is closed (the answer went);
- a connection that would make more than `max_connections` open at once gets a 503 and is closed
  before anything of it is read;
- a connection closed while its client is still sending a body (an answer given unread: 401, 413,
  408) lingers: the answer goes out with a FIN, what still arrives is read and dropped, for at most
  that same body deadline, then it is closed (closing with unread bytes resets the connection, and
  the client would lose the answer).

Each cut is reported to `on_cut(kind)` (`header_timeout`, `body_timeout`, `connection_limit`: the
router counts them in `kvdepot_route_errors_total`). The deadline of a body the app reads is the
RequestGuard's (httpkit/guard.py): an ASGI app sees the body, not the headers.

State: per connection, one timer; the connection set is uvicorn's (shared by the server).
Runs on the server's event loop.

Primitives: GuardedH11Protocol.with_limits(ConnectionLimits(...)) -> a protocol class for
uvicorn.Config(http=...).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

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
    body_timeout_s: float | None = None  # what is left of an answered request's body; None: headers'


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
        self._timer: asyncio.TimerHandle | None = None

    @classmethod
    def with_limits(cls, limits: ConnectionLimits) -> type[GuardedH11Protocol]:
        return type("GuardedH11Protocol", (cls,), {"limits": limits})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._lingering = _Lingering(transport, self)
        super().connection_made(cast(asyncio.Transport, self._lingering))
        if len(self.connections) > self.limits.max_connections:
            self.limits.on_cut("connection_limit")
            message = f"more than {self.limits.max_connections} connections are open (max_connections)"
            transport.write(_answer(503, "Service Unavailable", "overloaded", message))
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._lingering.lingering:
            return  # the rest of a body answered unread: dropped
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _answered_body_left(self) -> bool:
        """The request is answered but its body is still arriving (the app did not read it)."""
        return (
            self.cycle is not None and self.cycle.response_complete
            and self.conn.their_state is h11.SEND_BODY
        )  # fmt: skip

    def _watch(self) -> None:
        if self.transport.is_closing():
            return
        if self._answered_body_left():
            self._arm(self._body_deadline_s())
        elif self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._arm()  # a request begun, its headers not all in
        else:
            self._disarm()
            idle = self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)
            if idle and self.timeout_keep_alive_task is None:  # uvicorn's, cancelled by every byte
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )

    def _body_deadline_s(self) -> float:
        body_s = self.limits.body_timeout_s
        return self.limits.header_timeout_s if body_s is None else body_s

    def linger(self) -> None:
        """Close for good once the body deadline passes (unless the client closed first)."""
        self._disarm()
        self._timer = self.loop.call_later(self._body_deadline_s(), self._lingering.close_now)

    def _arm(self, delay: float | None = None) -> None:
        if self._timer is None:
            after = self.limits.header_timeout_s if delay is None else delay
            self._timer = self.loop.call_later(after, self._late)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _late(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self._answered_body_left():
            self.limits.on_cut("body_timeout")
            self._lingering.close_now()  # the answer went; the rest of the body is never read
            return
        if self.conn.their_state is not h11.IDLE:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # still answering the previous request: its deadlines are the app's
        self.limits.on_cut("header_timeout")
        message = f"the request's headers did not arrive within {self.limits.header_timeout_s} s"
        self.transport.write(_answer(408, "Request Timeout", "header_timeout", message))
        self.transport.close()


class _Lingering:
    """The connection's transport as uvicorn sees it: `close()` while the client is still sending
    a body half-closes instead (the answer, then a FIN), keeps reading (the protocol drops what
    arrives) and leaves the real close to the protocol's linger deadline or to the client."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self.lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        t = self._transport
        if self.lingering or t.is_closing():
            return
        if self._protocol.conn.their_state is not h11.SEND_BODY or not t.can_write_eof():
            t.close()
            return
        self.lingering = True
        t.write_eof()
        t.resume_reading()
        self._protocol.linger()

    def close_now(self) -> None:
        self.lingering = False
        self._transport.close()
