"""The router's HTTP app (Starlette): OpenAI-compatible endpoints in front of the engines.

`POST /v1/completions`, `POST /v1/chat/completions`: parse (400 on malformed JSON or a body that is
not an object), plan the scoring (fleet/tokenize.py), get the tokens (the request's, or an engine's
/tokenize), ask the directory (fleet/router.py decides), relay (fleet/http/proxy.py).
`GET /v1/models` (the first healthy engine's), `GET /health` (`OK` while an engine is healthy, 503
when none is or when a background task died), `GET /status` (the engines as the router sees
them: `admin_token` needed, loopback clients only without one; URLs' credentials masked),
`GET /metrics`. Any other path is a 404, another method a 405, a body over `max_body_bytes` a 413,
a body not all in within `body_timeout_s` a 408 (httpkit/guard.RequestGuard; both close the
connection), all as `{"error": {"code", "message"}}`. Headers are relayed end to end only
(proxy.end_to_end: no hop-by-hop header, none the sender named in `Connection`). The header
deadline and the connection cap are the server's (httpkit/connections.py, fleet/wiring/route.py).

State: `RouterState` (settings, engines, the httpx client, metrics, the supervisor of its
background task), built by create_router_app and opened/closed by the app's lifespan. Everything
runs on one event loop.

Primitives in call order: create_router_app(settings, supervisor) -> Starlette; lifespan: the
health poll starts under the supervisor; per request: completion(request); on shutdown: the poll
cancelled, the client closed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import orjson
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from app.redact import redact_url
from app.settings import is_loopback
from fleet.http.proxy import Proxy, end_to_end, error_response
from fleet.http.router_metrics import RouterMetrics
from fleet.http.upstream import Upstream
from fleet.router import Decision, Engines, Score
from fleet.router_config import RouterSettings
from fleet.tokenize import CHAT, COMPLETIONS, Unscorable, plan_request
from httpkit.guard import RequestGuard, bearer_ok

__all__ = ["BackgroundTasks", "RouterState", "create_router_app"]

log = structlog.get_logger("kvdepot.route")


class BackgroundTasks(Protocol):
    """What the router needs of app.supervisor.Supervisor."""

    def start(
        self, name: str, coro: Coroutine[Any, Any, Any], *, drain: bool = True
    ) -> asyncio.Task[Any]: ...

    def failures(self) -> dict[str, str]: ...

    async def stop(self, drain_s: float) -> None: ...

@dataclass
class RouterState:
    settings: RouterSettings
    engines: Engines
    metrics: RouterMetrics
    client: httpx.AsyncClient
    upstream: Upstream
    proxy: Proxy
    tasks: BackgroundTasks


def _state(request: Request) -> RouterState:
    state: RouterState = request.app.state.router
    return state


async def completion(request: Request) -> Response:
    """Relay one request. A client that goes away before the answer starts cancels the work: the
    engine's connection is closed (vLLM aborts the request) and its in-flight slot is freed."""
    st = _state(request)
    path = request.url.path
    endpoint = "chat" if path == CHAT else "completions"
    raw = await request.body()
    work = asyncio.create_task(_completion(st, request, path, raw))
    gone = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        st.metrics.errors.labels("client_gone").inc()
        response: Response = error_response(499, "client_closed", "the client went away")
    else:
        response = work.result()
    st.metrics.requests.labels(endpoint, f"{response.status_code // 100}xx").inc()
    return response


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (its body was read: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _completion(st: RouterState, request: Request, path: str, raw: bytes) -> Response:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        st.metrics.errors.labels("bad_json").inc()
        return error_response(400, "bad_json", f"the body is not valid JSON: {exc}"[:300])
    if not isinstance(body, dict):
        st.metrics.errors.labels("bad_json").inc()
        return error_response(400, "bad_json", "the body must be a JSON object")
    scores, reason = await _scores(st, path, body)
    decision = st.engines.choose(scores, reason)
    if decision is None:
        st.metrics.errors.labels("no_engine").inc()
        return error_response(503, "engines_unavailable", "no engine configured")
    _count(st, decision)
    headers = end_to_end(request.headers.items())
    # relayed bytes as the engine sent them: only an encoding the client asked for
    headers.setdefault("accept-encoding", "identity")
    return await st.proxy.relay(path, raw, headers, decision, scores)


async def _scores(st: RouterState, path: str, body: dict[str, object]) -> tuple[list[Score] | None, str]:
    """The directory's scores for the request, or None and the reason it is routed by load."""
    plan = plan_request(path, body)
    if isinstance(plan, Unscorable):
        return None, plan.why
    if st.settings.directory_url is None:
        return None, "no_directory"
    tokens = await st.upstream.tokens(plan)
    if isinstance(tokens, str):
        return None, tokens
    model, lora = await st.upstream.model_names(plan.model)
    scores = await st.upstream.score(model, tokens, plan.cache_salt, lora)
    if isinstance(scores, str):
        return None, scores
    return scores, ""


def _count(st: RouterState, decision: Decision) -> None:
    if decision.routed:
        st.metrics.routed.labels(decision.engine.shown).inc()
    else:
        st.metrics.fallback.labels(decision.reason).inc()


async def models(request: Request) -> Response:
    status, body = await _state(request).upstream.models(request.headers.get("authorization"))
    if status == 0:
        return error_response(503, "engines_unavailable", "no engine answered /v1/models")
    return Response(body, status_code=status, media_type="application/json")


async def health(request: Request) -> Response:
    st = _state(request)
    dead = st.tasks.failures()
    if dead:
        return PlainTextResponse(f"background task died: {dead}"[:500], status_code=503)
    now = st.engines.clock()
    if any(e.healthy(now) for e in st.engines.all):
        return PlainTextResponse("OK")
    return PlainTextResponse("no healthy engine", status_code=503)


async def status(request: Request) -> Response:
    """The engines and the directory as the router sees them: for the holder of `admin_token`
    (loopback clients only when none is set); every URL's credentials masked."""
    st = _state(request)
    if not _may_see_status(st.settings, request):
        return error_response(
            401, "unauthorized", "GET /status needs the router's admin_token (Authorization: Bearer <token>)"
        )
    directory = st.settings.directory_url
    shown = None if directory is None else redact_url(directory)
    return JSONResponse({"directory_url": shown, "engines": st.engines.status()})


def _may_see_status(settings: RouterSettings, request: Request) -> bool:
    token = settings.admin_token
    if token is not None:
        return bearer_ok(request.headers.get("authorization"), token.get_secret_value())
    host = request.client.host if request.client is not None else ""
    return is_loopback(host)


async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type="text/plain; version=0.0.4")


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(
        exc.status_code, "http_error"
    )
    if exc.status_code == 413:
        _state(request).metrics.errors.labels("too_large").inc()
    return error_response(exc.status_code, code, str(exc.detail))


