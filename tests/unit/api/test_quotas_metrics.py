"""TenantCollector: tenant metrics read from the ledger at scrape time, bounded label sets."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from api.metrics import TenantCollector
from engine.facade import CacheEngine
from engine.results import SlotStatus
from engine.tenants.quota import Quota
from tests.factories import engine, small_layout, tokens

CHUNK = 16
PAGE = 4096


def scrape(eng: CacheEngine, top_n: int) -> dict[tuple[str, str, str], float]:
    registry = CollectorRegistry()
    registry.register(TenantCollector(eng, top_n))
    text = generate_latest(registry).decode()
    return {
        (s.name, s.labels["tenant"], s.labels["tier"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def store(eng: CacheEngine, eid: int, salt: str, chunks: int) -> None:
    slots = eng.store(eid, "w", tokens(chunks * CHUNK), salt)
    eng.commit(eid, [s.oid for s in slots if s.status is SlotStatus.RESERVED])


def test_top_n_by_bytes_are_named_and_the_rest_sum_to_other() -> None:
    with engine(64 * PAGE) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        for salt, chunks in (("", 5), ("big", 6), ("mid", 3), ("small", 1), ("other", 4)):
            store(eng, eid, salt, chunks)
            eng.lookup(eid, "r", tokens(8 * CHUNK), salt)
            eng.end_request(eid, "r")
        eng.lookup(eid, "r", tokens(2 * CHUNK), "never-stored")
        eng.tenants.set_quota("zero", Quota(l1_bytes=0))
        store(eng, eid, "zero", 2)
        samples = scrape(eng, 2)
        tenants = {t for (_, t, _) in samples}
        assert tenants == {"big", "_default", "other"}  # the salt "other" is never named
        assert samples[("kvdepot_tenant_bytes", "big", "l1")] == 6 * PAGE
        assert samples[("kvdepot_tenant_bytes", "_default", "l1")] == 5 * PAGE
        assert samples[("kvdepot_tenant_bytes", "other", "l1")] == (3 + 1 + 4) * PAGE
        assert samples[("kvdepot_tenant_objects", "other", "l1")] == 8
        # Counters over all labels add up to the engine's own figures.
        hits = sum(v for (n, _, _), v in samples.items() if n == "kvdepot_tenant_hit_chunks_total")
        misses = sum(v for (n, _, _), v in samples.items() if n == "kvdepot_tenant_miss_chunks_total")
        assert (hits, misses) == (eng.counters.hit_chunks, eng.counters.miss_chunks)
        assert samples[("kvdepot_tenant_quota_refused_chunks_total", "other", "l1")] == 2
        assert ("kvdepot_tenant_quota_bytes", "other", "l1") not in samples


def test_label_sets_stay_bounded_with_many_tenants() -> None:
    with engine(256 * PAGE) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        for i in range(100):
            store(eng, eid, f"t{i}", 1 + i % 3)
        samples = scrape(eng, 5)
        assert len({t for (_, t, _) in samples}) == 6
        total = sum(v for (n, _, _), v in samples.items() if n == "kvdepot_tenant_bytes")
        assert total == eng.cache.allocator.used
