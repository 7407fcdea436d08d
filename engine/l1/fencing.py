"""Fencing: client write reservations of writers that may be stalled, quarantined instead of freed.

Role: L1Cache's (engine/l1/cache.py) reservations whose writer may still copy into them. A client's
write reservation (`holder` set at STORE) whose lease expires, or whose session went suspect, is
QUARANTINED, not freed: its writer may be stalled, not dead, and would go on copying into whatever
the extent became. Its key is free at once (a new reservation of it gets other memory) and COMMIT
of it is refused (lease expired); the memory is freed when the holder is known gone
(`release_holder`, when its lifeline closes), or object by object when the holder itself commits or
aborts it late (`writer_done`). Quarantined bytes are counted per instance and in total
(engine/l1/quarantine.py, which also bounds what may be reserved). The sidecar's own reservations
(holder 0) are aborted at expiry as ever.

State: the Quarantine; the cache's live reservations (oid -> object, shared with the cache) and
the cache's steps it was given (abort, forget the key, free the memory). Owned by the event loop,
through L1Cache only.

Primitives in call order:
  fence_holder(holder)         a client session is suspect: its reservations are quarantined
  reap(now)                    expired reservations: a client's quarantined, the sidecar's aborted
  writer_done(holder, oids)    its late COMMIT/ABORT: those of its quarantined objects are freed
  release_holder(holder)       a client session is gone: its reservations and quarantine go
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from engine.l1.lifecycle import Event, L1Object
from engine.l1.quarantine import Quarantine
from engine.tenants.ledger import TenantLedger
from engine.tenants.quota import L1

if TYPE_CHECKING:
    from engine.l1.results import L1Counters


class Fencing:
    def __init__(
        self, quarantine: Quarantine, reservations: dict[int, L1Object], *, counters: L1Counters,
        ledger: TenantLedger, aligned: Callable[[int], int], abort: Callable[[L1Object], None],
        forget: Callable[[L1Object], None], free: Callable[[L1Object], None],
    ) -> None:  # fmt: skip
        self.quarantine = quarantine
        self._reservations = reservations
        self._counters = counters
        self._ledger = ledger
        self._aligned = aligned
        self._abort = abort
        self._forget = forget
        self._free = free

    def fence_holder(self, holder: int) -> int:
        """The client session `holder` is suspect (silent: stalled or dying): its reservations
        are quarantined now, as if their lease expired. Returns how many."""
        mine = [o for o in self._reservations.values() if o.holder == holder and not o.io_busy]
        for obj in mine:
            self._fence(obj)
        return len(mine)

    def reap(self, now: float) -> int:
        """Reclaim write reservations whose lease expired: those a client writes into are
        quarantined (their writer may still be copying), the sidecar's own are aborted. Returns
        how many."""
        expired = [o for o in self._reservations.values() if o.lease_deadline <= now and not o.io_busy]
        for obj in expired:
            if obj.holder:
                self._fence(obj)
            else:
                self._abort(obj)
        self._counters.expired_reservations += len(expired)
        return len(expired)

    def writer_done(self, holder: int, oids: Iterable[int]) -> int:
        """The client session `holder` committed or aborted `oids` after their lease expired: it
        copies into them no more (a client commits once its copies are done), so those it holds
        quarantined are freed now instead of when its lifeline closes. The extents stay in the
        writer's own write domain (engine/l1/domains.py). Returns how many."""
        return self._unquarantine(self.quarantine.take(holder, oids)) if holder else 0

    def release_holder(self, holder: int) -> int:
        """The client session `holder` is gone (its lifeline closed: it writes no more): its
        reservations are dropped and its quarantined memory freed. Returns the reservations."""
        mine = [o for o in self._reservations.values() if o.holder == holder]
        for obj in mine:
            self._abort(obj)
        self._unquarantine(self.quarantine.take(holder))
        return len(mine)

    def _fence(self, obj: L1Object) -> None:
        """Quarantine a client's expired reservation: its key is free for others at once, it
        can no longer be committed, and its memory stays allocated (never reused, so late bytes
        of a stalled writer land nowhere else) until `release_holder(obj.holder)`."""
        del self._reservations[obj.oid]
        obj.apply(Event.QUARANTINE)
        self._forget(obj)
        charge = self._aligned(obj.size)
        self._ledger.credit(obj.key.salt, L1, charge)  # the tenant holds no chunk there any more
        self.quarantine.add(obj, charge)
        self._counters.quarantined += 1

    def _unquarantine(self, objects: list[L1Object]) -> int:
        for obj in objects:
            obj.apply(Event.FREE)
            self._counters.quarantine_freed += 1
            self._free(obj)
        return len(objects)
