"""The event bus in a real `kvdepot serve` process: data-plane traffic from a client moves the
events metrics (published, queue drained by the supervised dispatcher, nothing dropped); a queue
too small for a burst drops and counts while every data-plane call still succeeds; with
events.enabled=false every figure stays 0."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from bench.sidecar import SidecarProcess
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import chunk_data, client, request_tokens
from tests.integration.waiting import wait_for

ENV = {"KVDEPOT_L1__CHUNK_SIZE": "16", "KVDEPOT_L2__ADAPTERS": "[]"}
CHUNKS = 4


def figures(sc: SidecarProcess) -> dict[str, float]:
    with urllib.request.urlopen(sc.http + "/metrics", timeout=5) as answer:
        text = answer.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("kvdepot_events"):
            for sample in family.samples:
                out[sample.name] = sample.value
    return out


def traffic(sc: SidecarProcess, seed: int) -> None:
    """Store CHUNKS chunks (with a LoRA name), look them up, retrieve and release them."""
    c = client(sc.url)
    try:
        toks = request_tokens(seed, CHUNKS)
        stored = c.store(
            toks, [chunk_data(seed, i) for i in range(CHUNKS)], request_id=f"w{seed}", lora_name="sql"
        )
        assert stored.stored == CHUNKS
        assert c.lookup(toks, request_id=f"r{seed}").hit_chunks == CHUNKS
        c.end_request(f"r{seed}")
    finally:
        c.close()


def test_traffic_moves_the_event_metrics_and_the_dispatcher_drains(sidecar_factory: StartSidecar) -> None:
    sc = sidecar_factory(env=ENV, l1_size_gb=0.02)
    assert sc.get_json("/status")["components"]["events"] == "running"
    before = figures(sc)
    assert before["kvdepot_events_dropped_total"] == 0
    traffic(sc, 1)
    # at least: CHUNKS STORED + one LOOKUP + START/END of hello, register, store, commit, lookup
    wait_for(lambda: figures(sc)["kvdepot_events_published_total"] >= before["kvdepot_events_published_total"]
             + CHUNKS + 1 + 2 * 5, what="events published")  # fmt: skip
    wait_for(lambda: figures(sc)["kvdepot_events_queue"] == 0, what="the queue drained")
    after = figures(sc)
    assert after["kvdepot_events_dropped_total"] == 0
    assert after["kvdepot_events_subscriber_errors_total"] == 0


def test_a_burst_beyond_the_queue_is_dropped_and_counted_never_blocking(
    sidecar_factory: StartSidecar,
) -> None:
    # 16 events, and the dispatcher waits a second after each wake-up: the burst overflows.
    env = ENV | {"KVDEPOT_EVENTS__CAPACITY": "16", "KVDEPOT_EVENTS__LINGER_MS": "1000"}
    sc = sidecar_factory(env=env, l1_size_gb=0.02)
    for seed in (1, 2, 3):
        traffic(sc, seed)  # every call answered (asserted inside)
    got = figures(sc)
    assert got["kvdepot_events_dropped_total"] > 0
    assert got["kvdepot_events_queue"] <= 16
    wait_for(lambda: figures(sc)["kvdepot_events_queue"] == 0, what="the queue drained")


def test_disabled_events_stay_zero(sidecar_factory: StartSidecar) -> None:
    sc = sidecar_factory(env=ENV | {"KVDEPOT_EVENTS__ENABLED": "false"}, l1_size_gb=0.02)
    assert "events" not in sc.get_json("/status")["components"]
    traffic(sc, 1)
    assert figures(sc) == {
        "kvdepot_events_published_total": 0,
        "kvdepot_events_dropped_total": 0,
        "kvdepot_events_subscriber_errors_total": 0,
        "kvdepot_events_queue": 0,
    }
