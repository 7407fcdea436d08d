"""The HTTP answers api/http builds itself: readiness, the whole /status, the error body.

The engine's parts of /status and every admin answer are the engine's typed answers
(engine/answers.py); FastAPI makes the OpenAPI schemas of all of them. `ERRORS` declares the JSON
error body for the statuses a route can answer with (`responses=` of a route).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.answers import L1Status, L2Status, TenantsSummary


@dataclass(frozen=True, slots=True)
class ErrorDetail:
    code: str
    """Stable, machine-readable (e.g. `not_found`, `invalid_input`, `unauthorized`)."""
    message: str


@dataclass(frozen=True, slots=True)
class ErrorBody:
    """Every error answer: `{"error": {"code", "message"}}`."""

    error: ErrorDetail


@dataclass(frozen=True, slots=True)
class Readiness:
    """200 `{"ready": true}`; 503 with `reasons`: component name -> why it is not ready."""

    ready: bool
    reasons: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class ServiceStatus:
    version: str
    uptime_s: float
    ready: bool
    components: dict[str, str]
    l1: L1Status
    l2: L2Status
    tenants: TenantsSummary
    tenant_details: bool
    """False: an admin token is set and the request did not hold it, so the tenants' names
    (`tenants.largest`) were left out."""
    settings: dict[str, Any]
    """The settings in effect (as `Settings`), secrets masked (`***`)."""


_WHY = {
    401: "The admin bearer token is missing or wrong.",
    404: "Not found.",
    409: "Conflicts with the current state.",
    502: "An L2 backend failed (code `backend`, retryable).",
    413: "The body is larger than http.max_body_bytes (code `payload_too_large`); it was not read.",
    422: "Invalid input (the message names the field).",
    500: "Unexpected failure (no details).",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a route that may answer with these error statuses (500 always)."""
    return {s: {"model": ErrorBody, "description": _WHY[s]} for s in sorted({*statuses, 500})}
