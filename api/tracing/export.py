"""Where finished spans go: the OTLP/HTTP exporter's thread, or an SDK span exporter (tests).

`OtlpExporter`: `add(record)` (event loop) appends the record to a bounded deque and returns; the
exporter's own thread wakes every `delay_s`, or as soon as `batch` records wait, encodes up to
`batch` records at a time (api/tracing/otlp.py) and POSTs them to the endpoint (OTLP/HTTP,
protobuf). As the SDK's exporter, it reads the OTLP variables, OTEL_EXPORTER_OTLP_TRACES_<X> before
OTEL_EXPORTER_OTLP_<X>: HEADERS; CERTIFICATE (the CA file that verifies an https endpoint, instead
of the system's), CLIENT_CERTIFICATE and CLIENT_KEY (mutual TLS); COMPRESSION (`gzip`, `deflate`
or `none`). A file that cannot be read, or a compression it does not know, is a ValueError at
construction. A full deque drops the new record (`dropped`); a failed export (after retries on a
refused connection, 429, 502, 503, 504) drops its batch (`failed` batches, `failed_spans`) and is
logged at most once a minute. The thread logs an unexpected error and carries on: it never dies
silently.

`SdkSpanSink`: each record made into the SDK's ReadableSpan and handed to a SpanExporter at once
(tests give the SDK's InMemorySpanExporter, and read the spans as the SDK would have made them).

State: the deque (appended by the loop, popped by the thread: deque operations are atomic), the
counters, the HTTP connection (used under the export lock: by the thread, or by `flush`'s caller).

Primitives in call order: OtlpExporter(endpoint, encoder, ...) -> add(record)... -> flush()
-> close() (the last export, bounded in time).
"""

from __future__ import annotations

import gzip
import http.client
import logging
import os
import random
import ssl
import threading
import time
import urllib.parse
import zlib
from collections import deque
from typing import Protocol

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags
from opentelemetry.util.re import parse_env_headers

from api.tracing.otlp import OtlpEncoder, SpanRecord

log = logging.getLogger("kvdepot.tracing")

#: the statuses an export is retried on (as the SDK's exporter), and the tries in all
RETRYABLE = frozenset({429, 502, 503, 504})
TRIES = 3
#: the first wait between tries (doubled each time) and the least time between two failure logs
BACKOFF_S = 0.25
LOG_EVERY_S = 60.0
#: the compression level of export bodies: zlib's default
LEVEL = 6
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSET = Status(StatusCode.UNSET)


class SpanSink(Protocol):
    def add(self, record: SpanRecord) -> None: ...

    def flush(self) -> bool: ...

    def close(self) -> None: ...


def otlp_env(name: str) -> str:
    """An OTLP exporter variable: the traces-specific one, else the general one ("" if neither)."""
    traces = os.environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}")
    return traces or os.environ.get(f"OTEL_EXPORTER_OTLP_{name}", "")


def tls_context(scheme: str) -> ssl.SSLContext | None:
    """The TLS context of an `https` endpoint per CERTIFICATE, CLIENT_CERTIFICATE and CLIENT_KEY
    (None for `http`, where the SDK ignores them too). ValueError naming the variable whose file
    is missing or not valid."""
    if scheme != "https":
        return None
    ca, cert, key = otlp_env("CERTIFICATE"), otlp_env("CLIENT_CERTIFICATE"), otlp_env("CLIENT_KEY")
    try:
        context = ssl.create_default_context(cafile=ca or None)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"OTEL_EXPORTER_OTLP_CERTIFICATE {ca!r}: {exc}") from None
    if key and not cert:
        raise ValueError("OTEL_EXPORTER_OTLP_CLIENT_KEY is set without OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE")
    if cert:
        try:
            context.load_cert_chain(cert, key or None)
        except (OSError, ssl.SSLError) as exc:
            what = f"OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE {cert!r} / CLIENT_KEY {key!r}"
            raise ValueError(f"{what}: {exc}") from None
    return context


def compression() -> str:
    """How export bodies are compressed, per COMPRESSION: "gzip", "deflate" (as the SDK's exporter
    also offers), or "" (`none` or unset)."""
    value = otlp_env("COMPRESSION").strip().lower()
    if value not in ("", "none", "gzip", "deflate"):
        raise ValueError(f"OTEL_EXPORTER_OTLP_COMPRESSION {value!r}: gzip, deflate or none")
    return "" if value == "none" else value


