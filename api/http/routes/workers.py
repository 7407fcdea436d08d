"""The worker registry: engine instances and their client processes (scheduler, workers) with
state (alive | suspect | dead), last-seen ages and heartbeat counters (engine/workers.py).

Admin token required (when one is set): pids and instances are fleet inventory. An instance's
nonce is its processes' shared credential (whoever knows it acts for the instance), so it is
never shown: an instance is named by a digest of it.
"""

from __future__ import annotations

import hashlib
import time
from typing import Annotated

from fastapi import APIRouter
from pydantic import BaseModel, Field

from api.http.answers import errors
from api.http.deps import Admin, Ctx
from engine.workers import Worker, WorkerState

router = APIRouter(tags=["workers"])

Age = Annotated[float, Field(ge=0, description="Seconds ago.")]


class WorkerAnswer(BaseModel):
    id: int = Field(description="The worker's data-plane session id.")
    role: str = Field(description="scheduler, worker, or empty when the client did not say.")
    rank: int | None
    pid: int | None = Field(description="From the lifeline's peer credentials; null before it connects.")
    state: WorkerState
    first_seen_age_s: Age
    last_seen_age_s: Age
    ended_age_s: float | None = Field(None, ge=0, description="Seconds since it died (dead ones).")
    heartbeats: int
    suspected: int = Field(description="Times it went suspect.")
    revived: int = Field(description="Times a heartbeat brought it back.")


class InstanceAnswer(BaseModel):
    instance: str = Field(description="A digest of the instance nonce (never the nonce itself).")
    workers: list[WorkerAnswer]


class WorkerTotalsAnswer(BaseModel):
    suspect: int
    dead: int
    revived: int
    heartbeats: int


class WorkersAnswer(BaseModel):
    heartbeat_s: float
    worker_timeout_s: float
    states: dict[WorkerState, int] = Field(description="Live workers by state; dead: the ones kept.")
    totals: WorkerTotalsAnswer
    instances: list[InstanceAnswer]


@router.get(
    "/workers",
    response_model=WorkersAnswer,
    summary="Engine instances and their workers: state, last seen, heartbeats (admin token)",
    responses=errors(401),
)
async def workers(ctx: Ctx, _: Admin) -> WorkersAnswer:
    reg = ctx.workers
    if reg is None:
        return WorkersAnswer(
            heartbeat_s=0, worker_timeout_s=0, states={}, instances=[],
            totals=WorkerTotalsAnswer(suspect=0, dead=0, revived=0, heartbeats=0),
        )  # fmt: skip
    now = time.monotonic()
    t = reg.totals
    return WorkersAnswer(
        heartbeat_s=reg.heartbeat_s,
        worker_timeout_s=reg.timeout_s,
        states=reg.by_state(),
        totals=WorkerTotalsAnswer(suspect=t.suspect, dead=t.dead, revived=t.revived, heartbeats=t.heartbeats),
        instances=[
            InstanceAnswer(instance=instance_name(name), workers=[_worker(w, now) for w in ws])
            for name, ws in reg.instances().items()
        ],
    )


def instance_name(instance: str) -> str:
    """`private-N` (a connection's own instance) as is; a nonce as a digest."""
    if instance.startswith("private-"):
        return instance
    return "sha256:" + hashlib.sha256(instance.encode()).hexdigest()[:16]


def _worker(w: Worker, now: float) -> WorkerAnswer:
    return WorkerAnswer(
        id=w.id, role=w.role, rank=w.rank, pid=w.pid, state=w.state,
        first_seen_age_s=_age(now, w.first_seen), last_seen_age_s=_age(now, w.last_seen),
        ended_age_s=None if w.ended is None else _age(now, w.ended),
        heartbeats=w.heartbeats, suspected=w.suspected, revived=w.revived,
    )  # fmt: skip


def _age(now: float, then: float) -> float:
    return round(max(now - then, 0.0), 3)
