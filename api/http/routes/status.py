"""Service status: version, uptime, component states, settings summary, L1/L2/tenant summaries."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter

from api.http.answers import ServiceStatus, errors
from api.http.deps import AdminView, Ctx
from app import __version__
from app.redact import redact_text
from app.settings import Settings

router = APIRouter(tags=["status"])


@router.get(
    "/status",
    response_model=ServiceStatus,
    summary="Version, uptime, components, settings (no secrets), L1/L2/tenants (names: token only)",
    responses=errors(),
)
async def status(ctx: Ctx, admin: AdminView) -> ServiceStatus:
    tenants = ctx.status.tenants()
    if not admin:
        tenants = dataclasses.replace(tenants, largest=[])  # salts: for the token's holder only
    return ServiceStatus(
        version=__version__,
        uptime_s=round(ctx.health.uptime_s(), 3),
        ready=not ctx.health.not_ready(),
        components=ctx.health.components(),
        l1=ctx.status.l1(),
        l2=ctx.status.l2(),
        tenants=tenants,
        tenant_details=admin,
        settings=settings_summary(ctx.settings),
    )


def settings_summary(settings: Settings) -> dict[str, Any]:
    """The settings without secrets: the admin token masked (Settings.summary), and the credentials
    of every URL (the user part, token-like query parameters: app/redact.py), whichever setting
    holds it (Redis adapters, tracing.otlp_endpoint, fleet.directory_url, fleet.engine_url...)."""
    masked: dict[str, Any] = _redacted(settings.summary())
    return masked


def _redacted(value: Any) -> Any:
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: _redacted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redacted(v) for v in value]
    return value
