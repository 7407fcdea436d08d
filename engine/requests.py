"""Per-request state: what a LOOKUP holds for its request until the request has read it.

State: (engine id, request id) -> RequestState (the read-locked objects in chunk order, the lease
deadline, the handle of the prefetch bringing more of them from L2). Engine ids belong to one
engine instance (engine/registry.py), so a request is its instance's. No record of expired
requests is kept: a late RELEASE learns whether its copy is safe from the generation check (the
objects it copied from are still alive, engine/l1/cache.py `alive`). Owned by the event
loop. Read locks are taken and dropped here only, through the L1 cache. A state that is replaced
(a newer lookup), released, ended or reaped is no longer current: its prefetch attaches nothing
more to it (the chunks it still brings stay in L1 as ordinary objects).

Primitives in call order:
  lookup(rid, found, now)   the request's new state: locks kept on chunks found again, taken on
                            the others, dropped on what it held and no longer found
  keep(rid, state)          the state is kept (it holds locks, or it waits for a prefetch)
  state.prefetch = handle   the prefetch started for it (engine/l2/prefetch.py)
  attach(state, obj, now)   a prefetched chunk arrived, in order: read-locked if still current
  get(rid) / settle(rid)    the current state; a finished prefetch that brought nothing is dropped
  release(rid, epoch)       drop the request's state and locks -> how many were held (with the
                            epoch of a state since replaced: nothing)
  reap(now)                 -> requests whose lease expired (locks dropped)
  release_engines(ids)      the requests of these engines are dropped (their instance is gone)
  release_holder(holder)    the requests a client session took part in (LOOKUP or RETRIEVE) are
                            dropped (it is suspect) -> their ids
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from engine.l1.cache import L1Cache
from engine.l1.lifecycle import L1Object
from engine.l2.prefetch import Prefetch

RequestId = tuple[int, str]


@dataclass(eq=False, slots=True)
class RequestState:
    objects: list[L1Object]
    """Read-locked, in chunk order: the request's hit so far."""
    deadline: float
    """The read lease: reaped at this time unless the request read and released it."""
    prefetch: Prefetch | None = None
    current: bool = True
    holders: set[int] = field(default_factory=set)
    """The client sessions that looked it up or retrieved from it (0: none named)."""
    epoch: int = 0
    """Which LOOKUP made it (unique in the table's life): a RELEASE names the one it copied for."""

    @property
    def pending(self) -> int:
        """Chunks its prefetch may still bring."""
        p = self.prefetch
        return 0 if p is None or p.finished else p.trying - p.loaded


class RequestTable:
    def __init__(self, cache: L1Cache, read_lease_s: float) -> None:
        self.cache = cache
        self.read_lease_s = read_lease_s
        #: the current state of every request that holds locks or waits for a prefetch
        self.locks: dict[RequestId, RequestState] = {}
        self._epochs = itertools.count(1)

    def __len__(self) -> int:
        return len(self.locks)

    def get(self, rid: RequestId) -> RequestState | None:
        return self.locks.get(rid)

    def lookup(self, rid: RequestId, found: list[L1Object], now: float) -> RequestState:
        """Replace the request's state by one holding `found` (a repeated lookup: the scheduler
        asks again while a request waits). Locks it already holds on the same chunks are kept
        rather than dropped and retaken. The new state is not kept until `keep`."""
        previous = self._drop(rid)
        held = previous.objects if previous is not None else []
        cache = self.cache
        for i, obj in enumerate(found):
            if i >= len(held) or held[i] is not obj:
                cache.lock(obj, now)
        for i, obj in enumerate(held):
            if i >= len(found) or found[i] is not obj:
                cache.unlock(obj)
        return RequestState(found, now + self.read_lease_s, epoch=next(self._epochs))

    def keep(self, rid: RequestId, state: RequestState) -> None:
        self.locks[rid] = state

    def attach(self, state: RequestState, obj: L1Object, now: float) -> bool:
        """A prefetched chunk arrived, in order: read-lock it for the request, if the state is
        still current (False: the request moved on), and renew the lease."""
        if not state.current:
            return False
        self.cache.lock(obj, now)
        state.objects.append(obj)
        state.deadline = now + self.read_lease_s
        return True

    def settle(self, rid: RequestId) -> RequestState | None:
        """The current state; one whose prefetch finished without bringing anything (and that
        holds nothing) is dropped: nothing is left to keep for the request."""
        state = self.locks.get(rid)
        if state is not None and state.prefetch is not None and state.prefetch.finished:
            state.prefetch = None
            if not state.objects:
                self._drop(rid)
        return state

    def epoch(self, rid: RequestId) -> int:
        """The epoch of the request's current state (0: it has none)."""
        state = self.locks.get(rid)
        return 0 if state is None else state.epoch

    def release(self, rid: RequestId, epoch: int = 0) -> int:
        """Drop the request's state and its read locks. Returns how many locks it held. With an
        `epoch` other than the current state's, nothing is dropped (-1): that state was replaced."""
        if epoch and self.epoch(rid) not in (0, epoch):
            return -1
        state = self._drop(rid)
        if state is None:
            return 0
        for obj in state.objects:
            self.cache.unlock(obj)
        return len(state.objects)

    def reap(self, now: float) -> int:
        """Drop the states whose lease expired; returns how many held locks."""
        expired = 0
        for rid in [rid for rid, state in self.locks.items() if state.deadline <= now]:
            if not self.locks[rid].objects:
                self._drop(rid)  # held nothing: nothing a late reader could miss
                continue
            self.release(rid)
            expired += 1
        return expired

    def release_engines(self, engine_ids: set[int]) -> int:
        """Drop the states and locks of every request of `engine_ids`. Returns how many."""
        rids = [rid for rid in self.locks if rid[0] in engine_ids]
        for rid in rids:
            self.release(rid)
        return len(rids)

    def release_holder(self, holder: int) -> list[RequestId]:
        """Drop the states and locks of the requests `holder` took part in. Returns their ids."""
        rids = [rid for rid, state in self.locks.items() if holder in state.holders]
        for rid in rids:
            self.release(rid)
        return rids

    def _drop(self, rid: RequestId) -> RequestState | None:
        state = self.locks.pop(rid, None)
        if state is not None:
            state.current = False
        return state
