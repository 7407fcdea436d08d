"""Liveness and readiness."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse

from api.http.answers import Readiness, errors
from api.http.deps import Ctx

router = APIRouter(tags=["health"])

NOT_READY: dict[str, Any] = {"model": Readiness, "description": "Not ready: the reasons per component."}


@router.get(
    "/health",
    response_class=PlainTextResponse,
    summary="Liveness: OK while the process lives",
    responses={200: {"content": {"text/plain": {"schema": {"type": "string", "example": "OK"}}}}},
)
async def health() -> PlainTextResponse:
    return PlainTextResponse("OK")


@router.get(
    "/ready",
    response_model=Readiness,
    response_model_exclude_none=True,
    summary="Readiness: 200 when every component runs, else 503 with reasons",
    responses={**errors(), 503: NOT_READY},
)
async def ready(ctx: Ctx) -> Readiness | JSONResponse:
    reasons = ctx.health.not_ready()
    if reasons:
        return JSONResponse({"ready": False, "reasons": reasons}, status_code=503)
    return Readiness(ready=True)
