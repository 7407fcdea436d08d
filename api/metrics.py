"""Prometheus metrics: one registry per service, process metrics plus kvdepot's own.

Cache figures (L1 bytes, objects by state, hit/miss/store/evict counters) are read from the engine
at scrape time by `EngineCollector`, so the hot path only bumps plain integers. Data-plane request
latency is a histogram per operation, observed by the data-plane server. `TenantCollector` reads
the tenant ledger at scrape time, labelled by tenant and tier with bounded cardinality: the
`tenants.metrics_top_n` tenants holding the most bytes by name (the empty salt as `_default`), all
others summed as `other`. When a tenant enters or leaves the top N its series start or stop and
`other` jumps: Prometheus reads a drop of a counter as a reset. The `tier` label is `l1` or an L2
adapter's name (bounded by the adapters attached; a detached adapter's counters stay under
`other`). `PinCollector` reads the prefix pins (engine/pins/): how many, what they hold per tier
(not per tenant), how many were released.

Each collector is a table: (metric name, help, where the value comes from); one loop per kind of
family turns a table into metrics, so adding a figure is adding a row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from engine.events import EventBus
from engine.facade import CacheEngine
from engine.pins.service import PinService
from engine.tenants.ledger import OTHER
from engine.tenants.quota import DEFAULT_TENANT, L1
from kvdepot_connector.protocol import Uncacheable

LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

Row = tuple[str, str, str]
"""(metric name without `kvdepot_`, help, attribute of the object the figures are read from)."""

# EngineCollector: figures of the L1 allocator, the engine's counters and the L1 cache's counters.
L1_GAUGES: tuple[Row, ...] = (
    ("l1_capacity_bytes", "L1 arena capacity.", "capacity"),
    ("l1_used_bytes", "L1 bytes allocated to objects.", "used"),
    ("l1_free_extents", "Free extents in the L1 allocator.", "free_extents"),
)
QUARANTINE_GAUGES: tuple[Row, ...] = (
    ("l1_quarantined_bytes", "L1 bytes of expired client reservations kept until their writer is gone.",
     "bytes"),
    ("l1_quarantined_objects", "Expired client reservations kept until their writer is gone.", "objects"),
)
ENGINE_COUNTERS: tuple[Row, ...] = (
    ("lookups", "LOOKUP operations.", "lookups"),
    ("lookup_hit_chunks", "Chunks found by lookups.", "hit_chunks"),
    ("lookup_miss_chunks", "Full chunks not found by lookups.", "miss_chunks"),
    ("lookup_hit_tokens", "Tokens found by lookups.", "hit_tokens"),
    ("lookup_miss_tokens", "Tokens not found by lookups.", "miss_tokens"),
    ("store_requests", "STORE operations.", "store_requests"),
    ("stored_chunks", "Chunks reserved for storing.", "stored_chunks"),
    ("store_existing_chunks", "Chunks a STORE found already present.", "existing_chunks"),
    ("decode_chunks_stored", "Committed chunks holding generated (decode) tokens.", "decode_chunks_stored"),
    ("no_space_chunks", "Chunks refused by STORE for lack of L1 room.", "no_space_chunks"),
    ("retrieved_chunks", "Chunks whose extents went to a reader (RETRIEVE, or a LOOKUP that named them).",
     "retrieved_chunks"),
    ("expired_read_leases", "Requests whose read locks were reclaimed after their lease.", "expired_locks"),
    ("lease_reaper_errors", "Lease reaper passes that failed (the next pass runs).", "reaper_errors"),
)
CACHE_COUNTERS: tuple[Row, ...] = (
    ("committed_chunks", "Chunks made ready by COMMIT.", "committed"),
    ("aborted_reservations", "Write reservations dropped.", "aborted"),
    ("evictions", "L1 objects evicted.", "evicted"),
    ("evicted_bytes", "L1 bytes evicted.", "evicted_bytes"),
    ("expired_write_leases", "Write reservations reclaimed after their lease.", "expired_reservations"),
    ("l1_quarantine_refusals",
     "Chunks refused: their instance (or all instances together) held its quarantine budget "
     "(quarantined plus in flight).", "quarantine_refused"),
)

# EventsCollector: the event bus's counters (engine/events.py).
EVENT_COUNTERS: tuple[Row, ...] = (
    ("events_published", "Events queued for the subscribers.", "published"),
    ("events_dropped", "Events dropped because the queue was full (the newest).", "dropped"),
    ("events_subscriber_errors", "Event subscriber calls that raised (the subscriber stays).",
     "subscriber_errors"),
)

# TenantCollector: per (tenant, tier), from the ledger's TierUsage.
TENANT_GAUGES: tuple[Row, ...] = (
    ("tenant_bytes", "Bytes a tenant holds in a tier.", "bytes"),
    ("tenant_objects", "Objects a tenant holds in a tier.", "objects"),
)
TENANT_COUNTERS: tuple[Row, ...] = (
    ("tenant_hit_chunks", "Chunks a tenant's lookups found, by the tier that served them (l1, or "
     "the adapter whose prefetch brought them).", "hits"),
    ("tenant_miss_chunks", "Full chunks a tenant's lookups did not find.", "misses"),
    ("tenant_evictions", "A tenant's objects evicted (quota or full tier).", "evictions"),
    ("tenant_quota_refused_chunks", "Chunks refused by the tenant's quota.", "quota_refusals"),
)

# L2Collector: per adapter (its Usage, its AdapterStats), then the controllers' counters.
ADAPTER_GAUGES: tuple[Row, ...] = (
    ("l2_bytes", "Bytes held by the adapter.", "bytes_used"),
    ("l2_objects", "Objects held by the adapter.", "objects"),
    ("l2_capacity_bytes", "Adapter capacity (0 = unknown).", "capacity_bytes"),
)
ADAPTER_COUNTERS: tuple[Row, ...] = tuple(
    (f"l2_{name}", doc, name)
    for name, doc in (
        ("stores", "Blobs stored."), ("store_bytes", "Bytes stored."), ("loads", "Blobs loaded."),
        ("load_bytes", "Bytes loaded."), ("misses", "Loads that found nothing."),
        ("errors", "Operations that failed."), ("integrity_failures", "Blobs that failed their check."),
        ("auth_failures", "Blobs refused for a missing or wrong MAC (also integrity failures)."),
        ("auth_unknown_key", "Blobs signed by a key id this sidecar does not hold: misses, never deleted."),
        ("evictions", "Blobs evicted (for capacity or a tenant's quota)."),
        ("no_space", "Stores refused for lack of room."),
    )
)  # fmt: skip
HEALTH_VALUE = {"ok": 1.0, "degraded": 0.5, "down": 0.0}
STORE_COUNTERS: tuple[Row, ...] = (
    ("l2_store_submitted", "Chunks queued for write-behind.", "submitted"),
    ("l2_store_dropped", "Queued chunks dropped because the queue was full.", "dropped"),
    ("l2_store_written", "Chunks written to at least one adapter.", "written"),
    (
        "l2_store_not_admitted",
        "Chunks not written behind under the seen_twice store policy: seen once so far.",
        "not_admitted",
    ),
    ("l2_store_failed", "Adapter writes that failed.", "failed"),
    (
        "l2_store_skipped_quota",
        "Chunks not written behind: their tenant may store nothing in L2.",
        "skipped_quota",
    ),
    (
        "l2_store_skipped_purge",
        "Chunks not written behind: their tenant was being purged.",
        "skipped_purge",
    ),
    (
        "l2_store_quota_refused",
        "Queued blobs not written to an adapter for the tenant's quota there.",
        "quota_refused",
    ),
    (
        "l2_store_quota_evicted_bytes",
        "Bytes of a tenant's own blobs evicted to make room within its quota.",
        "quota_evicted_bytes",
    ),
)
PREFETCH_COUNTERS: tuple[Row, ...] = (
    ("l2_prefetch_started", "Prefetches started by lookups.", "started"),
    ("l2_prefetch_loaded_chunks", "Chunks loaded from L2 into L1.", "chunks_loaded"),
    ("l2_prefetch_loaded_bytes", "Bytes loaded from L2 into L1.", "bytes_loaded"),
    ("l2_prefetch_deadline_expired", "Prefetches cut short by the deadline.", "deadline_expired"),
    ("l2_prefetch_load_errors", "Chunk loads that failed.", "load_errors"),
    ("l2_prefetch_integrity_failures", "Loaded blobs that failed their check.", "integrity_failures"),
)


def build_registry(engine: CacheEngine | None = None, tenants_top_n: int = 20) -> CollectorRegistry:
    """Process, platform and GC metrics; with `engine`, also the engine's collectors below."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    if engine is not None:
        registry.register(EngineCollector(engine))
        registry.register(L2Collector(engine))
        registry.register(TenantCollector(engine, tenants_top_n))
        registry.register(EventsCollector(engine.events))
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


