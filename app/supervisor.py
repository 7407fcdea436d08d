"""Supervisor: starts every background task, keeps references, records crashes.

State: the running tasks (a set, discarded on done) and the names of tasks that died with an
exception. Only the event loop touches it. `/ready` asks `failures()`: a dead task makes the
service unready, with its name and error as the reason.

Primitives in call order: `start(name, coroutine)` -> ... -> `stop(timeout)` (cancel what is left
after the components had their chance to drain).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import structlog

log = structlog.get_logger("kvdepot.supervisor")


class Supervisor:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._no_drain: set[asyncio.Task[Any]] = set()
        self._failures: dict[str, str] = {}
        self._stopping = False
        self.crashed = asyncio.Event()

    def start(self, name: str, coro: Coroutine[Any, Any, Any], *, drain: bool = True) -> asyncio.Task[Any]:
        """Run `coro` as a supervised task. `drain=False`: a loop with nothing to finish, cancelled
        at once on stop (a reaper, a poller) instead of being waited for."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        if not drain:
            self._no_drain.add(task)
        task.add_done_callback(self._on_done)
        return task

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        self._no_drain.discard(task)
        if task.cancelled():
            if not self._stopping:
                # Nobody here cancelled it: something it awaited was cancelled under it (a closed
                # socket does that). A dead task all the same.
                self._failures[task.get_name()] = "cancelled unexpectedly"
                log.error("task_cancelled", task=task.get_name())
                self.crashed.set()
            return
        exc = task.exception()
        if exc is not None:
            self._failures[task.get_name()] = f"{type(exc).__name__}: {exc}"
            log.error("task_crashed", task=task.get_name(), error=repr(exc), exc_info=exc)
            self.crashed.set()
        elif not self._stopping:
            self._failures[task.get_name()] = "exited unexpectedly"
            log.error("task_exited", task=task.get_name())
            self.crashed.set()

    def failures(self) -> dict[str, str]:
        return dict(self._failures)

    def running(self) -> list[str]:
        return sorted(t.get_name() for t in self._tasks)

    async def stop(self, drain_s: float) -> None:
        """Wait up to `drain_s` for the tasks to finish, then cancel the rest."""
        self._stopping = True
        for task in list(self._no_drain):
            task.cancel()
        if not self._tasks:
            return
        _done, pending = await asyncio.wait(set(self._tasks), timeout=drain_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)
