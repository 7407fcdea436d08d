"""`tracing` settings: OpenTelemetry spans of each engine request, exported over OTLP (composed into
app/settings.py). Off unless `otlp_endpoint` is set: then nothing is built or subscribed."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class TracingSettings(BaseModel):
    """Spans from the event bus's START/END pairs: one root span per engine request."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    otlp_endpoint: str | None = Field(
        None, max_length=500,
        description="OTLP/HTTP (protobuf) traces endpoint, e.g. http://127.0.0.1:4318/v1/traces; unset = "
        "no tracing (no subscriber, no cost).",
    )  # fmt: skip
    service_instance_id: str | None = Field(
        None, max_length=200,
        description="The resource's service.instance.id; default: host name and data-plane URL.",
    )  # fmt: skip
    sample_ratio: float = Field(
        1.0, ge=0, le=1,
        description="Share of requests traced when the engine sent no trace context (one that did "
        "decides itself: its sampled flag is followed).",
    )  # fmt: skip
    orphan_timeout_s: float = Field(
        60.0, gt=0, le=86400,
        description="A span open this long (a request root: silent this long) is ended as an orphan "
        "(counted in kvdepot_trace_orphan_spans_total).",
    )  # fmt: skip
    max_open_spans: int = Field(
        100_000, ge=16, le=10_000_000,
        description="Spans open at once; past it new ones are not made (counted).",
    )  # fmt: skip
    export_queue: int = Field(
        8192, ge=64, le=1 << 20, description="Ended spans queued for export; past it they are dropped."
    )
    export_timeout_s: float = Field(10.0, gt=0, le=300, description="One export request's timeout.")

    @field_validator("otlp_endpoint")
    @classmethod
    def _check_endpoint(cls, endpoint: str | None) -> str | None:
        if endpoint is None:
            return None
        if not endpoint.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL (OTLP over HTTP, protobuf)")
        return endpoint
