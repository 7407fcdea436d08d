"""L1Cache: the objects in the arena, their lifecycles, leases, eviction and tenant quotas.

State (owned by the event loop, no locks): key -> object for everything not terminal (two indexes,
engine/l1/index.py), oid -> object for every live object and for write reservations (oids are
random, 62 bits, drawn in batches by engine/l1/oids.py, never reused while their object lives;
each reservation records the engine instance that owns it), the allocator, the eviction policy,
counters, the tenant ledger it reports every object's memory into (charged from reservation until
freed; engine/tenants), and the room maker (engine/l1/room.py, holding the `Shedder` given at
construction: the write-behind queue, engine/l2/store_queue.py).
Only this package changes an L1Object; the L2 controllers go through the primitives below.

Primitives in call order:
  find(key)                      visible object or None (an access for the eviction policy)
  find_chain(ns, salt, hashes)   the visible objects of a chain of chunk hashes, up to the first
                                 missing one (an access for the policy); no key is built
  alive(oid)                     the object is still the same committed object (bytes unchanged)
  try_reserve(key, size, now[, temporary, owner])
                                 -> object in WRITE_RESERVED, or Refusal.QUOTA / Refusal.NO_SPACE
                                 (engine/l1/results.py, with the counters)
  busy_for_io(obj)               context: threads write into the reservation, never reap it
  owner_of(oid)                  the owner of a live reservation, or None
  commit(oid, now)               -> READY (LeaseExpired if the reservation was reclaimed)
  abort(obj)                     reservation dropped, memory freed
  lock(obj, now) / unlock(obj)   read locks; the last unlock of a doomed/temporary object frees it
  make_ordinary(obj)             a temporary object is kept after its last reader
  pin(obj) / unpin(obj, copied)  held for a copy to L2, apart from read locks (never evicted);
                                 records whether the object is in L2 (`in_l2`)
  fit_quota(salt)                evict the tenant's ready objects (policy order) down to its L1 limit
  bind_pins(kept)                keys held by prefix pins (engine/pins/): never evicted (deleted,
                                 cleared and purged all the same); a temporary object (prefetched
                                 from L2) of such a key is committed as an ordinary one
  evict(...) / delete(obj) / clear(...)
  fence_holder / reap / writer_done / release_holder
                                 stalled or gone writers (engine/l1/fencing.py; read locks: the facade)

Fencing (engine/l1/fencing.py): a client's write reservation whose lease expires, or whose session
went suspect, is quarantined, not freed (its writer may be stalled) until its holder is gone or done
with it. A client reservation taking its instance's quarantined and in-flight bytes past
`quarantine_max_bytes`, or everyone's past `quarantine_total_max_bytes`, is refused (no_space).

Events: a committed object that leaves is published as REMOVED (tier L1) on `events`: "evicted"
(room, quotas), "deleted" (delete, last reader or pin of a doomed or temporary object), or the
reason `delete`/`clear` are given; a reservation that never became visible announces nothing.

Write domains (engine/l1/domains.py; `domains`, for an arena of segments): a client's reservation
(`holder` set) goes in its engine instance's segments, the sidecar's own in the sidecar's;
`domains.freed` hears of every extent freed, after `fences` (engine/l1/fences.py) moved its words.

Room is made on reserve by the `RoomMaker` (engine/l1/room.py), which shares the allocator,
policy, ledger and counters: first within the tenant's L1 quota (its own ready objects in policy order, then
its chunks queued for write-behind; else QUOTA), then within the arena's watermarks (ready objects
of any tenant in policy order, then queued chunks of any tenant; else NO_SPACE).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence

from app.errors import LeaseExpired, NotFound
from engine.events import L1_TIER, EventBus, Kind
from engine.keys import Namespace, ObjectKey
from engine.l1.allocator import ExtentAllocator
from engine.l1.domains import SIDECAR, WriteDomains
from engine.l1.eviction import EvictionPolicy
from engine.l1.fences import ReleaseFences
from engine.l1.fencing import Fencing
from engine.l1.index import KeyIndex
from engine.l1.lifecycle import Event, L1Object, ObjectState
from engine.l1.oids import OidSource
from engine.l1.quarantine import Quarantine
from engine.l1.results import L1Counters, Refusal
from engine.l1.room import RoomMaker, Shedder
from engine.tenants.ledger import TenantLedger
from engine.tenants.quota import L1

__all__ = ["L1Cache", "L1Counters", "Refusal"]  # the cache's types (engine/l1/results.py) with it


class L1Cache:
    def __init__(
        self,
        allocator: ExtentAllocator,
        policy: EvictionPolicy,
        *,
        high_watermark: float,
        low_watermark: float,
        write_lease_s: float,
        ledger: TenantLedger | None = None,
        shedder: Shedder | None = None,
        quarantine_max_bytes: int | None = None,
        quarantine_total_max_bytes: int | None = None,
        events: EventBus | None = None,
        domains: WriteDomains | None = None,
    ) -> None:
        self.allocator = allocator
        #: who may write which segment (None: the arena is one segment anyone writes)
        self.domains = domains
        self.events = events if events is not None else EventBus(enabled=False)
        self.policy = policy
        self.fences: ReleaseFences | None = None  # words a reader checks after its copy; None: it asks
        #: usage per tenant; without one given, a ledger without quotas (everyone shares freely)
        self.ledger = ledger if ledger is not None else TenantLedger()
        self.write_lease_s = write_lease_s
        self.counters = L1Counters()
        self._index = KeyIndex()
        self._reservations: dict[int, L1Object] = {}
        self._by_oid: dict[int, L1Object] = {}
        self._oids = OidSource()
        self._room = RoomMaker(
            allocator, policy, self.ledger, self.counters, high=int(allocator.capacity * high_watermark),
            low=int(allocator.capacity * low_watermark), shedder=shedder, release=self._evicted,
            let_go=self._let_go, domains=domains,
        )  # fmt: skip
        capacity = allocator.capacity
        self.quarantine = Quarantine(
            capacity // 2 if quarantine_max_bytes is None else quarantine_max_bytes,
            capacity * 3 // 4 if quarantine_total_max_bytes is None else quarantine_total_max_bytes,
        )
        self._fencing = Fencing(
            self.quarantine, self._reservations, counters=self.counters, ledger=self.ledger,
            aligned=allocator.aligned, abort=self.abort, forget=self._index.forget,
            free=self._free_quarantined,
        )  # fmt: skip

    # --- queries -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def objects(self) -> Iterator[L1Object]:
        """Every live object (a snapshot): for whole-cache checks."""
        return iter(list(self._index.values()))

    def peek(self, key: ObjectKey) -> L1Object | None:
        """The object under `key` in any live state, without telling the eviction policy."""
        return self._index.get(key)

    def find(self, key: ObjectKey, now: float) -> L1Object | None:
        obj = self._index.get(key)
        if obj is None or not obj.visible or obj.doomed:
            return None
        obj.last_access = now
        self.policy.on_access(obj)
        return obj

    def find_chain(self, ns: Namespace, salt: str, hashes: Sequence[bytes], now: float) -> list[L1Object]:
        """What `find` gives for the keys (ns, salt, hashes[i]), i = 0.. up to the first None."""
        chain = self._index.chain(ns, salt)
        found: list[L1Object] = []
        if chain is None:
            return found
        get = chain.get
        ready, locked = ObjectState.READY, ObjectState.READ_LOCKED
        for h in hashes:
            obj = get(h)
            if obj is None or obj.doomed or (obj.state is not ready and obj.state is not locked):
                break
            found.append(obj)
        on_access = self.policy.on_access
        for obj in found:
            obj.last_access = now
            on_access(obj)
        return found

    def alive(self, oid: int) -> bool:
        """The object `oid` is committed and not yet freed: committed objects are immutable, so its
        bytes are those it was committed with (the generation check of a late reader)."""
        obj = self._by_oid.get(oid)
        return obj is not None and obj.visible

    def state_counts(self) -> dict[str, int]:
        counts = {
            s.value: 0 for s in (ObjectState.WRITE_RESERVED, ObjectState.READY, ObjectState.READ_LOCKED)
        }
        for obj in self._index.values():
            counts[obj.state.value] += 1
        return counts

    # --- writes --------------------------------------------------------------------------------

    def try_reserve(
        self, key: ObjectKey, size: int, now: float, *, temporary: bool = False, owner: str = "",
        holder: int = 0, generated: bool = False, overflow: str = "",
    ) -> L1Object | Refusal:  # fmt: skip
        """Reserve room for `key`, within its tenant's quota (see the module docstring). A
        temporary object, once committed, is deleted when its last reader lets go (`make_ordinary`
        keeps it). `owner`: the engine instance it belongs to; `holder`: the client session that
        writes into it (0: the sidecar itself); `generated`: it holds KV of generated tokens;
        `overflow`: for a write of the sidecar's (an L2 load), the engine instance whose write domain
        takes it when the sidecar's own segments have no room (its request asked for it: it counts
        as that engine's write)."""
        if key in self._index:
            raise ValueError("reserve of a key that is present")
        salt = key.salt
        charge = self.allocator.aligned(size)
        if self.quarantine.refuses(owner, charge if holder else 0):
            self.counters.quarantine_refused += 1
            return Refusal.NO_SPACE  # its stalled writers hold too much memory we cannot reuse
        ledger = self.ledger
        limit = ledger.limit(salt, L1)
        if limit is not None and not self._room.fit(salt, limit, charge):
            self.counters.quota_refused += 1
            ledger.note_refusal(salt, L1)
            return Refusal.QUOTA
        offset = self._room.allocate(size, owner if holder else SIDECAR)
        if offset is None and overflow and not holder and self.domains is not None:
            offset = self._room.allocate(size, overflow)
        if offset is None:
            self.counters.no_space += 1
            return Refusal.NO_SPACE
        oid = self._oids.next()
        while oid in self._by_oid:
            oid = self._oids.next()
        obj = L1Object(
            oid=oid, key=key, offset=offset, size=size, last_access=now, temporary=temporary, owner=owner,
            holder=holder, generated=generated,
        )  # fmt: skip
        obj.apply(Event.RESERVE)
        obj.lease_deadline = now + self.write_lease_s
        self._index.add(obj)
        self._reservations[oid] = obj
        self._by_oid[oid] = obj
        ledger.charge(salt, L1, charge)
        if holder:
            self.quarantine.reserved(owner, charge)  # a client writes it: it may end up quarantined
        self.counters.reserved += 1
        return obj

    def owner_of(self, oid: int) -> str | None:
        """The engine instance owning the live reservation `oid`; None when there is none."""
        obj = self._reservations.get(oid)
        return None if obj is None else obj.owner

    def commit(self, oid: int, now: float) -> L1Object:
        obj = self._reservations.pop(oid, None)
        if obj is None:
            raise LeaseExpired(f"reservation {oid} is unknown or its lease expired")
        if obj.holder:
            self.quarantine.settled(obj.owner, self.allocator.aligned(obj.size))
        obj.apply(Event.COMMIT)
        obj.last_access = now
        kept = self._room.kept
        if obj.temporary and kept is not None and kept(obj.key):
            obj.temporary = False  # a prefix pin holds it in L1: kept after its reader, as any other
        self.policy.on_insert(obj)
        self.counters.committed += 1
        if obj.doomed:  # cleared while being written: never visible, so nothing to announce
            obj.apply(Event.DELETE)
            self.counters.deleted += 1
            self._release(obj)
        return obj

    def abort(self, obj: L1Object) -> None:
        if self._reservations.pop(obj.oid, None) is not None and obj.holder:
            self.quarantine.settled(obj.owner, self.allocator.aligned(obj.size))
        obj.apply(Event.ABORT)
        self.counters.aborted += 1
        self._release(obj)

    @contextlib.contextmanager
    def busy_for_io(self, obj: L1Object) -> Iterator[None]:
        """Threads write into the reservation meanwhile: it is not reaped until the block ends."""
        obj.io_busy = True
        try:
            yield
        finally:
            obj.io_busy = False

    def make_ordinary(self, obj: L1Object) -> None:
        """Keep a temporary object when its last reader lets go, as any other."""
        obj.temporary = False

    def reservation(self, oid: int) -> L1Object:
        obj = self._reservations.get(oid)
        if obj is None:
            raise NotFound(f"reservation {oid} is unknown or its lease expired")
        return obj

    # --- reads ---------------------------------------------------------------------------------

    def lock(self, obj: L1Object, now: float) -> None:
        obj.apply(Event.LOCK)
        obj.last_access = now

    def unlock(self, obj: L1Object) -> None:
        if obj.apply(Event.UNLOCK) is ObjectState.DELETED:
            self.counters.deleted += 1
            self._removed(obj, "deleted")
            self._release(obj)

    # --- pins (copies to L2) -------------------------------------------------------------------

    def pin(self, obj: L1Object) -> None:
        """Hold a visible object for a copy to L2: never evicted, deleted or reused until unpinned.
        It counts as in L2 (`in_l2`) from now."""
        obj.apply(Event.PIN)
        obj.in_l2 = True

    def unpin(self, obj: L1Object, *, copied: bool) -> bool:
        """The copy is done (`copied`: it reached L2; if not, the object is no longer in L2 and a
        later commit or hit may copy it again). True when nothing holds the object any more."""
        obj.in_l2 = copied
        if obj.apply(Event.UNPIN) is ObjectState.DELETED:
            self.counters.deleted += 1
            self._removed(obj, "deleted")
            self._release(obj)
            return True
        return not obj.held

    def _let_go(self, obj: L1Object) -> bool:
        return self.unpin(obj, copied=False)

    # --- removal -------------------------------------------------------------------------------

    def delete(self, obj: L1Object, reason: str = "deleted") -> None:
        """Delete a ready object now, or doom a held or reserved one (freed on last unlock, unpin
        or commit). `reason`: what its REMOVED event says ("" : none, the caller announces)."""
        if obj.state is ObjectState.READY and not obj.pins:
            obj.apply(Event.DELETE)
            self.counters.deleted += 1
            if reason:
                self._removed(obj, reason)
            self._release(obj)
        else:
            obj.doomed = True

    def clear(self, predicate: Callable[[L1Object], bool] | None = None, reason: str = "deleted") -> int:
        """Delete every object (`predicate`: those it accepts); `reason` as for `delete`."""
        n = 0
        for obj in list(self._index.values()):
            if predicate is None or predicate(obj):
                self.delete(obj, reason)
                n += 1
        return n

    def evict(self, need: int, salt: str | None = None) -> int:
        """Evict ready objects (of `salt` only, when given) in policy order until `need` arena bytes
        were freed, or none is left. Returns the bytes freed."""
        return self._room.evict(need, salt)

    def fit_quota(self, salt: str) -> int:
        """Evict `salt`'s ready objects (policy order) until it holds no more than its L1
        limit (as far as its unpinned objects allow). Returns the bytes freed."""
        return self._room.fit_quota(salt)

    def bind_pins(self, kept: Callable[[ObjectKey], bool] | None) -> None:
        """Objects whose key `kept` accepts (a prefix pin holds it in L1) are never evicted, by any
        policy, for room or for quota; `delete` and `clear` remove them all the same."""
        self._room.kept = kept

    # --- fencing (engine/l1/fencing.py) --------------------------------------------------------

    def fence_holder(self, holder: int) -> int:
        """The client session `holder` is suspect: its reservations are quarantined. How many."""
        return self._fencing.fence_holder(holder)

    def reap(self, now: float) -> int:
        """Expired write reservations: a client's quarantined, the sidecar's aborted. How many."""
        return self._fencing.reap(now)

    def writer_done(self, holder: int, oids: Iterable[int]) -> int:
        """`holder`'s late COMMIT/ABORT of `oids`: those it holds quarantined are freed. How many."""
        return self._fencing.writer_done(holder, oids)

    def release_holder(self, holder: int) -> int:
        """The client session `holder` is gone: its reservations and quarantine go. Returns the
        reservations."""
        return self._fencing.release_holder(holder)

    # --- internals -----------------------------------------------------------------------------

    def _removed(self, obj: L1Object, reason: str) -> None:
        events = self.events
        if events.enabled:
            events.emit(Kind.REMOVED, tier=L1_TIER, key=obj.key, reason=reason)

    def _evicted(self, obj: L1Object) -> None:
        self._removed(obj, "evicted")
        self._release(obj)

    def _release(self, obj: L1Object) -> None:
        self._index.forget(obj)
        self._by_oid.pop(obj.oid, None)
        self.policy.on_remove(obj)
        self._free(obj.offset)
        self.ledger.credit(obj.key.salt, L1, self.allocator.aligned(obj.size))

    def _free_quarantined(self, obj: L1Object) -> None:
        self._by_oid.pop(obj.oid, None)
        self._free(obj.offset)

    def _free(self, offset: int) -> None:
        size = self.allocator.size_of(offset)
        if self.fences is not None:
            self.fences.bump_extent(offset, size)
        domains = self.domains
        if domains is not None:
            domains.freed(offset, size)
        self.allocator.free(offset)
