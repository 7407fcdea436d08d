"""L2 adapters at runtime: list, attach, resize, detach — no restart, no failed data-plane call."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Query, Response
from pydantic import BaseModel, ConfigDict, Field

from api.http.deps import Admin, Ctx
from app.settings import AdapterConfig

router = APIRouter(prefix="/l2", tags=["l2"])


class AdapterPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    capacity_gb: float = Field(gt=0, le=1 << 20, description="New capacity; shrinking evicts (LRU).")


class PolicyPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    store_policy: Literal["all", "first", "seen_twice"] | None = None
    prefetch_deadline_ms: float | None = Field(None, gt=0, le=60_000)


@router.get("/adapters", summary="Attached L2 adapters with type, config, usage, health")
async def list_adapters(ctx: Ctx) -> dict[str, Any]:
    return {"adapters": ctx.engine.l2_adapters(), "policy": ctx.engine.l2_policy()}


@router.post("/adapters", status_code=201, summary="Attach an adapter (JSON adapter config)")
async def add_adapter(ctx: Ctx, _: Admin, config: Annotated[AdapterConfig, Body()]) -> dict[str, Any]:
    return await ctx.engine.add_adapter(config)


@router.patch("/adapters/{name}", summary="Change an adapter's capacity")
async def patch_adapter(ctx: Ctx, _: Admin, name: str, patch: AdapterPatch) -> dict[str, Any]:
    return await ctx.engine.resize_adapter(name, int(patch.capacity_gb * (1 << 30)))


@router.delete("/adapters/{name}", status_code=204, summary="Detach: drain (finish in-flight work) or drop")
async def remove_adapter(
    ctx: Ctx, _: Admin, name: str, mode: Annotated[Literal["drain", "drop"], Query()] = "drain"
) -> Response:
    await ctx.engine.remove_adapter(name, mode)
    return Response(status_code=204)


@router.patch("/policy", summary="Change the store policy or the prefetch deadline")
async def patch_policy(ctx: Ctx, _: Admin, patch: PolicyPatch) -> dict[str, Any]:
    return ctx.engine.set_l2_policy(patch.store_policy, patch.prefetch_deadline_ms)
