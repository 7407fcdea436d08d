"""A real vLLM (CPU, `--otlp-traces-endpoint`) with the connector and a real sidecar, both exporting
their traces over OTLP/HTTP to a receiver in this process: a completion request sent with a W3C
`traceparent` header gives, in the sidecar's export, a `kvdepot.request` root in that trace, a
child of the header's span, with the request's `lookup` under it, beside vLLM's own `llm_request`
span of the request (same trace, same parent); a request without the header gives a root in a
trace of its own."""

from __future__ import annotations

import http.client
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.bench.otlp import OtlpReceiver, ReceivedSpan
from app.bench.sidecar import SidecarProcess, start_sidecar
from tests.e2e.harness import KV_ELEMENT_BYTES, VllmServer, connector_config, prompt

BLOCK = 128


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver(keep=10_000)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver) -> Iterator[SidecarProcess]:
    env = {"KVDEPOT_L1__CHUNK_SIZE": str(BLOCK), "KVDEPOT_TRACING__OTLP_ENDPOINT": receiver.endpoint}
    sc = start_sidecar(tmp_path_factory.mktemp("sidecar"), env=env, l1_size_gb=64 * KV_ELEMENT_BYTES / 1024)
    yield sc
    sc.stop()


@pytest.fixture(scope="module")
def engine(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory, sidecar: SidecarProcess, receiver: OtlpReceiver
) -> Iterator[VllmServer]:
    kv = connector_config(sidecar.url, kvdepot_chunk_size=BLOCK, kvdepot_load="sync")
    # vLLM hands a request's trace headers on only when it traces itself (it drops them otherwise).
    server = VllmServer(
        model_dir, tmp_path_factory.mktemp("logs"), kv=kv, name="traced",
        extra_args=["--otlp-traces-endpoint", receiver.endpoint],
        extra_env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
    ).wait_healthy()  # fmt: skip
    yield server
    server.stop()


def complete(server: VllmServer, tokens: list[int], headers: dict[str, str]) -> None:
    body = {"model": server.model, "prompt": tokens, "max_tokens": 2, "temperature": 0}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    try:
        sent = {"Content-Type": "application/json"} | headers
        conn.request("POST", "/v1/completions", json.dumps(body), sent)
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()[:500]
        resp.read()
    finally:
        conn.close()


def roots_in(receiver: OtlpReceiver, trace_id: str) -> list[ReceivedSpan]:
    return [s for s in receiver.received() if s.trace_id == trace_id and s.name == "kvdepot.request"]


def test_the_sidecars_spans_join_the_trace_the_request_came_with(
    engine: VllmServer, receiver: OtlpReceiver
) -> None:
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    complete(engine, prompt(31, 4 * BLOCK), {"traceparent": f"00-{trace_id}-{parent}-01"})
    deadline = time.monotonic() + 60
    while not roots_in(receiver, trace_id):  # the root ends at END_REQUEST; exports run every second
        assert time.monotonic() < deadline, [(s.name, s.trace_id) for s in receiver.received()][-20:]
        time.sleep(0.2)
    (root,) = roots_in(receiver, trace_id)
    assert root.parent_span_id == parent
    # vLLM's own span of the request (exported to the same receiver): a sibling in the same trace.
    while not [s for s in receiver.received() if s.trace_id == trace_id and s.name == "llm_request"]:
        assert time.monotonic() < deadline, "vLLM exported no llm_request span in the trace"
        time.sleep(0.2)
    (vllm_span,) = [s for s in receiver.received() if s.trace_id == trace_id and s.name == "llm_request"]
    assert vllm_span.parent_span_id == parent
    children = [s for s in receiver.received() if s.parent_span_id == root.span_id]
    assert "lookup" in {s.name for s in children}, [s.name for s in children]
    for child in children:
        assert child.trace_id == trace_id
        assert root.start_ns <= child.start_ns <= child.end_ns

    # Without a traceparent: a root of its own, in a trace nobody named.
    before = {s.trace_id for s in receiver.received()}
    complete(engine, prompt(32, 4 * BLOCK), {})
    deadline = time.monotonic() + 60
    while True:
        fresh = [s for s in receiver.received() if s.name == "kvdepot.request" and s.trace_id not in before]
        if fresh:
            break
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert fresh[0].parent_span_id == ""
