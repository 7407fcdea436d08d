"""The control plane's side of the audit log (api/audit.py keeps it): `AuditMiddleware` records
every mutating control-plane call, with what it changed.

`AuditMiddleware` (pure ASGI, outside the RequestGuard, so calls the guard refuses are recorded
too) sees every request whose method is not GET, HEAD or OPTIONS. Before and after the call it
takes a snapshot of what the call may change (`snapshot`): a tenant's quota (PUT/DELETE
/quotas/{salt}), the attached adapters' configuration and state (/l2/adapters, /l2/adapters/{name}),
the L2 policy (/l2/policy), a tenant's pins (PUT/DELETE /pins/{salt}: id, chunks, tiers, expiry);
anything else has none (null). The record (api/audit.py names its fields) names the resource and
target the path addresses (`target_of`), the caller (peer, a digest of the bearer token) and the
outcome (status, and the error body's code).

State: none beyond the AuditLog it is given. Event loop only.

Primitives: AuditMiddleware(app, audit, ctx); target_of(path) -> (resource, target);
snapshot(ctx, resource, target).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.audit import AuditLog, token_fingerprint
from app.errors import KVDepotError
from engine.tenants.quota import DEFAULT_TENANT

if TYPE_CHECKING:
    from api.http.context import ControlContext

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: bytes of an error body read for its code
_ERROR_BODY = 4096


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
