"""Sessions: one per data-plane connection (ZMQ routing id), made by its HELLO, held by a lifeline.

State: routing id -> Session (id, engine instance, lifeline token, whether its lifeline is open,
created, last seen, `on_closed` callbacks), in least recently seen order; token -> Session; the
sessions not held by a lifeline yet, in HELLO order; the number of open sessions per engine
instance; a counter for session ids. Owned by the event loop.

A session says which engine instance a connection acts for: the `instance` nonce of its HELLO
(shared by the engine's scheduler and worker processes), or, when HELLO gave none, a private
instance of this session alone (`private-<id>`: never valid hex, so no client can name it). Each
session gets a random lifeline token (32 bytes) that its HELLO reply hands the client: the client
process connects its lifeline (api/lifeline.py) with it, and from then on the lifeline's holder is
the session. When the lifeline closes (the process died, or closed it) the session is closed.

The table is bounded (`max_sessions`). ZMQ reports no disconnects, so a session whose lifeline is
not held within `handshake_s` of its HELLO (the lifeline's handshake timeout; a real client
connects it right after the HELLO reply) expires: `expire(now)`, which the server runs for every
frame, closes it, and with it its instance when it was the instance's last session (a flood of
HELLOs that never open a lifeline holds its places for seconds, not `idle_s`). When the table is
full all the same, the least recently seen session WITHOUT a lifeline idle for `idle_s` is closed
to make room (its connection, if still there, is told `hello_required` and says HELLO again); a
session with a live lifeline is never evicted. If none can go, the HELLO is refused (Overloaded).
`handshake_s` 0: no expiry (a table without lifelines). A second HELLO on the same connection
replaces its session (the new one is counted before the old one closes, so its instance does not
end in between).

Closing a session runs its `on_closed` callbacks, then the table's `on_session_closed` hooks
(what the session itself holds goes: its reservations, its quarantined memory); when it was the
last open session of its instance, the `on_instance_gone` hooks run (the instance's requests,
registrations, KV planes and sealed regions go).

Primitives in call order:
  hello(peer, instance, now)  -> Session (new, replacing this peer's previous one); Overloaded
  hold(token)                 -> the open Session of this token, now held by a lifeline; or None
  expire(now)                 -> sessions closed because no lifeline held them within handshake_s
  get(peer, now)              -> Session, marked seen; HelloRequired when the peer said no HELLO
  close(peer) / end(session)  the session ends (callbacks and hooks run)
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from api.dataplane.errors import HelloRequired
from app.errors import Overloaded

log = logging.getLogger("kvdepot.dataplane")

TOKEN_BYTES = 32
A = TypeVar("A")


@dataclass(eq=False, slots=True)
class Session:
    id: int
    peer: bytes
    instance: str
    """The engine instance this connection acts for (its HELLO's nonce, or a private one)."""
    created: float
    last_seen: float
    token: bytes = b""
    """The lifeline token its HELLO reply handed out (random, used once)."""
    held: bool = False
    """A lifeline holds it: never evicted as idle; closed when the lifeline closes."""
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
    def __init__(self, *, max_sessions: int, idle_s: float, handshake_s: float = 0.0) -> None:
        self.max_sessions = max_sessions
        self.idle_s = idle_s
        self.handshake_s = handshake_s
        #: sessions closed because their lifeline was not held in time (counted for /status)
        self.expired = 0
        #: run with every session that closed (after its own callbacks)
        self.on_session_closed: list[Callable[[Session], object]] = []
        #: run with an instance whose last open session closed
        self.on_instance_gone: list[Callable[[str], object]] = []
        self._sessions: OrderedDict[bytes, Session] = OrderedDict()
        self._tokens: dict[bytes, Session] = {}
        #: sessions not held by a lifeline yet, oldest HELLO first (what `expire` looks at)
        self._pending: OrderedDict[int, Session] = OrderedDict()
        self._instances: dict[str, int] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._sessions)

    def held(self) -> int:
        """Sessions held by a lifeline now."""
        return sum(1 for s in self._sessions.values() if s.held)

    def instances(self) -> int:
        return len(self._instances)

    def hello(self, peer: bytes, instance: str, now: float) -> Session:
        self.expire(now)
        previous = self._sessions.pop(peer, None)
        if previous is None and len(self._sessions) >= self.max_sessions:
            idle = next(
                (s for s in self._sessions.values() if not s.held and now - s.last_seen >= self.idle_s), None
            )
            if idle is None:
                raise Overloaded(f"{self.max_sessions} connections are open (data_plane.max_sessions)")
            self.close(idle.peer)
        sid = next(self._ids)
        token = secrets.token_bytes(TOKEN_BYTES)
        session = Session(sid, peer, instance or f"private-{sid}", now, now, token=token)
        self._sessions[peer] = session
        self._tokens[session.token] = session
        self._pending[sid] = session
        self._instances[session.instance] = self._instances.get(session.instance, 0) + 1
        if previous is not None:
            self.end(previous)
        return session

    def hold(self, token: bytes) -> Session | None:
        """The open session this token was handed to, now held by a lifeline (once: a token
        admits one lifeline). None for an unknown, used or closed one."""
        session = self._tokens.pop(token, None)
        if session is None or session.closed:
            return None
        session.held = True
        self._pending.pop(session.id, None)
        return session

    def expire(self, now: float) -> int:
        """Close the sessions whose lifeline was not held within `handshake_s` of their HELLO
        (oldest first; O(1) when none is due). Returns how many."""
        if self.handshake_s <= 0:
            return 0
        closed = 0
        while self._pending:
            session = next(iter(self._pending.values()))
            if now - session.created < self.handshake_s:
                break
            self.end(session)
            closed += 1
        if closed:
            self.expired += closed
            log.info("%d data-plane sessions expired: no lifeline within %.1f s", closed, self.handshake_s)
        return closed

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
            self.end(session)

    def end(self, session: Session) -> None:
        """Close `session` (once): its callbacks, the table's hooks, and its instance's end if it
        was the instance's last open session."""
        if session.closed:
            return
        if self._sessions.get(session.peer) is session:
            del self._sessions[session.peer]
        self._tokens.pop(session.token, None)
        self._pending.pop(session.id, None)
        session.close()
        _run(self.on_session_closed, session, "on_session_closed")
        left = self._instances.get(session.instance, 1) - 1
        if left > 0:
            self._instances[session.instance] = left
            return
        self._instances.pop(session.instance, None)
        _run(self.on_instance_gone, session.instance, "on_instance_gone")

    def close_all(self) -> None:
        for session in list(self._sessions.values()):
            self.end(session)


def _run(hooks: list[Callable[[A], object]], arg: A, what: str) -> None:
    for hook in hooks:
        try:
            hook(arg)
        except Exception:
            log.exception("a session %s hook failed", what)
