"""Prometheus exposition."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.http.deps import Ctx

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    summary="Prometheus text exposition",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def metrics(ctx: Ctx) -> Response:
    return Response(generate_latest(ctx.registry), media_type=CONTENT_TYPE_LATEST)
