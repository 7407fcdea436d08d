"""A tenant's cache: purge it from every tier; and the clear of whole tiers. Admin token required.

`DELETE /tenants/{cache_salt}/cache` starts a purge job (engine/purge.py) and answers 202 with it
once the job is on disk (502 `backend` when its file cannot be written);
`GET /tenants/{cache_salt}/cache/purge` reads its progress. `PUT|GET|DELETE
/tenants/{cache_salt}/label`: the tenant's display name (engine/tenants/labels.py).
`POST /cache/clear?tiers=l1,disk` clears tiers (L1 only by default) the same way; `GET /cache/clear`
reads the latest clear. The empty cache_salt (the default tenant) is `_default`; a salt that holds
nothing is purged all the same (nothing found: a job that ends at once).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, ConfigDict, Field

from api.http.answers import errors
from api.http.deps import Admin, Ctx, available
from api.http.routes.quotas import Salt, salt_of
from engine.answers import TenantLabel
from engine.purge import PurgeJob, PurgeJobs

router = APIRouter(tags=["tenants"])


class LabelBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    label: str = Field(
        min_length=1, max_length=64,
        description="Display name: A-Z a-z 0-9 _ . : - (letter or digit first); not other/_default.",
    )  # fmt: skip


def _jobs(ctx: Ctx) -> PurgeJobs:
    return available(ctx.purge, "purge and clear")


@router.delete(
    "/tenants/{cache_salt:path}/cache",
    status_code=202,
    response_model=PurgeJob,
    summary="Purge a tenant's chunks from L1 and every L2 adapter (a job; progress below)",
    responses=errors(401, 404, 422, 502),
)
async def purge_tenant(ctx: Ctx, _: Admin, cache_salt: Salt) -> PurgeJob:
    return await _jobs(ctx).purge(salt_of(cache_salt))


@router.get(
    "/tenants/{cache_salt:path}/cache/purge",
    response_model=PurgeJob,
    summary="The progress of the tenant's latest purge",
    responses=errors(401, 404, 422),
)
async def purge_status(ctx: Ctx, _: Admin, cache_salt: Salt) -> PurgeJob:
    return _jobs(ctx).latest(salt_of(cache_salt))


@router.post(
    "/cache/clear",
    status_code=202,
    response_model=PurgeJob,
    summary="Clear every chunk of the tiers named (`l1` and adapter names; default L1), as a job",
    responses=errors(401, 404, 422, 502),
)
async def clear_cache(
    ctx: Ctx, _: Admin,
    tiers: Annotated[str | None, Query(max_length=4096, description="Comma-separated tier names.")] = None,
) -> PurgeJob:  # fmt: skip
    names = None if tiers is None else [t.strip() for t in tiers.split(",") if t.strip()]
    return await _jobs(ctx).clear(names)


@router.get(
    "/cache/clear",
    response_model=PurgeJob,
    summary="The progress of the latest clear",
    responses=errors(401, 404),
)
async def clear_status(ctx: Ctx, _: Admin) -> PurgeJob:
    return _jobs(ctx).latest(None)


@router.put(
    "/tenants/{cache_salt:path}/label",
    response_model=TenantLabel,
    summary="Give a tenant a display name, used instead of its cache_salt in metrics, /status, logs",
    responses=errors(401, 409, 413, 422),
)
async def put_label(ctx: Ctx, _: Admin, cache_salt: Salt, body: LabelBody) -> TenantLabel:
    return await ctx.admin.set_label(salt_of(cache_salt), body.label)


@router.get(
    "/tenants/{cache_salt:path}/label",
    response_model=TenantLabel,
    summary="A tenant's display name",
    responses=errors(401, 404, 422),
)
async def get_label(ctx: Ctx, _: Admin, cache_salt: Salt) -> TenantLabel:
    return ctx.admin.label(salt_of(cache_salt))


@router.delete(
    "/tenants/{cache_salt:path}/label",
    status_code=204,
    response_class=Response,
    summary="Remove a tenant's display name (metrics name it by its cache_salt again)",
    responses=errors(401, 404, 422),
)
async def delete_label(ctx: Ctx, _: Admin, cache_salt: Salt) -> Response:
    await ctx.admin.delete_label(salt_of(cache_salt))
    return Response(status_code=204)
