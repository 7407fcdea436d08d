"""Supervisor: keeps its tasks, records the ones that die, drains then cancels on stop."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from app.supervisor import Supervisor

pytestmark = pytest.mark.anyio


class Probe:
    """Events a supervised test task sets: when it starts running and when it is cancelled."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def forever(self) -> None:
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def forever() -> None:
    await asyncio.Event().wait()


async def test_running_lists_live_tasks_by_name() -> None:
    sup = Supervisor()
    sup.start("b-task", forever())
    sup.start("a-task", forever(), drain=False)
    assert sup.running() == ["a-task", "b-task"]
    assert sup.failures() == {}
    await sup.stop(0.01)
    assert sup.running() == []
    assert sup.failures() == {}
    assert not sup.crashed.is_set()


async def test_task_that_raises_is_a_named_failure() -> None:
    sup = Supervisor()
    go = asyncio.Event()

    async def dies() -> None:
        await go.wait()
        raise RuntimeError("disk on fire")

    sup.start("healthy", forever())
    task = sup.start("worker", dies())
    go.set()
    with anyio.fail_after(5):
        await sup.crashed.wait()
    assert task.done()
    assert sup.failures() == {"worker": "RuntimeError: disk on fire"}
    assert sup.running() == ["healthy"]
    await sup.stop(0.01)
    assert sup.failures() == {"worker": "RuntimeError: disk on fire"}


async def test_task_that_returns_while_running_is_a_failure() -> None:
    sup = Supervisor()

    async def quits() -> None:
        return None

    sup.start("quitter", quits())
    with anyio.fail_after(5):
        await sup.crashed.wait()
    assert sup.failures() == {"quitter": "exited unexpectedly"}
    assert sup.running() == []


async def test_task_cancelled_from_inside_is_a_failure() -> None:
    sup = Supervisor()
    loop = asyncio.get_running_loop()
    pending: asyncio.Future[None] = loop.create_future()
    waiting = asyncio.Event()

    async def awaits_a_future() -> None:
        waiting.set()
        await pending

    task = sup.start("poller", awaits_a_future())
    await waiting.wait()
    pending.cancel()  # as pyzmq does to pending receives when its socket is closed
    with anyio.fail_after(5):
        await asyncio.wait([task])
    assert task.cancelled()
    assert "poller" in sup.failures()
    assert sup.crashed.is_set()


async def test_stop_waits_for_draining_tasks_to_finish() -> None:
    sup = Supervisor()
    stopping = asyncio.Event()
    drained: list[str] = []

    async def drains() -> None:
        await stopping.wait()
        for _ in range(3):  # some work left to finish after the stop request
            await asyncio.sleep(0)
        drained.append("done")

    sup.start("drainer", drains())
    stopping.set()
    with anyio.fail_after(5):
        await sup.stop(30)
    assert drained == ["done"]
    assert sup.running() == []
    assert sup.failures() == {}
    assert not sup.crashed.is_set()


async def test_stop_cancels_no_drain_tasks_at_once() -> None:
    sup = Supervisor()
    probe = Probe()
    task = sup.start("reaper", probe.forever(), drain=False)
    await probe.started.wait()
    with anyio.fail_after(5):  # far below the 60 s drain allowance
        await sup.stop(60)
    assert probe.cancelled.is_set()
    assert task.cancelled()
    assert sup.failures() == {}
    assert not sup.crashed.is_set()


async def test_stop_cancels_what_does_not_drain_in_time() -> None:
    sup = Supervisor()
    probe = Probe()
    task = sup.start("stuck", probe.forever())
    await probe.started.wait()
    with anyio.fail_after(5):
        await sup.stop(0.05)
    assert probe.cancelled.is_set()
    assert task.cancelled()
    assert sup.running() == []
    assert sup.failures() == {}


async def test_task_that_returns_during_stop_is_not_a_failure() -> None:
    sup = Supervisor()
    stopping = asyncio.Event()

    async def serves_until_stopped() -> None:
        await stopping.wait()

    sup.start("server", serves_until_stopped())
    stopping.set()
    await sup.stop(5)
    assert sup.failures() == {}
    assert not sup.crashed.is_set()


async def test_stop_with_no_tasks_returns() -> None:
    sup = Supervisor()
    with anyio.fail_after(1):
        await sup.stop(30)
    assert sup.running() == []
