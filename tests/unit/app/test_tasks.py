"""TaskSet: a component's side tasks are kept while they run, leave when done, a crash is logged,
and close cancels what is left and waits for it."""

from __future__ import annotations

import asyncio

import pytest
import structlog

from app.tasks import TaskSet

pytestmark = pytest.mark.anyio


async def test_tasks_are_kept_while_running_and_leave_when_done() -> None:
    tasks = TaskSet("test")
    go = asyncio.Event()

    async def wait_then(value: int) -> int:
        await go.wait()
        return value

    first = tasks.spawn(wait_then(1), name="one")
    second = tasks.spawn(wait_then(2))
    assert len(tasks) == 2
    assert first in list(tasks) and first.get_name() == "one"
    go.set()
    assert await asyncio.gather(first, second) == [1, 2]
    await asyncio.sleep(0)  # the done callbacks run
    assert len(tasks) == 0


async def test_a_crash_is_logged_with_the_set_and_task_names() -> None:
    tasks = TaskSet("replays")

    async def crash() -> None:
        raise RuntimeError("boom")

    with structlog.testing.capture_logs() as logs:
        task = tasks.spawn(crash(), name="replay-1")
        await asyncio.wait([task])
        await asyncio.sleep(0)  # the done callback runs
    crashed = [e for e in logs if e["event"] == "task_crashed"]
    assert len(crashed) == 1
    assert crashed[0]["tasks"] == "replays" and crashed[0]["task"] == "replay-1"
    assert "boom" in crashed[0]["error"]
    assert len(tasks) == 0


async def test_close_cancels_and_waits_and_cancel_needs_no_await() -> None:
    tasks = TaskSet("test")
    cancelled = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    task = tasks.spawn(forever())
    await asyncio.sleep(0)  # it runs up to its wait
    await tasks.close(wait_s=5)
    assert task.cancelled() and cancelled.is_set()
    other = tasks.spawn(forever())
    tasks.cancel()
    await asyncio.wait([other])
    assert other.cancelled()
    await asyncio.sleep(0)
    assert len(tasks) == 0
