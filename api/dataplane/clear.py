"""The data plane's CLEAR: one tenant's chunks removed at an engine's request, and audited.

Role: what `DataPlaneServer` answers to CLEAR (api/dataplane/server.py). CLEAR of every tenant is
refused (`unauthorized`: it is an administrator's act); a tenant's clear is recorded in the audit
log (api/audit.py) as the control plane's mutations are, with the tenant's L1 bytes before
and after, and the caller named by a digest of its engine instance nonce (never the nonce).

State: none (the engine and the audit log it is given). Runs on the event loop.
Primitives: `clear_tenant(engine, audit, instance, m) -> CountReply`.
"""

from __future__ import annotations

import time

from api.audit import AuditLog, fingerprint
from app.errors import KVDepotError, Unauthorized
from engine.facade import CacheEngine
from engine.tenants.quota import DEFAULT_TENANT, L1
from httpkit.errors import http_status
from kvdepot_connector import protocol as p


def clear_tenant(engine: CacheEngine, audit: AuditLog | None, instance: str, m: p.Clear) -> p.Reply:
    """Clear `m.cache_salt`'s chunks (Unauthorized without one), audited either way."""
    salt = m.cache_salt
    before = None if salt is None else _held(engine, salt)
    try:
        if salt is None:
            raise Unauthorized(
                "clearing every tenant is not a data-plane operation: give a cache_salt to clear one "
                "tenant (restart the sidecar, or remove the tenant's quota and data over HTTP, for more)"
            )
        count = engine.clear(salt)
    except KVDepotError as exc:
        _audit(audit, instance, salt, before=before, after=before, exc=exc)
        raise
    _audit(audit, instance, salt, before=before, after=_held(engine, salt), exc=None)
    return p.CountReply(id=m.id, count=count)


def _held(engine: CacheEngine, salt: str) -> dict[str, int]:
    return {"l1_bytes": engine.tenants.held(salt, L1)}


def _audit(
    audit: AuditLog | None, instance: str, salt: str | None, *, before: object, after: object,
    exc: KVDepotError | None,
) -> None:  # fmt: skip
    if audit is None:
        return
    audit.record({
        "ts": round(time.time(), 3), "method": "CLEAR", "resource": "dataplane.clear",
        "target": None if salt is None else (salt or DEFAULT_TENANT),
        "caller": {"peer": f"dataplane instance {fingerprint(instance)}", "token": None},
        "before": before, "after": after,
        "outcome": {"status": 200, "code": None} if exc is None else {"status": http_status(exc),
                                                                        "code": exc.code},
    })  # fmt: skip
