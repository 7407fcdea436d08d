"""HealthTracker: an adapter's health as /status and metrics show it; LatencyRecorder: its
latency, a tiny histogram per operation, for the metrics exporter.

State: whether the backend is down, the last error and when it happened, the errors counted
(event loop only).

Primitives in call order:
  success()                 a batch went through: the backend is up again
  failure(message, count, down=...)
                            errors counted; `down` when the backend as a whole failed
  snapshot(closed)          -> Health: down (backend failed, or closed), degraded (an error within
                            DEGRADED_WINDOW_S), else ok
  LatencyRecorder.observe(op, seconds)   one more sample of an operation kind ("store", "load")
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from storage.base import Health, HealthState

DEGRADED_WINDOW_S = 30.0


class HealthTracker:
    """ok / degraded (an error within DEGRADED_WINDOW_S) / down (backend failed, or closed)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._down = False
        self._last_error: str | None = None
        self._last_error_at = float("-inf")
        self.errors_total = 0

    def success(self) -> None:
        self._down = False

    def failure(self, message: str, count: int = 1, *, down: bool = False) -> None:
        self.errors_total += count
        self._last_error = message
        self._last_error_at = self._clock()
        self._down = self._down or down

    def snapshot(self, closed: bool) -> Health:
        state: HealthState
        if closed or self._down:
            state = "down"
        elif self._clock() - self._last_error_at < DEGRADED_WINDOW_S:
            state = "degraded"
        else:
            state = "ok"
        return Health(state=state, last_error=self._last_error, errors_total=self.errors_total)


LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


@dataclass(slots=True)
class Histogram:
    """Per-bucket counts (not cumulative); the last slot counts what exceeds every bound."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    count: int = 0
    sum_s: float = 0.0

    def observe(self, seconds: float) -> None:
        index = len(self.bounds)
        for i, bound in enumerate(self.bounds):
            if seconds <= bound:
                index = i
                break
        self.counts[index] += 1
        self.count += 1
        self.sum_s += seconds


@dataclass(slots=True)
class LatencyRecorder:
    """One histogram per operation kind ("store", "load", ...), created on first use."""

    ops: dict[str, Histogram] = field(default_factory=dict)

    def observe(self, op: str, seconds: float) -> None:
        hist = self.ops.get(op)
        if hist is None:
            hist = self.ops[op] = Histogram()
        hist.observe(seconds)
