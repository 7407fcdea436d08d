"""The directory's HTTP API (FastAPI, on the loop the subscriptions run on).

  POST   /v1/instances          register or heartbeat (InstanceSpec; the instance's credential)
  DELETE /v1/instances/{id}     forget an instance and what it holds (admin token)
  GET    /v1/instances          the instances: liveness, sync state, chunks per medium, load (admin)
  POST   /v1/score              the instances that serve the longest prefix of a request, best first
  POST   /v1/match              where the request's content is held at other offsets (directory.match)
  GET    /health, GET /metrics (admin token)

Registration: the bearer is the instance's own credential, HMAC(secret, the body's id)
(fleet/credentials.py; the secret: `directory.instance_secret`, else `http.admin_token`), which
may move the instance's endpoints; the admin token registers too (an operator) but moves no live
or static instance's endpoints (409). With neither secret nor token registration is open, and no
live instance's endpoints move. Registered instances silent `forget_after` timeouts are swept
before each registration (and by the service's sweeper), so `max_instances` frees.

A score request is decoded with msgspec (a 32k-token body parses in a fraction of pydantic's
time); a malformed one is 400 with a stable code. Registration bodies are pydantic (InstanceSpec):
a bad one is 422 naming the field. Bodies past `http.max_body_bytes` are 413 unread; a body not
all in within `http.body_timeout_s` of its headers is 408 (both close the connection).

State: none beyond the context (DirectoryContext). Event loop only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from app import __version__
from app.errors import InvalidInput, NotFound, Overloaded, Unauthorized
from app.settings import HttpSettings
from fleet.credentials import credential_ok
from fleet.directory import Directory
from fleet.http.subscriptions import Subscriptions
from fleet.registry import Registered
from fleet.spec import DirectoryConfig, InstanceSpec
from httpkit.docs import install_docs
from httpkit.errors import error_body, install_error_handlers
from httpkit.guard import RequestGuard, admin_ok


@dataclass(frozen=True, slots=True)
class DirectoryContext:
    http: HttpSettings
    directory: Directory
    subscriptions: Subscriptions
    metrics: CollectorRegistry
    """The collectors /metrics answers with (the sidecar registry is `directory.registry`)."""


class ScoreRequest(msgspec.Struct, forbid_unknown_fields=False):
    model: str
    token_ids: list[int]
    cache_salt: str | None = None
    lora_name: str | None = None


_score_decoder = msgspec.json.Decoder(ScoreRequest)
_encoder = msgspec.json.Encoder()
_bearer = HTTPBearer(auto_error=False)


def _ctx(request: Request) -> DirectoryContext:
    ctx: DirectoryContext = request.app.state.ctx
    return ctx


Ctx = Annotated[DirectoryContext, Depends(_ctx)]


def _admin(ctx: Ctx, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    given = f"Bearer {credentials.credentials}" if credentials is not None else None
    if not admin_ok(ctx.http.admin_token, given):
        raise Unauthorized("a valid bearer token is required (Authorization: Bearer <token>)")


Admin = Annotated[None, Depends(_admin)]
Bearer = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
router = APIRouter()


def registration_secret(http: HttpSettings, config: DirectoryConfig) -> str | None:
    """The secret deriving the sidecars' credentials (instance_secret, else the admin token)."""
    secret = config.instance_secret or http.admin_token
    return None if secret is None else secret.get_secret_value()


def _registrant_owns(
    ctx: DirectoryContext, spec: InstanceSpec, credentials: HTTPAuthorizationCredentials | None
) -> bool:
    """Whether the bearer is the instance's own credential; the admin token: False; else 401."""
    secret = registration_secret(ctx.http, ctx.directory.config)
    if secret is None:
        return False  # open registration: nobody owns an id
    given = None if credentials is None else credentials.credentials
    if credential_ok(secret, spec.id, given):
        return True
    token = ctx.http.admin_token
    if token is not None and admin_ok(token, f"Bearer {given}" if given else None):
        return False
    raise Unauthorized(
        "registration needs the instance's credential (Authorization: Bearer <HMAC-SHA256(secret, id)>)"
    )


@router.get("/health", summary="Plain OK while the process runs")
async def health() -> Response:
    return Response("OK", media_type="text/plain")


