"""The periodic reconcile of every adapter's fleet ledger (its `fleet` capability, storage/base.py:
a fleet-scope Redis adapter's tenant ledger, storage/redis/fleet.py).

Role: one supervised loop for all adapters, those attached at run time included: each fleet ledger
with a `reconcile_interval_s` is reconciled that often (first one interval after it was seen), one
adapter at a time, its scan bounded by the adapter's own rate (Redis: `scan_keys_per_s`). A failed
round (Redis down) is logged and tried again at the next interval; it never ends the loop.

State: when each adapter is due (by adapter identity, forgotten once it is detached). Event loop.

Primitives: run_reconcile(tiers, tick_s) (the supervised coroutine), reconcile_due(tiers, due, now).
"""

from __future__ import annotations

import asyncio
import time

import structlog

from engine.l2.tiers import L2Tiers

log = structlog.get_logger("kvdepot.l2.reconcile")


async def reconcile_due(tiers: L2Tiers, due: dict[int, float], now: float) -> int:
    """Reconcile the adapters whose time has come; the number reconciled."""
    seen: set[int] = set()
    done = 0
    for tier in tiers.active():
        fleet = tier.adapter.capabilities().fleet
        interval = None if fleet is None else fleet.reconcile_interval_s
        if fleet is None or interval is None:
            continue
        ident = id(tier.adapter)
        seen.add(ident)
        if ident not in due:
            due[ident] = now + interval
            continue
        if now < due[ident]:
            continue
        due[ident] = now + interval
        try:
            report = await fleet.reconcile()
        except Exception as exc:
            log.warning("l2_reconcile_failed", adapter=tier.name, error=f"{type(exc).__name__}: {exc}")
            continue
        done += 1
        log.info(
            "l2_reconciled", adapter=tier.name, keys=report.keys_scanned, tenants=report.tenants,
            released_bytes=report.released_bytes, adopted_bytes=report.adopted_bytes,
        )  # fmt: skip
    for ident in [i for i in due if i not in seen]:
        del due[ident]
    return done


async def run_reconcile(tiers: L2Tiers, tick_s: float = 1.0) -> None:
    due: dict[int, float] = {}
    while True:
        await asyncio.sleep(tick_s)
        await reconcile_due(tiers, due, time.monotonic())
