"""TaskSet: the asyncio tasks one component runs on the side (a replay being served, a reply sent
later, a job), kept referenced while they run.

Role: the loop keeps only a weak reference to a task, so a task nobody holds may vanish mid-run;
each component that starts such tasks keeps them here instead of in a set of its own. A task leaves
the set when it is done; one that ends with an exception is logged (`task_crashed`, with the set's
and the task's names), since nobody awaits it. At close the component cancels what is left
(`cancel`, from synchronous code) or cancels and waits for it (`close`). Long-lived loops of the
service are the Supervisor's (app/supervisor.py), which also turns a dead one into `/ready` failing.

Pure: asyncio and structlog only, so every layer may use it (tests/check_layering.py).

State: the running tasks. Event loop only.

Primitives in call order: spawn(coro[, name]) ... len(tasks) ... cancel() | await close(wait_s).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import structlog

log = structlog.get_logger("kvdepot.tasks")

T = TypeVar("T")


class TaskSet:
    def __init__(self, name: str) -> None:
        """`name`: the component's, in the log line of a task that crashed."""
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        """The running tasks (a snapshot)."""
        return iter(list(self._tasks))

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Task[T]:
        """Run `coro` as a task of this set (on the running loop)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("task_crashed", tasks=self.name, task=task.get_name(), error=repr(exc), exc_info=exc)

    def cancel(self) -> None:
        """Cancel every running task (they leave the set as they finish)."""
        for task in list(self._tasks):
            task.cancel()

    async def close(self, wait_s: float | None = None) -> None:
        """Cancel every running task and wait up to `wait_s` for them to finish (None: as long as
        they take)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=wait_s)
