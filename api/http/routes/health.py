"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse

from api.http.deps import Ctx

router = APIRouter(tags=["health"])


@router.get("/health", response_class=PlainTextResponse, summary="Liveness: OK while the process lives")
async def health() -> PlainTextResponse:
    return PlainTextResponse("OK")


@router.get("/ready", summary="Readiness: 200 when every component runs, else 503 with reasons")
async def ready(ctx: Ctx) -> JSONResponse:
    reasons = ctx.health.not_ready()
    if reasons:
        return JSONResponse({"ready": False, "reasons": reasons}, status_code=503)
    return JSONResponse({"ready": True})
