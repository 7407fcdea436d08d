"""The traceparent the connector passes on: picked from vLLM's trace headers, validated, and
bounded on the wire (a malformed one in a LOOKUP frame is refused by the decoder)."""

from __future__ import annotations

import msgspec
import pytest

from kvdepot_connector import protocol as p
from kvdepot_connector.tracecontext import traceparent_of

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        (None, ""),
        ({}, ""),
        ({"traceparent": GOOD}, GOOD),
        ({"Traceparent": " " + GOOD.upper() + " "}, GOOD),
        ({"traceparent": GOOD, "tracestate": "k=v"}, GOOD),
        ({"traceparent": "01-" + GOOD[3:]}, ""),  # another version
        ({"traceparent": GOOD + "-extra"}, ""),
        ({"traceparent": "00-" + "0" * 32 + "-00f067aa0ba902b7-01"}, ""),  # all-zero trace id
        ({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01"}, ""),
        ({"traceparent": "x" * 10_000}, ""),
    ],
)
def test_traceparent_of(headers: dict[str, str] | None, expected: str) -> None:
    assert traceparent_of(headers) == expected


def test_lookup_carries_it_optionally_and_the_decoder_bounds_it() -> None:
    m = p.Lookup(id=1, engine_id=2, request_id="r", tokens=b"", traceparent=GOOD)
    decoded = p.request_decoder.decode(p.encode(m))
    assert isinstance(decoded, p.Lookup) and decoded.traceparent == GOOD
    plain = p.request_decoder.decode(p.encode(p.Lookup(id=1, engine_id=2, request_id="r", tokens=b"")))
    assert isinstance(plain, p.Lookup) and plain.traceparent == ""
    bad = msgspec.msgpack.encode({"op": "lookup", "id": 1, "engine_id": 2, "request_id": "r", "tokens": b"",
                                  "traceparent": "not-a-trace"})  # fmt: skip
    with pytest.raises(msgspec.ValidationError):
        p.request_decoder.decode(bad)


def _miss() -> p.LookupReply:
    return p.LookupReply(id=0, hit_tokens=0, hit_chunks=0, total_chunks=0)


class _RecordingClient:
    """A sidecar client whose lookups all miss, recording the traceparent each carried."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def lookup(self, tokens: object, *, request_id: str, traceparent: str = "", **_: object) -> p.LookupReply:
        self.seen.append((request_id, traceparent))
        return _miss()


def test_the_scheduler_side_sends_the_requests_traceparent_with_its_lookups() -> None:
    from kvdepot_connector.vllm.scheduler import SchedulerSide

    client = _RecordingClient()
    sched = SchedulerSide([client], chunk_size=16, block_size=16)  # type: ignore[list-item]
    prompt = list(range(32))
    sched.matched_tokens("traced", prompt, None, len(prompt), 0, traceparent=GOOD)
    sched.matched_tokens("plain", prompt, None, len(prompt), 0)
    assert client.seen == [("traced", GOOD), ("plain", "")]
