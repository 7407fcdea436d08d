"""A tenant's L2 quota met at once: when a quota is set below what the tenant holds, its oldest
blobs in each tier are evicted down to the new limit then, not at its next write there (a tenant
that stopped writing would otherwise stay over its limit indefinitely).

A local tier is judged by the ledger this sidecar keeps (`tiers.ledger`); a tier with a fleet
ledger (the adapter's `fleet` capability, storage/base.py: a fleet-scope Redis) by what that ledger
says fleet-wide.
A tier that does not answer is left as it is and logged: the tenant's next write there meets the
limit (engine/l2/store.py). Stateless; event loop.
"""

from __future__ import annotations

import structlog

from app.errors import BackendError
from engine.l2.tiers import L2Tiers

log = structlog.get_logger("kvdepot.l2")


async def enforce_quota(tiers: L2Tiers, salt: str) -> int:
    """Evict `salt`'s oldest blobs in every active tier until it holds no more than its limit
    there. Returns the bytes evicted."""
    ledger = tiers.ledger
    evicted = 0
    for tier in tiers.active():
        fleet = tier.adapter.capabilities().fleet
        try:
            if fleet is not None:
                used, _, limit = await fleet.usage(salt)
            else:
                limit = None if ledger is None else ledger.limit(salt, tier.name)
                used = 0 if ledger is None else ledger.held(salt, tier.name)
            if limit is not None and used > limit:
                evicted += await tier.adapter.evict_salt(salt, used - limit)
        except BackendError as exc:
            log.warning("quota_not_enforced", tier=tier.name, error=str(exc))
    return evicted
