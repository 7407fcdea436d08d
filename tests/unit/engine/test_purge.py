"""PurgeJobs with the engine as app/main wires it (L1, write-behind to two in-memory adapters, the
event bus): a purge removes one tenant's chunks from L1 and every adapter and nothing of another's,
announcing REMOVED per chunk and tier; a clear empties the tiers named (CLEARED each); the job list
survives in its file until a job ends (it is there before purge returns, and gone before the job
shows done); a purge whose file cannot be written is refused; bad tier names are refused."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest

from app.errors import BackendError, InvalidInput, NotFound
from engine.events import L1_TIER, Event, EventBus, Kind
from engine.facade import CacheEngine
from engine.purge import PURGE_FILE, PurgeJob, PurgeJobs
from engine.results import SlotStatus
from storage.base import L2Adapter
from storage.mock.config import MockAdapterConfig
from tests.factories import l2_engine, small_layout, tokens

pytestmark = pytest.mark.anyio

CHUNK = 16
T = TypeVar("T")
TWO = [MockAdapterConfig(name="m1"), MockAdapterConfig(name="m2")]


def store(eng: CacheEngine, eid: int, salt: str, which: int, chunks: int) -> None:
    slots = eng.store(eid, f"w{salt}{which}", tokens(chunks * CHUNK, start=which * 10_000), salt)
    assert all(eng.commit(eid, [s.oid for s in slots if s.status is SlotStatus.RESERVED]))


def salts(adapter: L2Adapter) -> dict[str, int]:
    out: dict[str, int] = {}
    for key in adapter.held_keys():
        salt = key.split("/")[5][2:]
        out[salt] = out.get(salt, 0) + 1
    return out


async def done(jobs: PurgeJobs, job: PurgeJob) -> PurgeJob:
    for _ in range(1000):
        if job.state != "running":
            return job
        await asyncio.sleep(0.005)
    raise AssertionError(f"job {job.id} did not end")


async def test_purge_removes_one_tenant_everywhere_and_clear_empties_tiers(tmp_path: Path) -> None:
    bus = EventBus(capacity=4096)
    seen: list[Event] = []
    bus.subscribe(seen.extend)
    async with l2_engine(64 * 4096, TWO, events=bus) as (eng, _):
        assert eng.l2 is not None
        eid = eng.register("m", small_layout()).engine_id
        for which in range(3):
            store(eng, eid, "p", which, 2)
            store(eng, eid, "q", which, 2)
        assert await eng.l2.store.wait_idle(10)
        adapters = [t.adapter for t in eng.l2.tiers.all()]
        assert [salts(a) for a in adapters] == [{"p": 6, "q": 6}] * 2
        with ThreadPoolExecutor(1) as pool:
            jobs = PurgeJobs(eng, eng.l2.tiers, bus, path=tmp_path / PURGE_FILE, executor=pool)
            with pytest.raises(NotFound):
                jobs.latest("p")
            job, again = await asyncio.gather(jobs.purge("p"), jobs.purge("p"))
            assert again is job  # the running one
            await done(jobs, job)
            assert job.state == "done" and job.l1_chunks == 6
            assert {n: p.removed for n, p in job.progress.items()} == {"m1": 6, "m2": 6}
            assert [salts(a) for a in adapters] == [{"q": 6}] * 2
            assert eng.tenants.held("p") == 0 and eng.tenants.held("q") == 6 * 4096
            bus.flush()
            removed = [(e.tier, e.key.salt) for e in seen if e.kind is Kind.REMOVED and e.key is not None]
            assert sorted(removed) == sorted([(L1_TIER, "p")] * 6 + [("m1", "p")] * 6 + [("m2", "p")] * 6)
            assert (tmp_path / PURGE_FILE).read_text() == '{"version": 1, "pending": []}'

            with pytest.raises(InvalidInput, match="nosuch"):
                await jobs.clear(["l1", "nosuch"])
            seen.clear()
            job = await done(jobs, await jobs.clear(["l1", "m2"]))
            assert job.l1_chunks == 6 and job.progress["m2"].removed == 6
            assert [salts(a) for a in adapters] == [{"q": 6}, {}]
            bus.flush()
            assert sorted(e.tier for e in seen if e.kind is Kind.CLEARED) == [L1_TIER, "m2"]
            assert jobs.latest(None) is job
            await jobs.close()


def test_load_reads_the_pending_jobs_and_ignores_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / PURGE_FILE
    assert PurgeJobs.load(path) == []
    path.write_text('{"version": 1, "pending": [{"kind": "purge", "salt": "p", "tiers": ["l1"]}]}')
    assert PurgeJobs.load(path) == [{"kind": "purge", "salt": "p", "tiers": ["l1"]}]
    path.write_text("not json")
    assert PurgeJobs.load(path) == []


class Inline(Executor):
    """Runs each job at once on the caller's thread, noting first what `note()` says."""

    def __init__(self, note: Callable[[], str]) -> None:
        self.note = note
        self.notes: list[str] = []

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        self.notes.append(self.note())
        fut: Future[T] = Future()
        fut.set_result(fn(*args, **kwargs))
        return fut


async def test_a_purge_is_in_the_file_when_it_returns_and_out_of_it_before_it_shows_done(
    tmp_path: Path,
) -> None:
    async with l2_engine(64 * 4096, TWO) as (eng, _):
        assert eng.l2 is not None
        eid = eng.register("m", small_layout()).engine_id
        store(eng, eid, "p", 0, 2)
        assert await eng.l2.store.wait_idle(10)
        path = tmp_path / PURGE_FILE
        holder: list[PurgeJobs] = []
        pool = Inline(lambda: holder[0].latest("p").state)
        jobs = PurgeJobs(eng, eng.l2.tiers, eng.cache.events, path=path, executor=pool)
        holder.append(jobs)
        job = await jobs.purge("p")
        assert [p["salt"] for p in PurgeJobs.load(path)] == ["p"]
        await done(jobs, job)
        assert job.state == "done" and PurgeJobs.load(path) == []
        assert pool.notes == ["running", "running"], "the job showed done before its file said so"
        await jobs.close()


async def test_a_purge_whose_file_cannot_be_written_is_refused(tmp_path: Path) -> None:
    async with l2_engine(64 * 4096, TWO) as (eng, _):
        assert eng.l2 is not None
        with ThreadPoolExecutor(1) as pool:
            path = tmp_path / "no-such-dir" / PURGE_FILE
            jobs = PurgeJobs(eng, eng.l2.tiers, eng.cache.events, path=path, executor=pool)
            with pytest.raises(BackendError, match="job file"):
                await jobs.purge("p")
            assert jobs.latest("p").state == "failed"
            await jobs.close()
