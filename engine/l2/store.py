"""StoreController: writes committed L1 chunks behind to the L2 tiers; the engine never waits on it.

State: a bounded FIFO of pending chunks, each holding a read lock on its L1 object (so it is not
evicted or reused before it is written), a bounded record of how often each chunk was seen (for
the `seen_twice` policy), counters. Owned by the event loop; encoding (a checksum over the whole
chunk, optional FP8/lz4) runs in the codec executor, adapter I/O in the adapters.

Primitives in call order:
  note_seen(keys)          lookups and stores report the chunks they saw (seen_twice policy)
  submit(obj, reg)         after COMMIT: queue the chunk if the policy wants it; when the queue
                           is full the OLDEST pending chunk is dropped (its lock released), counted
  run_worker()             supervised loop(s): take a batch, encode, store to the tiers the policy
                           chooses at that moment, release the locks
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import structlog

from engine.keys import ObjectKey
from engine.l1.arena import SharedArena
from engine.l1.cache import L1Cache
from engine.l1.lifecycle import L1Object
from engine.l2.tiers import L2Tiers, Tier
from engine.results import Registration
from storage import codec

log = structlog.get_logger("kvdepot.l2.store")

SEEN_MEMORY = 1 << 17
BATCH = 8


@dataclass(slots=True)
class StoreCounters:
    submitted: int = 0
    skipped_policy: int = 0
    dropped: int = 0
    written: int = 0
    written_bytes: int = 0
    failed: int = 0


@dataclass(slots=True)
class _Pending:
    obj: L1Object
    reg: Registration


class StoreController:
    def __init__(
        self,
        *,
        cache: L1Cache,
        arena: SharedArena,
        tiers: L2Tiers,
        policy: str,
        queue_depth: int,
        codec_options: Callable[[Registration], codec.CodecOptions],
        executor: Executor,
    ) -> None:
        self.cache = cache
        self.arena = arena
        self.tiers = tiers
        self.policy = policy
        self.queue_depth = queue_depth
        self.counters = StoreCounters()
        self._codec_options = codec_options
        self._executor = executor
        self._queue: deque[_Pending] = deque()
        self._wakeup = asyncio.Event()
        self._seen: OrderedDict[ObjectKey, int] = OrderedDict()
        self._busy = 0
        self._idle = asyncio.Event()
        self._idle.set()
        cache.shed = self.shed

    @property
    def depth(self) -> int:
        return len(self._queue)

    def idle(self) -> bool:
        return not self._queue and self._busy == 0

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is queued or being written. False on timeout."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    # --- called synchronously by the facade ----------------------------------------------------

    def note_seen(self, key: ObjectKey) -> int:
        count = self._seen.pop(key, 0) + 1
        self._seen[key] = count
        if len(self._seen) > SEEN_MEMORY:
            self._seen.popitem(last=False)
        return count

    def wants(self, key: ObjectKey) -> bool:
        if not self.tiers.active():
            return False
        return self.policy != "seen_twice" or self._seen.get(key, 0) >= 2

    def submit(self, obj: L1Object, reg: Registration) -> bool:
        """Queue a ready chunk for write-behind. False when the policy does not want it."""
        if obj.in_l2 or not self.wants(obj.key):
            self.counters.skipped_policy += 1
            return False
        obj.in_l2 = True  # queued once; a failed write clears it so a later commit/hit retries
        self.cache.lock(obj, obj.last_access)
        self._queue.append(_Pending(obj, reg))
        self._idle.clear()
        self.counters.submitted += 1
        while len(self._queue) > self.queue_depth:
            old = self._queue.popleft()
            old.obj.in_l2 = False
            self.cache.unlock(old.obj)
            self.counters.dropped += 1
        self._wakeup.set()
        return True

    def shed(self, nbytes: int, salt: str | None = None) -> int:
        """L1 (or a tenant's quota, when `salt` is given) is out of room: drop the oldest queued
        writes (not those being written), of that tenant only when given, until `nbytes` of their
        chunks are unpinned. Returns the bytes unpinned."""
        freed = 0
        keep: deque[_Pending] = deque()
        while self._queue and freed < nbytes:
            old = self._queue.popleft()
            if salt is not None and old.obj.key.salt != salt:
                keep.append(old)
                continue
            old.obj.in_l2 = False
            freed += old.obj.size if old.obj.locks == 1 else 0
            self.cache.unlock(old.obj)
            self.counters.dropped += 1
        keep.extend(self._queue)
        self._queue = keep
        if self.idle():
            self._idle.set()
        return freed

    # --- the workers ---------------------------------------------------------------------------

    async def run_worker(self) -> None:
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = [self._queue.popleft() for _ in range(min(BATCH, len(self._queue)))]
            self._busy += 1
            try:
                await self._write(batch)
            finally:
                self._busy -= 1
                for item in batch:
                    self.cache.unlock(item.obj)
                if self.idle():
                    self._idle.set()

    def _targets(self) -> list[Tier]:
        active = self.tiers.active()
        return active[:1] if self.policy == "first" else active

    async def _write(self, batch: list[_Pending]) -> None:
        targets = self._targets()
        if not targets:
            for item in batch:
                item.obj.in_l2 = False
            return
        loop = asyncio.get_running_loop()
        blobs = await loop.run_in_executor(self._executor, self._encode, batch)
        ok = [False] * len(batch)
        for tier in targets:
            items = [(blob.key, blob) for blob in blobs]
            start = time.perf_counter()
            with tier.use():
                results = await tier.adapter.store(items)
            tier.adapter.latency.observe("store_batch", time.perf_counter() - start)
            for i, result in enumerate(results):
                if result.ok:
                    ok[i] = True
                else:
                    self.counters.failed += 1
        for item, blob, written in zip(batch, blobs, ok, strict=True):
            if written:
                self.counters.written += 1
                self.counters.written_bytes += blob.nbytes
            else:
                item.obj.in_l2 = False

    def _encode(self, batch: list[_Pending]) -> list[codec.EncodedBlob]:
        """In the codec executor: header + checksum (+ FP8/lz4) over the locked L1 bytes."""
        out = []
        for item in batch:
            obj = item.obj
            payload = self.arena.view(obj.offset, obj.size)
            out.append(
                codec.encode(
                    obj.key.serialize(), obj.key.namespace.layout_fp, payload, self._codec_options(item.reg)
                )
            )
        return out
