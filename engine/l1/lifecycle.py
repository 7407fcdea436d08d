r"""Object lifecycle: the states of an L1 object and the only moves allowed between them.

    ABSENT --reserve--> WRITE_RESERVED --commit--> READY --lock--> READ_LOCKED(n) --lock/unlock-->
                          |     |                   |   ^                  |         READ_LOCKED(n+-1)
               quarantine     abort        evict/delete  \--unlock(last)--/
                    v           v                   v                      | unlock(last), doomed
              QUARANTINED --free--> DELETED EVICTED/DELETED <--------------/

QUARANTINED: a client's write reservation whose lease expired while its writer may still be
alive (stalled) and copying. Its key is free for others at once and it can no longer be
committed, but its memory is neither freed nor reused until the writer is known gone (its
lifeline closed): a generation check cannot stop late bytes from landing, only fencing can.

A write reservation is invisible to readers. A "temporary" object (loaded from L2 for the requests
that asked for it) and a "doomed" one (cleared while held; invisible to new readers) are deleted
when the last reader or pin lets go instead of going back to READY.

Pins (pin/unpin: a copy to L2 reads the object's bytes) are counted apart from read locks and do
not change the state: a pinned object stays READY or READ_LOCKED, visible as before, but is never
evicted or deleted (EVICT or DELETE of a pinned object is illegal), and the last unlock of a pinned
temporary or doomed object leaves it READY until its last unpin. `L1Object.apply` checks every move
against `TRANSITIONS` and raises `IllegalTransition` on any other, always (not only in debug
builds). Only engine/l1 changes an L1Object; other packages read it.
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
    QUARANTINED = "quarantined"


class Event(enum.Enum):
    __hash__ = object.__hash__

    RESERVE = "reserve"
    COMMIT = "commit"
    ABORT = "abort"
    LOCK = "lock"
    UNLOCK = "unlock"
    EVICT = "evict"
    DELETE = "delete"
    PIN = "pin"
    UNPIN = "unpin"
    QUARANTINE = "quarantine"
    FREE = "free"


S = ObjectState
E = Event

#: (state, event) -> states the event may lead to; which one is decided by the lock count / doom.
TRANSITIONS: dict[tuple[ObjectState, Event], frozenset[ObjectState]] = {
    (S.ABSENT, E.RESERVE): frozenset({S.WRITE_RESERVED}),
    (S.WRITE_RESERVED, E.COMMIT): frozenset({S.READY}),
    (S.WRITE_RESERVED, E.ABORT): frozenset({S.DELETED}),
    (S.WRITE_RESERVED, E.QUARANTINE): frozenset({S.QUARANTINED}),
    (S.QUARANTINED, E.FREE): frozenset({S.DELETED}),
    (S.READY, E.LOCK): frozenset({S.READ_LOCKED}),
    (S.READ_LOCKED, E.LOCK): frozenset({S.READ_LOCKED}),
    (S.READ_LOCKED, E.UNLOCK): frozenset({S.READ_LOCKED, S.READY, S.DELETED}),
    (S.READY, E.EVICT): frozenset({S.EVICTED}),
    (S.READY, E.DELETE): frozenset({S.DELETED}),
    (S.READY, E.PIN): frozenset({S.READY}),
    (S.READ_LOCKED, E.PIN): frozenset({S.READ_LOCKED}),
    (S.READY, E.UNPIN): frozenset({S.READY, S.DELETED}),
    (S.READ_LOCKED, E.UNPIN): frozenset({S.READ_LOCKED}),
}

TERMINAL = frozenset({S.EVICTED, S.DELETED})


class IllegalTransition(RuntimeError):
    """A move the table does not allow. Always a bug in the caller."""


@dataclass(eq=False, slots=True)
class L1Object:
    """One chunk in L1: its key, its extent in the arena and its lifecycle."""

    oid: int
    """Random (62 bits), never reused while the object lives: names this object, not its extent."""
    key: ObjectKey
    offset: int
    size: int
    state: ObjectState = S.ABSENT
    locks: int = 0
    pins: int = 0
    doomed: bool = False
    temporary: bool = False
    in_l2: bool = False
    io_busy: bool = False  # a thread is copying into this reservation: never reap it meanwhile
    owner: str = ""  # the engine instance that reserved it ("" : the sidecar itself, e.g. L2 loads)
    holder: int = 0  # the client session that writes into the reservation (0: the sidecar writes)
    generated: bool = False  # holds KV of generated (decode) tokens: counted apart when committed
    hit: bool = False  # a lookup found it (announced once, in the LOOKUP event's `hits`)
    lease_deadline: float = 0.0
    last_access: float = 0.0

    def apply(self, event: Event) -> ObjectState:
        allowed = TRANSITIONS.get((self.state, event))
        if allowed is None:
            raise IllegalTransition(f"object {self.oid}: {event.value} not allowed in {self.state.value}")
        locks, pins = self.locks, self.pins
        if event is E.LOCK:
            locks += 1
            target = S.READ_LOCKED
        elif event is E.UNLOCK or event is E.UNPIN:
            if event is E.UNLOCK:
                locks -= 1
            else:
                pins -= 1
            if locks < 0 or pins < 0:
                raise IllegalTransition(f"object {self.oid}: {event.value} without a {event.value[2:]}")
            target = S.READ_LOCKED if locks else S.READY if pins or not self.transient else S.DELETED
        else:
            if event is E.PIN:
                pins += 1
            elif pins and (event is E.EVICT or event is E.DELETE):
                raise IllegalTransition(f"object {self.oid}: {event.value} while pinned")
            target = next(iter(allowed))
        if target not in allowed:
            raise IllegalTransition(f"object {self.oid}: {self.state.value} -> {target.value}")
        self.locks = locks
        self.pins = pins
        self.state = target
        return target

    @property
    def transient(self) -> bool:
        """Deleted, not kept, once nothing holds it (doomed, or temporary)."""
        return self.doomed or self.temporary

    @property
    def visible(self) -> bool:
        """Readers may find it (ready or read-locked)."""
        return self.state is S.READY or self.state is S.READ_LOCKED

    @property
    def held(self) -> bool:
        """Read-locked or pinned."""
        return self.locks > 0 or self.pins > 0

    @property
    def evictable(self) -> bool:
        return self.state is S.READY and not self.pins
