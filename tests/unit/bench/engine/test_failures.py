"""Why requests failed: the server's message read from error bodies and stream events, the counts by
status and the first few failures per server, and their lines for the terminal."""

from __future__ import annotations

import json

from bench.engine.report import failure_lines
from bench.engine.sender import MESSAGE_CHARS, server_message, stream_failure
from bench.engine.stats import FIRST_FAILURES, Failure, RequestRecord, failures, summarize

VLLM_400 = {
    "error": {
        "message": "Token id 7999 is out of vocabulary",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
}


def test_the_message_of_an_error_body() -> None:
    assert server_message(json.dumps(VLLM_400).encode()) == "Token id 7999 is out of vocabulary"
    assert server_message(b'{"error": "injected failure"}') == "injected failure"
    assert server_message(b'{"detail": "Not Found"}') == "Not Found"
    assert server_message(b'{"message": "overloaded"}') == "overloaded"
    # No message field: the body's first bytes, as text.
    listed = b'{"detail": [{"loc": ["body", "prompt"], "msg": "field required"}]}'
    assert server_message(listed) == listed.decode()
    assert server_message(b"upstream connect error") == "upstream connect error"
    long = b"<html>" + b"x" * 1000
    assert server_message(long) == long[:MESSAGE_CHARS].decode() and MESSAGE_CHARS == 200
    assert len(server_message(json.dumps({"error": {"message": "m" * 500}}).encode())) == MESSAGE_CHARS
    assert server_message(b"\xff\xfe bad bytes") == "\ufffd\ufffd bad bytes"


def test_an_error_event_in_a_stream() -> None:
    # What vLLM streams (with HTTP 200) for a refused streaming request.
    f = stream_failure(VLLM_400["error"])
    assert f == Failure("400", 400, "Token id 7999 is out of vocabulary", in_stream=True)
    assert str(f) == "HTTP 400 (in the stream): Token id 7999 is out of vocabulary"
    assert stream_failure("engine dead") == Failure("stream error", None, "engine dead", in_stream=True)
    assert str(Failure("ReadTimeout", None, "timed out")) == "ReadTimeout: timed out"


def record(index: int, failure: Failure | None, server: str = "target") -> RequestRecord:
    return RequestRecord(
        server, "measured", index, "unique", 0.0, 8, None if failure else 0.01, failure=failure
    )


def test_counts_by_status_and_the_first_failures() -> None:
    timeout = Failure("ReadTimeout", None, "ReadTimeout('')")
    records = [record(0, None)]
    records += [record(i, Failure("400", 400, f"Token id {i} is out of vocabulary")) for i in range(1, 8)]
    records += [record(8, timeout), record(9, timeout), record(10, None)]
    got = failures(records)
    assert got["errors"] == 9
    assert list(got["by_status"].items()) == [("400", 7), ("ReadTimeout", 2)]  # most frequent first
    assert len(got["first"]) == FIRST_FAILURES == 5
    assert got["first"][0] == {
        "pass": "measured", "index": 1, "kind": "400", "status": 400, "in_stream": False,
        "message": "Token id 1 is out of vocabulary",
    }  # fmt: skip
    assert [f["index"] for f in got["first"]] == [1, 2, 3, 4, 5]  # in the order they ended
    assert failures([record(0, None)]) == {"errors": 0, "by_status": {}, "first": []}
    summary = summarize(records, 1.0)
    assert summary["errors"] == 9 and summary["errors_by_status"] == {"400": 7, "ReadTimeout": 2}
    assert records[8].error == "ReadTimeout: ReadTimeout('')" and records[0].error is None


def test_terminal_lines_name_status_and_message() -> None:
    target = failures([
        record(3, Failure("400", 400, "Token id 7999 is out of vocabulary", in_stream=True)),
        record(4, Failure("ConnectError", None, "All connection attempts failed")),
    ])  # fmt: skip
    lines = failure_lines({"target": target, "baseline": failures([record(0, None, "baseline")])})
    assert lines == [
        "target: 2 requests failed (400 x1, ConnectError x1); the first 2:",
        "  measured #3: HTTP 400 (in the stream): Token id 7999 is out of vocabulary",
        "  measured #4: ConnectError: All connection attempts failed",
    ]
