"""A tiny OTLP/HTTP traces receiver in a thread of the benchmark's process: it accepts what the
sidecar's exporter POSTs to /v1/traces (protobuf; gzip, deflate or plain), counts requests, bytes and
spans, and answers 200 with an empty ExportTraceServiceResponse, as a collector that keeps up does;
with `keep` it also keeps the last spans decoded (tests read them); with `tls` it serves https
(a server-side SSLContext: a collector behind TLS, mutual TLS when the context asks for a client
certificate).

Primitives in call order: OtlpReceiver() (binds 127.0.0.1, a free port) -> endpoint -> stop() ->
the figures.
"""

from __future__ import annotations

import gzip
import ssl
import threading
import zlib
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

#: the largest export accepted (the SDK's batches are far smaller)
MAX_BODY = 64 << 20


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, object]


class OtlpReceiver:
    def __init__(self, keep: int = 0, tls: ssl.SSLContext | None = None) -> None:
        """`keep`: the last this many spans received are kept, decoded (`received()`; tests)."""
        self.requests = 0
        self.compressed = {"gzip": 0, "deflate": 0}
        """Requests received compressed, by Content-Encoding."""
        self.bytes = 0
        self.spans = 0
        self.errors = 0
        self._kept: deque[ReceivedSpan] = deque(maxlen=max(keep, 1))
        self._keep = keep > 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                if self.path != "/v1/traces" or not 0 < length <= MAX_BODY:
                    receiver._count(0, 0, error=True)
                    self.send_error(400)
                    return
                body = self.rfile.read(length)
                request = ExportTraceServiceRequest()
                try:
                    encoding = self.headers.get("content-encoding")
                    if encoding in ("gzip", "deflate"):
                        body = gzip.decompress(body) if encoding == "gzip" else zlib.decompress(body)
                        with receiver._lock:
                            receiver.compressed[encoding] += 1
                    request.ParseFromString(body)
                except Exception:
                    receiver._count(0, 0, error=True)
                    self.send_error(400)
                    return
                spans = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
                if receiver._keep:
                    receiver._remember(request)
                receiver._count(len(body), spans)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: object) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._scheme = "http"
        if tls is not None:
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
            self._scheme = "https"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()

    def _remember(self, request: ExportTraceServiceRequest) -> None:
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    attributes = {kv.key: getattr(kv.value, kv.value.WhichOneof("value") or "string_value")
                                  for kv in span.attributes}  # fmt: skip
                    with self._lock:
                        self._kept.append(ReceivedSpan(
                            span.name, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
                            span.start_time_unix_nano, span.end_time_unix_nano, attributes,
                        ))  # fmt: skip

    def received(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._kept)

    def _count(self, nbytes: int, spans: int, *, error: bool = False) -> None:
        with self._lock:
            self.requests += 1
            self.bytes += nbytes
            self.spans += spans
            self.errors += error

    @property
    def endpoint(self) -> str:
        return f"{self._scheme}://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def stop(self) -> dict[str, int]:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
        return {"exports": self.requests, "bytes": self.bytes, "spans": self.spans, "errors": self.errors}
