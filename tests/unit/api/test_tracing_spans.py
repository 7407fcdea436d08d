"""SpanBuilder fed hand-made event sequences, exporting to the SDK's in-memory exporter: nesting,
timestamps, a root that waits for its open children, late write-behind joining an ended root,
orphans ended and counted, the open-span cap, ENDs without STARTs, error status."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import StatusCode

from api.tracing.export import SdkSpanSink
from api.tracing.spans import ROOT, SpanBuilder
from engine.events import Event, Kind

S = 1_000_000_000


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def builder(
    exporter: InMemorySpanExporter, *, timeout_s: float = 10.0, max_open: int = 1000, ratio: float = 1.0
) -> SpanBuilder:
    sink = SdkSpanSink(exporter, Resource.create(), InstrumentationScope("test"))
    return SpanBuilder(sink, orphan_timeout_s=timeout_s, max_open=max_open, sample_ratio=ratio)


def start(span: int, op: str, rid: str, ts: int, tier: str = "", trace: str = "") -> Event:
    return Event(Kind.START, ts, op=op, request_id=rid, span=span, tier=tier, trace=trace)


def end(span: int, op: str, rid: str, ts: int, tier: str = "", reason: str = "ok", detail: int = 0) -> Event:
    return Event(Kind.END, ts, op=op, request_id=rid, span=span, tier=tier, reason=reason, detail=detail)


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {s.name: s for s in exporter.get_finished_spans()}


def test_children_nest_under_one_root_at_their_event_times(exporter: InMemorySpanExporter) -> None:
    b = builder(exporter)
    b.on_events([
        start(1, "lookup", "r", 100), start(2, "l2.prefetch", "r", 110),
        start(3, "l2.prefetch", "r", 111, "disk"), end(1, "lookup", "r", 120),
        end(3, "l2.prefetch", "r", 150, "disk", detail=4), end(2, "l2.prefetch", "r", 151, detail=4),
        start(4, "retrieve", "r", 160), end(4, "retrieve", "r", 170),
        start(5, "end_request", "r", 180), end(5, "end_request", "r", 190),
    ])  # fmt: skip
    spans = by_name(exporter)
    assert set(spans) == {ROOT, "lookup", "prefetch", "retrieve"}  # the whole prefetch (tier "") is no span
    root = spans[ROOT]
    assert (root.start_time, root.end_time) == (100, 190)
    assert root.context is not None
    for name, (t0, t1) in {"lookup": (100, 120), "prefetch": (111, 150), "retrieve": (160, 170)}.items():
        span = spans[name]
        assert (span.start_time, span.end_time) == (t0, t1)
        assert span.parent is not None and span.parent.span_id == root.context.span_id
    assert spans["prefetch"].attributes is not None
    assert spans["prefetch"].attributes["kvdepot.chunks"] == 4
    assert b.open_spans() == 0 and b.started == b.ended == 4


def test_the_root_waits_for_open_children_and_late_writes_join_its_trace(
    exporter: InMemorySpanExporter,
) -> None:
    b = builder(exporter)
    b.on_events([
        start(1, "store", "r", 100), end(1, "store", "r", 110), start(2, "l2.store", "r", 115, "disk"),
        start(3, "end_request", "r", 120), end(3, "end_request", "r", 121),
    ])  # fmt: skip
    assert ROOT not in by_name(exporter), "a write-behind of the request is still open"
    b.on_events([end(2, "l2.store", "r", 140, "disk", detail=2)])
    root = by_name(exporter)[ROOT]
    assert root.end_time == 140 and root.context is not None
    # a decode save written behind after the request ended: a child of the ended root
    b.on_events([start(4, "l2.store", "r", 200, "redis"), end(4, "l2.store", "r", 210, "redis", detail=1)])
    late = [s for s in exporter.get_finished_spans() if s.name == "write_behind" and s.start_time == 200]
    assert len(late) == 1 and late[0].parent is not None
    assert late[0].parent.span_id == root.context.span_id
    assert b.open_spans() == 0


def test_a_traceparent_makes_the_root_a_child_in_that_trace(exporter: InMemorySpanExporter) -> None:
    b = builder(exporter)
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    b.on_events([start(1, "lookup", "r", 10, trace=tp), end(1, "lookup", "r", 20),
                 start(2, "end_request", "r", 30), end(2, "end_request", "r", 31)])  # fmt: skip
    root = by_name(exporter)[ROOT]
    assert root.context is not None and root.parent is not None
    assert format(root.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert format(root.parent.span_id, "016x") == "b7ad6b7169203331"


def test_orphans_are_ended_and_counted(exporter: InMemorySpanExporter) -> None:
    b = builder(exporter, timeout_s=1.0)
    b.on_events([start(1, "lookup", "a", 0), end(1, "lookup", "a", 10), start(2, "retrieve", "b", 0)])
    assert b.sweep(S // 2) == 0
    assert b.sweep(2 * S) == 3  # a's root (silent), b's retrieve and then b's root
    assert b.orphans == 3 and b.open_spans() == 0
    spans = exporter.get_finished_spans()
    assert len(spans) == 4
    for span in spans:
        if span.name != "lookup":
            assert span.attributes is not None and span.attributes["kvdepot.orphan"] is True
            assert span.status.status_code is StatusCode.ERROR
    roots = sorted(s.end_time or 0 for s in spans if s.name == ROOT)
    # a's root ends at its last activity, b's no earlier than its orphaned child
    assert roots == [10, 2 * S]


def test_the_cap_refuses_new_spans_and_ends_without_starts_are_counted(
    exporter: InMemorySpanExporter,
) -> None:
    b = builder(exporter, max_open=16)
    b.on_events([start(i, "lookup", f"r{i}", i) for i in range(1, 20)])
    assert b.open_spans() <= 16 and b.refused > 0
    b.on_events([end(i, "lookup", f"r{i}", 100 + i) for i in range(1, 20)])
    assert b.unmatched == b.refused
    b.on_events([end(99, "retrieve", "x", 5, reason="not_found")])
    assert b.unmatched == b.refused + 1


def test_an_error_end_marks_the_span(exporter: InMemorySpanExporter) -> None:
    b = builder(exporter)
    b.on_events([start(1, "retrieve", "r", 1), end(1, "retrieve", "r", 2, reason="not_found")])
    span = by_name(exporter)["retrieve"]
    assert span.status.status_code is StatusCode.ERROR and span.status.description == "not_found"
    assert b.close(10) == 1  # the root, still open, ends at shutdown
    assert by_name(exporter)[ROOT].end_time == 10
