"""StatusReader: snapshots of the engine for /status, as typed answers (engine/answers.py).

Role: read-only. Each call copies the figures of the moment: L1 (arena, allocator check, objects by
state, registered engines, counters), L2 (adapters, policy, write-behind and prefetch counters) and
the tenant summary. State: none of its own; it reads the engine and its L2 parts on the event loop.

Primitives: l1() / l2() / tenants()
"""

from __future__ import annotations

import dataclasses

from engine.admin import Administration
from engine.answers import EngineInfo, L1Status, L2Status, LargeTenant, TenantsSummary
from engine.facade import CacheEngine
from engine.l1.allocator import AllocatorError


class StatusReader:
    def __init__(self, engine: CacheEngine, admin: Administration) -> None:
        self.engine = engine
        self.admin = admin

    def l1(self) -> L1Status:
        engine = self.engine
        alloc = engine.cache.allocator
        try:
            alloc.check()
            allocator_error = None
        except AllocatorError as exc:
            allocator_error = str(exc)
        return L1Status(
            allocator_ok=allocator_error is None,
            allocator_error=allocator_error,
            arena=f"memfd:{engine.arena.name} {engine.arena.size}",
            capacity_bytes=alloc.capacity,
            used_bytes=alloc.used,
            objects=len(engine.cache),
            objects_by_state=engine.cache.state_counts(),
            free_extents=alloc.free_extents,
            largest_free_bytes=alloc.largest_free(),
            chunk_size=engine.chunk_size,
            engines=[
                EngineInfo(
                    engine_id=r.engine_id,
                    model=r.namespace.model,
                    kv_rank=r.namespace.kv_rank,
                    layout=r.layout.kind,
                    chunk_bytes=r.chunk_bytes,
                )
                for r in engine.engines.all()
            ],
            locked_requests=engine.locked_requests(),
            counters=dataclasses.asdict(engine.counters) | dataclasses.asdict(engine.cache.counters),
            quarantined_bytes=engine.cache.quarantine.bytes,
            quarantined_objects=engine.cache.quarantine.objects,
            quarantine_max_bytes=engine.cache.quarantine.max_bytes,
        )

    def l2(self) -> L2Status:
        l2 = self.engine.l2
        listed = self.admin.l2_adapters()
        if l2 is None:
            return L2Status(adapters=listed.adapters, policy=None, store=None, prefetch=None)
        return L2Status(
            adapters=listed.adapters,
            policy=listed.policy,
            store=dataclasses.replace(l2.store.counters),
            prefetch=dataclasses.replace(l2.prefetch.counters),
        )

    def tenants(self) -> TenantsSummary:
        summary = self.engine.tenants.summary()
        return TenantsSummary(
            allowlist=summary["allowlist"],
            quotas=summary["quotas"],
            tenants_holding_bytes=summary["tenants_holding_bytes"],
            quota_refused_chunks=summary["quota_refused_chunks"],
            largest=[LargeTenant(**large) for large in summary["largest"]],
        )
