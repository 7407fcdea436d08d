"""Wiring of tracing (api/tracing): built from `settings.tracing` only when its `otlp_endpoint` is set
(otherwise nothing is built, nothing subscribes to the bus: no cost), with an OpenTelemetry SDK
tracer provider whose resource names this sidecar (service.name=kvdepot, service.version,
service.instance.id), a batch span processor exporting over OTLP/HTTP (protobuf) from its own
thread, the span builder subscribed to the event bus and its figures in the registry.

Tests and benchmarks may give their own span exporter (the SDK's InMemorySpanExporter) instead of
the OTLP one.

Primitives in call order: build_tracing(settings, instance_id, registry[, exporter]) -> Tracing |
None -> Tracing.subscriber (to the bus) -> Tracing.run_sweeper() (a supervised task) ->
Tracing.close() (ends what is open, flushes, shuts the provider down).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.util.types import AnyValue
from prometheus_client import CollectorRegistry

from api.tracing.config import TracingSettings
from api.tracing.metrics import TracingCollector
from api.tracing.spans import SpanBuilder
from app import __version__
from engine.events import Subscriber

#: how often open spans are checked for orphans (at most; a tenth of the timeout when shorter)
SWEEP_S = 5.0


class FixedResource(Resource):
    """The sidecar's resource with its hash computed once: the OTLP encoder hashes the resource of
    every span it encodes (a JSON dump of the attributes each time, a third of the encoding)."""

    def __init__(self, attributes: Mapping[str, AnyValue], schema_url: str | None = None) -> None:
        super().__init__(attributes, schema_url)
        self._fixed_hash = super().__hash__()

    def __hash__(self) -> int:
        return self._fixed_hash


@dataclass(frozen=True, slots=True)
class Tracing:
    builder: SpanBuilder
    provider: TracerProvider
    sweep_s: float

    @property
    def subscriber(self) -> Subscriber:
        return self.builder.on_events

    async def run_sweeper(self) -> None:
        """End orphans every `sweep_s` until cancelled."""
        while True:
            await asyncio.sleep(self.sweep_s)
            self.builder.sweep(time.time_ns())

    def close(self) -> None:
        self.builder.close(time.time_ns())
        self.provider.force_flush(timeout_millis=2000)
        self.provider.shutdown()


def build_tracing(
    settings: TracingSettings, instance_id: str, registry: CollectorRegistry | None = None,
    exporter: SpanExporter | None = None,
) -> Tracing | None:  # fmt: skip
    """Tracing per `settings` (None when `otlp_endpoint` is unset and no `exporter` is given).
    `exporter`: export there, synchronously as each span ends (tests), instead of OTLP."""
    if settings.otlp_endpoint is None and exporter is None:
        return None
    created = Resource.create(
        {
            "service.name": "kvdepot",
            "service.version": __version__,
            "service.instance.id": settings.service_instance_id or instance_id,
        }
    )
    resource = FixedResource(created.attributes, created.schema_url)
    sampler = ParentBased(TraceIdRatioBased(settings.sample_ratio))
    provider = TracerProvider(resource=resource, sampler=sampler)
    processor: SpanProcessor
    if exporter is not None:
        processor = SimpleSpanProcessor(exporter)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        otlp = OTLPSpanExporter(endpoint=settings.otlp_endpoint, timeout=settings.export_timeout_s)
        processor = BatchSpanProcessor(otlp, max_queue_size=settings.export_queue, schedule_delay_millis=1000)
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("kvdepot", __version__)
    builder = SpanBuilder(
        tracer, processor, provider.resource, orphan_timeout_s=settings.orphan_timeout_s,
        max_open=settings.max_open_spans, version=__version__,
    )  # fmt: skip
    if registry is not None:
        registry.register(TracingCollector(builder))
    return Tracing(builder, provider, min(SWEEP_S, settings.orphan_timeout_s / 10))
