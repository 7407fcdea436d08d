"""The audit log's recent records (api/audit.py): mutating calls, their caller, change and outcome."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from api.audit import CAPACITY
from api.http.answers import errors
from api.http.deps import Admin, Ctx

router = APIRouter(tags=["audit"])


class Caller(BaseModel):
    peer: str | None = Field(description="The caller's address:port.")
    token: str | None = Field(description="First 8 hex of the SHA-256 of the bearer token given; null: none.")


class Outcome(BaseModel):
    status: int
    code: str | None = Field(description="The error's stable code; null on success.")


class AuditRecord(BaseModel):
    ts: float = Field(description="Unix time of the call's end.")
    method: str
    resource: str = Field(description='"quotas", "l2.adapters", "l2.policy", or the path.')
    target: str | None = Field(description="The tenant (as GET /quotas names it) or the adapter.")
    caller: Caller
    before: Any = Field(description="What the call could change, before it (null: nothing there).")
    after: Any = Field(description="The same, after it.")
    outcome: Outcome


class AuditList(BaseModel):
    recorded: int = Field(description="Calls recorded since start (the oldest beyond the last "
                          f"{CAPACITY} are gone).")  # fmt: skip
    refused: int = Field(0, description="Mutations refused for want of the token (401/403) since start.")
    refused_unlogged: int = Field(
        0, description="Of those, the ones past the per-minute budget: summed in one log line, not kept here."
    )
    records: list[AuditRecord] = Field(description="Newest first.")


@router.get(
    "/audit",
    response_model=AuditList,
    summary="The most recent mutating control-plane calls: caller, change (before/after), outcome",
    responses=errors(401, 422),
)
async def recent_calls(
    ctx: Ctx, _: Admin,
    limit: Annotated[int, Query(ge=1, le=CAPACITY, description="Records, newest first.")] = 100,
) -> AuditList:  # fmt: skip
    audit = ctx.audit
    return AuditList(
        recorded=audit.recorded, refused=audit.refused, refused_unlogged=audit.refused_unlogged,
        records=[AuditRecord.model_validate(r) for r in audit.recent(limit)],
    )
