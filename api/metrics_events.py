"""EventMetrics: the histograms a counter cannot give, made by an EventBus subscriber.

  kvdepot_l2_load_seconds{adapter}            one chunk's load from an L2 adapter ("l2.load"
                                              START/END pairs), whatever its outcome
  kvdepot_lookup_hit_ratio                    per LOOKUP: tokens hit over the tokens of its full
                                              chunks, L2 included: a lookup whose misses are being
                                              prefetched is observed when its prefetch ends
  kvdepot_reuse_distance_seconds              a chunk's first hit (in L1, or loaded back from L2
                                              for a request) after it was stored (committed in L1)
  kvdepot_chunk_age_at_eviction_seconds{tier} a chunk's age when a tier evicted it (since it was
                                              stored there: committed or loaded into L1, written
                                              to an adapter); tier "l1" or the adapter's name

Bounded memory: the times chunks were stored (for the reuse distance; for the age, per tier) and
the lookups waiting for their prefetch are kept in insertion order, each up to `max_tracked`; past
it the oldest are forgotten (their later hit or eviction is not observed: counted in
`forgotten`). Chunks stored before the sidecar started (an L2 that survived a restart) have no
store time and are not observed either. A load whose START the bus dropped is not observed.

State: three bounded ordered maps, the load STARTs in flight, the histograms. Event loop only
(the bus's dispatcher).

Primitives in call order: EventMetrics(registry, chunk_size, max_tracked) -> on_events(events)...
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import TypeVar

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.events import L1_TIER, Event, Kind
from engine.keys import ObjectKey

LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0)
AGE_BUCKETS = (0.1, 1.0, 10.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 86400.0, 7 * 86400.0)

K = TypeVar("K")
V = TypeVar("V")


def _remember(store: OrderedDict[K, V], key: K, value: V, cap: int) -> int:
    """Set `key` (as the newest); forget the oldest beyond `cap`. Answers how many were forgotten."""
    store[key] = value
    store.move_to_end(key)
    n = 0
    while len(store) > cap:
        store.popitem(last=False)
        n += 1
    return n


class EventMetrics:
    def __init__(self, registry: CollectorRegistry, *, chunk_size: int, max_tracked: int = 65536) -> None:
        if chunk_size <= 0 or max_tracked <= 0:
            raise ValueError("chunk_size and max_tracked must be positive")
        self.chunk_size = chunk_size
        self.max_tracked = max_tracked
        self.forgotten = 0
        self.load_seconds = Histogram(
            "kvdepot_l2_load_seconds", "Load of one chunk from an L2 adapter (event times).",
            ["adapter"], registry=registry, buckets=LOAD_BUCKETS,
        )  # fmt: skip
        self.hit_ratio = Histogram(
            "kvdepot_lookup_hit_ratio",
            "Per lookup: tokens hit (L1, then L2) over the tokens of its full chunks.",
            registry=registry, buckets=RATIO_BUCKETS,
        )  # fmt: skip
        self.reuse = Histogram(
            "kvdepot_reuse_distance_seconds", "Time from a chunk's store to its first hit.",
            registry=registry, buckets=AGE_BUCKETS,
        )  # fmt: skip
        self.age = Histogram(
            "kvdepot_chunk_age_at_eviction_seconds", "A chunk's age in a tier when the tier evicted it.",
            ["tier"], registry=registry, buckets=AGE_BUCKETS,
        )  # fmt: skip
        self._loads: OrderedDict[int, int] = OrderedDict()  # START span -> ts
        self._stored: OrderedDict[ObjectKey, int] = OrderedDict()  # chunk -> store time (no hit yet)
        self._born: OrderedDict[tuple[str, ObjectKey], int] = OrderedDict()  # (tier, chunk) -> time
        self._waiting: OrderedDict[str, tuple[int, int]] = OrderedDict()  # request -> (hit, total)
        registry.register(_Figures(self))

    def tracked(self) -> int:
        return len(self._loads) + len(self._stored) + len(self._born) + len(self._waiting)

    def on_events(self, events: Sequence[Event]) -> None:
        for event in events:
            kind = event.kind
            if kind is Kind.STORED:
                self._on_stored(event)
            elif kind is Kind.REMOVED:
                self._on_removed(event)
            elif kind is Kind.LOOKUP:
                self._on_lookup(event)
            elif kind is Kind.START:
                if event.op == "l2.load":
                    self.forgotten += _remember(self._loads, event.span, event.ts_ns, self.max_tracked)
            elif kind is Kind.END:
                self._on_end(event)
            elif kind is Kind.CLEARED:
                self._on_cleared(event.tier)

    def _on_stored(self, event: Event) -> None:
        key = event.key
        if key is None:
            return
        ts = event.ts_ns
        cap = self.max_tracked
        if event.tier == L1_TIER:
            if event.op == "l2.load":  # brought back from L2 for a request: a hit
                self._hit(key, ts)
            else:
                self.forgotten += _remember(self._stored, key, ts, cap)
        self.forgotten += _remember(self._born, (event.tier, key), ts, cap)

    def _hit(self, key: ObjectKey, ts: int) -> None:
        stored = self._stored.pop(key, None)
        if stored is not None:
            self.reuse.observe(max(ts - stored, 0) / 1e9)

    def _on_removed(self, event: Event) -> None:
        if event.key is None:
            return
        born = self._born.pop((event.tier, event.key), None)
        if born is not None and event.reason == "evicted":
            tier = "l1" if event.tier == L1_TIER else event.tier
            self.age.labels(tier).observe(max(event.ts_ns - born, 0) / 1e9)

    def _on_cleared(self, tier: str) -> None:
        if not tier:
            self._born.clear()
            return
        for slot in [s for s in self._born if s[0] == tier]:
            del self._born[slot]

    def _on_lookup(self, event: Event) -> None:
        for key in event.hits:
            self._hit(key, event.ts_ns)
        total = event.total
        if total <= 0:
            return
        if event.reason == "prefetch" and event.request_id:
            pair = (event.detail, total)
            self.forgotten += _remember(self._waiting, event.request_id, pair, self.max_tracked)
            return
        self.hit_ratio.observe(min(event.detail / total, 1.0))

    def _on_end(self, event: Event) -> None:
        op = event.op
        if op == "l2.load":
            started = self._loads.pop(event.span, None)
            if started is not None:
                self.load_seconds.labels(event.tier).observe(max(event.ts_ns - started, 0) / 1e9)
        elif op == "l2.prefetch" and not event.tier:
            waiting = self._waiting.pop(event.request_id, None)
            if waiting is not None:
                hit, total = waiting
                self.hit_ratio.observe(min((hit + event.detail * self.chunk_size) / total, 1.0))


class _Figures(Collector):
    def __init__(self, metrics: EventMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "kvdepot_event_metrics_forgotten", "Chunk store times (and waiting lookups) forgotten, oldest "
            "first, to stay within events.tracked_chunks: their next hit or eviction is not observed.",
            value=self.metrics.forgotten,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "kvdepot_event_metrics_tracked", "Chunk store times, loads and lookups the histograms keep now.",
            value=self.metrics.tracked(),
        )  # fmt: skip
