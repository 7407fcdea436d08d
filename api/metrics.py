"""Prometheus metrics: one registry per service, process metrics plus kvdepot's own.

Cache figures (L1 bytes, objects by state, hit/miss/store/evict counters) are read from the engine
at scrape time by `EngineCollector`, so the hot path only bumps plain integers. Data-plane request
latency is a histogram per operation, observed by the data-plane server. `TenantCollector` reads
the tenant ledger at scrape time, labelled by tenant and tier with bounded cardinality: the
`tenants.metrics_top_n` tenants holding the most bytes by name (the empty salt as `_default`), all
others summed as `other`. When a tenant enters or leaves the top N its series start or stop and
`other` jumps: Prometheus reads a drop of a counter as a reset. The `tier` label is `l1` or an L2
adapter's name (bounded by the adapters attached; a detached adapter's counters stay under
`other`).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from engine.facade import CacheEngine
from engine.tenants.ledger import OTHER
from engine.tenants.quota import DEFAULT_TENANT

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


class TenantCollector(Collector):
    """Per tenant and tier: bytes held, objects, lookup hits and misses, evictions, quota refusals."""

    def __init__(self, engine: CacheEngine, top_n: int) -> None:
        self.engine = engine
        self.top_n = top_n

    def collect(self) -> Iterator[Metric]:
        ledger = self.engine.tenants
        rows = ledger.labelled(self.top_n)
        labels = ["tenant", "tier"]
        gauges = {
            "bytes": GaugeMetricFamily(
                "kvdepot_tenant_bytes", "Bytes a tenant holds in a tier.", labels=labels
            ),
            "objects": GaugeMetricFamily(
                "kvdepot_tenant_objects", "Objects a tenant holds in a tier.", labels=labels
            ),
        }
        counters = {
            "hits": CounterMetricFamily(
                "kvdepot_tenant_hit_chunks", "Chunks a tenant's lookups found.", labels=labels
            ),
            "misses": CounterMetricFamily(
                "kvdepot_tenant_miss_chunks", "Full chunks a tenant's lookups did not find.", labels=labels
            ),
            "evictions": CounterMetricFamily(
                "kvdepot_tenant_evictions", "A tenant's objects evicted (quota or full tier).", labels=labels
            ),
            "quota_refusals": CounterMetricFamily(
                "kvdepot_tenant_quota_refused_chunks", "Chunks refused by the tenant's quota.", labels=labels
            ),
        }
        limits = GaugeMetricFamily(
            "kvdepot_tenant_quota_bytes",
            "A named tenant's limit in a tier (absent = unlimited).",
            labels=labels,
        )
        families: list[tuple[str, GaugeMetricFamily | CounterMetricFamily]] = [
            *gauges.items(),
            *counters.items(),
        ]
        for tenant, tiers in rows.items():
            salt = "" if tenant == DEFAULT_TENANT else tenant
            for tier, usage in tiers.items():
                for name, family in families:
                    family.add_metric([tenant, tier], getattr(usage, name))
                limit = None if tenant == OTHER else ledger.limit(salt, tier)
                if limit is not None:
                    limits.add_metric([tenant, tier], limit)
        yield from gauges.values()
        yield from counters.values()
        yield limits


class L2Collector(Collector):
    """Per-adapter L2 figures and the write-behind / prefetch counters, read at scrape time."""

    def __init__(self, engine: CacheEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        l2 = self.engine.l2
        if l2 is None:
            return
        gauges = {
            "bytes": GaugeMetricFamily("kvdepot_l2_bytes", "Bytes held by the adapter.", labels=["adapter"]),
            "objects": GaugeMetricFamily(
                "kvdepot_l2_objects", "Objects held by the adapter.", labels=["adapter"]
            ),
            "capacity": GaugeMetricFamily(
                "kvdepot_l2_capacity_bytes", "Adapter capacity (0 = unknown).", labels=["adapter"]
            ),
            "healthy": GaugeMetricFamily(
                "kvdepot_l2_up", "1 when the adapter is healthy, 0.5 degraded, 0 down.", labels=["adapter"]
            ),
        }
        counter_names = (
            ("stores", "Blobs stored."), ("store_bytes", "Bytes stored."), ("loads", "Blobs loaded."),
            ("load_bytes", "Bytes loaded."), ("misses", "Loads that found nothing."),
            ("errors", "Operations that failed."), ("integrity_failures", "Blobs that failed their check."),
            ("evictions", "Blobs evicted (for capacity or a tenant's quota)."),
            ("no_space", "Stores refused for lack of room."),
        )  # fmt: skip
        counters = {
            name: CounterMetricFamily(f"kvdepot_l2_{name}", doc, labels=["adapter"])
            for name, doc in counter_names
        }
        latency = HistogramMetricFamily(
            "kvdepot_l2_op_seconds",
            "L2 operation latency by adapter and operation.",
            labels=["adapter", "op"],
        )
        for tier in l2.tiers.all():
            adapter = tier.adapter
            name = adapter.name
            usage = adapter.usage()
            gauges["bytes"].add_metric([name], usage.bytes_used)
            gauges["objects"].add_metric([name], usage.objects)
            gauges["capacity"].add_metric([name], usage.capacity_bytes)
            gauges["healthy"].add_metric(
                [name], {"ok": 1.0, "degraded": 0.5, "down": 0.0}[adapter.health().state]
            )
            for cname, _doc in counter_names:
                counters[cname].add_metric([name], getattr(adapter.stats, cname))
            for op, hist in adapter.latency.ops.items():
                cumulative = 0
                buckets = []
                for bound, count in zip((*hist.bounds, float("inf")), hist.counts, strict=True):
                    cumulative += count
                    buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
                latency.add_metric([name, op], buckets, sum_value=hist.sum_s)
        yield from gauges.values()
        yield from counters.values()
        yield latency
        store, prefetch = l2.store.counters, l2.prefetch.counters
        yield GaugeMetricFamily("kvdepot_l2_store_queue_depth", "Chunks waiting to be written behind.",
                                value=l2.store.depth)  # fmt: skip
        for name, doc, value in (
            ("l2_store_submitted", "Chunks queued for write-behind.", store.submitted),
            ("l2_store_dropped", "Queued chunks dropped because the queue was full.", store.dropped),
            ("l2_store_written", "Chunks written to at least one adapter.", store.written),
            ("l2_store_failed", "Adapter writes that failed.", store.failed),
            (
                "l2_store_skipped_quota",
                "Chunks not written behind: their tenant may store nothing in L2.",
                store.skipped_quota,
            ),
            (
                "l2_store_quota_refused",
                "Queued blobs not written to an adapter for the tenant's quota there.",
                store.quota_refused,
            ),
            (
                "l2_store_quota_evicted_bytes",
                "Bytes of a tenant's own blobs evicted to make room within its quota.",
                store.quota_evicted_bytes,
            ),
            ("l2_prefetch_started", "Prefetches started by lookups.", prefetch.started),
            ("l2_prefetch_loaded_chunks", "Chunks loaded from L2 into L1.", prefetch.chunks_loaded),
            ("l2_prefetch_loaded_bytes", "Bytes loaded from L2 into L1.", prefetch.bytes_loaded),
            (
                "l2_prefetch_deadline_expired",
                "Prefetches cut short by the deadline.",
                prefetch.deadline_expired,
            ),
            ("l2_prefetch_load_errors", "Chunk loads that failed.", prefetch.load_errors),
            (
                "l2_prefetch_integrity_failures",
                "Loaded blobs that failed their check.",
                prefetch.integrity_failures,
            ),
        ):
            yield CounterMetricFamily(f"kvdepot_{name}", doc, value=value)
