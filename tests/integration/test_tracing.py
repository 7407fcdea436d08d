"""Traces of a real sidecar (the service built and run in this process, a disk L2 under its data
dir, the real connector client over the data-plane socket from a thread): one engine request that
misses L1 and loads from L2 gives a root span with lookup, prefetch(disk) and retrieve children,
nested and ordered in time, in the trace of the traceparent the client sent. The spans reach the
SDK's in-memory exporter, the one thing that differs from an OTLP export."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.main import Service
from app.settings_load import load_settings
from tests.integration.dp_client import LAYOUT, chunk_data, client, request_tokens

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN}-01"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("KVDEPOT_"):
            monkeypatch.delenv(name)


def settings(data_dir: Path, **extra: Any) -> Any:
    return load_settings({
        "data_dir": data_dir, "http.port": 0, "l1.size_gb": 1 / 1024, "l1.populate": False,
        "l1.chunk_size": 16, "l2.prefetch_deadline_ms": 5000,
        "l2.adapters": [{"type": "disk", "name": "disk", "fsync": "never"}],
        "events.linger_ms": 0, **extra,
    })  # fmt: skip


async def until(check: Callable[[], bool], what: str, within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def drive(service: Service, exporter: InMemorySpanExporter) -> None:
    """Store 24 chunks through a 16-chunk L1 (written behind to disk), then LOOKUP (wait) the
    first request again under the traceparent, RETRIEVE it and end it."""
    task = asyncio.get_running_loop().create_task(service.run())
    try:
        await until(lambda: not service.not_ready() or task.done(), "the service to be ready")
        assert not task.done(), task.result()
        assert service.l2 is not None and service.dataplane is not None
        c = await asyncio.to_thread(client, service.dataplane.url)
        try:
            for n, seed in enumerate((11, 12, 13), start=1):
                toks = request_tokens(seed, 8)
                data = [chunk_data(seed, i) for i in range(8)]
                got = await asyncio.to_thread(c.store, toks, data, request_id=f"w{seed}")
                assert got.stored == 8
                await until(lambda n=n: service.l2 is not None and service.l2.store.counters.written >= 8 * n,
                            "write-behind")  # fmt: skip
            toks = request_tokens(11, 8)
            reply = await asyncio.to_thread(
                lambda: c.lookup(toks, request_id="r11", wait=True, traceparent=TRACEPARENT)
            )
            assert reply.hit_chunks == 8 and reply.pending_chunks == 0
            outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(8)]
            assert await asyncio.to_thread(c.retrieve, "r11", outs)
            for i, out in enumerate(outs):
                assert torch.equal(out, chunk_data(11, i)), f"chunk {i} differs"
            await asyncio.to_thread(c.end_request, "r11")
        finally:
            await asyncio.to_thread(c.close)
        assert service.l2.prefetch.counters.chunks_loaded >= 1, "the request should have missed L1"
        await until(lambda: any(s.name == "kvdepot.request" and s.attributes is not None
                                and s.attributes.get("kvdepot.request_id") == "r11"
                                for s in exporter.get_finished_spans()), "the root span of r11")  # fmt: skip
    finally:
        service.request_stop()
        assert await asyncio.wait_for(task, 20) == 0


def spans_of(exporter: InMemorySpanExporter, request_id: str) -> list[ReadableSpan]:
    """The root of `request_id` (named by its attribute) and every span of its trace under it."""
    spans = exporter.get_finished_spans()
    roots = [
        s for s in spans
        if s.name == "kvdepot.request" and s.attributes is not None
        and s.attributes.get("kvdepot.request_id") == request_id
    ]  # fmt: skip
    ids = {r.context.span_id for r in roots if r.context is not None}
    return roots + [s for s in spans if s.parent is not None and s.parent.span_id in ids]


def test_a_request_loaded_from_l2_is_one_root_with_lookup_prefetch_and_retrieve(
    tmp_path: Path, clean_env: None
) -> None:
    exporter = InMemorySpanExporter()
    service = Service(settings(tmp_path / "svc"), span_exporter=exporter)
    service.build()
    try:
        asyncio.run(drive(service, exporter))
    finally:
        service.close()
    spans = spans_of(exporter, "r11")
    roots = [s for s in spans if s.name == "kvdepot.request"]
    assert len(roots) == 1
    root = roots[0]
    assert root.context is not None and root.parent is not None
    # The root joins the engine's trace, as a child of the span the traceparent named.
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert format(root.parent.span_id, "016x") == PARENT_SPAN
    assert root.resource.attributes["service.name"] == "kvdepot"
    assert str(root.resource.attributes["service.instance.id"]).endswith("/" + service_instance(tmp_path))

    children = {s.name: s for s in spans if s is not root}
    assert {"lookup", "prefetch", "retrieve"} <= set(children), sorted(children)
    for child in children.values():
        assert child.parent is not None and child.parent.span_id == root.context.span_id, child.name
        assert child.context is not None and child.context.trace_id == root.context.trace_id
        assert child.start_time is not None and child.end_time is not None
        assert root.start_time is not None and root.end_time is not None
        assert root.start_time <= child.start_time <= child.end_time <= root.end_time, child.name
    lookup, prefetch, retrieve = children["lookup"], children["prefetch"], children["retrieve"]
    assert prefetch.attributes is not None
    assert prefetch.attributes["kvdepot.adapter"] == "disk"
    assert int(str(prefetch.attributes["kvdepot.chunks"])) >= 1
    assert lookup.start_time is not None and prefetch.start_time is not None
    assert prefetch.end_time is not None and lookup.end_time is not None and retrieve.start_time is not None
    # The lookup started the prefetch and (wait=True) answered once it was done; the retrieve came after.
    assert lookup.start_time <= prefetch.start_time
    assert prefetch.end_time <= lookup.end_time <= retrieve.start_time
    assert root.start_time == lookup.start_time  # the request's first event opened its root
    # The histograms made from the same events.
    assert service.control is not None
    sample = service.control.registry.get_sample_value
    assert (sample("kvdepot_l2_load_seconds_count", {"adapter": "disk"}) or 0) >= 1
    assert (sample("kvdepot_lookup_hit_ratio_bucket", {"le": "1.0"}) or 0) >= 1
    assert (sample("kvdepot_lookup_hit_ratio_bucket", {"le": "0.99"}) or 0) < (
        sample("kvdepot_lookup_hit_ratio_count") or 0
    ), "r11 hit all its tokens once its prefetch was done"
    assert (sample("kvdepot_reuse_distance_seconds_count") or 0) >= 1
    assert (sample("kvdepot_chunk_age_at_eviction_seconds_count", {"tier": "l1"}) or 0) >= 1
    # The write-behind of the stores is traced too, per adapter.
    writes = [s for s in spans_of(exporter, "w12") if s.name == "write_behind"]
    assert writes
    assert all(s.attributes is not None and s.attributes["kvdepot.adapter"] == "disk" for s in writes)


def service_instance(tmp_path: Path) -> str:
    from engine.l1.arena import instance_id

    return instance_id(tmp_path / "svc")


def test_tracing_unset_builds_nothing_and_subscribes_nothing(tmp_path: Path, clean_env: None) -> None:
    service = Service(settings(tmp_path / "svc"))
    service.build()
    try:
        assert service.tracing is None
        assert service.event_metrics is not None
        assert service.event_subscribers() == [service.event_metrics.on_events]  # the histograms only
    finally:
        service.close()
