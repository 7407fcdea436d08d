r"""Object lifecycle: the states of an L1 object and the only moves allowed between them.

    ABSENT --reserve--> WRITE_RESERVED --commit--> READY --lock--> READ_LOCKED(n) --lock/unlock-->
                             |                      |   ^                  |         READ_LOCKED(n+-1)
                           abort           evict/delete  \--unlock(last)--/
                             v                      v                      | unlock(last), doomed
                          DELETED          EVICTED/DELETED  <--------------/

A write reservation is invisible to readers. A "temporary" object (loaded from L2 for the requests
that asked for it) and a "doomed" one (cleared while locked; invisible to new readers) are deleted
when their last reader unlocks instead of going back to READY. `L1Object.apply` checks every move
against `TRANSITIONS` and raises `IllegalTransition` on any other, always (not only in debug builds).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.keys import ObjectKey


class ObjectState(enum.Enum):
    # Members are singletons: identity hashing (C-level) instead of Enum's hash of the name, which
    # is measurable on the lookup path (one table lookup per lock/unlock).
    __hash__ = object.__hash__

    ABSENT = "absent"
    WRITE_RESERVED = "write_reserved"
    READY = "ready"
    READ_LOCKED = "read_locked"
    EVICTED = "evicted"
    DELETED = "deleted"


class Event(enum.Enum):
    __hash__ = object.__hash__

    RESERVE = "reserve"
    COMMIT = "commit"
    ABORT = "abort"
    LOCK = "lock"
    UNLOCK = "unlock"
    EVICT = "evict"
    DELETE = "delete"


S = ObjectState
E = Event

#: (state, event) -> states the event may lead to; which one is decided by the lock count / doom.
TRANSITIONS: dict[tuple[ObjectState, Event], frozenset[ObjectState]] = {
    (S.ABSENT, E.RESERVE): frozenset({S.WRITE_RESERVED}),
    (S.WRITE_RESERVED, E.COMMIT): frozenset({S.READY}),
    (S.WRITE_RESERVED, E.ABORT): frozenset({S.DELETED}),
    (S.READY, E.LOCK): frozenset({S.READ_LOCKED}),
    (S.READ_LOCKED, E.LOCK): frozenset({S.READ_LOCKED}),
    (S.READ_LOCKED, E.UNLOCK): frozenset({S.READ_LOCKED, S.READY, S.DELETED}),
    (S.READY, E.EVICT): frozenset({S.EVICTED}),
    (S.READY, E.DELETE): frozenset({S.DELETED}),
}

TERMINAL = frozenset({S.EVICTED, S.DELETED})


class IllegalTransition(RuntimeError):
    """A move the table does not allow. Always a bug in the caller."""


@dataclass(eq=False, slots=True)
class L1Object:
    """One chunk in L1: its key, its extent in the arena and its lifecycle."""

    oid: int
    key: ObjectKey
    offset: int
    size: int
    state: ObjectState = S.ABSENT
    locks: int = 0
    doomed: bool = False
    temporary: bool = False
    in_l2: bool = False
    io_busy: bool = False  # a thread is copying into this reservation: never reap it meanwhile
    lease_deadline: float = 0.0
    last_access: float = 0.0

    def apply(self, event: Event) -> ObjectState:
        allowed = TRANSITIONS.get((self.state, event))
        if allowed is None:
            raise IllegalTransition(f"object {self.oid}: {event.value} not allowed in {self.state.value}")
        if event is E.LOCK:
            locks = self.locks + 1
            target = S.READ_LOCKED
        elif event is E.UNLOCK:
            locks = self.locks - 1
            if locks < 0:
                raise IllegalTransition(f"object {self.oid}: unlock without a lock")
            target = S.READ_LOCKED if locks else (S.DELETED if self.doomed or self.temporary else S.READY)
        else:
            locks = self.locks
            target = next(iter(allowed))
        if target not in allowed:
            raise IllegalTransition(f"object {self.oid}: {self.state.value} -> {target.value}")
        self.locks = locks
        self.state = target
        return target

    @property
    def visible(self) -> bool:
        """Readers may find it (ready or read-locked)."""
        return self.state is S.READY or self.state is S.READ_LOCKED

    @property
    def evictable(self) -> bool:
        return self.state is S.READY
