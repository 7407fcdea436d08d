from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import anyio
import pytest

from app.errors import BackendError
from storage.base import LOAD_MISS, OK, LoadResult, OpResult, Status
from storage.codec import EncodedBlob
from storage.common import AdapterCore
from storage.health import DEGRADED_WINDOW_S, HealthTracker, Histogram
from storage.inflight import gather_all, settled

pytestmark = pytest.mark.anyio


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class ScriptedAdapter(AdapterCore):
    """An adapter whose backend does what the test says: answer, fail, or answer too little."""

    kind = "scripted"

    def __init__(self) -> None:
        super().__init__("scripted")
        self.starts = 0
        self.fail_with: Exception | None = None
        self.short = False

    async def _start(self) -> None:
        self.starts += 1

    async def _store(self, items: list[tuple[str, EncodedBlob]]) -> list[OpResult]:
        return [OK] * len(items)

    async def _contains(self, keys: list[str]) -> list[OpResult]:
        if self.fail_with is not None:
            raise self.fail_with
        return [OK] * (len(keys) - 1 if self.short else len(keys))

    async def _load(self, keys: list[str]) -> list[LoadResult]:
        return [LOAD_MISS] * len(keys)

    async def _delete(self, keys: list[str]) -> list[OpResult]:
        return [OpResult.error("disk on fire")] * len(keys)


async def test_first_operation_starts_the_adapter_once() -> None:
    adapter = ScriptedAdapter()
    await asyncio.gather(adapter.contains(["a"]), adapter.contains(["b"]), adapter.start())
    assert adapter.starts == 1
    await adapter.close()


async def test_backend_failure_is_errors_and_down_until_a_success() -> None:
    adapter = ScriptedAdapter()
    adapter.fail_with = BackendError("connection refused")
    results = await adapter.contains(["a", "b"])
    assert [r.status for r in results] == [Status.ERROR, Status.ERROR]
    assert "connection refused" in results[0].message
    assert adapter.health().state == "down"
    adapter.fail_with = None
    assert (await adapter.contains(["a"]))[0].ok
    health = adapter.health()
    assert health.state == "degraded"
    assert health.errors_total == 2
    await adapter.close()


async def test_bugs_and_short_answers_never_escape() -> None:
    adapter = ScriptedAdapter()
    adapter.fail_with = KeyError("oops")
    assert [r.status for r in await adapter.contains(["a"])] == [Status.ERROR]
    adapter.fail_with = None
    adapter.short = True
    results = await adapter.contains(["a", "b", "c"])
    assert [r.status for r in results] == [Status.ERROR] * 3
    assert "2 results for 3 keys" in results[0].message
    assert [r.status for r in await adapter.delete(["x"])] == [Status.ERROR]
    assert adapter.stats.errors == 5
    await adapter.close()


async def test_closed_adapter_answers_errors_and_rejects_bad_capacity() -> None:
    adapter = ScriptedAdapter()
    with pytest.raises(ValueError, match="positive"):
        await adapter.set_capacity(0)
    await adapter.close()
    await adapter.close()  # idempotent
    assert [r.message for r in await adapter.load(["a"])] == ["adapter closed"]
    assert adapter.health().state == "down"
    with anyio.fail_after(1):
        await adapter.start()  # never starts once closed
    assert adapter.starts == 0


def test_health_tracker_windows() -> None:
    clock = FakeClock()
    tracker = HealthTracker(clock)
    assert tracker.snapshot(closed=False).state == "ok"
    tracker.failure("one key failed")
    assert tracker.snapshot(closed=False).state == "degraded"
    clock.now += DEGRADED_WINDOW_S + 1
    snap = tracker.snapshot(closed=False)
    assert (snap.state, snap.last_error, snap.errors_total) == ("ok", "one key failed", 1)
    tracker.failure("unreachable", 3, down=True)
    clock.now += DEGRADED_WINDOW_S + 1
    assert tracker.snapshot(closed=False).state == "down"
    tracker.success()
    assert tracker.snapshot(closed=False).state == "ok"
    assert tracker.snapshot(closed=True).state == "down"


def test_histogram_buckets() -> None:
    hist = Histogram()
    for seconds in (0.0001, 0.0005, 0.003, 100.0):
        hist.observe(seconds)
    assert hist.counts[0] == 2  # <= 0.5 ms, bounds inclusive
    assert hist.counts[3] == 1  # (2.5 ms, 5 ms]
    assert hist.counts[-1] == 1  # beyond every bound
    assert hist.count == 4
    assert hist.sum_s == pytest.approx(100.0036)


# --- load_into and the helpers that keep buffers safe ----------------------------------------------


async def test_load_into_defaults_to_whole_blobs_from_load() -> None:
    class Whole(ScriptedAdapter):
        async def _load(self, keys: list[str]) -> list[LoadResult]:
            return [LoadResult.hit(b"blob-" + k.encode()) for k in keys]

    adapter = Whole()
    outs = [memoryview(bytearray(4)), memoryview(bytearray(4))]
    results = await adapter.load_into(["a", "b"], outs)
    assert [(r.data, r.in_place) for r in results] == [(b"blob-a", False), (b"blob-b", False)]
    assert adapter.stats.load_bytes == 12
    assert adapter.latency.ops["load"].count == 1
    await adapter.close()


async def test_settled_lets_a_cancellation_through_only_when_the_thread_is_done() -> None:
    executor = ThreadPoolExecutor(1, thread_name_prefix="test-settled")
    inside, release = threading.Event(), threading.Event()
    out = bytearray(4)
    interrupted: list[bool] = []

    def write() -> int:
        inside.set()
        release.wait(10)
        out[:] = b"done"
        return 4

    task = asyncio.create_task(settled(executor.submit(write), interrupt=lambda: interrupted.append(True)))
    assert await anyio.to_thread.run_sync(inside.wait, 5)
    task.cancel()
    await anyio.wait_all_tasks_blocked()
    assert not task.done()  # still waiting for the thread
    assert interrupted == [True]
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert out == b"done"  # written before the cancellation went through, never after
    executor.shutdown()


async def test_settled_drops_a_call_that_has_not_started() -> None:
    executor = ThreadPoolExecutor(1, thread_name_prefix="test-settled")
    release = threading.Event()
    executor.submit(release.wait, 10)  # the only thread is busy
    ran: list[bool] = []
    task = asyncio.create_task(settled(executor.submit(ran.append, True)))
    await anyio.wait_all_tasks_blocked()
    task.cancel()
    with anyio.fail_after(5), pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    executor.shutdown()
    assert ran == []


async def test_gather_all_waits_for_every_awaitable_before_raising() -> None:
    finished: list[str] = []
    gate = asyncio.Event()

    async def fails() -> int:
        raise KeyError("first")

    async def slow() -> int:
        await gate.wait()
        finished.append("slow")
        return 2

    task = asyncio.create_task(gather_all([fails(), slow()]))
    await anyio.wait_all_tasks_blocked()
    assert not task.done()
    gate.set()
    with pytest.raises(KeyError):
        await task
    assert finished == ["slow"]
    assert await gather_all([slow(), slow()]) == [2, 2]
