"""The session table: lifeline tokens, which sessions may be evicted, when an instance ends."""

from __future__ import annotations

import pytest

from api.dataplane.sessions import SessionTable
from app.errors import Overloaded


def table(max_sessions: int = 4) -> tuple[SessionTable, list[int], list[str]]:
    t = SessionTable(max_sessions=max_sessions, idle_s=10.0)
    closed: list[int] = []
    gone: list[str] = []
    t.on_session_closed.append(lambda s: closed.append(s.id))
    t.on_instance_gone.append(gone.append)
    return t, closed, gone


def test_a_token_admits_one_lifeline_of_an_open_session() -> None:
    t, _, _ = table()
    s = t.hello(b"a", "ab" * 8, 0.0)
    assert len(s.token) == 32 and t.hold(b"\x00" * 32) is None
    assert t.hold(s.token) is s and s.held
    assert t.hold(s.token) is None  # used
    other = t.hello(b"b", "ab" * 8, 0.0)
    t.close(b"b")
    assert t.hold(other.token) is None  # closed


def test_a_held_session_is_never_evicted_as_idle() -> None:
    t, closed, _ = table(max_sessions=2)
    held = t.hello(b"a", "", 0.0)
    t.hold(held.token)
    idle = t.hello(b"b", "", 0.0)
    t.hello(b"c", "", 100.0)  # full: the idle session without a lifeline goes, not the held one
    assert closed == [idle.id] and not held.closed
    t.hold(t.get(b"c", 100.0).token)
    with pytest.raises(Overloaded):
        t.hello(b"d", "", 1000.0)  # everyone left is held by a lifeline


def test_an_instance_ends_with_its_last_session_and_a_new_hello_keeps_it() -> None:
    t, closed, gone = table()
    a = t.hello(b"a", "cd" * 8, 0.0)
    b = t.hello(b"b", "cd" * 8, 0.0)
    again = t.hello(b"a", "cd" * 8, 1.0)  # the same connection says HELLO again
    assert closed == [a.id] and gone == []
    t.end(b)
    assert gone == []
    t.end(again)
    assert gone == ["cd" * 8] and len(t) == 0
    t.end(again)  # once
    assert closed == [a.id, b.id, again.id] and gone == ["cd" * 8]


def test_a_session_not_held_within_the_handshake_timeout_expires_with_its_instance() -> None:
    t = SessionTable(max_sessions=2, idle_s=600.0, handshake_s=5.0)
    gone: list[str] = []
    t.on_instance_gone.append(gone.append)
    held = t.hello(b"a", "ab" * 8, 0.0)
    t.hold(held.token)
    flood = [t.hello(b"b", "cd" * 8, 1.0)]
    with pytest.raises(Overloaded):
        t.hello(b"c", "ef" * 8, 5.9)  # full; the unheld one is not due yet (nor idle for idle_s)
    assert t.expire(5.9) == 0
    flood.append(t.hello(b"c", "ef" * 8, 6.0))  # due now: it goes, and makes room
    assert flood[0].closed and gone == ["cd" * 8] and t.expired == 1
    t.expire(1000.0)
    assert flood[1].closed and not held.closed and gone == ["cd" * 8, "ef" * 8]
    assert len(t) == 1 and t.hold(flood[1].token) is None  # its token admits no lifeline any more


def test_no_session_expires_in_a_table_without_lifelines() -> None:
    t = SessionTable(max_sessions=2, idle_s=600.0)
    s = t.hello(b"a", "", 0.0)
    assert t.expire(1e9) == 0 and not s.closed
