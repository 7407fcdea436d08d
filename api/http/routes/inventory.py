"""`GET /inventory`: the complete holding per tier as NDJSON, in the KV events' block-hash terms
(api/kvevents/inventory.py), streamed. Needs the admin token (it shows what every tenant holds), or
the sidecar's own directory credential (`fleet.directory_token`): what the directory sends to a
registered sidecar's resync, so the directory never needs, nor hands out, the sidecars' admin token."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from api.http.answers import errors
from api.http.deps import Ctx, is_admin
from app.errors import NotFound, Unauthorized

router = APIRouter(tags=["kv events"])


def _reader(ctx: Ctx, request: Request) -> None:
    """The admin token, or this sidecar's directory credential (fleet.directory_token)."""
    if is_admin(ctx, request):
        return
    own = ctx.settings.fleet.directory_token
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    given = given.strip() if scheme.lower() == "bearer" else ""
    if own is not None and given and hmac.compare_digest(given.encode(), own.get_secret_value().encode()):
        return
    raise Unauthorized("a valid admin bearer token is required (Authorization: Bearer <token>)")


Reader = Annotated[None, Depends(_reader)]


@dataclass(frozen=True, slots=True)
class InventoryLine:
    """One NDJSON line: a header (`incarnation`, `seq`, `scheme`, `salt`), a chunk (`medium`,
    `model`, `block_size`, `block_hashes`) or the end (`chunks`, `unknown_layout`)."""

    kind: Literal["header", "chunk", "end"]
    incarnation: str | None = None
    seq: int | None = None
    scheme: str | None = None
    salt: str | None = None
    medium: str | None = None
    model: str | None = None
    block_size: int | None = None
    block_hashes: list[int] | None = None
    chunks: int | None = None
    unknown_layout: int | None = None


@router.get(
    "/inventory",
    summary="Every chunk held, per tier, as NDJSON block hashes; header: incarnation and sequence",
    responses={
        200: {"model": InventoryLine, "description": "application/x-ndjson: one InventoryLine per line"},
        **errors(401, 404),
    },
    response_class=StreamingResponse,
)
async def inventory(ctx: Ctx, _reader: Reader) -> StreamingResponse:
    if ctx.inventory is None:
        raise NotFound("KV events are off (kv_events.endpoint is unset): no inventory to resync from")
    return StreamingResponse(ctx.inventory.lines(), media_type="application/x-ndjson")
