"""The write-behind's tenant quotas in L2 (engine/l2/store.py, whose docstring states the rules):
whether each blob may be written to a tier, evicting the tenant's own oldest blobs there to make it
fit; for a tier with a fleet ledger (the adapter's `fleet` capability, storage/base.py: a
fleet-scope Redis), reserving a batch's bytes in that ledger before the write and committing them
after it.

State (event loop only): the bytes of each (tenant, tier) being written, which count against the
limit until the write returns; the counters are the store controller's.

Primitives in call order:
  refused_everywhere(salt)          a tenant that may store nothing in any target tier (refusals noted)
  reserve_batch(tier, ...)          fleet ledger: every blob's first reservation, one pipeline per node
  admit(tier, salt, size, key, first) / written(tier, salt, size)
                                    a blob admitted counts as being written until `written`
  commit_fleet(tier, ...)           fleet ledger: the reservations of the blobs written are committed
"""

from __future__ import annotations

import structlog

from app.errors import BackendError
from engine.l2.store_queue import StoreCounters
from engine.l2.tiers import L2Tiers, Tier
from engine.tenants.ledger import TierAccounting
from storage import codec
from storage.base import FleetQuota, OpResult, Reservation

log = structlog.get_logger("kvdepot.l2.store")


class QuotaAdmission:
    def __init__(self, tiers: L2Tiers, counters: StoreCounters) -> None:
        self.tiers = tiers
        self.counters = counters
        self._writing: dict[tuple[str, str], int] = {}  # (salt, tier) -> bytes being written

    def refused_everywhere(self, salt: str, targets: list[Tier]) -> bool:
        """True (refusals noted) when `salt` may store nothing in any of `targets` and holds
        nothing there that a write would have to evict."""
        ledger = self.tiers.ledger
        if ledger is None or not targets:
            return False
        for tier in targets:
            if ledger.limit(salt, tier.name) != 0 or ledger.held(salt, tier.name):
                return False
        for tier in targets:
            ledger.note_refusal(salt, tier.name)
        self.counters.skipped_quota += 1
        return True

    async def admit(
        self, tier: Tier, salt: str, size: int, key: str, first: Reservation | None = None
    ) -> bool:
        """Whether a blob of `salt` and `size` bytes may be written to `tier` (engine/l2/store.py).
        True: its bytes count as being written until `written(tier, salt, size)`."""
        slot = (salt, tier.name)
        writing = self._writing.get(slot, 0)
        ledger = self.tiers.ledger
        fleet = tier.adapter.capabilities().fleet
        if fleet is not None:
            if not await self._admit_fleet(tier, fleet, salt, size, key, first=first):
                return False
            self._writing[slot] = self._writing.get(slot, 0) + size  # read after the await
            return True
        limit = None if ledger is None else ledger.limit(salt, tier.name)
        if ledger is None or limit is None:
            self._writing[slot] = writing + size
            return True
        fits = size + writing <= limit  # once all it holds there is evicted, at the worst
        over = ledger.held(salt, tier.name) + writing - (limit - size if fits else limit)
        if fits:
            self._writing[slot] = writing + size  # before awaiting: concurrent batches see it
        try:
            if over > 0:
                self.counters.quota_evicted_bytes += await tier.adapter.evict_salt(salt, over)
        except BaseException:
            if fits:
                self.written(tier, salt, size)
            raise
        if fits and ledger.held(salt, tier.name) + self._writing[slot] <= limit:
            return True
        if fits:
            self.written(tier, salt, size)
        ledger.note_refusal(salt, tier.name)
        self.counters.quota_refused += 1
        return False

    async def _admit_fleet(
        self, tier: Tier, fleet: FleetQuota, salt: str, size: int, key: str, *, first: Reservation | None
    ) -> bool:
        """Fleet ledger: reserve the blob's bytes there (`first`: done already, with the batch);
        over the limit, evict the tenant's oldest blobs fleet-wide and try once more. BackendError
        when the ledger does not answer (the caller writes nothing more of the batch to that tier)."""
        ledger = self.tiers.ledger
        fallback = None if ledger is None else ledger.limit(salt, tier.name)
        got = first if first is not None else await fleet.reserve(salt, key, size, fallback)
        if not got.ok and got.limit is not None and size <= got.limit:
            over = got.used + size - got.limit
            self.counters.quota_evicted_bytes += await tier.adapter.evict_salt(salt, over)
            got = await fleet.reserve(salt, key, size, fallback)
        elif not got.ok and got.limit is not None and got.used > got.limit:  # never fits: still
            over = got.used - got.limit  # brought down to a lowered limit
            self.counters.quota_evicted_bytes += await tier.adapter.evict_salt(salt, over)
        if got.ok:
            return True
        if ledger is not None:
            ledger.note_refusal(salt, tier.name)
        self.counters.quota_refused += 1
        return False

    def written(self, tier: Tier, salt: str, size: int) -> None:
        slot = (salt, tier.name)
        left = self._writing[slot] - size
        if left:
            self._writing[slot] = left
        else:
            del self._writing[slot]


async def reserve_batch(
    tier: Tier, ledger: TierAccounting | None, blobs: list[codec.EncodedBlob], salts: list[str]
) -> list[Reservation | None]:
    """Fleet ledger: every blob's first reservation, in one pipeline per node (in order, so the
    first chunks of a chain win); None for each blob otherwise, or where the ledger failed."""
    fleet = tier.adapter.capabilities().fleet
    if fleet is None:
        return [None] * len(blobs)
    items = [
        (salt, blob.key, blob.nbytes, None if ledger is None else ledger.limit(salt, tier.name))
        for salt, blob in zip(salts, blobs, strict=True)
    ]
    try:
        return await fleet.reserve_many(items)
    except BackendError:
        return [None] * len(blobs)  # each is tried alone, and fails alone


async def commit_fleet(
    tier: Tier, keys: list[str], salts: list[str], admitted: list[int], results: list[OpResult]
) -> None:
    """Fleet ledger: the reservations of the blobs written are no longer in flight (a failed
    write's stays pending: eviction and reconcile leave it alone for fleet_grace_s)."""
    fleet = tier.adapter.capabilities().fleet
    if fleet is None:
        return
    by_salt: dict[str, list[str]] = {}
    for key, i, result in zip(keys, admitted, results, strict=True):
        if result.ok:
            by_salt.setdefault(salts[i], []).append(key)
    for salt, written in by_salt.items():
        try:
            await fleet.commit(salt, written)
        except BackendError as exc:
            log.warning("l2_fleet_commit_failed", adapter=tier.name, error=str(exc))