Family = GaugeMetricFamily | CounterMetricFamily
FamilyType = Callable[..., Family]


def single(kind: FamilyType, rows: Iterable[Row], source: object) -> Iterator[Metric]:
    """One unlabelled metric per row, its value `getattr(source, attribute)`."""
    for name, doc, attr in rows:
        yield kind(f"kvdepot_{name}", doc, value=getattr(source, attr))


class Labelled:
    """One labelled family per row; `add` appends a sample to each from one object's figures."""

    def __init__(self, kind: FamilyType, rows: Iterable[Row], labels: list[str]) -> None:
        self.rows = [(attr, kind(f"kvdepot_{name}", doc, labels=labels)) for name, doc, attr in rows]

    def add(self, labels: list[str], source: Any) -> None:
        for attr, family in self.rows:
            family.add_metric(labels, getattr(source, attr))

    def families(self) -> Iterator[Family]:
        return (family for _, family in self.rows)


class EngineCollector(Collector):
    """L1 and lookup figures, read from the engine when Prometheus scrapes."""

    def __init__(self, engine: CacheEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        yield from single(GaugeMetricFamily, L1_GAUGES, engine.cache.allocator)
        yield from single(GaugeMetricFamily, QUARANTINE_GAUGES, engine.cache.quarantine)
        by_state = GaugeMetricFamily("kvdepot_l1_objects", "L1 objects by lifecycle state.", labels=["state"])
        for state, n in engine.cache.state_counts().items():
            by_state.add_metric([state], n)
        yield by_state
        yield from single(CounterMetricFamily, ENGINE_COUNTERS, engine.counters)
        yield from single(CounterMetricFamily, CACHE_COUNTERS, engine.cache.counters)
        uncacheable = CounterMetricFamily(
            "kvdepot_uncacheable_requests",
            "Requests a client neither loaded nor stored because it could not key them, by reason.",
            labels=["reason"],
        )
        for reason in Uncacheable:  # every reason, zeros included: a bounded label set
            uncacheable.add_metric([reason.value], engine.uncacheable.get(reason.value, 0))
        yield uncacheable


class EventsCollector(Collector):
    """The event bus's figures (zero while events are disabled), read when Prometheus scrapes."""

    def __init__(self, events: EventBus) -> None:
        self.events = events

    def collect(self) -> Iterator[Metric]:
        yield from single(CounterMetricFamily, EVENT_COUNTERS, self.events)
        yield GaugeMetricFamily(
            "kvdepot_events_queue", "Events waiting for the dispatcher.", value=self.events.pending()
        )


class PinCollector(Collector):
    """Prefix pins: how many, the bytes they may hold per tier (`l1` always), and releases."""

    def __init__(self, pins: PinService) -> None:
        self.pins = pins

    def collect(self) -> Iterator[Metric]:
        pins = self.pins
        yield GaugeMetricFamily("kvdepot_pins", "Prefix pins held (PUT /pins).", value=len(pins.table))
        held = GaugeMetricFamily(
            "kvdepot_pinned_bytes", "Bytes prefix pins may hold in the tier, over all tenants.",
            labels=["tier"],
        )  # fmt: skip
        tiers = {L1} | {t for p in pins.table.pins() for t in p.tiers}
        for tier in sorted(tiers):
            held.add_metric([tier], pins.pinned_bytes(tier))
        yield held
        yield CounterMetricFamily(
            "kvdepot_pins_released", "Prefix pins released by their TTL or DELETE.", value=pins.released
        )


class TenantCollector(Collector):
    """Per tenant and tier: bytes held, objects, lookup hits and misses, evictions, quota refusals."""

    def __init__(self, engine: CacheEngine, top_n: int) -> None:
        self.engine = engine
        self.top_n = top_n

    def collect(self) -> Iterator[Metric]:
        ledger = self.engine.tenants
        labels = ["tenant", "tier"]
        gauges = Labelled(GaugeMetricFamily, TENANT_GAUGES, labels)
        counters = Labelled(CounterMetricFamily, TENANT_COUNTERS, labels)
        limits = GaugeMetricFamily(
            "kvdepot_tenant_quota_bytes",
            "A named tenant's limit in a tier (absent = unlimited).",
            labels=labels,
        )
        for tenant, tiers in ledger.labelled(self.top_n).items():
            salt = "" if tenant == DEFAULT_TENANT else tenant
            for tier, usage in tiers.items():
                gauges.add([tenant, tier], usage)
                counters.add([tenant, tier], usage)
                limit = None if tenant == OTHER else ledger.limit(salt, tier)
                if limit is not None:
                    limits.add_metric([tenant, tier], limit)
        yield from gauges.families()
        yield from counters.families()
        yield limits


class L2Collector(Collector):
    """Per-adapter L2 figures and the write-behind / prefetch counters, read at scrape time."""

    def __init__(self, engine: CacheEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        l2 = self.engine.l2
        if l2 is None:
            return
        gauges = Labelled(GaugeMetricFamily, ADAPTER_GAUGES, ["adapter"])
        up = GaugeMetricFamily(
            "kvdepot_l2_up", "1 when the adapter is healthy, 0.5 degraded, 0 down.", labels=["adapter"]
        )
        counters = Labelled(CounterMetricFamily, ADAPTER_COUNTERS, ["adapter"])
        latency = HistogramMetricFamily(
            "kvdepot_l2_op_seconds",
            "L2 operation latency by adapter and operation.",
            labels=["adapter", "op"],
        )
        for tier in l2.tiers.all():
            adapter = tier.adapter
            name = adapter.name
            gauges.add([name], adapter.usage())
            up.add_metric([name], HEALTH_VALUE[adapter.health().state])
            counters.add([name], adapter.stats)
            for op, hist in adapter.latency.ops.items():
                latency.add_metric(
                    [name, op], cumulative_buckets(hist.bounds, hist.counts), sum_value=hist.sum_s
                )
        yield from gauges.families()
        yield up
        yield from counters.families()
        yield latency
        yield GaugeMetricFamily(
            "kvdepot_l2_store_queue_depth", "Chunks waiting to be written behind.", value=l2.store.depth
        )
        yield from single(CounterMetricFamily, STORE_COUNTERS, l2.store.counters)
        yield from single(CounterMetricFamily, PREFETCH_COUNTERS, l2.prefetch.counters)


def cumulative_buckets(bounds: Iterable[float], counts: Iterable[int]) -> list[tuple[str, float]]:
    """Per-bucket counts (the last one past every bound) as Prometheus' cumulative `le` buckets."""
    buckets: list[tuple[str, float]] = []
    total = 0
    for bound, count in zip((*bounds, float("inf")), counts, strict=True):
        total += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), total))
    return buckets
