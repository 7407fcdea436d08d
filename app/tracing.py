"""Wiring of tracing (api/tracing): built from `settings.tracing` only when its `otlp_endpoint` is set
(otherwise nothing is built, nothing subscribes to the bus: no cost): the span builder subscribed to
the event bus, handing finished spans to the OTLP/HTTP exporter's thread (protobuf encoded there,
api/tracing/otlp.py), whose resource names this sidecar (service.name=kvdepot, service.version,
service.instance.id, with the SDK's telemetry.sdk.* and OTEL_RESOURCE_ATTRIBUTES), and its figures
in the registry.

Tests and benchmarks may give an SDK span exporter (the SDK's InMemorySpanExporter) instead of the
OTLP one: each span is then made into the SDK's ReadableSpan and exported at once.

Primitives in call order: build_tracing(settings, instance_id, registry[, exporter]) -> Tracing |
None -> Tracing.subscriber (to the bus) -> Tracing.run_sweeper() (a supervised task) ->
Tracing.close() (ends what is open, exports what is queued, stops the exporter).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client import CollectorRegistry

from api.tracing.config import TracingSettings
from api.tracing.export import OtlpExporter, SdkSpanSink, SpanSink
from api.tracing.metrics import TracingCollector
from api.tracing.otlp import OtlpEncoder
from api.tracing.spans import SpanBuilder
from app import __version__
from app.errors import ConfigError
from engine.events import Subscriber

#: how often open spans are checked for orphans (at most; a tenth of the timeout when shorter)
SWEEP_S = 5.0


@dataclass(frozen=True, slots=True)
class Tracing:
    builder: SpanBuilder
    sink: SpanSink
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
        self.sink.close()


def build_tracing(
    settings: TracingSettings, instance_id: str, registry: CollectorRegistry | None = None,
    exporter: SpanExporter | None = None,
) -> Tracing | None:  # fmt: skip
    """Tracing per `settings` (None when `otlp_endpoint` is unset and no `exporter` is given).
    `exporter`: export there, synchronously as each span ends (tests), instead of OTLP."""
    if settings.otlp_endpoint is None and exporter is None:
        return None
    resource = Resource.create(
        {
            "service.name": "kvdepot",
            "service.version": __version__,
            "service.instance.id": settings.service_instance_id or instance_id,
        }
    )
    sink: SpanSink
    if exporter is not None:
        sink = SdkSpanSink(exporter, resource, InstrumentationScope("kvdepot", __version__))
    else:
        assert settings.otlp_endpoint is not None
        encoder = OtlpEncoder(resource.attributes, resource.schema_url, "kvdepot", __version__)
        try:
            sink = OtlpExporter(
                settings.otlp_endpoint, encoder, timeout_s=settings.export_timeout_s,
                queue=settings.export_queue,
            )  # fmt: skip
        except ValueError as exc:  # an OTEL_EXPORTER_OTLP_* file or value it cannot use
            raise ConfigError(f"tracing: {exc}") from None
    builder = SpanBuilder(
        sink, orphan_timeout_s=settings.orphan_timeout_s, max_open=settings.max_open_spans,
        sample_ratio=settings.sample_ratio,
    )  # fmt: skip
    if registry is not None:
        registry.register(TracingCollector(builder, sink if isinstance(sink, OtlpExporter) else None))
    return Tracing(builder, sink, min(SWEEP_S, settings.orphan_timeout_s / 10))
