"""HealthTracker: an adapter's health as /status and metrics show it.

State: whether the backend is down, the last error and when it happened, the errors counted
(event loop only).

Primitives in call order:
  success()                 a batch went through: the backend is up again
  failure(message, count, down=...)
                            errors counted; `down` when the backend as a whole failed
  snapshot(closed)          -> Health: down (backend failed, or closed), degraded (an error within
                            DEGRADED_WINDOW_S), else ok
"""

from __future__ import annotations

import time
from collections.abc import Callable

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
