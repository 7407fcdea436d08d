"""The router's Prometheus metrics, in a registry of its own (served at the router's `/metrics`).

State: the registry and its families; bumped by the router's event loop, read at scrape time.
The `engine` label is the engine's URL (bounded by the configured engines); `reason` and `kind`
come from fixed vocabularies (fleet/router.py, fleet/http/proxy.py).

Primitives: RouterMetrics(engine_urls); .routed / .fallback / .errors / .retries counters,
.in_flight gauge, .upstream_first_byte / .directory_seconds histograms; .render() -> bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["RouterMetrics"]

F = TypeVar("F", Counter, Gauge, Histogram)

UPSTREAM_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
DIRECTORY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class RouterMetrics:
    def __init__(self, engine_urls: Sequence[str]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._engine_urls = tuple(engine_urls)
        self.routed = self._per_engine(
            Counter("kvdepot_route_routed", "Requests sent to the engine the directory scored best.",
                    ["engine"], registry=r)
        )  # fmt: skip
        self.fallback = Counter(
            "kvdepot_route_fallback",
            "Requests sent to the least loaded engine instead, by reason (no_prefix, unknown_instance, "
            "imbalance, directory_down, directory_timeout, no_directory, no_model, tokenize_failed, "
            "bad_request, prompt_embeds, too_long, unsupported_path).",
            ["reason"], registry=r,
        )  # fmt: skip
        self.errors = Counter(
            "kvdepot_route_errors",
            "Failures, by kind: engine_connect, engine_timeout, engine_status, engine_broken (before "
            "any byte was sent back: retried), midstream (after: the client's stream is cut), "
            "no_engine, too_large, bad_json, directory, tokenize, client_gone (the client left before "
            "the answer started: the engine's request is dropped), header_timeout, body_timeout, "
            "connection_limit (a client connection cut: too slow, or one too many).",
            ["kind"], registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "kvdepot_route_retries", "Requests sent again to another engine after a failure.", registry=r
        )
        self.requests = Counter(
            "kvdepot_route_requests", "Requests answered, by endpoint and status class.",
            ["endpoint", "status"], registry=r,
        )  # fmt: skip
        self.in_flight = self._per_engine(
            Gauge("kvdepot_route_in_flight", "Requests in flight per engine through this router.",
                  ["engine"], registry=r)
        )  # fmt: skip
        self.upstream_first_byte = self._per_engine(
            Histogram(
                "kvdepot_route_upstream_first_byte_seconds",
                "From sending a request to an engine to its first byte of answer (headers and, for a "
                "stream, the first chunk).",
                ["engine"], buckets=UPSTREAM_BUCKETS, registry=r,
            )
        )  # fmt: skip
        self.directory_seconds = Histogram(
            "kvdepot_route_directory_seconds", "Duration of /v1/score calls (answered or not).",
            buckets=DIRECTORY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokenize_seconds = Histogram(
            "kvdepot_route_tokenize_seconds", "Duration of /tokenize calls to engines.",
            buckets=(*DIRECTORY_BUCKETS, 2.5, 5.0), registry=r,
        )  # fmt: skip

    def _per_engine(self, family: F) -> F:
        """A family labelled by `engine`, every engine's series made at once (a gauge's at 0)."""
        for url in self._engine_urls:
            family.labels(url)
        return family

    def render(self) -> bytes:
        return generate_latest(self.registry)
