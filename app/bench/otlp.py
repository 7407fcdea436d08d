"""A tiny OTLP/HTTP traces receiver in a thread of the benchmark's process: it accepts what the
sidecar's exporter POSTs to /v1/traces (protobuf), counts requests, bytes and spans, and answers
200 with an empty ExportTraceServiceResponse, as a collector that keeps up does.

Primitives in call order: OtlpReceiver() (binds 127.0.0.1, a free port) -> endpoint -> stop() ->
the figures.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

#: the largest export accepted (the SDK's batches are far smaller)
MAX_BODY = 64 << 20


class OtlpReceiver:
    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0
        self.spans = 0
        self.errors = 0
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
                    request.ParseFromString(body)
                except Exception:
                    receiver._count(0, 0, error=True)
                    self.send_error(400)
                    return
                spans = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
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
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()

    def _count(self, nbytes: int, spans: int, *, error: bool = False) -> None:
        with self._lock:
            self.requests += 1
            self.bytes += nbytes
            self.spans += spans
            self.errors += error

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def stop(self) -> dict[str, int]:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
        return {"exports": self.requests, "bytes": self.bytes, "spans": self.spans, "errors": self.errors}
