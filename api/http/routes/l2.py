"""L2 adapters at runtime: list, attach, resize, detach — no restart, no failed data-plane call."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Body, Query, Response
from pydantic import BaseModel, ConfigDict, Field

from api.http.answers import errors
from api.http.deps import Admin, Ctx
from app.settings import AdapterConfig
from engine.answers import AdapterAnswer, AdapterList, L2Policy, ReconcileAnswer

router = APIRouter(prefix="/l2", tags=["l2"])


class AdapterPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    capacity_gb: float = Field(gt=0, le=1 << 20, description="New capacity; shrinking evicts (LRU).")


class PolicyPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    store_policy: Literal["all", "first", "seen_twice"] | None = None
    prefetch_deadline_ms: float | None = Field(None, gt=0, le=60_000)


@router.get(
    "/adapters",
    response_model=AdapterList,
    summary="Attached L2 adapters with type, config (no secrets), usage, health; the policy",
    responses=errors(),
)
async def list_adapters(ctx: Ctx) -> AdapterList:
    return ctx.admin.l2_adapters()


@router.post(
    "/adapters",
    status_code=201,
    response_model=AdapterAnswer,
    summary="Attach an adapter (JSON adapter config; disk paths only under l2.allowed_roots)",
    responses=errors(401, 404, 409, 413, 422),
)
async def add_adapter(ctx: Ctx, _: Admin, config: Annotated[AdapterConfig, Body()]) -> AdapterAnswer:
    return await ctx.admin.add_adapter(config)


@router.patch(
    "/adapters/{name}",
    response_model=AdapterAnswer,
    summary="Change an adapter's capacity",
    responses=errors(401, 404, 413, 422),
)
async def patch_adapter(ctx: Ctx, _: Admin, name: str, patch: AdapterPatch) -> AdapterAnswer:
    return await ctx.admin.resize_adapter(name, int(patch.capacity_gb * (1 << 30)))


@router.delete(
    "/adapters/{name}",
    status_code=204,
    response_class=Response,
    summary="Detach: drain (finish in-flight work) or drop",
    responses=errors(401, 404, 409, 422),
)
async def remove_adapter(
    ctx: Ctx, _: Admin, name: str, mode: Annotated[Literal["drain", "drop"], Query()] = "drain"
) -> Response:
    await ctx.admin.remove_adapter(name, mode)
    return Response(status_code=204)


@router.post(
    "/adapters/{name}/reconcile",
    response_model=ReconcileAnswer,
    summary="Reconcile a fleet-scope Redis adapter's tenant ledger with a scan of its prefix, now",
    responses=errors(401, 404, 409, 422, 502),
)
async def reconcile_adapter(ctx: Ctx, _: Admin, name: str) -> ReconcileAnswer:
    return await ctx.admin.reconcile(name)


@router.patch(
    "/policy",
    response_model=L2Policy,
    summary="Change the store policy or the prefetch deadline",
    responses=errors(401, 404, 413, 422),
)
async def patch_policy(ctx: Ctx, _: Admin, patch: PolicyPatch) -> L2Policy:
    return ctx.admin.set_l2_policy(patch.store_policy, patch.prefetch_deadline_ms)