class OtlpExporter:
    def __init__(
        self, endpoint: str, encoder: OtlpEncoder, *, timeout_s: float, queue: int, batch: int = 512,
        delay_s: float = 1.0,
    ) -> None:  # fmt: skip
        url = urllib.parse.urlsplit(endpoint)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {endpoint!r}")
        self.endpoint = endpoint
        self._url = url
        self._path = url.path or "/"
        if url.query:
            self._path += "?" + url.query
        headers = parse_env_headers(otlp_env("HEADERS"), liberal=True)
        self._headers = {**headers, "Content-Type": "application/x-protobuf"}
        self._tls = tls_context(url.scheme)
        self._compression = compression()
        if self._compression:
            self._headers["Content-Encoding"] = self._compression
        self.encoder = encoder
        self.timeout_s = timeout_s
        self.queue_max = queue
        self.batch = batch
        self.delay_s = delay_s
        self.exported = 0
        self.dropped = 0
        """Records not queued: the deque was full."""
        self.failed = 0
        """Export requests that failed (their spans lost)."""
        self.failed_spans = 0
        self._queue: deque[SpanRecord] = deque()
        self._in_flight = 0
        self._wake = threading.Event()
        self._stopped = False
        self._export_lock = threading.Lock()
        self._connection: http.client.HTTPConnection | None = None
        self._logged_at = -LOG_EVERY_S
        self._thread = threading.Thread(target=self._run, name="kvdepot-otlp-export", daemon=True)
        self._thread.start()

    # -- the event loop ---------------------------------------------------------------------------

    def add(self, record: SpanRecord) -> None:
        queue = self._queue
        if len(queue) >= self.queue_max:
            self.dropped += 1
            return
        queue.append(record)
        if len(queue) >= self.batch and not self._wake.is_set():
            self._wake.set()

    def pending(self) -> int:
        return len(self._queue)

    # -- the exporter's thread ---------------------------------------------------------------------

    def _run(self) -> None:
        """Export every `delay_s` (sooner when `batch` records wait) until closed, then once more."""
        while True:
            self._wake.wait(self.delay_s)
            self._wake.clear()
            stopping = self._stopped
            try:
                self._export_queued()
            except Exception:
                log.exception("span export failed unexpectedly; the exporter carries on")
            if stopping:
                with self._export_lock:
                    self._disconnect()
                return

    def _export_queued(self) -> None:
        with self._export_lock:
            queue = self._queue
            while queue:
                records = [queue.popleft() for _ in range(min(self.batch, len(queue)))]
                self._in_flight = len(records)
                body = self.encoder.encode(records)
                if self._compression == "gzip":
                    body = gzip.compress(body, LEVEL)
                elif self._compression == "deflate":
                    body = zlib.compress(body, LEVEL)
                if self._post(body):
                    self.exported += len(records)
                else:
                    self.failed += 1
                    self.failed_spans += len(records)
                self._in_flight = 0

    def _post(self, body: bytes) -> bool:
        """POST one export request; answers whether it was accepted (2xx), after retries."""
        problem = ""
        for attempt in range(TRIES):
            if attempt:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
            try:
                connection = self._connect()
                connection.request("POST", self._path, body, self._headers)
                response = connection.getresponse()
                response.read()
            except (OSError, http.client.HTTPException) as error:
                self._disconnect()
                problem = f"{type(error).__name__}: {error}"
                continue
            if 200 <= response.status < 300:
                return True
            problem = f"HTTP {response.status}"
            if response.will_close:
                self._disconnect()
            if response.status not in RETRYABLE:
                break
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            lost = self.failed + 1
            log.warning("span export to %s failed (%s); %d batches lost so far", self.endpoint, problem, lost)
        return False

    def _connect(self) -> http.client.HTTPConnection:
        if self._connection is None:
            url = self._url
            host, port = url.hostname or "", url.port
            self._connection = (
                http.client.HTTPSConnection(host, port, timeout=self.timeout_s, context=self._tls)
                if url.scheme == "https"
                else http.client.HTTPConnection(host, port, timeout=self.timeout_s)
            )
        return self._connection

    def _disconnect(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    # -- any thread --------------------------------------------------------------------------------

    def flush(self) -> bool:
        """Export what is queued now, in the calling thread (after an export the thread has under
        way); answers whether the queue emptied."""
        self._export_queued()
        return not self._queue

    def close(self, timeout_s: float = 5.0) -> None:
        """Export what is queued (the thread's last round) and stop, waiting at most `timeout_s`:
        an endpoint that does not answer does not hold up shutdown (what it had is counted lost)."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            lost = len(self._queue) + self._in_flight
            self.failed_spans += lost
            log.warning("span exporter busy %.1f s into shutdown; %d queued spans lost", timeout_s, lost)


class SdkSpanSink:
    """Records made into the SDK's ReadableSpans and exported at once (tests)."""

    def __init__(self, exporter: SpanExporter, resource: Resource, scope: InstrumentationScope) -> None:
        self.exporter = exporter
        self.resource = resource
        self.scope = scope

    def add(self, record: SpanRecord) -> None:
        self.exporter.export([self.readable(record)])

    def readable(self, record: SpanRecord) -> ReadableSpan:
        name, trace_id, span_id, parent_id, remote, start_ns, end_ns, attributes, status = record
        context = SpanContext(trace_id, span_id or random.getrandbits(64) or 1, False, _SAMPLED)
        parent = SpanContext(trace_id, parent_id, remote, _SAMPLED) if parent_id else None
        return ReadableSpan(
            name=name, context=context, parent=parent, resource=self.resource, attributes=dict(attributes),
            status=_UNSET if status is None else Status(StatusCode.ERROR, status), start_time=start_ns,
            end_time=end_ns, instrumentation_scope=self.scope,
        )  # fmt: skip

    def flush(self) -> bool:
        return True

    def close(self) -> None:
        self.exporter.shutdown()
