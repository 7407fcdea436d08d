"""Reclaimer: what the engine takes back from clients that went silent or away, and from leases
that expired.

Role: the facade's (engine/facade.py) maintenance half. A client session that is silent past its
timeout (engine/workers.py) may be stalled, not dead: nothing it holds may block others, so the
requests it took part in lose their read locks (its late RELEASE of them is answered invalid: it
is fenced) and its write reservations are quarantined (engine/l1/quarantine.py). A session whose
lifeline closed writes no more: its reservations (and their quarantine) go at once. An instance
whose last session is gone loses its requests and registrations. Expired write reservations and
read locks are reaped every `reap_interval_s` by `run_reaper`.

State: holder session -> its requests fenced when it went suspect (at most MAX_FENCED each), and
the collaborators it was given (the L1 cache, the request table, the registrations, the store
announcer, the engine's counters). Owned by the event loop; every method but `run_reaper` is
synchronous and short.

Primitives in call order:
  suspect(holder)       -> (requests, reservations): locks dropped and fenced, reservations
                           quarantined
  fenced(holder, rid)   whether a RELEASE of `rid` by `holder` comes after its locks went (the
                        fence is lifted as it answers True)
  unfence(holder, rid)  `holder` works on `rid` again (a new LOOKUP or RETRIEVE)
  end_holder(holder)    -> reservations dropped (its lifeline closed)
  end_instance(inst)    -> requests dropped with its registrations (its last session is gone)
  reap()                -> (reservations, requests) whose lease expired
  run_reaper(interval)  reap every interval; a failed pass is logged and counted
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from engine.announce import StoreAnnouncer
from engine.l1.cache import L1Cache
from engine.registry import EngineRegistry
from engine.requests import RequestId, RequestTable
from engine.results import EngineCounters

log = structlog.get_logger("kvdepot.engine")

#: requests remembered per suspect session for its late RELEASEs (beyond: the generation check)
MAX_FENCED = 4096


class Reclaimer:
    def __init__(
        self, *, cache: L1Cache, requests: RequestTable, engines: EngineRegistry, announcer: StoreAnnouncer,
        counters: EngineCounters, clock: Callable[[], float],
    ) -> None:  # fmt: skip
        self._cache = cache
        self._requests = requests
        self._engines = engines
        self._announcer = announcer
        self._counters = counters
        self._clock = clock
        #: holder -> its requests whose locks went when it was suspect (a late RELEASE: invalid)
        self._fenced: dict[int, set[RequestId]] = {}

    def suspect(self, holder: int) -> tuple[int, int]:
        """The client session `holder` went silent: the requests it took part in lose their read
        locks (fenced) and its write reservations are quarantined. Returns (requests, reservations)."""
        rids = self._requests.release_holder(holder)
        if rids:
            fences = self._cache.fences
            if fences is not None:  # its copies in flight ask the sidecar (and hear invalid)
                fences.bump_all()
            fenced = self._fenced.setdefault(holder, set())
            fenced.update(rids[: max(MAX_FENCED - len(fenced), 0)])
        n = self._cache.fence_holder(holder)
        c = self._counters
        c.suspect_locks += len(rids)
        c.suspect_reservations += n
        return len(rids), n

    def fenced(self, holder: int, rid: RequestId) -> bool:
        """`holder`'s RELEASE of `rid` comes after its locks went when it was suspect (answered
        invalid, counted); the fence is lifted meanwhile."""
        fenced = self._fenced.get(holder)
        if fenced is None or rid not in fenced:
            return False
        fenced.discard(rid)
        self._counters.suspect_releases += 1
        return True

    def unfence(self, holder: int, rid: RequestId) -> None:
        """`holder` works on `rid` again (a new lookup or retrieve): its next RELEASE is current."""
        fenced = self._fenced.get(holder)
        if fenced is not None:
            fenced.discard(rid)

    def end_holder(self, holder: int) -> int:
        """The client session `holder` is gone (its lifeline closed: the process cannot write any
        more): its write reservations are dropped at once. Returns how many."""
        self._fenced.pop(holder, None)
        n = self._cache.release_holder(holder)
        if n and self._announcer:
            self._announcer.prune(self._reserved)
        self._counters.gone_reservations += n
        return n

    def end_instance(self, instance: str) -> int:
        """The last session of `instance` is gone: its requests' read locks and its registrations
        (with their KV planes, through `engines.on_drop`) go at once. Returns the requests."""
        ids = set(self._engines.drop_instance(instance))
        n = self._requests.release_engines(ids) if ids else 0
        c = self._counters
        c.instances_gone += 1
        c.gone_locks += n
        log.info("instance_gone", engines=len(ids), requests=n)
        return n

    def reap(self) -> tuple[int, int]:
        """Reclaim expired write reservations and read locks. Returns (reservations, requests)."""
        now = self._clock()
        reservations = self._cache.reap(now)
        if reservations and self._announcer:
            self._announcer.prune(self._reserved)
        expired = self._requests.reap(now)
        self._counters.expired_locks += expired
        return reservations, expired

    async def run_reaper(self, interval_s: float) -> None:
        """Reap every `interval_s`; a pass that fails is logged and counted, the next one runs."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.reap()
            except Exception:
                self._counters.reaper_errors += 1
                log.exception("lease_reaper_pass_failed", errors=self._counters.reaper_errors)

    def _reserved(self, oid: int) -> bool:
        return self._cache.owner_of(oid) is not None
