"""Prometheus metrics of the worker registry (engine/workers.py), read at scrape time:
`kvdepot_workers{state}` (live workers alive or suspect, and the dead ones kept),
`kvdepot_worker_suspect_total`, `kvdepot_worker_dead_total`, `kvdepot_worker_revived_total`,
`kvdepot_worker_heartbeats_total`."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from api.metrics import single
from engine.workers import WorkerRegistry

TOTALS = [
    ("worker_suspect", "Workers that went suspect (silent past fleet.worker_timeout_s).", "suspect"),
    ("worker_dead", "Workers whose session ended (lifeline closed, replaced or evicted).", "dead"),
    ("worker_revived", "Suspect workers that heartbeated again.", "revived"),
    ("worker_heartbeats", "Heartbeats received over lifelines.", "heartbeats"),
]


class WorkerCollector(Collector):
    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            "kvdepot_workers", "Engine client processes by state (dead: the ones kept).", labels=["state"]
        )
        for state, n in self.registry.by_state().items():
            gauge.add_metric([state.value], n)
        yield gauge
        yield from single(CounterMetricFamily, TOTALS, self.registry.totals)
