"""Prometheus figures of the KV-event publisher, read at scrape time (the hot path bumps ints)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from api.kvevents.publisher import KvEventPublisher


class KvEventsCollector(Collector):
    def __init__(self, publisher: KvEventPublisher) -> None:
        self.publisher = publisher

    def collect(self) -> Iterator[Metric]:
        p = self.publisher
        yield CounterMetricFamily(
            "kvdepot_kv_events_sent", "KV-event batches handed to the PUB socket.", value=p.sent
        )
        yield CounterMetricFamily(
            "kvdepot_kv_events_dropped",
            "KV-event batches a full subscriber queue refused (still in the replay buffer).",
            value=p.dropped,
        )
        by_type = CounterMetricFamily(
            "kvdepot_kv_events_events", "KV events published, by type.", labels=["type"]
        )
        for name, n in p.events_sent.items():
            by_type.add_metric([name], n)
        yield by_type
        yield CounterMetricFamily(
            "kvdepot_kv_events_unknown_layout",
            "Chunk events not published: no engine registered their layout since the start.",
            value=p.namer.unknown_layout,
        )
        yield CounterMetricFamily("kvdepot_kv_events_replays", "Replay requests served.", value=p.replays)
        yield CounterMetricFamily(
            "kvdepot_kv_events_replays_refused",
            "Replay requests ignored: MAX_REPLAYS replays were being sent (the client asks again).",
            value=p.replays_refused,
        )
        yield CounterMetricFamily(
            "kvdepot_kv_events_bad_requests",
            "Malformed requests on the replay socket (ignored; logged at a bounded rate).",
            value=p.bad_requests.count,
        )
        yield CounterMetricFamily(
            "kvdepot_kv_events_subscriptions_refused",
            "Subscriptions the PUB socket did not apply: not this sidecar's topics, or past "
            "kv_events.max_subscriptions distinct model filters.",
            value=p.refused_subscriptions.count,
        )
        yield CounterMetricFamily(
            "kvdepot_kv_events_peers_dropped",
            "Connections to the PUB socket shut down: their peer sent more refused filters than its "
            "budget (libzmq keeps every filter a connected peer sent).",
            value=p.peers.dropped if p.peers is not None else 0,
        )
        yield GaugeMetricFamily(
            "kvdepot_kv_events_sequence", "Sequence number of the last batch published.", value=p.last_seq
        )
        yield GaugeMetricFamily(
            "kvdepot_kv_events_subscribers", "Subscriptions on the PUB socket.", value=p.subscribers
        )
