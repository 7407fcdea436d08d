"""Operations in flight: the gate that lets an adapter's close() end them, and the waits that never
hand a caller's buffers back while an executor thread may still use them.

State: OpGate keeps the set of tasks running through it and whether it is closed (event loop
only); ExecutorJobs the executor jobs running. settled and gather_all keep nothing.

Primitives in call order:
  OpGate.run(coro)          the coroutine as a task, or GateClosed once the gate closed (also for
                            a task the closing cancelled)
  OpGate.close()            cancel what is in flight (CLOSED_MESSAGE) and wait up to CLOSE_WAIT_S
  settled(job, interrupt)   await an executor job; a cancellation goes through only once the job
                            is done with the caller's memory
  gather_all(aws)           asyncio.gather that leaves nothing running when it raises
  Placed(header)            what an executor read into a caller's out answers (disk, slab)
  ExecutorJobs(executor)    .submit(fn, *args) ... await .wait(limit_s): an adapter's executor
                            jobs, kept until done so that its close can wait for them
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import structlog

log = structlog.get_logger("kvdepot.storage")

T = TypeVar("T")

CLOSE_WAIT_S = 5.0
CLOSED_MESSAGE = "adapter closed"


@dataclass(frozen=True, slots=True)
class Placed:
    """An executor read put the blob's payload into the caller's out; `header` is its header."""

    header: bytes


async def settled(job: concurrent.futures.Future[T], interrupt: Callable[[], None] | None = None) -> T:
    """The result of `job`, a call running in an executor thread. A cancellation goes through only
    once the call has finished (or was dropped before it started), never while it may still touch
    memory the caller hands back when cancelled; `interrupt` (called on the loop) makes a running
    call stop early."""
    fut = asyncio.wrap_future(job)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        job.cancel()
        if interrupt is not None:
            interrupt()
        while not fut.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([fut])
        if not fut.cancelled():
            fut.exception()  # retrieved: the caller was cancelled and will not look
        raise


async def gather_all(aws: Iterable[Awaitable[T]]) -> list[T]:
    """asyncio.gather that waits for every awaitable before it raises, the first exception then, or
    lets a cancellation through: none is left running with the caller's buffers."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return cast(list[T], results)


class ExecutorJobs:
    """The jobs one adapter gave its executor, kept until each is done, so that its close can wait
    for them (a descriptor or buffer a job uses must outlive it). Submitted from the event loop; a
    job leaves the set from its thread when it ends."""

    def __init__(self, executor: concurrent.futures.Executor) -> None:
        self._executor = executor
        self._running: set[concurrent.futures.Future[Any]] = set()

    def __len__(self) -> int:
        return len(self._running)

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        job = self._executor.submit(fn, *args)
        self._running.add(job)
        job.add_done_callback(self._running.discard)
        return job

    async def wait(self, limit_s: float | None = None) -> None:
        """Until the jobs running now are done, or `limit_s` seconds passed (they run on)."""
        running = [asyncio.wrap_future(job) for job in list(self._running)]
        if running:
            await asyncio.wait(running, timeout=limit_s)


class GateClosed(Exception):
    """The adapter closed before the operation finished."""


class OpGate:
    """Operations in flight, so that `close()` can end them. Event loop only."""

    def __init__(self) -> None:
        self._closed = False
        self._tasks: set[asyncio.Task[Any]] = set()

    def is_closed(self) -> bool:
        return self._closed

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """The coroutine's result, or GateClosed when the gate closes first."""
        if self._closed:
            coro.close()
            raise GateClosed
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self.is_closed() and task.cancelled() and (current is None or not current.cancelling()):
                raise GateClosed from None
            raise

    async def close(self) -> None:
        """Cancel what is in flight and wait (bounded) for it to unwind."""
        self._closed = True
        pending = list(self._tasks)
        for task in pending:
            task.cancel(CLOSED_MESSAGE)
        if pending:
            _, still = await asyncio.wait(pending, timeout=CLOSE_WAIT_S)
            if still:
                log.warning("l2_close_left_tasks", count=len(still))
