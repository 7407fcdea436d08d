"""Tenant quotas: list, read, set, delete. The empty cache_salt (the default tenant) is `_default`.

A limit is bytes, or null for unlimited; 0 means the tenant stores nothing in that tier. Changes are
written to `<data_dir>/quotas.json` before they are answered and apply to the next operation.
Salts are tenants' secrets (vLLM's cache_salt): when an admin token is set, reading needs it too.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response
from pydantic import BaseModel, ConfigDict, Field

from api.http.answers import errors
from api.http.deps import Admin, Ctx
from engine.answers import QuotaList, TenantQuota
from engine.tenants.quota import DEFAULT_TENANT, LIMIT_MAX, MAX_SALT_LEN, Quota

router = APIRouter(prefix="/quotas", tags=["quotas"])

Limit = Annotated[
    int | None,
    Field(
        strict=True, ge=0, le=LIMIT_MAX,
        description="Bytes the tenant may hold in the tier; null = unlimited, 0 = nothing.",
    ),
]  # fmt: skip

Salt = Annotated[
    str,
    Path(
        min_length=1, max_length=MAX_SALT_LEN,
        description=f"The tenant's cache_salt; `{DEFAULT_TENANT}` for the empty salt.",
    ),
]  # fmt: skip


class QuotaBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    l1_bytes: Limit = None
    l2_bytes: Limit = Field(None, description="Limit in each L2 adapter.")
    pinned_bytes: Limit = Field(
        None, description="What the tenant's prefix pins (PUT /pins) may hold in each tier."
    )


def salt_of(name: str) -> str:
    return "" if name == DEFAULT_TENANT else name


@router.get(
    "",
    response_model=QuotaList,
    summary="Every tenant with a quota or usage: quota, limits and usage per tier",
    responses=errors(401),
)
async def list_quotas(ctx: Ctx, _: Admin) -> QuotaList:
    return ctx.admin.quotas()


@router.get(
    "/{cache_salt:path}",
    response_model=TenantQuota,
    summary="One tenant's quota, limits and usage per tier",
    responses=errors(401, 404, 422),
)
async def get_quota(ctx: Ctx, _: Admin, cache_salt: Salt) -> TenantQuota:
    return await ctx.admin.fleet_quota(salt_of(cache_salt))


@router.put(
    "/{cache_salt:path}",
    response_model=TenantQuota,
    summary="Set a tenant's quota (null = unlimited); a tenant over it is brought down to it now",
    responses=errors(401, 413, 422),
)
async def put_quota(ctx: Ctx, _: Admin, cache_salt: Salt, body: QuotaBody) -> TenantQuota:
    quota = Quota(l1_bytes=body.l1_bytes, l2_bytes=body.l2_bytes, pinned_bytes=body.pinned_bytes)
    return await ctx.admin.set_quota(salt_of(cache_salt), quota)


@router.delete(
    "/{cache_salt:path}",
    status_code=204,
    response_class=Response,
    summary="Remove a tenant's quota",
    responses=errors(401, 404, 422),
)
async def delete_quota(ctx: Ctx, _: Admin, cache_salt: Salt) -> Response:
    await ctx.admin.delete_quota(salt_of(cache_salt))
    return Response(status_code=204)
