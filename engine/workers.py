"""WorkerRegistry: engine instance -> its client processes (scheduler, workers) and their liveness.

State: worker id (its data-plane session id) -> Worker (engine instance, role, rank, pid once its
lifeline connected, first and last seen, state, counters) for the live ones; the last `dead_kept`
dead ones for inspection (older ones dropped); totals. Owned by the event loop (no locks).

Liveness: each client process heartbeats over its lifeline every `heartbeat_s`, from a thread of
its own (kvdepot_connector.lifeline), so a long engine step does not silence it. A worker whose
lifeline closes is dead at once (`dead`). One that heartbeated and then stays silent for
`timeout_s` is suspect (`sweep` returns it: the caller releases its read locks and quarantines
its reservations, engine/facade.py `suspect_holder`). A heartbeat from a suspect worker makes it
alive again (`beat` returns True). A worker that never heartbeated (a client older than
heartbeats) is never suspected: its liveness is its lifeline alone.

States, checked on every move (an illegal one raises IllegalWorkerMove):
  alive -> suspect -> alive ...;   alive | suspect -> dead (terminal)

Primitives in call order:
  add(wid, instance, role, rank, now)  a HELLO: registered alive
  attach(wid, pid, now)                its lifeline connected (the peer process's pid)
  beat(wid, now) -> bool               a heartbeat; True when it revived a suspect worker
  sweep(now) -> [Worker]               the workers that became suspect now
  dead(wid, now)                       its session ended (lifeline closed, replaced, evicted)
  instances() / by_state()             snapshots (GET /workers, metrics)
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass


class WorkerState(enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"


MOVES: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.ALIVE: frozenset({WorkerState.SUSPECT, WorkerState.DEAD}),
    WorkerState.SUSPECT: frozenset({WorkerState.ALIVE, WorkerState.DEAD}),
    WorkerState.DEAD: frozenset(),
}


class IllegalWorkerMove(RuntimeError):
    """A worker state change outside `MOVES` (a bug)."""


@dataclass(eq=False, slots=True)
class Worker:
    id: int
    instance: str
    role: str
    """"scheduler", "worker", or "" when the client did not say."""
    rank: int | None
    first_seen: float
    last_seen: float
    """The last HELLO, lifeline connection or heartbeat (monotonic seconds)."""
    pid: int | None = None
    state: WorkerState = WorkerState.ALIVE
    heartbeats: int = 0
    suspected: int = 0
    """Times it went suspect."""
    revived: int = 0
    """Times a heartbeat brought it back from suspect."""
    ended: float | None = None

    def move(self, to: WorkerState) -> None:
        if to not in MOVES[self.state]:
            raise IllegalWorkerMove(f"worker {self.id}: {self.state.value} -> {to.value}")
        self.state = to


@dataclass(slots=True)
class WorkerTotals:
    suspect: int = 0
    dead: int = 0
    revived: int = 0
    heartbeats: int = 0


class WorkerRegistry:
    def __init__(self, *, timeout_s: float = 10.0, heartbeat_s: float = 2.0, dead_kept: int = 256) -> None:
        if timeout_s <= 0 or heartbeat_s <= 0 or dead_kept < 0:
            raise ValueError("timeout_s and heartbeat_s must be positive, dead_kept at least 0")
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.dead_kept = dead_kept
        self.totals = WorkerTotals()
        self._live: dict[int, Worker] = {}
        self._dead: OrderedDict[int, Worker] = OrderedDict()

    def __len__(self) -> int:
        return len(self._live)

    def get(self, wid: int) -> Worker | None:
        return self._live.get(wid) or self._dead.get(wid)

    def add(self, wid: int, instance: str, role: str = "", rank: int | None = None, *, now: float) -> Worker:
        if wid in self._live:
            raise ValueError(f"worker {wid} is registered already")
        worker = Worker(wid, instance, role, rank, first_seen=now, last_seen=now)
        self._live[wid] = worker
        return worker

    def attach(self, wid: int, pid: int, now: float) -> None:
        worker = self._live.get(wid)
        if worker is not None:
            worker.pid = pid
            worker.last_seen = now

    def beat(self, wid: int, now: float) -> bool:
        """A heartbeat from `wid`. True when it was suspect and is alive again."""
        worker = self._live.get(wid)
        if worker is None:
            return False
        worker.heartbeats += 1
        worker.last_seen = now
        self.totals.heartbeats += 1
        if worker.state is WorkerState.SUSPECT:
            worker.move(WorkerState.ALIVE)
            worker.revived += 1
            self.totals.revived += 1
            return True
        return False

    def sweep(self, now: float) -> list[Worker]:
        """The heartbeating workers silent for `timeout_s` or more, now suspect."""
        limit = now - self.timeout_s
        out = [
            w for w in self._live.values()
            if w.state is WorkerState.ALIVE and w.heartbeats and w.last_seen <= limit
        ]  # fmt: skip
        for worker in out:
            worker.move(WorkerState.SUSPECT)
            worker.suspected += 1
        self.totals.suspect += len(out)
        return out

    def dead(self, wid: int, now: float) -> Worker | None:
        """`wid`'s session ended: dead, kept among the last `dead_kept` dead workers."""
        worker = self._live.pop(wid, None)
        if worker is None:
            return None
        worker.move(WorkerState.DEAD)
        worker.ended = now
        self.totals.dead += 1
        if self.dead_kept:
            self._dead[wid] = worker
            while len(self._dead) > self.dead_kept:
                self._dead.popitem(last=False)
        return worker

    def instances(self) -> dict[str, list[Worker]]:
        """Engine instance -> its workers, live ones first, then the dead ones kept."""
        out: dict[str, list[Worker]] = {}
        for worker in [*self._live.values(), *self._dead.values()]:
            out.setdefault(worker.instance, []).append(worker)
        return out

    def by_state(self) -> dict[WorkerState, int]:
        counts = dict.fromkeys(WorkerState, 0)
        for worker in self._live.values():
            counts[worker.state] += 1
        counts[WorkerState.DEAD] = len(self._dead)
        return counts
