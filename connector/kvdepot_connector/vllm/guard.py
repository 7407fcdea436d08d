"""SidecarGuard: a sidecar that fails or does not answer becomes misses, not a stalled engine.

After a failure the guard stays open (calls skipped) for a backoff that doubles up to a bound,
then lets one call through; a success closes it. Warnings are logged once per transition, so a
dead sidecar does not flood the engine's log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("kvdepot.connector")


class SidecarGuard:
    def __init__(
        self, *, first_backoff_s: float = 1.0, max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self._clock = clock
        self._first = first_backoff_s
        self._max = max_backoff_s
        self._backoff = 0.0
        self._retry_at = 0.0
        self.failures = 0

    def available(self) -> bool:
        return self._backoff == 0.0 or self._clock() >= self._retry_at

    @property
    def down(self) -> bool:
        return self._backoff > 0.0

    def failed(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        if self._backoff == 0.0:
            log.warning("kvdepot sidecar unavailable during %s (%s); serving without the cache", what, exc)
        self._backoff = min(self._max, self._backoff * 2 or self._first)
        self._retry_at = self._clock() + self._backoff

    def succeeded(self) -> None:
        if self._backoff:
            log.warning("kvdepot sidecar reachable again; cache back in use")
        self._backoff = 0.0