@router.get("/metrics", summary="Prometheus metrics of the directory")
async def metrics(ctx: Ctx, _admin: Admin) -> Response:
    return Response(generate_latest(ctx.metrics), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/instances", summary="Register a sidecar, or heartbeat (the same body again)")
async def register(spec: InstanceSpec, ctx: Ctx, credentials: Bearer) -> dict[str, Any]:
    own = _registrant_owns(ctx, spec, credentials)
    d = ctx.directory
    now = time.monotonic()
    for gone in d.registry.sweep(now):  # the silent ones' places are free again
        ctx.subscriptions.stop(gone)
    status = d.registry.register(spec, now, own=own)
    d.stats.registrations += 1
    inst = d.registry.get(spec.id)
    assert inst is not None
    if status is not Registered.REFRESHED or ctx.subscriptions.get(spec.id) is None:
        ctx.subscriptions.start(spec.id)
    else:
        action = inst.tracker.published(spec.incarnation, spec.events_seq, now, d.config.catchup_grace_s)
        ctx.subscriptions.nudge(spec.id, action)
    return {"id": spec.id, "status": status.value, "timeout_s": d.registry.timeout_s}


@router.delete("/v1/instances/{instance_id}", status_code=204, summary="Forget an instance")
async def forget(instance_id: str, ctx: Ctx, _admin: Admin) -> Response:
    if ctx.directory.registry.forget(instance_id) is None:
        raise NotFound(f"no instance {instance_id!r}")
    ctx.subscriptions.stop(instance_id)
    return Response(status_code=204)


@router.get("/v1/instances", summary="Known instances: liveness, sync, chunks per medium, load")
async def instances(ctx: Ctx, _admin: Admin) -> dict[str, Any]:
    d = ctx.directory
    now = time.monotonic()
    out = []
    for inst in d.registry.instances.values():
        sub = ctx.subscriptions.get(inst.id)
        t = inst.tracker
        out.append({
            "id": inst.id, "url": inst.spec.url, "engine_url": inst.spec.engine_url,
            "live": d.registry.alive(inst, now), "static": inst.static,
            "last_seen_s": round(now - inst.last_seen, 3), "synced": t.synced,
            "incarnation": t.incarnation, "next_seq": t.expected,
            "chunks": {m: d.index.counts.get(bit, 0) for m, bit in inst.holders.items()},
            "tiers": {m: inst.tier_of(m).value for m in inst.holders},
            "models": sorted({ns.model for ns in inst.spec.namespaces}),
            "salt_mode": inst.spec.salt_mode, "l1_usage": inst.spec.l1_usage,
            "queue_depth": inst.spec.queue_depth,
            "subscription_failures": 0 if sub is None else sub.failures,
            "last_error": "" if sub is None else sub.last_error,
        })  # fmt: skip
    return {"instances": out, "chunks": len(d.index)}


@router.post("/v1/score", summary="The instances serving the longest prefix of a request, best first")
async def score(request: Request, ctx: Ctx) -> Response:
    req = _decode_request(await request.body())
    result = ctx.directory.scorer.score(
        req.model, req.token_ids, req.cache_salt, req.lora_name, time.monotonic()
    )
    fields = ("id", "url", "engine_url", "prefix_tokens", "tiers", "score", "queue_depth", "l1_usage")
    rows = [{name: getattr(s, name) for name in fields} for s in result.instances]
    answer = {"chunk_size": result.chunk_size, "instances": rows}
    return Response(_encoder.encode(answer), media_type="application/json")


@router.post("/v1/match", summary="Where the request's content is held at other offsets (reports only)")
async def match(request: Request, ctx: Ctx) -> Response:
    req = _decode_request(await request.body())
    rows = ctx.directory.scorer.match(
        req.model, req.token_ids, req.cache_salt, req.lora_name, time.monotonic()
    )
    answer = {
        "instances": [
            {
                "id": r.id,
                "url": r.url,
                "chunk_size": r.chunk_size,
                "matched_tokens": len(r.matches) * r.chunk_size,
                "matches": [{"offset": o, "tokens": r.chunk_size, "tier": t} for o, t in r.matches],
            }
            for r in rows
        ]
    }
    return Response(_encoder.encode(answer), media_type="application/json")


def _decode_request(body: bytes) -> ScoreRequest:
    try:
        req = _score_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidInput(f"bad request body: {exc}") from None
    if not req.model or len(req.model) > 256:
        raise InvalidInput("model must be 1..256 characters")
    for name, value in (("cache_salt", req.cache_salt), ("lora_name", req.lora_name)):
        if value is not None and len(value) > 1024:
            raise InvalidInput(f"{name} must be at most 1024 characters")
    return req


def create_directory_app(ctx: DirectoryContext) -> FastAPI:
    app = FastAPI(title="kvdepot directory", version=__version__, docs_url=None, redoc_url=None)
    install_docs(app)  # the sidecar's /docs pages: no request leaves the host
    app.state.ctx = ctx
    install_error_handlers(app)

    @app.exception_handler(Overloaded)
    async def _full(_: Request, exc: Overloaded) -> JSONResponse:  # the directory is full: retry later
        return JSONResponse(error_body(exc.code, exc.message), status_code=503)

    app.include_router(router)
    # The body cap and deadline before anything is read; tokens are checked per route (scores need none).
    app.add_middleware(
        RequestGuard, max_body_bytes=ctx.http.max_body_bytes, token_ok=lambda _h: True,
        body_timeout_s=ctx.http.body_timeout_s,
    )  # fmt: skip
    return app
