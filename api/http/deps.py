"""FastAPI dependencies, as `Annotated` aliases: the context, and the admin-token guard."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.http.context import ControlContext
from app.errors import Unauthorized


def get_ctx(request: Request) -> ControlContext:
    ctx: ControlContext = request.app.state.ctx
    return ctx


Ctx = Annotated[ControlContext, Depends(get_ctx)]

_bearer = HTTPBearer(auto_error=False)


def require_admin(
    ctx: Ctx, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """Mutating endpoints depend on this: when `http.admin_token` is set, the bearer must match."""
    token = ctx.settings.http.admin_token
    if token is None:
        return
    given = credentials.credentials if credentials is not None else ""
    if not hmac.compare_digest(given.encode(), token.get_secret_value().encode()):
        raise Unauthorized("a valid admin bearer token is required (Authorization: Bearer <token>)")


Admin = Annotated[None, Depends(require_admin)]
