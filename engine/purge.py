"""PurgeJobs: a tenant's chunks removed from L1 and every L2 adapter (purge), or every chunk of some
tiers (clear), as background jobs whose progress the control plane reads.

Role: `purge(salt)` deletes the tenant's objects in L1 (CacheEngine.clear(salt): REMOVED "purged"
per chunk), then, adapter by adapter, its blobs: an adapter with a `scan` capability (storage/base.py)
lists every blob its backend holds (Redis: a SCAN of its prefix on every node, what any sidecar
wrote, before or after a restart, at most its `scan_keys_per_s` keys a second), any other its
`held_keys()` (disk, slab, mock: every blob it holds); they are deleted in batches.
Each blob deleted announces REMOVED (tier = the adapter): through the adapter's holdings hook for
the blobs it held ("deleted"), "purged" for the others. `clear(tiers)` does the same for every chunk
of the tiers named (`l1`: CacheEngine.clear(), CLEARED for L1; an adapter: all its blobs, then
CLEARED for it). A job is idempotent: run again it scans again and deletes what is left. The jobs
not finished are kept in `<data_dir>/purges.json` (written atomically, fsync, when one starts, and
when one ends before it shows "done"): `purge` and `clear` return (the 202) only once the file
lists the job, and after a restart `resume` starts them again, so a purge answered is never lost.
While a purge runs, the tenant's write-behind is held off (StoreController.hold: its queued chunks
dropped, new ones refused); the adapters are swept once its batches in flight have landed, and L1
once more at the end, so the tenant's chunks that this sidecar stored or loaded meanwhile are gone
too. (Another sidecar writing the tenant to a shared Redis meanwhile is not held off.)

State (event loop only): the jobs by id (the last MAX_JOBS), the tasks running (kept in a set,
cancelled at close), the latest job per target, the targets not finished (what the file holds). A
job's task never raises: a failure ends it "failed" with the message.

Primitives in call order: load(path) (start-up), PurgeJobs(engine, tiers, events, path=, executor=),
resume(loaded), await purge(salt) / await clear(tiers) (the running job for the same target is
returned instead of a second one, once it is in the file), job(id) / latest(target), close().
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import structlog

from app.errors import BackendError, InvalidInput, NotFound
from engine.events import EventBus, Kind
from engine.facade import CacheEngine
from engine.keys import ObjectKey
from engine.l2.store import StoreController
from engine.l2.tiers import L2Tiers, Tier
from engine.tenants.quota import L1, check_salt
from engine.tenants.registry import write_atomically
from storage.base import Status, key_salt

log = structlog.get_logger("kvdepot.purge")

PURGE_FILE = "purges.json"
MAX_JOBS = 256
BATCH = 256
ALL = "*"
"""The target of a clear (every tenant)."""

JobState = Literal["running", "done", "failed"]


@dataclass(slots=True)
class TierProgress:
    scanned: int = 0
    removed: int = 0
    failed: int = 0


@dataclass(slots=True)
class PurgeJob:
    """One purge (`tenant` set) or clear (`tenant` null) and how far it got."""

    id: str
    kind: Literal["purge", "clear"]
    tenant: str | None
    tiers: list[str]
    state: JobState = "running"
    l1_chunks: int = 0
    progress: dict[str, TierProgress] = field(default_factory=dict)
    error: str | None = None
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None


class PurgeJobs:
    def __init__(
        self, engine: CacheEngine, tiers: L2Tiers | None, events: EventBus, keys_per_s: int = 2000,
        *, path: Path | None = None, executor: Executor | None = None,
    ) -> None:  # fmt: skip
        if path is not None and executor is None:
            raise ValueError("a persistent job list needs an executor for its file writes")
        self.engine = engine
        self.tiers = tiers
        self.events = events
        self.keys_per_s = keys_per_s
        self.path = path
        self._executor = executor
        self._pending: dict[str, dict[str, Any]] = {}
        self._jobs: OrderedDict[str, PurgeJob] = OrderedDict()
        self._latest: dict[str, str] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: job id -> done once the job file lists it (until then purge/clear do not answer)
        self._saved: dict[str, asyncio.Future[None]] = {}
        self._ids = itertools.count(1)

    # --- starting and reading ------------------------------------------------------------------

    async def purge(self, salt: str) -> PurgeJob:
        """The tenant's purge, once it is in the job file (BackendError when it cannot be written:
        nothing started)."""
        return await self._durable(self._purge(salt))

    async def clear(self, tiers: list[str] | None) -> PurgeJob:
        """`tiers`: `l1` and adapter names (None: L1 only). InvalidInput for an unknown name. Once
        it is in the job file, as for purge."""
        return await self._durable(self._clear(tiers))

    def _purge(self, salt: str) -> PurgeJob:
        check_salt(salt)
        tiers = [L1, *(t.name for t in self._adapters())]
        return self._start("purge", salt, tiers)

    def _clear(self, tiers: list[str] | None) -> PurgeJob:
        names = [L1] if not tiers else list(dict.fromkeys(tiers))
        known = {L1, *(t.name for t in self._adapters())}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise InvalidInput(f"unknown tier(s) {', '.join(unknown)}; tiers are {', '.join(sorted(known))}")
        return self._start("clear", None, names)

    async def _durable(self, job: PurgeJob) -> PurgeJob:
        saved = self._saved.get(job.id)
        if saved is not None:
            await asyncio.shield(saved)
        return job

    def job(self, job_id: str) -> PurgeJob:
        found = self._jobs.get(job_id)
        if found is None:
            raise NotFound(f"no purge or clear job {job_id!r}")
        return found

    def latest(self, salt: str | None) -> PurgeJob:
        """The latest job for the tenant (None: the latest clear). NotFound when there is none."""
        job_id = self._latest.get(ALL if salt is None else "s:" + salt)
        if job_id is None or job_id not in self._jobs:
            raise NotFound("no purge of this tenant" if salt is not None else "no clear")
        return self._jobs[job_id]

    @staticmethod
    def load(path: Path) -> list[dict[str, Any]]:
        """The jobs that were running when the sidecar stopped (start-up, blocking). A file that
        cannot be read is logged and ignored: a purge can always be asked again."""
        try:
            body = json.loads(path.read_text(encoding="utf-8"))
            pending = body["pending"]
            if not isinstance(pending, list):
                raise ValueError("pending is not a list")
            return [p for p in pending if isinstance(p, dict)]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("purge_file_ignored", path=str(path), error=f"{type(exc).__name__}: {exc}")
            return []

    def resume(self, pending: list[dict[str, Any]]) -> list[PurgeJob]:
        """Start again the jobs `load` found (once the adapters are attached)."""
        jobs = []
        for entry in pending:
            try:
                if entry.get("kind") == "purge" and isinstance(entry.get("salt"), str):
                    jobs.append(self._purge(entry["salt"]))
                elif entry.get("kind") == "clear" and isinstance(entry.get("tiers"), list):
                    known = {L1, *(t.name for t in self._adapters())}
                    tiers = [t for t in entry["tiers"] if t in known]
                    if tiers:
                        jobs.append(self._clear(tiers))
            except InvalidInput as exc:
                log.warning("purge_not_resumed", error=str(exc))
        for job in jobs:
            log.info("purge_resumed", job=job.id, kind=job.kind, tiers=job.tiers)
        return jobs

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- running -------------------------------------------------------------------------------

    def _adapters(self) -> list[Tier]:
        return [] if self.tiers is None else self.tiers.active()

    def _start(self, kind: Literal["purge", "clear"], salt: str | None, tiers: list[str]) -> PurgeJob:
        target = ALL if salt is None else "s:" + salt
        running = self._latest.get(target)
        if running is not None and running in self._jobs and self._jobs[running].state == "running":
            job = self._jobs[running]
            if kind == "purge" or job.tiers == tiers:
                return job
        name = None if salt is None else self.engine.tenants.name_of(salt)
        job = PurgeJob(id=f"{kind}-{next(self._ids)}", kind=kind, tenant=name, tiers=tiers)
        self._jobs[job.id] = job
        self._latest[target] = job.id
        while len(self._jobs) > MAX_JOBS:
            old_id, old = next(iter(self._jobs.items()))
            if old.state == "running":
                break
            del self._jobs[old_id]
        entry: dict[str, Any] = {"kind": kind, "salt": salt} if salt is not None else {"kind": kind}
        self._pending[target] = entry | {"tiers": tiers}
        saved = self._saved[job.id] = asyncio.get_running_loop().create_future()
        saved.add_done_callback(_retrieved)
        task = asyncio.get_running_loop().create_task(self._run(job, salt, target, saved), name=job.id)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    async def _run(self, job: PurgeJob, salt: str | None, target: str, saved: asyncio.Future[None]) -> None:
        try:
            try:
                await self._save(strict=True)
            except OSError as exc:
                if self._latest.get(target) == job.id:
                    self._pending.pop(target, None)
                saved.set_exception(BackendError(f"purge: the job file cannot be written: {exc}"))
                raise
            saved.set_result(None)
            store = None if self.engine.l2 is None or salt is None else self.engine.l2.store
            if store is not None and salt is not None:
                store.hold(salt)
            try:
                await self._sweep(job, salt, store)
            finally:
                if store is not None and salt is not None:
                    store.unhold(salt)
            if self._latest.get(target) == job.id:
                self._pending.pop(target, None)
            await self._save()  # then done: a restart in between runs it again (idempotent)
            job.state = "done"
        except asyncio.CancelledError:
            job.state, job.error = "failed", "cancelled (the sidecar stopped); ask again to finish"
            raise
        except Exception as exc:
            log.warning("purge_failed", job=job.id, error=f"{type(exc).__name__}: {exc}")
            job.state, job.error = "failed", f"{type(exc).__name__}: {exc}"
        finally:
            self._saved.pop(job.id, None)
            if not saved.done():
                saved.cancel()
            job.finished_at = time.time()
            log.info("purge_ended", job=job.id, state=job.state, l1_chunks=job.l1_chunks,
                     removed={n: p.removed for n, p in job.progress.items()})  # fmt: skip

    async def _sweep(self, job: PurgeJob, salt: str | None, store: StoreController | None) -> None:
        """L1, then (a purge) once the tenant's write-behind in flight has landed, each adapter,
        then L1 again (what lookups loaded or clients stored meanwhile)."""
        if L1 in job.tiers:
            job.l1_chunks = self.engine.clear(salt)
        if store is not None and salt is not None:  # bounded: a tier that hangs holds no purge
            settle_s = self.tiers.drain_timeout_s if self.tiers is not None else 30.0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(settle_s):
                    await store.settled(salt)
        for tier in self._adapters():
            if tier.name in job.tiers:
                progress = job.progress.setdefault(tier.name, TierProgress())
                await self._tier(tier, salt, progress)
                if salt is None:
                    self.events.emit(Kind.CLEARED, tier=tier.name, op="clear", detail=progress.removed)
        if L1 in job.tiers and salt is not None:
            job.l1_chunks += self.engine.clear(salt)

    async def _save(self, *, strict: bool = False) -> None:
        """The jobs not finished, to `path` (a restart resumes them). A failed write raises OSError
        when `strict`, else it is logged."""
        if self.path is None:
            return
        data = json.dumps({"version": 1, "pending": list(self._pending.values())}).encode()
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, write_atomically, self.path, data)
        except OSError as exc:
            log.warning("purge_file_not_written", path=str(self.path), error=str(exc))
            if strict:
                raise

    async def _tier(self, tier: Tier, salt: str | None, progress: TierProgress) -> None:
        adapter = tier.adapter
        held = set(adapter.held_keys())
        async for batch in self._keys(tier):
            progress.scanned += len(batch)
            mine = [k for k in batch if _belongs(k, salt)]
            for start in range(0, len(mine), BATCH):
                keys = mine[start : start + BATCH]
                for key, result in zip(keys, await adapter.delete(keys), strict=True):
                    if result.status is Status.OK:
                        progress.removed += 1
                        if key not in held:  # the holdings hook announced the others
                            self.events.emit(Kind.REMOVED, tier=tier.name, key=ObjectKey.parse(key),
                                             reason="purged")  # fmt: skip
                    elif result.status is not Status.MISS:
                        progress.failed += 1

    async def _keys(self, tier: Tier) -> AsyncIterator[list[str]]:
        """Every key the tier's backend holds (its `scan` capability: Redis, whoever wrote them),
        else what the adapter holds."""
        adapter = tier.adapter
        scan = adapter.capabilities().scan
        if scan is not None:
            async for batch in scan.scan_keys():
                yield batch
            return
        keys = adapter.held_keys()
        for start in range(0, len(keys), BATCH):
            yield keys[start : start + BATCH]
            await asyncio.sleep(0)


def _retrieved(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()  # a resumed job's failure is the job's state; nobody awaits it


def _belongs(key: str, salt: str | None) -> bool:
    """`key` is a chunk key (not a stranger's value under the prefix) of `salt` (None: any)."""
    found = key_salt(key)
    return found is not None and (salt is None or found == salt)
