"""Sessions: one per data-plane connection (ZMQ routing id), made by its HELLO.

State: routing id -> Session (id, engine instance, created, last seen, `on_closed` callbacks), in
least recently seen order; a counter for session ids. Owned by the event loop.

A session says which engine instance a connection acts for: the `instance` nonce of its HELLO
(shared by the engine's scheduler and worker processes), or, when HELLO gave none, a private
instance of this session alone (`private-<id>`: never valid hex, so no client can name it). A
second HELLO on the same connection replaces its session.

The table is bounded (`max_sessions`). ZMQ reports no disconnects, so when it is full the least
recently seen session idle for `idle_s` is closed to make room (its connection, if still there,
is told `hello_required` and says HELLO again; what its instance owns is not touched); if none is
that idle, the HELLO is refused (Overloaded). `Session.close()` runs the `on_closed` callbacks:
where later work learns that a client is gone (a lifeline closed), it closes its session.

Primitives in call order:
  hello(peer, instance, now)  -> Session (new, replacing this peer's previous one); Overloaded
  get(peer, now)              -> Session, marked seen; HelloRequired when the peer said no HELLO
  close(peer)                 the session ends (its callbacks run)
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from api.dataplane.errors import HelloRequired
from app.errors import Overloaded

log = logging.getLogger("kvdepot.dataplane")


@dataclass(eq=False, slots=True)
class Session:
    id: int
    peer: bytes
    instance: str
    """The engine instance this connection acts for (its HELLO's nonce, or a private one)."""
    created: float
    last_seen: float
    on_closed: list[Callable[[Session], None]] = field(default_factory=list)
    closed: bool = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for callback in self.on_closed:
            try:
                callback(self)
            except Exception:
                log.exception("session %d: an on_closed callback failed", self.id)


class SessionTable:
    def __init__(self, *, max_sessions: int, idle_s: float) -> None:
        self.max_sessions = max_sessions
        self.idle_s = idle_s
        self._sessions: OrderedDict[bytes, Session] = OrderedDict()
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._sessions)

    def hello(self, peer: bytes, instance: str, now: float) -> Session:
        self.close(peer)
        if len(self._sessions) >= self.max_sessions:
            oldest = next(iter(self._sessions.values()))
            if now - oldest.last_seen < self.idle_s:
                raise Overloaded(f"{self.max_sessions} connections are open (data_plane.max_sessions)")
            self.close(oldest.peer)
        sid = next(self._ids)
        session = Session(sid, peer, instance or f"private-{sid}", now, now)
        self._sessions[peer] = session
        return session

    def get(self, peer: bytes, now: float) -> Session:
        session = self._sessions.get(peer)
        if session is None:
            raise HelloRequired("say HELLO first on this connection (or again: the sidecar restarted)")
        session.last_seen = now
        self._sessions.move_to_end(peer)
        return session

    def close(self, peer: bytes) -> None:
        session = self._sessions.pop(peer, None)
        if session is not None:
            session.close()
