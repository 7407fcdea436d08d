"""RoomMaker: how L1 makes room for a reservation: tenant quota fit, watermark eviction, victims
in policy order, and shedding of chunks queued for write-behind.

State: the arena watermarks (bytes) and the `Shedder` given at construction (the write-behind
queue, engine/l2/store_queue.py). It acts on the cache's allocator, eviction policy, tenant ledger
and counters, which it shares with L1Cache (engine/l1/cache.py), and hands every object it takes
out back to the cache: `release` (forget and free an evicted object), `let_go` (unpin a chunk the
shedder dropped). Built and owned by L1Cache; touched only from the event loop through it, no
locks.

Primitives in call order (L1Cache.try_reserve calls the first two, in this order):
  fit(salt, limit, charge)  -> True when `charge` more bytes fit the tenant's L1 limit
  allocate(size[, domain])  -> an arena offset, or None (no space)
  evict(need[, salt])       ready objects in policy order, until `need` bytes were freed
  fit_quota(salt)           the tenant's ready objects in policy order, down to its L1 limit

Room is made on reserve, in two steps:
1. The tenant's quota (when it has an L1 limit): if its held bytes plus this object would exceed
   the limit, its own ready objects are evicted in policy order (never another tenant's) until
   it fits; when they are not enough, the shedder lets go of the tenant's oldest chunks queued for
   write-behind first. If that is still not enough (the rest is locked or reserved), nothing is
   evicted and the answer is QUOTA; an object larger than the limit (limit 0 included) is QUOTA
   at once. A lowered limit is therefore met at the tenant's next reservation (the facade also
   calls `fit_quota` at the start of every store of a tenant with a limit).
2. The arena, as before quotas: when usage would cross the high watermark, ready objects of any
   tenant are evicted in policy order down to the low watermark; locked, pinned and reserved
   objects are never evicted. When nothing is left to evict, the shedder lets go of the oldest
   queued chunks of any tenant (their L2 write is dropped, counted). If that is not enough
   (everything held, or fragmentation), NO_SPACE.

Write domains (engine/l1/domains.py, when the arena has segments): an object is placed only in a
segment of the domain that writes it (its own first, then one it may claim), and only objects whose
eviction may make room that domain can use are victims (in its own segments, the sidecar's for an
engine, a gone instance's); the watermark step evicts among those too.

Prefix pins (engine/pins/): `kept` (set through L1Cache.bind_pins) says which keys a tenant's
prefix pin holds in L1; such objects are never chosen as victims, by any policy, in either step
(a tenant's pinned chunks count against its quota all the same). Kept objects a scan passes over
are reported to the policy as accessed, so they do not pile up at the head of its order and every
later scan does not walk past them again. When only kept, locked or reserved objects are left, the
answer is QUOTA or NO_SPACE as above: a miss, never an error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from engine.keys import ObjectKey
from engine.l1.allocator import ExtentAllocator
from engine.l1.domains import SIDECAR, WriteDomains
from engine.l1.eviction import EvictionPolicy
from engine.l1.lifecycle import Event, L1Object
from engine.tenants.ledger import TenantLedger
from engine.tenants.quota import L1

if TYPE_CHECKING:
    from engine.l1.cache import L1Counters


class Shedder(Protocol):
    """Who holds pins that may be let go when L1 has no other room (the write-behind queue)."""

    def shed(self, nbytes: int, salt: str | None, unpin: Callable[[L1Object], bool]) -> int:
        """Let go of pins, oldest first (on objects of `salt` only, when given), handing each
        object to `unpin` (True: nothing holds it any more), until `nbytes` of objects were let go
        entirely. Returns those bytes."""
        ...


class RoomMaker:
    def __init__(
        self,
        allocator: ExtentAllocator,
        policy: EvictionPolicy,
        ledger: TenantLedger,
        counters: L1Counters,
        *,
        high: int,
        low: int,
        shedder: Shedder | None,
        release: Callable[[L1Object], None],
        let_go: Callable[[L1Object], bool],
        domains: WriteDomains | None = None,
    ) -> None:
        self.allocator = allocator
        self.domains = domains
        self.policy = policy
        self.ledger = ledger
        self.counters = counters
        #: arena bytes: crossing `high` evicts down to `low`
        self.high = high
        self.low = low
        self._shedder = shedder
        self._release = release
        self._let_go = let_go
        #: keys a prefix pin holds in L1 (None: no pins): never victims
        self.kept: Callable[[ObjectKey], bool] | None = None

    def fit(self, salt: str, limit: int, charge: int) -> bool:
        """Make `charge` more bytes fit `salt`'s limit by evicting its own ready objects (policy order). False
        (and nothing evicted) when they cannot fit."""
        if charge > limit:
            return False
        over = self.ledger.held(salt, L1) + charge - limit
        if over <= 0:
            return True
        victims, freed = self._victims(over, salt)
        if freed < over and self._shed(over - freed, salt):
            # Its chunks waiting for write-behind were let go (those L2 writes are dropped, counted).
            victims, freed = self._victims(over, salt)
        if freed < over:
            return False
        self.counters.quota_evicted += len(victims)
        self._evict(victims)
        return True

    def allocate(self, size: int, domain: str = SIDECAR) -> int | None:
        """An offset for `size` bytes written by `domain` (see the module docstring), or None."""
        alloc = self.allocator
        need = alloc.aligned(size)
        domains = self.domains
        if alloc.used + need > self.high:
            self.evict(alloc.used + need - self.low, helps=None if domains is None else domains.helps(domain))
        offset = self._place(size, domain)
        helps = None if offset is not None or domains is None else domains.helps(domain)
        while offset is None:
            # Fragmented or above the low watermark already: free more, one object's worth at a time.
            # When everything left is pinned, chunks pinned only by queued write-behind are let go
            # (their L2 write is dropped and counted) rather than refusing the engine.
            if self.evict(need, helps=helps) == 0 and (
                self._shed(need, None) == 0 or self.evict(need, helps=helps) == 0
            ):
                return None
            offset = self._place(size, domain)
        return offset

    def _place(self, size: int, domain: str) -> int | None:
        """Allocate in `domain`'s segments (an extent may cross from one to the next when both
        are its own), else growing them by one it may claim (which it then owns), else, for a
        chunk larger than a segment, in consecutive empty ones it owns or may claim."""
        domains = self.domains
        if domains is None:
            return self.allocator.allocate(size)
        alloc = self.allocator
        need = alloc.aligned(size)
        runs = domains.runs(domain)
        for first, last in runs:
            lo, hi = domains.bounds(first)[0], domains.bounds(last)[1]
            if hi - lo - sum(domains.used[first : last + 1]) >= need:
                offset = alloc.allocate_in(size, lo, hi)
                if offset is not None:
                    self._allocated(domain, offset, need)
                    return offset
        starts = {last + 1: first for first, last in runs}  # a claimable segment right after a run
        for i in domains.claimable(domain):
            lo = domains.bounds(starts.get(i, i))[0]
            offset = alloc.allocate_in(size, lo, domains.bounds(i)[1])
            if offset is not None:
                domains.claim(domain, i)
                self._allocated(domain, offset, need)
                return offset
        if need <= domains.segment:
            return None
        run = domains.run(domain, -(-need // domains.segment))
        if run is None:
            return None
        offset = alloc.allocate_in(size, domains.bounds(run[0])[0], domains.bounds(run[-1])[1])
        if offset is not None:
            for i in run:
                if domains.owner[i] != domain:
                    domains.claim(domain, i)
            domains.allocated(offset, need)
        return offset

    def _allocated(self, domain: str, offset: int, need: int) -> None:
        """Count an extent in its segments; one that starts writing into an empty segment of its
        domain's may have the domain claim its next one ahead (engine/l1/domains.py)."""
        domains = self.domains
        assert domains is not None
        last = domains.index(offset + need - 1)
        started = domains.used[last] == 0
        domains.allocated(offset, need)
        if started:
            domains.ahead(domain, last, need)

    def evict(
        self, need: int, salt: str | None = None, helps: Callable[[L1Object], bool] | None = None
    ) -> int:
        """Evict ready objects (of `salt` only, when given; only those `helps` accepts, when
        given) in policy order until `need` arena bytes were freed, or none is left. Returns the
        bytes freed."""
        victims, freed = self._victims(need, salt, helps)
        self._evict(victims)
        return freed

    def fit_quota(self, salt: str) -> int:
        """Evict `salt`'s ready objects (policy order) until it holds no more than its L1
        limit (as far as its unpinned objects allow). Returns the bytes freed."""
        limit = self.ledger.limit(salt, L1)
        if limit is None:
            return 0
        over = self.ledger.held(salt, L1) - limit
        if over <= 0:
            return 0
        victims, freed = self._victims(over, salt)
        self.counters.quota_evicted += len(victims)
        self._evict(victims)
        return freed

    # --- internals -----------------------------------------------------------------------------

    def _shed(self, nbytes: int, salt: str | None) -> int:
        return 0 if self._shedder is None else self._shedder.shed(nbytes, salt, self._let_go)

    def _victims(
        self, need: int, salt: str | None, helps: Callable[[L1Object], bool] | None = None
    ) -> tuple[list[L1Object], int]:
        """Ready objects in policy order whose arena bytes add up to `need` (fewer if there are
        not enough), and their bytes. Chosen first, evicted after: the policy is not changed
        while it is being iterated."""
        victims: list[L1Object] = []
        passed: list[L1Object] = []
        freed = 0
        aligned = self.allocator.aligned
        kept = self.kept
        for obj in self.policy.candidates(salt):
            if freed >= need:
                break
            if obj.evictable:
                if helps is not None and not helps(obj):
                    continue
                if kept is not None and kept(obj.key):
                    passed.append(obj)
                    continue
                victims.append(obj)
                freed += aligned(obj.size)
        for obj in passed:  # pinned: told to the policy as used, so later scans do not pass them again
            self.policy.on_access(obj)
        return victims, freed

    def _evict(self, victims: list[L1Object]) -> None:
        counters = self.counters
        for obj in victims:
            obj.apply(Event.EVICT)
            counters.evicted += 1
            counters.evicted_bytes += obj.size
            self.ledger.note_eviction(obj.key.salt, L1, obj.size)
            self._release(obj)