def create_router_app(settings: RouterSettings, tasks: BackgroundTasks) -> Starlette:
    """The router's app; its client and health poll live as long as the app's lifespan."""
    engines = Engines(settings.engines, settings.unhealthy_s, settings.max_imbalance)
    metrics_ = RouterMetrics([redact_url(e.url) for e in settings.engines])
    # One pool for every engine; no overall timeout here: each call sets its own.
    client = httpx.AsyncClient(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64), trust_env=False
    )
    state = RouterState(
        settings, engines, metrics_, client,
        Upstream(settings, client, engines, metrics_), Proxy(settings, client, engines, metrics_), tasks,
    )  # fmt: skip

    def count(kind: str) -> None:  # the guard's and the connections' cuts
        metrics_.errors.labels(kind).inc()

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        tasks.start("route-health-poll", state.upstream.run_health_poll(), drain=False)
        try:
            yield
        finally:
            await tasks.stop(1.0)
            await client.aclose()

    guard = Middleware(
        RequestGuard, max_body_bytes=settings.max_body_bytes, token_ok=lambda _: True,
        body_timeout_s=settings.body_timeout_s, count=count,
    )  # fmt: skip
    app = Starlette(
        routes=[
            Route(COMPLETIONS, completion, methods=["POST"]),
            Route(CHAT, completion, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/status", status, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        middleware=[guard],
        exception_handlers={HTTPException: _http_error},
        lifespan=lifespan,
    )
    app.state.router = state
    return app

