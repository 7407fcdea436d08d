"""The write-behind's fleet-scope steps (engine/l2/store.py): reserving a batch's bytes in a Redis
tier's fleet ledger (storage/redis_fleet.py) before the write, committing them after it.

Stateless functions, on the event loop.
"""

from __future__ import annotations

import structlog

from app.errors import BackendError
from engine.l2.tiers import Tier
from engine.tenants.ledger import TierAccounting
from storage import codec
from storage.base import OpResult
from storage.redis_fleet import FleetLedger, Reservation

log = structlog.get_logger("kvdepot.l2.store")


async def reserve_batch(
    tier: Tier, ledger: TierAccounting | None, blobs: list[codec.EncodedBlob], salts: list[str]
) -> list[Reservation | None]:
    """Fleet scope: every blob's first reservation, in one pipeline per node (in order, so the
    first chunks of a chain win); None for each blob otherwise, or where the ledger failed."""
    fleet = getattr(tier.adapter, "fleet", None)
    if not isinstance(fleet, FleetLedger):
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
    """Fleet scope: the reservations of the blobs written are no longer in flight (a failed
    write's stays pending: eviction and reconcile leave it alone for fleet_grace_s)."""
    fleet = getattr(tier.adapter, "fleet", None)
    if not isinstance(fleet, FleetLedger):
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
