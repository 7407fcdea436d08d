"""Service status: version, uptime, component states, settings summary, L1/L2/tenant summaries."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter

from api.http.answers import ServiceStatus, errors
from api.http.deps import AdminView, Ctx
from app import __version__
from app.settings import Settings
from engine.answers import redact_url

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
    """The settings without secrets: the admin token and Redis URL passwords masked."""
    out = settings.summary()
    for adapter in out["l2"]["adapters"]:
        if "url" in adapter:
            adapter["url"] = redact_url(adapter["url"])
    return out
