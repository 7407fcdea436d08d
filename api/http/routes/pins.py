"""Prefix pins: keep the chunks of a tenant's token prefix from eviction. Admin token required.

`PUT /pins/{cache_salt}` pins the full chunks of `token_ids` of `model` in `tiers` (`l1` and disk
adapters) until `ttl_s` runs out (null: until deleted); the same prefix again replaces its pin.
A pin that cannot be honoured (the tenant's `pinned_bytes` quota or tier quota, the share of a
tier all pins may take, an adapter that evicts by its own policy, a model no engine registered)
is 409 with the reason; malformed input is 422. `GET /pins` lists every pin, `GET
/pins/{cache_salt}` a tenant's; `DELETE /pins/{cache_salt}?id=` releases one (without `id`:
all of the tenant's). Chunks a pin holds are still deleted by purges and clears.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, ConfigDict, Field

from api.http.answers import errors
from api.http.deps import Admin, Ctx, available
from api.http.routes.quotas import Salt, salt_of
from engine.answers import PinAnswer, PinList
from engine.pins.service import TOKEN_MAX, PinService
from engine.registry import MAX_ID_LEN

router = APIRouter(prefix="/pins", tags=["pins"])

TokenId = Annotated[int, Field(strict=True, ge=0, le=TOKEN_MAX)]
TierName = Annotated[str, Field(min_length=1, max_length=64)]


class PinBody(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(min_length=1, max_length=MAX_ID_LEN, description="The model id engines register.")
    token_ids: list[TokenId] = Field(
        min_length=1, max_length=1 << 22,
        description="The prefix; its full chunks (l1.chunk_size tokens each) are pinned.",
    )  # fmt: skip
    ttl_s: int | None = Field(
        None, strict=True, ge=1, le=365 * 86400,
        description="Seconds until the pin is released (also bounded by pins.max_ttl_s); null: until DELETE.",
    )  # fmt: skip
    tiers: list[TierName] = Field(
        default_factory=lambda: ["l1"], min_length=1, max_length=16,
        description="Where the chunks are kept: `l1` and names of L2 adapters that honour pins (disk).",
    )  # fmt: skip


def _pins(ctx: Ctx) -> PinService:
    return available(ctx.pins, "pins")


@router.get("", response_model=PinList, summary="Every prefix pin", responses=errors(401))
async def list_pins(ctx: Ctx, _: Admin) -> PinList:
    return await _pins(ctx).pins()


@router.get(
    "/{cache_salt:path}",
    response_model=PinList,
    summary="A tenant's prefix pins",
    responses=errors(401, 404, 422),
)
async def tenant_pins(ctx: Ctx, _: Admin, cache_salt: Salt) -> PinList:
    return await _pins(ctx).pins(salt_of(cache_salt))


@router.put(
    "/{cache_salt:path}",
    response_model=PinAnswer,
    summary="Pin a token prefix's chunks in tiers (kept from eviction until ttl_s or DELETE)",
    responses=errors(401, 409, 413, 422),
)
async def put_pin(ctx: Ctx, _: Admin, cache_salt: Salt, body: PinBody) -> PinAnswer:
    return await _pins(ctx).put(salt_of(cache_salt), body.model, body.token_ids, body.ttl_s, body.tiers)


@router.delete(
    "/{cache_salt:path}",
    status_code=204,
    response_class=Response,
    summary="Release a tenant's pin (`id`), or all of its pins",
    responses=errors(401, 404, 422),
)
async def delete_pin(
    ctx: Ctx, _: Admin, cache_salt: Salt,
    id: Annotated[str | None, Query(min_length=1, max_length=64, description="The pin's id.")] = None,
) -> Response:  # fmt: skip
    await _pins(ctx).delete(salt_of(cache_salt), id)
    return Response(status_code=204)
