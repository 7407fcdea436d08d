"""The FastAPI application factory. Nothing is built at import time."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Awaitable, Callable

import structlog
from fastapi import FastAPI, Request, Response
from starlette.routing import BaseRoute, Match
from starlette.types import Scope

from api.http.audit import AuditCollector, AuditMiddleware
from api.http.context import ControlContext
from api.http.deps import token_ok
from api.http.docs import install_docs
from api.http.errors import install_error_handlers
from api.http.guard import RequestGuard
from api.http.routes import ROUTERS
from app import __version__

log = structlog.get_logger("kvdepot.http")


def create_app(ctx: ControlContext) -> FastAPI:
    app = FastAPI(
        title="kvdepot",
        version=__version__,
        summary="KV-cache sidecar control plane",
        docs_url=None,  # FastAPI's pages load their assets from CDNs: install_docs serves them
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.ctx = ctx
    install_docs(app)
    install_error_handlers(app)
    routes: list[BaseRoute] = []
    for router in ROUTERS:
        app.include_router(router)
        routes += router.routes
    # Inside the request scope below (its rejections are logged), outside everything that reads bodies.
    http = ctx.settings.http
    app.add_middleware(
        RequestGuard, max_body_bytes=http.max_body_bytes, token_ok=functools.partial(token_ok, http),
        body_timeout_s=http.body_timeout_s,
    )  # fmt: skip
    # Outside the guard: every mutating call is audited, those it refuses too (rate-limited).
    app.add_middleware(AuditMiddleware, audit=ctx.audit, ctx=ctx)
    ctx.registry.register(AuditCollector(ctx.audit))

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
                path=route_of(request.scope, routes),
                status=response.status_code,
                ms=round((time.perf_counter() - start) * 1000, 2),
            )
        return response

    return app


def route_of(scope: Scope, routes: list[BaseRoute]) -> str:
    """The path template of the route a request is for (`/quotas/{cache_salt:path}`), so that
    request logs never show a tenant's salt: the route the router chose, else (a request refused
    before routing) the first of `routes` that matches. A path no route matches is logged as is."""
    chosen = scope.get("route")
    candidates = (
        [chosen] if chosen is not None else [r for r in routes if r.matches(scope)[0] is not Match.NONE]
    )
    for route in candidates:
        path = getattr(route, "path", None)
        if isinstance(path, str):
            return path
    return str(scope["path"])[:200]
