"""A three-turn chat through a real vLLM (CPU) with KVDepotConnector: every turn's prompt is the
previous prompt, the previous answer's token ids and new tokens, so turns 2 and 3 hit through the
full chunks of the previous answers, which the connector saved when those requests finished
(kvdepot_save_decode, on by default).

The reference is the same chat on a plain vLLM without the connector (prefix caching on): its
own prefix cache keeps the blocks of generated tokens too, so it reuses exactly what the
connector does (chunks of one block) and the tokens and logprobs must match it (within the
tolerance of test_vllm.py; measured: bit for bit). Turn 1 must also equal a full computation (the
same prompt under a fresh cache_salt). Turns 2 and 3 are not compared with one: KV computed while
decoding differs in the last bits from the same tokens' KV computed in a prefill, and this random
model's logits are nearly flat, so the greedy token flips at a near-tie (measured: two candidates
4e-6 apart in logprob) for vLLM's own prefix cache exactly as for the connector.

The same engine and sidecar (one engine start for both) also trace: vLLM with
`--otlp-traces-endpoint` and the sidecar export their spans over OTLP/HTTP to a receiver in this
process. A completion request sent with a W3C `traceparent` header gives, in the sidecar's export,
a `kvdepot.request` root in that trace, a child of the header's span, with the request's `lookup`
under it, beside vLLM's own `llm_request` span of the request (same trace, same parent); a request
without the header gives a root in a trace of its own.
"""

from __future__ import annotations

import http.client
import json
import re
import secrets
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.otlp import OtlpReceiver, ReceivedSpan
from bench.sidecar import SidecarProcess, start_sidecar
from tests.e2e.harness import HITS, VllmServer, connector_config, prompt
from tests.e2e.test_vllm import BLOCK, assert_close

ANSWER = 160  # tokens per answer: more than a full chunk of 128
NEW = 40  # new tokens of the user in every later turn


def decode_chunks_stored(sc: SidecarProcess) -> int:
    with urllib.request.urlopen(sc.http + "/metrics", timeout=5) as answer:
        text = answer.read().decode()
    found = re.search(r"^kvdepot_decode_chunks_stored_total (\S+)$", text, re.MULTILINE)
    assert found
    return int(float(found.group(1)))


def wait_decode_chunks(sc: SidecarProcess, expected: int) -> None:
    """The decode save runs in the engine step after the request finished: wait for it."""
    deadline = time.monotonic() + 60
    while decode_chunks_stored(sc) < expected:
        assert time.monotonic() < deadline, f"{decode_chunks_stored(sc)} decode chunks stored, not {expected}"
        time.sleep(0.1)
    assert decode_chunks_stored(sc) == expected


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver(keep=10_000)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver) -> Iterator[SidecarProcess]:
    env = {"KVDEPOT_L1__CHUNK_SIZE": str(BLOCK), "KVDEPOT_TRACING__OTLP_ENDPOINT": receiver.endpoint}
    sc = start_sidecar(tmp_path_factory.mktemp("sidecar"), env=env)
    yield sc
    sc.stop()


@pytest.fixture(scope="module")
def engine(
    model_dir: Path, logs: Path, sidecar: SidecarProcess, receiver: OtlpReceiver
) -> Iterator[VllmServer]:
    kv = connector_config(sidecar.url, kvdepot_chunk_size=BLOCK, kvdepot_load="sync")
    # vLLM hands a request's trace headers on only when it traces itself (it drops them otherwise).
    server = VllmServer(
        model_dir, logs, kv=kv, name="engine-chat",
        extra_args=["--otlp-traces-endpoint", receiver.endpoint],
        extra_env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
    ).wait_healthy()  # fmt: skip
    yield server
    server.stop()


@pytest.mark.timeout(1200)  # nine answers of 160 tokens on two shared cores
def test_three_turns_hit_through_the_previous_answers(
    reference: VllmServer, sidecar: SidecarProcess, engine: VllmServer
) -> None:
    turn_prompt = prompt(21, 1000)  # 7 full chunks and 104 tokens
    # Full chunks of prompt + answer with KV when each turn ends (the last answer token has none),
    # and the hit each turn must get: every full chunk stored by the turns before.
    expected_hits = [0]
    expected_decode = 0
    for turn in range(3):
        hits_before = engine.metric(HITS)
        got, answer = engine.complete_ids(turn_prompt, max_tokens=ANSWER)
        assert engine.metric(HITS) - hits_before == expected_hits[turn], f"turn {turn + 1}"

        if turn == 0:  # no reuse yet: exactly a full computation
            assert got == reference.complete(turn_prompt, max_tokens=ANSWER, cache_salt="full")
        assert_close(got, reference.complete(turn_prompt, max_tokens=ANSWER))

        # The decode save: the chunks past the ones the prompt filled, up to the last with KV.
        prompt_chunks = len(turn_prompt) // BLOCK
        done_chunks = (len(turn_prompt) + ANSWER - 1) // BLOCK
        expected_decode += done_chunks - prompt_chunks
        wait_decode_chunks(sidecar, expected_decode)

        turn_prompt = turn_prompt + answer + prompt(100 + turn, NEW)
        expected_hits.append(done_chunks * BLOCK)
    assert expected_hits[1:3] == [1152, 1280]  # turn 2 and 3: through the answers' full chunks


def complete_traced(server: VllmServer, tokens: list[int], headers: dict[str, str]) -> None:
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
    complete_traced(engine, prompt(31, 4 * BLOCK), {"traceparent": f"00-{trace_id}-{parent}-01"})
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
    complete_traced(engine, prompt(32, 4 * BLOCK), {})
    deadline = time.monotonic() + 60
    while True:
        fresh = [s for s in receiver.received() if s.name == "kvdepot.request" and s.trace_id not in before]
        if fresh:
            break
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert fresh[0].parent_span_id == ""
