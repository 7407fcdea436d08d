"""EventMetrics fed hand-made events: L2 load latency per adapter, the hit ratio of a lookup
(observed at once, or when its prefetch ends), reuse distance, age at eviction per tier, and the
bounded memory of store times (oldest forgotten, counted)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from api.metrics_events import EventMetrics
from engine.events import L1_TIER, Event, Kind
from tests.factories import key

S = 1_000_000_000


def metrics(cap: int = 1000) -> tuple[EventMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    return EventMetrics(registry, chunk_size=16, max_tracked=cap), registry


def test_load_latency_per_adapter() -> None:
    m, r = metrics()
    m.on_events([Event(Kind.START, 0, op="l2.load", tier="disk", span=7),
                 Event(Kind.END, S // 100, op="l2.load", tier="disk", span=7),
                 Event(Kind.END, S, op="l2.load", tier="disk", span=8)])  # fmt: skip  (8: no START)
    assert r.get_sample_value("kvdepot_l2_load_seconds_count", {"adapter": "disk"}) == 1
    assert r.get_sample_value("kvdepot_l2_load_seconds_sum", {"adapter": "disk"}) == 0.01


def test_hit_ratio_waits_for_the_prefetch() -> None:
    m, r = metrics()
    m.on_events([Event(Kind.LOOKUP, 0, op="lookup", request_id="a", detail=16, total=64)])
    assert r.get_sample_value("kvdepot_lookup_hit_ratio_count") == 1
    assert r.get_sample_value("kvdepot_lookup_hit_ratio_sum") == 0.25
    m.on_events([Event(Kind.LOOKUP, 0, op="lookup", request_id="b", detail=16, total=64, reason="prefetch")])
    assert r.get_sample_value("kvdepot_lookup_hit_ratio_count") == 1
    m.on_events([Event(Kind.END, 5, op="l2.prefetch", request_id="b", detail=2)])  # 2 chunks of 16 tokens
    assert r.get_sample_value("kvdepot_lookup_hit_ratio_count") == 2
    assert r.get_sample_value("kvdepot_lookup_hit_ratio_sum") == 0.25 + 0.75


def test_reuse_distance_and_age_at_eviction() -> None:
    m, r = metrics()
    k1, k2 = key(1), key(2)
    m.on_events([
        Event(Kind.STORED, 0, tier=L1_TIER, key=k1, op="commit"),
        Event(Kind.STORED, 0, tier=L1_TIER, key=k2, op="commit"),
        Event(Kind.STORED, S, tier="disk", key=k1, op="l2.store"),
        Event(Kind.LOOKUP, 3 * S, op="lookup", detail=16, total=16, hits=[k1]),
        Event(Kind.LOOKUP, 9 * S, op="lookup", detail=16, total=16, hits=[k1]),  # a second hit: not a reuse
        Event(Kind.REMOVED, 10 * S, tier=L1_TIER, key=k2, reason="evicted"),
        Event(Kind.STORED, 12 * S, tier=L1_TIER, key=k2, op="l2.load", reason="disk"),  # back from L2: a hit
        Event(Kind.REMOVED, 20 * S, tier="disk", key=k1, reason="evicted"),
        Event(Kind.REMOVED, 20 * S, tier=L1_TIER, key=k1, reason="deleted"),  # not an eviction
    ])  # fmt: skip
    assert r.get_sample_value("kvdepot_reuse_distance_seconds_count") == 2
    assert r.get_sample_value("kvdepot_reuse_distance_seconds_sum") == 3 + 12
    assert r.get_sample_value("kvdepot_chunk_age_at_eviction_seconds_sum", {"tier": "l1"}) == 10
    assert r.get_sample_value("kvdepot_chunk_age_at_eviction_seconds_sum", {"tier": "disk"}) == 19
    assert r.get_sample_value("kvdepot_chunk_age_at_eviction_seconds_count", {"tier": "l1"}) == 1


def test_store_times_are_bounded_oldest_forgotten_and_counted() -> None:
    m, r = metrics(cap=16)
    m.on_events([Event(Kind.STORED, i, tier=L1_TIER, key=key(i), op="commit") for i in range(100)])
    assert m.tracked() <= 2 * 16
    assert r.get_sample_value("kvdepot_event_metrics_forgotten_total") == 2 * (100 - 16)
    m.on_events([Event(Kind.LOOKUP, 200, op="lookup", detail=32, total=32, hits=[key(0), key(99)])])
    assert r.get_sample_value("kvdepot_reuse_distance_seconds_count") == 1  # key(0) was forgotten
    m.on_events([Event(Kind.CLEARED, 300, tier="")])
    assert m.tracked() == 15  # the store times left for the reuse distance; the ages went with the clear
