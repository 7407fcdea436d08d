"""FastAPI dependencies, as `Annotated` aliases: the context, the admin-token guard, and whether a
request holds the token (for answers that show tenants only to the token's holder); and
`available`, a part of the context that this sidecar's settings may leave out, or NotFound."""

from __future__ import annotations

from typing import Annotated, TypeVar

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.http.context import ControlContext
from app.errors import NotFound, Unauthorized
from app.settings import HttpSettings
from httpkit.guard import admin_ok

T = TypeVar("T")


def available(part: T | None, what: str) -> T:
    """`part` of the context; NotFound when this sidecar runs without it (`what`: plural)."""
    if part is None:
        raise NotFound(f"{what} are not available in this sidecar")
    return part


def get_ctx(request: Request) -> ControlContext:
    ctx: ControlContext = request.app.state.ctx
    return ctx


Ctx = Annotated[ControlContext, Depends(get_ctx)]

_bearer = HTTPBearer(auto_error=False)


def token_ok(http: HttpSettings, authorization: str | None) -> bool:
    """Whether an `Authorization` header value carries the admin token (always, when none is set)."""
    return admin_ok(http.admin_token, authorization)


def is_admin(ctx: Ctx, request: Request) -> bool:
    """True when the request may see tenants: it holds the admin token, or none is set."""
    return token_ok(ctx.settings.http, request.headers.get("authorization"))


def require_admin(
    ctx: Ctx, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """Mutating endpoints and those showing tenants depend on this: when `http.admin_token` is
    set, the bearer must match."""
    given = f"Bearer {credentials.credentials}" if credentials is not None else None
    if not token_ok(ctx.settings.http, given):
        raise Unauthorized("a valid admin bearer token is required (Authorization: Bearer <token>)")


Admin = Annotated[None, Depends(require_admin)]
AdminView = Annotated[bool, Depends(is_admin)]
