"""The FastAPI application factory. Nothing is built at import time."""

from __future__ import annotations

import functools
import time
import uuid

import structlog
from fastapi import FastAPI
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.audit import AuditCollector
from api.http.audit import AuditMiddleware
from api.http.context import ControlContext
from api.http.deps import token_ok
from api.http.routes import ROUTERS
from app import __version__
from httpkit.docs import install_docs
from httpkit.errors import install_error_handlers
from httpkit.guard import RequestGuard

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

    # Outermost: a request id for every request (its log lines and the answer's x-request-id).
    app.add_middleware(RequestScope, routes=routes)
    return app


class RequestScope:
    """Pure ASGI (no task or stream per request, so an answer needs few turns of a busy loop):
    binds the request id (`x-request-id`, or a fresh one) to the log context, returns it in the
    answer's headers, and logs each request but `/health` and `/metrics` with its route template,
    status and time."""

    def __init__(self, app: ASGIApp, routes: list[BaseRoute]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        asked = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), b"")
        request_id = asked.decode("latin-1")[:64] or uuid.uuid4().hex[:16]
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", ()) if k != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode("latin-1"))]}
            await send(message)

        structlog.contextvars.bind_contextvars(request_id=request_id)
        start = time.perf_counter()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            structlog.contextvars.unbind_contextvars("request_id")
        if status and scope["path"] not in ("/health", "/metrics"):
            log.info(
                "http_request", request_id=request_id, method=scope["method"],
                path=route_of(scope, self.routes), status=status,
                ms=round((time.perf_counter() - start) * 1000, 2),
            )  # fmt: skip


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
