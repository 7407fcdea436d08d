"""StoreQueue: the bounded FIFO of committed chunks waiting to be written behind to L2.

Built before the L1 cache, which is given it as its `Shedder`: when L1 (or a tenant's L1 quota)
has no other room, the oldest queued chunks are let go. Each queued chunk is pinned in L1 by the
store controller (engine/l2/store.py), which pins on `push` and unpins what the queue hands back;
`shed` unpins through the function L1 passes it. State: the pending chunks, how many batches are
being written, the write-behind counters (`StoreCounters`). Owned by the event loop.

Primitives in call order:
  push(item)                  -> the oldest items dropped because the queue was full (counted)
  wait_work() / take(n)       a worker waits for work, then takes a batch (it is busy until done)
  done()                      the batch was written (or not)
  remove_salt(salt)           a purge: the tenant's queued chunks taken out (to unpin)
  shed(nbytes, salt, unpin)   Shedder: let go of the oldest queued chunks (not those being
                              written), of one tenant when given, until `nbytes` were unpinned
  idle() / wait_idle(timeout) nothing queued or being written
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.events import ChunkOrigin
from engine.l1.lifecycle import L1Object
from engine.l2.tiers import wait_set
from engine.results import Registration


@dataclass(slots=True)
class StoreCounters:
    submitted: int = 0
    skipped_policy: int = 0
    not_admitted: int = 0
    """Chunks not written behind under `seen_twice`: seen once so far (also in skipped_policy)."""
    skipped_quota: int = 0
    """Chunks not queued: their tenant may store nothing in any target tier (quota 0, allowlist)."""
    dropped: int = 0
    written: int = 0
    written_bytes: int = 0
    failed: int = 0
    quota_refused: int = 0
    """Queued blobs not written to a tier for the tenant's quota there (one per blob and tier)."""
    quota_evicted_bytes: int = 0
    """Bytes of a tenant's own blobs evicted to make room within its quota."""
    skipped_purge: int = 0
    """Chunks not written behind (refused, or dropped from the queue): their tenant was being purged."""


@dataclass(slots=True)
class Pending:
    obj: L1Object
    reg: Registration
    request_id: str = ""
    """The request whose COMMIT queued it ("" unknown: events off, or queued by a lookup)."""
    origin: ChunkOrigin | None = None
    """What its STORED events say of the chunk (tokens, parent, ...; None: events off)."""


class StoreQueue:
    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.counters = StoreCounters()
        self._items: deque[Pending] = deque()
        self._busy = 0
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return len(self._items)

    def push(self, item: Pending) -> list[Pending]:
        """Queue `item`. Returns the oldest items dropped to stay within `max_depth` (to unpin)."""
        self._items.append(item)
        self._idle.clear()
        dropped = []
        while len(self._items) > self.max_depth:
            dropped.append(self._items.popleft())
        self.counters.dropped += len(dropped)
        self._wakeup.set()
        return dropped

    async def wait_work(self) -> None:
        while not self._items:
            self._wakeup.clear()
            await self._wakeup.wait()

    def take(self, n: int) -> list[Pending]:
        """Up to `n` of the oldest items; the queue is busy until `done()`."""
        self._busy += 1
        return [self._items.popleft() for _ in range(min(n, len(self._items)))]

    def done(self) -> None:
        self._busy -= 1
        if self.idle():
            self._idle.set()

    def remove_salt(self, salt: str) -> list[Pending]:
        """Take every queued chunk of `salt` out of the queue (a purge): the caller unpins them."""
        gone = [item for item in self._items if item.obj.key.salt == salt]
        if gone:
            self._items = deque(item for item in self._items if item.obj.key.salt != salt)
            if self.idle():
                self._idle.set()
        return gone

    def shed(self, nbytes: int, salt: str | None, unpin: Callable[[L1Object], bool]) -> int:
        """Shedder (engine/l1/room.py): drop the oldest queued writes, of `salt`'s chunks only
        when given, until `nbytes` of their chunks are unpinned. Returns the bytes unpinned."""
        freed = 0
        keep: deque[Pending] = deque()
        while self._items and freed < nbytes:
            old = self._items.popleft()
            if salt is not None and old.obj.key.salt != salt:
                keep.append(old)
                continue
            freed += old.obj.size if unpin(old.obj) else 0
            self.counters.dropped += 1
        keep.extend(self._items)
        self._items = keep
        if self.idle():
            self._idle.set()
        return freed

    def idle(self) -> bool:
        return not self._items and self._busy == 0

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is queued or being written. False on timeout."""
        return await wait_set(self._idle, timeout_s)
