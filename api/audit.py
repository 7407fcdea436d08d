"""The audit log: every mutating call on the sidecar's control plane (api/http/audit.py records
them) and every data-plane CLEAR (api/dataplane/clear.py), who made it, what it changed, how it
ended. Here, where both planes reach it without one importing the other.

The record:

  ts, method, resource ("quotas", "pins", "l2.adapters", "l2.policy", "dataplane.clear", or the
  path), target (the tenant as GET /quotas names it, or the adapter), caller {peer (address:port), token
  (the first 8 hex of the SHA-256 of the bearer token given, null without one)}, before, after,
  outcome {status, code (the error body's code; null on success)}

A data-plane CLEAR (an engine purging one tenant; CLEAR of all is refused there) is recorded by
the data-plane server (api/dataplane/clear.py): resource "dataplane.clear", the caller the engine
instance (a digest of its nonce), before/after the tenant's L1 bytes.

It is logged as ONE structured line (logger `kvdepot.audit`, event `admin_call`; the tenant's salt
appears there only as `target_fp`, the first 8 hex of its SHA-256: logs never show salts) and kept
in a ring of the last `capacity` records, newest first in `recent(limit)` (GET /audit, admin token
required). The token itself is never kept, logged or answered.

Calls refused for want of the token (401, 403) are counted (`refused`, the metric
`kvdepot_audit_refused_calls_total`) but logged and kept one by one only up to `refused_per_window`
(20) a minute: anyone can send them, and 5000 of them must neither write megabytes of log nor push
the real calls out of the ring. The others of a window are summed (`refused_unlogged`,
`kvdepot_audit_refused_unlogged_total`) in one `admin_calls_refused` line (`unlogged`), logged with
the first refused call of a later window.

State: the ring, the counters, the current window of refused calls. Event loop only (the
middleware, the route and the data plane run there).

Primitives: AuditLog(capacity) -> record(entry) ... -> recent(limit); fingerprint(secret),
token_fingerprint(authorization); AuditCollector(audit) for /metrics.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import structlog
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

log = structlog.get_logger("kvdepot.audit")

#: most records kept (and most that GET /audit answers)
CAPACITY = 1000
#: calls refused for want of the token: rate-limited in the log and the ring
REFUSED_STATUS = frozenset({401, 403})
#: refused calls logged (and kept) one by one per window; the rest are summed
REFUSED_PER_WINDOW = 20
REFUSED_WINDOW_S = 60.0


def fingerprint(secret: str) -> str:
    """The first 8 hex of the SHA-256 of `secret`: names it in logs without showing it."""
    return hashlib.sha256(secret.encode()).hexdigest()[:8]


def token_fingerprint(authorization: str | None) -> str | None:
    if not authorization:
        return None
    _, _, token = authorization.partition(" ")
    return fingerprint(token.strip() or authorization)


class AuditLog:
    def __init__(
        self, capacity: int = CAPACITY, refused_per_window: int = REFUSED_PER_WINDOW,
        window_s: float = REFUSED_WINDOW_S, clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        if capacity <= 0 or refused_per_window < 0 or window_s <= 0:
            raise ValueError("capacity and window_s must be positive, refused_per_window not negative")
        self.capacity = capacity
        self.recorded = 0
        self.refused = 0
        """Calls refused for want of the token (401/403), all counted."""
        self.refused_unlogged = 0
        """Of those, the ones past `refused_per_window` in a window: summed, not logged one by one."""
        self.refused_per_window = refused_per_window
        self.window_s = window_s
        self.clock = clock
        self._window_start = clock()
        self._window_logged = 0
        self._window_unlogged = 0
        self._records: deque[dict[str, Any]] = deque(maxlen=capacity)

    def record(self, entry: dict[str, Any]) -> None:
        if entry.get("outcome", {}).get("status") in REFUSED_STATUS and not self._admit_refused():
            return
        self._records.append(entry)
        self.recorded += 1
        line = {k: v for k, v in entry.items() if k != "target"}
        if entry.get("resource") in ("quotas", "pins", "dataplane.clear") and entry.get("target") is not None:
            line["target_fp"] = fingerprint(str(entry["target"]))
        elif entry.get("target") is not None:
            line["target"] = entry["target"]
        log.info("admin_call", **line)

    def _admit_refused(self) -> bool:
        """Count one refused call; whether it is logged and kept one by one (the first
        `refused_per_window` of each window are; a window's others are summed in one line, logged
        with the first refused call of a later window)."""
        self.refused += 1
        now = self.clock()
        if now - self._window_start >= self.window_s:
            if self._window_unlogged:
                log.warning(
                    "admin_calls_refused", unlogged=self._window_unlogged,
                    window_s=round(now - self._window_start, 3),
                )  # fmt: skip
            self._window_start, self._window_logged, self._window_unlogged = now, 0, 0
        if self._window_logged < self.refused_per_window:
            self._window_logged += 1
            return True
        self._window_unlogged += 1
        self.refused_unlogged += 1
        return False

    def recent(self, limit: int) -> list[dict[str, Any]]:
        """The last `limit` records, newest first."""
        out: list[dict[str, Any]] = []
        for entry in reversed(self._records):
            if len(out) >= limit:
                break
            out.append(entry)
        return out


class AuditCollector(Collector):
    """The refused calls' counters, read at scrape time."""

    def __init__(self, audit: AuditLog) -> None:
        self.audit = audit

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "kvdepot_audit_refused_calls", "Mutations refused for want of the admin token (401/403).",
            value=self.audit.refused,
        )  # fmt: skip
        yield CounterMetricFamily(
            "kvdepot_audit_refused_unlogged",
            "Refused calls past the per-minute budget: summed in one admin_calls_refused line, not "
            "logged nor kept one by one.",
            value=self.audit.refused_unlogged,
        )  # fmt: skip
