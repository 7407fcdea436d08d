"""The tracing subscriber's figures, read when Prometheus scrapes (registered only when tracing is on)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from api.tracing.export import OtlpExporter
from api.tracing.spans import SpanBuilder

COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("trace_spans_started", "Spans started (roots and children).", "started"),
    ("trace_spans_ended", "Spans ended, orphans included.", "ended"),
    ("trace_orphan_spans", "Spans ended by the orphan timeout: their END never came.", "orphans"),
    ("trace_spans_refused", "Spans not made: tracing.max_open_spans were open.", "refused"),
    ("trace_unmatched_ends", "END events without their START (refused, dropped by the bus).", "unmatched"),
)
EXPORT_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("trace_spans_exported", "Spans the OTLP endpoint accepted.", "exported"),
    ("trace_spans_dropped", "Ended spans not exported: tracing.export_queue spans waited.", "dropped"),
    ("trace_export_failed_spans", "Spans lost with an export request that failed (after retries).",
     "failed_spans"),
)  # fmt: skip


class TracingCollector(Collector):
    def __init__(self, builder: SpanBuilder, exporter: OtlpExporter | None = None) -> None:
        """`exporter`: its figures too (the OTLP exporter; none when spans go to an SDK exporter)."""
        self.builder = builder
        self.exporter = exporter

    def collect(self) -> Iterator[Metric]:
        for name, help_text, attribute in COUNTERS:
            yield CounterMetricFamily(f"kvdepot_{name}", help_text, value=getattr(self.builder, attribute))
        yield GaugeMetricFamily(
            "kvdepot_trace_open_spans", "Spans open now (roots and children).",
            value=self.builder.open_spans(),
        )  # fmt: skip
        if self.exporter is not None:
            for name, help_text, attribute in EXPORT_COUNTERS:
                value = getattr(self.exporter, attribute)
                yield CounterMetricFamily(f"kvdepot_{name}", help_text, value=value)
