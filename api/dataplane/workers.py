"""WorkerWatch: the data plane's sessions and lifelines feeding the worker registry, and what the
engine does when a worker goes suspect or dead.

Role: every HELLO registers its session as a worker of its engine instance (role and rank from
the HELLO, engine/workers.py); the lifeline that then holds the session gives its pid
(`held`) and its heartbeats (`beat`); a session that ends (lifeline closed, replaced, evicted)
is a dead worker (its locks and reservations went with the session's own hooks). `run` sweeps
for silent workers every `interval_s`: each one found is suspect, and `engine.suspect_holder`
drops its locks and quarantines its reservations. Counted (the registry's totals; metrics in
api/metrics_workers.py) and logged.

State: none of its own beyond the registry it is given. Owned by the event loop.

Primitives in call order: `hello(session, role, rank)`, `held(session, pid)`, `beat(session)`,
`sweep()` (also run periodically by `run(interval_s)`); sessions that end are seen through the
session table's `on_session_closed` hook.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from api.dataplane.sessions import Session, SessionTable
from engine.facade import CacheEngine
from engine.workers import Worker, WorkerRegistry

log = structlog.get_logger("kvdepot.workers")


class WorkerWatch:
    def __init__(
        self, engine: CacheEngine, sessions: SessionTable, registry: WorkerRegistry,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.engine = engine
        self.registry = registry
        self._clock = clock
        sessions.on_session_closed.append(self._ended)

    def hello(self, session: Session, role: str, rank: int | None) -> None:
        self.registry.add(session.id, session.instance, role, rank, now=self._clock())

    def held(self, session: Session, pid: int) -> None:
        self.registry.attach(session.id, pid, self._clock())

    def beat(self, session: Session) -> None:
        if self.registry.beat(session.id, self._clock()):
            worker = self.registry.get(session.id)
            assert worker is not None
            log.info("worker_alive_again", **_fields(worker))

    def sweep(self) -> int:
        """Workers silent for the timeout become suspect: their locks and reservations let go."""
        suspects = self.registry.sweep(self._clock())
        for worker in suspects:
            requests, reservations = self.engine.suspect_holder(worker.id)
            log.warning(
                "worker_suspect", silent_s=round(self._clock() - worker.last_seen, 3), requests=requests,
                reservations=reservations, **_fields(worker),
            )  # fmt: skip
        return len(suspects)

    async def run(self, interval_s: float) -> None:
        """Sweep every `interval_s`; a pass that fails is logged, the next one runs."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.sweep()
            except Exception:
                log.exception("worker_sweep_failed")

    def _ended(self, session: Session) -> None:
        worker = self.registry.dead(session.id, self._clock())
        if worker is not None:
            log.info("worker_dead", was=_was(worker), **_fields(worker))


def _fields(worker: Worker) -> dict[str, object]:
    return {"worker": worker.id, "role": worker.role, "rank": worker.rank, "pid": worker.pid}


def _was(worker: Worker) -> str:
    return "suspect" if worker.suspected > worker.revived else "alive"
