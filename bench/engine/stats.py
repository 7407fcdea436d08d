"""Per-request records and the aggregator of `kvdepot bench engine`.

Role: keep every finished request's timings, answer running totals for the live display (done,
in flight, errors, rolling TTFT percentiles, output tokens/s) and summarize a pass or a whole
run (TTFT, inter-token latency and end-to-end latency percentiles, throughput, errors).

State: the list of records and the in-flight count, both owned by the benchmark's event loop (the
sender appends, the display reads on the same loop).

Primitives, in call order: `Aggregator.started()` when a request is sent, `Aggregator.add(record)`
when it ends, `Aggregator.live()` for the display, `summarize(records, wall_s)` per pass,
`failures(records)` per server (why requests failed: counts by status, the first few).
Percentiles interpolate linearly between the two nearest ranks (numpy's default), so p50 of an
even count is the mean of the middle two.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

ROLLING_WINDOW = 64
"""Requests the live display's TTFT percentiles look back on."""
FIRST_FAILURES = 5
"""Failed requests per server whose status and message the report keeps."""


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th quantile (0 <= q <= 1) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Failure:
    """Why one request failed."""

    kind: str
    """What the counts by status count: the status as text (`"400"`), else the exception's class
    for a request that got no usable answer (`ConnectError`, `ReadTimeout`, ...)."""
    status: int | None
    """The server's status: the answer's HTTP status, or the `code` of an error event in a 200
    stream (vLLM reports a refused streaming request so); None when there was none."""
    message: str
    """The server's message (the JSON error's `message`, else the body's first bytes), or the
    exception's text."""
    in_stream: bool = False
    """The error came as an event in a stream whose HTTP status was 200."""

    def __str__(self) -> str:
        head = self.kind if self.status is None else f"HTTP {self.status}"
        return f"{head}{' (in the stream)' if self.in_stream else ''}: {self.message}"


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds, `start_s` from the run's start."""

    server: str
    pass_name: str
    index: int
    group: str
    start_s: float
    prompt_tokens: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    failure: Failure | None = None

    @property
    def error(self) -> str | None:
        """The failure as one line (the CSV's `error` column)."""
        return None if self.failure is None else str(self.failure)[:300]

    @property
    def ok(self) -> bool:
        return self.failure is None and self.ttft_s is not None


def _ms(values: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        v = percentile(values, q)
        out[name] = None if math.isnan(v) else round(v * 1000, 3)
    out["mean"] = round(sum(values) / len(values) * 1000, 3) if values else None
    return out


def by_status(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Failed requests per `Failure.kind` (`"400"`, `"ReadTimeout"`, ...), most frequent first."""
    counts: dict[str, int] = {}
    for r in records:
        if r.failure is not None:
            counts[r.failure.kind] = counts.get(r.failure.kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def failures(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """One server's failed requests: how many, counts by status, and the first `FIRST_FAILURES`
    (in the order they ended) with pass, index, status and the server's message."""
    failed = [r for r in records if r.failure is not None]
    first = [
        {"pass": r.pass_name, "index": r.index, "kind": r.failure.kind, "status": r.failure.status,
         "in_stream": r.failure.in_stream, "message": r.failure.message}
        for r in failed[:FIRST_FAILURES]
        if r.failure is not None
    ]  # fmt: skip
    return {"errors": len(failed), "by_status": by_status(failed), "first": first}


def summarize(records: Sequence[RequestRecord], wall_s: float) -> dict[str, Any]:
    """A pass's (or a run's) figures; `wall_s` is the span the records were sent in."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "errors_by_status": by_status(records),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": out_tokens,
        "wall_s": round(wall_s, 3),
        "ttft_ms": _ms(ttft),
        "itl_ms": _ms(itl),
        "e2e_ms": _ms(e2e),
        "output_tokens_per_s": round(out_tokens / wall_s, 3) if wall_s > 0 else None,
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
    }


@dataclass
class Live:
    """What the display shows: a snapshot, computed on the loop."""

    server: str
    pass_name: str
    done: int
    total: int | None
    in_flight: int
    errors: int
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    output_tokens_per_s: float
    elapsed_s: float
    hit_rate: float | None


class Aggregator:
    """Running totals of the current pass, and every record of the run."""

    def __init__(self) -> None:
        self.records: list[RequestRecord] = []
        self.in_flight = 0
        self.server = ""
        self.pass_name = ""
        self.pass_total: int | None = None
        self.pass_start = 0
        self.pass_started_s = 0.0
        self.hit_rate: float | None = None
        """The last hit rate read from the server's /metrics (the display shows it)."""

    def begin_pass(self, server: str, name: str, total: int | None, now_s: float) -> None:
        self.server, self.pass_name, self.pass_total = server, name, total
        self.pass_start = len(self.records)
        self.pass_started_s = now_s

    def started(self) -> None:
        self.in_flight += 1

    def add(self, record: RequestRecord) -> None:
        self.in_flight -= 1
        self.records.append(record)

    def pass_records(self) -> list[RequestRecord]:
        return self.records[self.pass_start :]

    def live(self, now_s: float) -> Live:
        current = self.pass_records()
        recent = [r.ttft_s for r in current[-ROLLING_WINDOW:] if r.ok and r.ttft_s is not None]
        elapsed = max(now_s - self.pass_started_s, 1e-9)

        def ms(q: float) -> float | None:
            v = percentile(recent, q)
            return None if math.isnan(v) else round(v * 1000, 1)

        return Live(
            server=self.server,
            pass_name=self.pass_name,
            done=len(current),
            total=self.pass_total,
            in_flight=self.in_flight,
            errors=sum(1 for r in current if not r.ok),
            ttft_p50_ms=ms(0.5),
            ttft_p90_ms=ms(0.9),
            ttft_p99_ms=ms(0.99),
            output_tokens_per_s=sum(r.output_tokens for r in current if r.ok) / elapsed,
            elapsed_s=elapsed,
            hit_rate=self.hit_rate,
        )
