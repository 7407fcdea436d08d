"""Complaints: a refusal counted every time and logged at a bounded rate, so that a flood of bad
requests from a hostile peer costs a counter, not a log line each (writing a log line costs far
more than refusing). Used by the KV-event sockets (api/kvevents/guard.py), the lifeline server
(api/lifeline.py) and the directory's subscriptions to its sidecars (fleet/http/subscriptions.py):
logging vocabulary, beside app/logs.py and app/redact.py, which the sidecar's and the fleet's edges
both use (tests/check_layering.py: SHARED_APP).

State: the counters and the time of the last line. Event loop only (no locks).
Primitives: Complaints(logger, event, interval_s) -> note(**fields) ...; `count` at any time.
"""

from __future__ import annotations

import time
from typing import Any


class Complaints:
    """Refusals counted, logged at most once per `interval_s` (with the count since the last line)."""

    def __init__(self, logger: Any, event: str, interval_s: float = 10.0) -> None:
        self._log = logger
        self._event = event
        self.interval_s = interval_s
        self.count = 0
        self._unlogged = 0
        self._last = -float("inf")

    def note(self, **fields: object) -> None:
        self.count += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._log.warning(self._event, refused=self._unlogged, total=self.count, **fields)
            self._unlogged = 0
            self._last = now
