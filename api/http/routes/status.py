"""Service status: version, uptime, component states, settings summary, L1/L2/tenant summaries."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from api.http.deps import Ctx
from app import __version__

router = APIRouter(tags=["status"])


@router.get("/status", summary="Version, uptime, components, settings (no secrets), L1/L2/tenants")
async def status(ctx: Ctx) -> dict[str, Any]:
    return {
        "version": __version__,
        "uptime_s": round(ctx.health.uptime_s(), 3),
        "ready": not ctx.health.not_ready(),
        "components": ctx.health.components(),
        "l1": ctx.engine.status(),
        "l2": ctx.engine.l2_status(),
        "tenants": ctx.engine.tenants_status(),
        "settings": ctx.settings.summary(),
    }
