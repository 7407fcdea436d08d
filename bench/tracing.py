"""`kvdepot bench tracing`: the CPU a span costs the sidecar, on the event loop and in all, against
the OpenTelemetry SDK's own path for the same spans, measured in the same run.

The same synthetic event stream (`--spans` spans: per request a root and four children, `lookup`,
`retrieve`, `release`, `store`, from START/END pairs as the bus delivers them, `--batch` events a
delivery) goes through:
- `direct`: what the sidecar runs (app/tracing.py): the span builder making plain records, the
  exporter's thread encoding OTLP protobuf itself and POSTing it;
- `sdk` (the baseline): SDK spans for the roots (tracer.start_span / end), the children made as
  the SDK's ReadableSpan at their END and handed to a BatchSpanProcessor, exported by the SDK's
  OTLP/HTTP exporter (the design before the direct path).
Both export to an OTLP/HTTP receiver in a child process (bench/otlp.py), so that the CPU
measured here is the exporting side's only. Between deliveries the bench sleeps `--gap-ms`, as a
loop serving requests would leave the exporter's thread time to run. Rounds alternate the paths.

JSON: per path, per round, `loop_us_per_span` (this thread's CPU while delivering: what the event
loop pays) and `process_us_per_span` (the whole process's CPU from the first delivery to the
exporter's close: loop, encoding, HTTP); their medians and `ratio_*` = direct / sdk; `ok`: every
span of every round reached the receiver.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, Status, StatusCode

from api.tracing.config import TracingSettings
from app.tracing import build_tracing
from engine.events import Event, Kind

CHILDREN = ("lookup", "retrieve", "release", "store")
RECEIVER = (
    "import sys\n"
    "from bench.otlp import OtlpReceiver\n"
    "r = OtlpReceiver()\n"
    "print(r.endpoint, flush=True)\n"
    "sys.stdin.read()\n"
    "print(r.stop()['spans'], flush=True)\n"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spans", type=int, default=20000, help="spans per round (a fifth of them roots)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each path, alternating")
    p.add_argument("--batch", type=int, default=64, help="events per bus delivery")
    p.add_argument("--gap-ms", type=float, default=2.0, help="sleep between deliveries")


def events(spans: int) -> list[Event]:
    out: list[Event] = []
    t0 = time.time_ns()
    n = 0
    for r in range(max(1, spans // (len(CHILDREN) + 1))):
        rid = f"req{r}"
        for op in (*CHILDREN, "end_request"):
            n += 1
            out.append(Event(Kind.START, t0 + 10 * n, op=op, request_id=rid, span=n))
            out.append(Event(Kind.END, t0 + 10 * n + 5, op=op, request_id=rid, span=n))
    return out


class SdkPath:
    """The baseline: the SDK's spans, processor and OTLP/HTTP exporter."""

    def __init__(self, endpoint: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        self.provider = TracerProvider(resource=Resource.create({"service.name": "kvdepot"}))
        self.processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint), schedule_delay_millis=1000)
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("kvdepot")
        self.scope = InstrumentationScope("kvdepot")
        self.roots: dict[str, Any] = {}
        self.starts: dict[int, int] = {}

    def on_events(self, batch: list[Event]) -> None:
        for e in batch:
            if e.op == "end_request":
                if e.kind is Kind.END:
                    self.roots.pop(e.request_id).end(end_time=e.ts_ns)
                continue
            if e.kind is Kind.START:
                if e.request_id not in self.roots:
                    self.roots[e.request_id] = self.tracer.start_span(
                        "kvdepot.request", context=Context(), attributes={"kvdepot.request_id": e.request_id},
                        start_time=e.ts_ns,
                    )  # fmt: skip
                self.starts[e.span] = e.ts_ns
                continue
            parent = self.roots[e.request_id].get_span_context()
            context = SpanContext(
                parent.trace_id, self.provider.id_generator.generate_span_id(), False, parent.trace_flags
            )
            self.processor.on_end(
                ReadableSpan(
                    name=e.op, context=context, parent=parent, resource=self.provider.resource,
                    attributes={}, status=Status(StatusCode.UNSET), start_time=self.starts.pop(e.span),
                    end_time=e.ts_ns, instrumentation_scope=self.scope,
                )
            )  # fmt: skip

    def close(self) -> None:
        self.provider.force_flush()
        self.provider.shutdown()


def one_round(path: str, evs: list[Event], args: argparse.Namespace) -> dict[str, Any]:
    receiver = subprocess.Popen(
        [sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert receiver.stdin is not None
    assert receiver.stdout is not None
    endpoint = receiver.stdout.readline().strip()
    tracing = None
    sdk = None
    if path == "direct":
        tracing = build_tracing(TracingSettings(otlp_endpoint=endpoint), "bench/1")
        assert tracing is not None
        deliver = tracing.subscriber
    else:
        sdk = SdkPath(endpoint)
        deliver = sdk.on_events
    step = args.batch
    gap = args.gap_ms / 1000
    loop_cpu = 0.0
    cpu0 = time.process_time()
    for i in range(0, len(evs), step):
        t = time.thread_time()
        deliver(evs[i : i + step])
        loop_cpu += time.thread_time() - t
        time.sleep(gap)
    if tracing is not None:
        tracing.close()
    if sdk is not None:
        sdk.close()
    total_cpu = time.process_time() - cpu0
    receiver.stdin.close()
    received = int(receiver.stdout.readline() or 0)
    receiver.wait(10)
    spans = len(evs) // 2
    return {
        "loop_us_per_span": round(loop_cpu / spans * 1e6, 2),
        "process_us_per_span": round(total_cpu / spans * 1e6, 2),
        "spans": spans, "received": received,
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    evs = events(args.spans)
    rounds: dict[str, list[dict[str, Any]]] = {"direct": [], "sdk": []}
    for _ in range(args.rounds):
        for path in ("direct", "sdk"):
            rounds[path].append(one_round(path, evs, args))
    out: dict[str, Any] = {"spans": len(evs) // 2, "batch": args.batch, "gap_ms": args.gap_ms}
    for path, results in rounds.items():
        out[path] = {
            "rounds": results,
            "loop_us_per_span_p50": statistics.median(r["loop_us_per_span"] for r in results),
            "process_us_per_span_p50": statistics.median(r["process_us_per_span"] for r in results),
        }
    for key in ("loop_us_per_span_p50", "process_us_per_span_p50"):
        out["ratio_" + key.removesuffix("_p50")] = round(out["direct"][key] / out["sdk"][key], 3)
    out["ok"] = all(r["received"] == r["spans"] for results in rounds.values() for r in results)
    with open("/proc/loadavg") as f:
        out["loadavg"] = f.read().split()[:3]
    print(json.dumps(out))
    return 0 if out["ok"] else 1
