"""Intake: the received KV-event messages of a subscription, waiting to be applied, bounded in bytes.

A reader task takes every message off the SUB socket as soon as the loop turns (also while the
subscription's task repairs: a resync awaiting `GET /inventory`, a replay), so what waits is here,
not in libzmq (whose queue is kept short: `rcvhwm`, at most the budget in bytes). A message is
charged its frames' bytes plus `OVERHEAD` (the objects that hold it) against a `Budget` all the
directory's subscriptions share (`directory.max_queued_event_bytes`: registering more instances
buys no more memory); one that would take the total past it is dropped and counted (`dropped`, the
directory's `events_dropped`, logged at a bounded rate) and the intake is marked `overflowed`: the
subscription resyncs the instance from its inventory (`take_overflow`), so dropped events are
repaired, never silently lost. (The budget is at least `max_event_bytes`: any one message fits.)

State: the queue and its byte count, the wake event, the reader task, counters; the shared
budget's byte count. Event loop only.
Primitives in call order: Budget(max_bytes); Intake(sub, budget, on_drop) -> start() ->
get(wait_s) ... take_overflow() ... close().
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable

import zmq.asyncio

#: bytes charged per message besides its frames (the list and bytes objects holding it)
OVERHEAD = 256
#: libzmq's queue of a SUB (or replay) socket, in messages, at least / at most (see `rcvhwm`)
_MIN_HWM, _MAX_HWM = 2, 1000


def rcvhwm(max_bytes: int, max_message: int) -> int:
    """A socket's RCVHWM: messages libzmq may hold while the loop is busy elsewhere, so that they
    take no more than the byte budget even at the largest size taken (`max_message`; 16 by
    default: 32 MiB of 2 MiB messages). Those past it are a gap, repaired like any other."""
    return max(_MIN_HWM, min(_MAX_HWM, max_bytes // max(max_message, 1)))


class Budget:
    """Bytes queued by all the intakes together, and the most they may hold."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0


class Intake:
    def __init__(self, sub: zmq.asyncio.Socket, budget: Budget, on_drop: Callable[[int], None]) -> None:
        self.sub = sub
        self.budget = budget
        self.bytes = 0
        self.dropped = 0
        self.overflowed = False
        self._on_drop = on_drop
        self._queue: deque[tuple[list[bytes], int]] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._read(), name="directory-intake")

    async def _read(self) -> None:
        while True:
            frames = await self.sub.recv_multipart()
            self.put(frames)

    def put(self, frames: list[bytes]) -> bool:
        """Queue a message; False: it did not fit (dropped, counted, `overflowed`)."""
        cost = OVERHEAD + sum(len(f) for f in frames)
        if self.budget.bytes + cost > self.budget.max_bytes:
            self.dropped += 1
            self.overflowed = True
            self._on_drop(cost)
            return False
        self._queue.append((frames, cost))
        self.bytes += cost
        self.budget.bytes += cost
        self._wake.set()
        return True

    async def get(self, wait_s: float) -> list[bytes] | None:
        """The oldest message, waiting up to `wait_s` for one (None: none came). Raises what
        ended the reader (the socket failed): the subscription starts afresh."""
        if not self._queue:
            self._check()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait_s)
            if not self._queue:
                self._check()
                return None
        frames, cost = self._queue.popleft()
        self.bytes -= cost
        self.budget.bytes -= cost
        return frames

    def take_overflow(self) -> bool:
        """Whether messages were dropped since the last call (the instance is due a resync)."""
        overflowed, self.overflowed = self.overflowed, False
        return overflowed

    def _check(self) -> None:
        task = self._task
        if task is not None and task.done() and not task.cancelled():
            exc = task.exception()
            if exc is not None:
                raise exc

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._queue.clear()
        self.budget.bytes -= self.bytes
        self.bytes = 0
