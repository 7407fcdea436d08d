"""The FastAPI application factory. Nothing is built at import time."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable

import structlog
from fastapi import FastAPI, Request, Response

from api.http.context import ControlContext
from api.http.errors import install_error_handlers
from api.http.routes import ROUTERS
from app import __version__

log = structlog.get_logger("kvdepot.http")


def create_app(ctx: ControlContext) -> FastAPI:
    app = FastAPI(
        title="kvdepot",
        version=__version__,
        summary="KV-cache sidecar control plane",
        docs_url="/docs",
        openapi_url="/openapi.json",
    )
    app.state.ctx = ctx
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)

    @app.middleware("http")
    async def request_scope(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        request_id = request.headers.get("x-request-id", "")[:64] or uuid.uuid4().hex[:16]
        structlog.contextvars.bind_contextvars(request_id=request_id)
        start = time.perf_counter()
        try:
            response = await call_next(request)
        finally:
            structlog.contextvars.unbind_contextvars("request_id")
        response.headers["x-request-id"] = request_id
        if request.url.path not in ("/health", "/metrics"):
            log.info(
                "http_request",
                request_id=request_id,
                method=request.method,
                path=request.url.path,
                status=response.status_code,
                ms=round((time.perf_counter() - start) * 1000, 2),
            )
        return response

    return app
