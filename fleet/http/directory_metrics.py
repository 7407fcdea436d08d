"""Prometheus metrics of the directory, read at scrape time from its state:
`kvdepot_directory_instances{state}` (live, stale), `kvdepot_directory_chunks` (index entries),
`kvdepot_directory_batches_total`, `kvdepot_directory_chunk_events_total` (chunk events applied),
`kvdepot_directory_duplicates_total`, `kvdepot_directory_gaps_repaired_total{by}` (replay,
inventory), `kvdepot_directory_resyncs_total{reason}`, `kvdepot_directory_bad_batches_total`,
`kvdepot_directory_registrations_total`, `kvdepot_directory_chunks_capped_total`,
`kvdepot_directory_event_disconnects_total`, `kvdepot_directory_events_dropped_total`,
`kvdepot_directory_instances_forgotten_total`,
`kvdepot_directory_score_requests_total`,
`kvdepot_directory_match_requests_total`; with the matcher on, `kvdepot_directory_repeated_chunks_total`,
`kvdepot_directory_match_collisions_total`, `kvdepot_directory_match_entries`."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleet.directory import Directory

_GAP_REASONS = ("replay_short", "replay_timeout", "no_replay", "reconnect")


class DirectoryCollector(Collector):
    def __init__(self, directory: Directory) -> None:
        self.directory = directory

    def collect(self) -> Iterator[Metric]:
        d = self.directory
        s = d.stats
        now = time.monotonic()
        live = sum(1 for i in d.registry.instances.values() if d.registry.alive(i, now))
        g = GaugeMetricFamily("kvdepot_directory_instances", "Known sidecars by state.", labels=["state"])
        g.add_metric(["live"], live)
        g.add_metric(["stale"], len(d.registry) - live)
        yield g
        yield GaugeMetricFamily("kvdepot_directory_chunks", "Chunks in the index.", value=len(d.index))
        for name, doc, value in (
            ("batches", "KV-event batches applied.", s.batches),
            ("chunk_events", "Chunk events (stored/removed) applied.", s.chunk_events),
            ("duplicates", "Batches skipped as already applied.", s.duplicates),
            ("bad_batches", "Messages that were not KV-event batches.", s.bad_batches),
            ("registrations", "Registrations and heartbeats received.", s.registrations),
            ("chunks_capped", "Chunks announced past an instance's max_chunks_per_instance, dropped.",
             d.registry.capped),
            ("event_disconnects", "KV-event connections lost (a frame past max_event_bytes included).",
             s.event_disconnects),
            ("events_dropped", "KV-event messages dropped past max_queued_event_bytes (the instance "
             "is resynced from its inventory).", s.events_dropped),
            ("instances_forgotten", "Registered instances forgotten after forget_after timeouts.",
             d.registry.forgotten),
            ("score_requests", "Score requests answered.", d.scorer.requests),
            ("match_requests", "Match requests answered.", d.scorer.match_requests),
        ):
            yield CounterMetricFamily(f"kvdepot_directory_{name}", doc, value=value)
        gaps = CounterMetricFamily(
            "kvdepot_directory_gaps_repaired", "Sequence gaps repaired, by what repaired them.", labels=["by"]
        )
        gaps.add_metric(["replay"], s.gaps_replayed)
        gaps.add_metric(["inventory"], sum(n for r, n in s.resyncs.items() if r in _GAP_REASONS))
        yield gaps
        resyncs = CounterMetricFamily(
            "kvdepot_directory_resyncs", "Holdings replaced from /inventory, by reason.", labels=["reason"]
        )
        for reason, n in sorted(s.resyncs.items()):
            resyncs.add_metric([reason], n)
        yield resyncs
        if d.matchers is not None:
            t = d.matchers.totals()
            yield CounterMetricFamily(
                "kvdepot_directory_repeated_chunks",
                "Chunks stored whose tokens were already held under another prefix (content computed "
                "again that prefix caching could not reuse).", value=t["repeated"],
            )  # fmt: skip
            yield CounterMetricFamily(
                "kvdepot_directory_match_collisions", "Fingerprint matches the full-hash check rejected.",
                value=t["collisions"],
            )  # fmt: skip
            yield GaugeMetricFamily(
                "kvdepot_directory_match_entries", "Chunks in the matcher's tables.", value=t["entries"]
            )
