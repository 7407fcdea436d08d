"""The audit log: every mutating control-plane call, who made it, what it changed, how it ended.

`AuditMiddleware` (pure ASGI, outside the RequestGuard, so calls the guard refuses are recorded
too) sees every request whose method is not GET, HEAD or OPTIONS. Before and after the call it
takes a snapshot of what the call may change (`snapshot`): a tenant's quota (PUT/DELETE
/quotas/{salt}), the attached adapters' configuration and state (/l2/adapters, /l2/adapters/{name}),
the L2 policy (/l2/policy), a tenant's pins (PUT/DELETE /pins/{salt}: id, chunks, tiers, expiry);
anything else has none (null). The record:

  ts, method, resource ("quotas", "pins", "l2.adapters", "l2.policy", or the path), target (the tenant
  as GET /quotas names it, or the adapter), caller {peer (address:port), token (the first 8 hex
  of the SHA-256 of the bearer token given, null without one)}, before, after,
  outcome {status, code (the error body's code; null on success)}

A data-plane CLEAR (an engine purging one tenant; CLEAR of all is refused there) is recorded too,
by the data-plane server: resource "dataplane.clear", the caller the engine instance (a digest of
its nonce), before/after the tenant's L1 bytes.

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
middleware and the route run there).

Primitives: AuditLog(capacity) -> AuditMiddleware(app, audit, ctx) ... -> recent(limit);
AuditCollector(audit) for /metrics.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import structlog
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import KVDepotError
from engine.tenants.quota import DEFAULT_TENANT

if TYPE_CHECKING:
    from api.http.context import ControlContext

log = structlog.get_logger("kvdepot.audit")

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: most records kept (and most that GET /audit answers)
CAPACITY = 1000
#: calls refused for want of the token: rate-limited in the log and the ring
REFUSED_STATUS = frozenset({401, 403})
#: refused calls logged (and kept) one by one per window; the rest are summed
REFUSED_PER_WINDOW = 20
REFUSED_WINDOW_S = 60.0
#: bytes of an error body read for its code
_ERROR_BODY = 4096


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


def _plain(value: Any) -> Any:
    """A snapshot as JSON-able data (dataclasses and pydantic models included, secrets masked)."""
    return json.loads(json.dumps(value, default=_default))


def _default(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    dump = getattr(value, "model_dump", None)
    if dump is not None:
        return dump(mode="json")
    return str(value)


def target_of(path: str) -> tuple[str, str | None]:
    """(resource, target) of a control-plane path."""
    if path.startswith("/quotas/"):
        return "quotas", unquote(path[len("/quotas/") :]) or None
    if path.startswith("/pins/"):
        return "pins", unquote(path[len("/pins/") :]) or None
    if path.rstrip("/") == "/l2/adapters":
        return "l2.adapters", None
    if path.startswith("/l2/adapters/"):
        return "l2.adapters", unquote(path[len("/l2/adapters/") :]) or None
    if path.rstrip("/") == "/l2/policy":
        return "l2.policy", None
    return path[:200], None


def snapshot(ctx: ControlContext, resource: str, target: str | None) -> Any:
    """What a call on (`resource`, `target`) may change, now (None: nothing known or nothing there)."""
    admin = ctx.admin
    try:
        if resource == "quotas" and target is not None:
            salt = "" if target == DEFAULT_TENANT else target
            return _plain(admin.quota(salt).quota)
        if resource == "pins" and target is not None and ctx.pins is not None:
            salt = "" if target == DEFAULT_TENANT else target
            return ctx.pins.summary(salt)
        if resource == "l2.adapters":
            adapters = {
                a.name: {"state": a.state, "config": _plain(a.config)} for a in admin.l2_adapters().adapters
            }
            return adapters if target is None else adapters.get(target)
        if resource == "l2.policy":
            return _plain(admin.l2_policy())
    except KVDepotError:
        return None
    return None


class AuditMiddleware:
    def __init__(self, app: ASGIApp, audit: AuditLog, ctx: ControlContext) -> None:
        self.app = app
        self.audit = audit
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in SAFE_METHODS:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        client = scope.get("client")
        peer = f"{client[0]}:{client[1]}" if client else None
        resource, target = target_of(str(scope.get("path", "")))
        before = snapshot(self.ctx, resource, target)
        status = 500
        body = bytearray()

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and status >= 400 and len(body) < _ERROR_BODY:
                body.extend(message.get("body", b"")[: _ERROR_BODY - len(body)])
            await send(message)

        caller = {"peer": peer, "token": token_fingerprint(headers.get("authorization"))}
        try:
            await self.app(scope, receive, watched)
        finally:
            self.audit.record({
                "ts": round(time.time(), 3), "method": scope["method"], "resource": resource,
                "target": target, "caller": caller,
                "before": before, "after": snapshot(self.ctx, resource, target),
                "outcome": {"status": status, "code": _error_code(bytes(body)) if status >= 400 else None},
            })  # fmt: skip


def _error_code(body: bytes) -> str | None:
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None
