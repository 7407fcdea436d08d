"""The OTLP encoding written directly (api/tracing/otlp.py) against the SDK's encoder of the same
spans, decoded by opentelemetry-proto; the exporter's thread posting to a real OTLP/HTTP receiver
(bench/otlp.py), counting what a dead endpoint loses and what a full queue drops; sampling
decided once per request."""

from __future__ import annotations

import socket
import time

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from api.tracing.export import OtlpExporter, SdkSpanSink
from api.tracing.otlp import OtlpEncoder, SpanRecord
from api.tracing.spans import ROOT, SpanBuilder
from bench.otlp import OtlpReceiver
from engine.events import Event, Kind

TRACE = 0x0AF7651916CD43DD8448EB211C80319C
T = 1_764_000_000_000_000_000
RECORDS: list[SpanRecord] = [
    # a root under a remote parent (an engine's traceparent), and one of its own
    (ROOT, TRACE, 0x1111, 0xB7AD6B7169203331, True, 100, 900, (("kvdepot.request_id", "r-é"),), None),
    (ROOT, TRACE + 1, 0x2222, 0, False, 5, 6, (("kvdepot.request_id", "x"), ("kvdepot.orphan", True)),
     "orphan"),
    # children: attributes of every type, an error status, a big timestamp
    ("prefetch", TRACE, 0x3333, 0x1111, False, 110, 150, (("kvdepot.adapter", "disk"), ("kvdepot.chunks", 4)),
     None),
    ("retrieve", TRACE, 0x4444, 0x1111, False, T, T + 1, (), "not_found"),
    ("store", TRACE, 0x5555, 0x1111, False, 1, 2, (("f", 0.5), ("no", False), ("big", 1 << 40)), ""),
]  # fmt: skip


def resource() -> Resource:
    return Resource.create({"service.name": "kvdepot", "service.instance.id": "host/1"})


def test_the_direct_encoding_decodes_to_what_the_sdk_encoder_makes_of_the_same_spans() -> None:
    res, scope = resource(), InstrumentationScope("kvdepot", "1.2.3")
    sink = SdkSpanSink(InMemorySpanExporter(), res, scope)
    expected = encode_spans([sink.readable(r) for r in RECORDS])
    ours = ExportTraceServiceRequest()
    ours.ParseFromString(OtlpEncoder(res.attributes, res.schema_url, "kvdepot", "1.2.3").encode(RECORDS))
    assert ours == expected, f"{ours}\n!=\n{expected}"
    spans = ours.resource_spans[0].scope_spans[0].spans
    assert [s.name for s in spans] == [r[0] for r in RECORDS]
    assert spans[0].flags & 0x300 == 0x300 and spans[2].flags & 0x300 == 0x100


def test_a_child_gets_a_fresh_span_id_when_encoded() -> None:
    record: SpanRecord = ("lookup", TRACE, 0, 0x1111, False, 1, 2, (), None)
    encoder = OtlpEncoder({}, "", "kvdepot", None)
    ids = set()
    for _ in range(3):
        request = ExportTraceServiceRequest()
        request.ParseFromString(encoder.encode([record]))
        ids.add(request.resource_spans[0].scope_spans[0].spans[0].span_id)
    assert len(ids) == 3 and all(len(i) == 8 and i != bytes(8) for i in ids)


def test_the_exporter_posts_every_record_to_a_real_receiver() -> None:
    receiver = OtlpReceiver(keep=1000)
    res = resource()
    encoder = OtlpEncoder(res.attributes, res.schema_url, "kvdepot", "1")
    exporter = OtlpExporter(receiver.endpoint, encoder, timeout_s=5, queue=10_000, batch=64, delay_s=0.05)
    try:
        for i in range(300):
            exporter.add(("lookup", TRACE, i + 1, 0x1111, False, i, i + 1, (("kvdepot.chunks", i),), None))
        assert exporter.flush()
    finally:
        exporter.close()
        figures = receiver.stop()
    assert exporter.exported == figures["spans"] == 300 and figures["errors"] == 0
    assert figures["exports"] >= 300 // 64
    got = sorted(receiver.received(), key=lambda s: s.start_ns)
    assert [s.attributes["kvdepot.chunks"] for s in got] == list(range(300))
    assert got[5].span_id == format(6, "016x") and got[5].parent_span_id == format(0x1111, "016x")


def test_a_dead_endpoint_loses_batches_counted_and_a_full_queue_drops() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    encoder = OtlpEncoder({}, "", "kvdepot", None)
    exporter = OtlpExporter(f"http://127.0.0.1:{port}/v1/traces", encoder, timeout_s=1, queue=64, delay_s=60)
    try:
        for i in range(70):
            exporter.add(("lookup", TRACE, 0, 1, False, i, i, (), None))
        assert exporter.dropped == 6
        exporter.flush()
    finally:
        exporter.close()
    assert exporter.failed == 1 and exporter.failed_spans == 64 and exporter.exported == 0


def test_an_endpoint_that_never_answers_does_not_hold_up_shutdown() -> None:
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1/traces"
        exporter = OtlpExporter(url, OtlpEncoder({}, "", "k", None), timeout_s=30, queue=64, delay_s=0.01)
        for i in range(10):
            exporter.add(("lookup", TRACE, 0, 1, False, i, i, (), None))
        deadline = time.monotonic() + 10
        while exporter.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert exporter.pending() == 0, "the thread took the batch"
        began = time.monotonic()
        exporter.close(timeout_s=0.3)
        assert time.monotonic() - began < 2
    assert exporter.failed_spans == 10 and exporter.exported == 0


def lookup_pair(span: int, rid: str, ts: int, trace: str = "") -> list[Event]:
    return [Event(Kind.START, ts, op="lookup", request_id=rid, span=span, trace=trace),
            Event(Kind.END, ts + 1, op="lookup", request_id=rid, span=span)]  # fmt: skip


def test_an_unsampled_request_makes_nothing_and_keeps_no_children() -> None:
    exporter = InMemorySpanExporter()
    sink = SdkSpanSink(exporter, resource(), InstrumentationScope("test"))
    never = SpanBuilder(sink, orphan_timeout_s=10, max_open=100, sample_ratio=0.0)
    never.on_events([Event(Kind.START, 1, op="store", request_id="r", span=1)])
    assert never.open_spans() == 1  # the request's decision, no child
    never.on_events([*lookup_pair(2, "r", 2), Event(Kind.END, 3, op="store", request_id="r", span=1)])
    never.on_events([Event(Kind.START, 4, op="end_request", request_id="r", span=3),
                     Event(Kind.END, 5, op="end_request", request_id="r", span=3)])  # fmt: skip
    never.on_events(lookup_pair(4, "r", 6))  # late: still unsampled, not a new root
    assert never.open_spans() == 0 and exporter.get_finished_spans() == ()
    assert never.started == never.ended == never.unmatched == 0
    # an engine that samples decides over the ratio, and one that does not over a ratio of 1
    sampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    never.on_events(lookup_pair(5, "e", 10, trace=sampled))
    always = SpanBuilder(sink, orphan_timeout_s=10, max_open=100, sample_ratio=1.0)
    always.on_events(lookup_pair(6, "f", 10, trace=sampled[:-2] + "00"))
    always.on_events(lookup_pair(7, "g", 10))
    names = sorted(s.name for s in exporter.get_finished_spans())
    assert names == ["lookup", "lookup"] and never.started == 2 and always.started == 2
