"""Prometheus metrics: one registry per service, process metrics plus kvdepot's own.

Cache figures (L1 bytes, objects by state, hit/miss/store/evict counters) are read from the engine
at scrape time by `EngineCollector`, so the hot path only bumps plain integers. Data-plane request
latency is a histogram per operation, observed by the data-plane server.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from engine.facade import CacheEngine

LATENCY_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)


def build_registry() -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class DataPlaneMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._latency = Histogram(
            "kvdepot_dataplane_request_seconds",
            "Data-plane request handling time by operation.",
            ["op"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self._errors = Counter(
            "kvdepot_dataplane_errors",
            "Data-plane error replies by operation and code.",
            ["op", "code"],
            registry=registry,
        )
        self._children: dict[str, Histogram] = {}

    def observe(self, op: str, seconds: float) -> None:
        child = self._children.get(op)
        if child is None:
            child = self._children[op] = self._latency.labels(op)
        child.observe(seconds)

    def error(self, op: str, code: str) -> None:
        self._errors.labels(op, code).inc()


class EngineCollector(Collector):
    """L1 and lookup figures, read from the engine when Prometheus scrapes."""

    def __init__(self, engine: CacheEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        alloc = engine.cache.allocator
        yield GaugeMetricFamily("kvdepot_l1_capacity_bytes", "L1 arena capacity.", value=alloc.capacity)
        yield GaugeMetricFamily("kvdepot_l1_used_bytes", "L1 bytes allocated to objects.", value=alloc.used)
        yield GaugeMetricFamily(
            "kvdepot_l1_free_extents", "Free extents in the L1 allocator.", value=alloc.free_extents
        )
        by_state = GaugeMetricFamily("kvdepot_l1_objects", "L1 objects by lifecycle state.", labels=["state"])
        for state, n in engine.cache.state_counts().items():
            by_state.add_metric([state], n)
        yield by_state
        c = engine.counters
        l1 = engine.cache.counters
        for name, doc, value in (
            ("lookups", "LOOKUP operations.", c.lookups),
            ("lookup_hit_chunks", "Chunks found by lookups.", c.hit_chunks),
            ("lookup_miss_chunks", "Full chunks not found by lookups.", c.miss_chunks),
            ("lookup_hit_tokens", "Tokens found by lookups.", c.hit_tokens),
            ("lookup_miss_tokens", "Tokens not found by lookups.", c.miss_tokens),
            ("store_requests", "STORE operations.", c.store_requests),
            ("stored_chunks", "Chunks reserved for storing.", c.stored_chunks),
            ("store_existing_chunks", "Chunks a STORE found already present.", c.existing_chunks),
            ("no_space_chunks", "Chunks refused by STORE for lack of L1 room.", c.no_space_chunks),
            ("retrieved_chunks", "Chunks handed out by RETRIEVE.", c.retrieved_chunks),
            ("committed_chunks", "Chunks made ready by COMMIT.", l1.committed),
            ("aborted_reservations", "Write reservations dropped.", l1.aborted),
            ("evictions", "L1 objects evicted.", l1.evicted),
            ("evicted_bytes", "L1 bytes evicted.", l1.evicted_bytes),
            (
                "expired_write_leases",
                "Write reservations reclaimed after their lease.",
                l1.expired_reservations,
            ),
            (
                "expired_read_leases",
                "Requests whose read locks were reclaimed after their lease.",
                c.expired_locks,
            ),
        ):
            yield CounterMetricFamily(f"kvdepot_{name}", doc, value=value)
