"""EventBus: what happens in the cache, published from the hot path without blocking it.

The engine publishes an `Event` (a small frozen record with its wall-clock timestamp) at every
observable change: a chunk stored in or removed from a tier, a tier cleared, a lookup answered, an
error, and a START/END pair around every data-plane operation and every L2 load/store. Publishing
appends the record to a bounded deque and returns: no await, no lock, no I/O, no allocation beyond
the record. A supervised dispatcher task (`run`) drains the deque in batches and hands each batch to
the subscribers registered at wiring time (the KV-event publisher first; metrics, logs and tracing
can follow).

Full queue: the NEWEST record is dropped and counted (`dropped`, exported as
`kvdepot_events_dropped_total`): what is queued keeps its order, and a consumer that needs the
complete holding resyncs from the inventory. `enabled=False` makes `publish` a no-op (one attribute
test), so a sidecar without subscribers pays nothing.

Subscribers: `subscribe(callback)` before `run` starts; a callback gets a list of events in publish
order, runs on the loop and must not block (a slow consumer buffers or drops in its own bounded
queue). A callback that raises is logged and counted (`subscriber_errors`) and stays subscribed: one
bad subscriber never stops the others or the bus.

State (event loop only): the deque, its bound, the counters, a wake-up event for the dispatcher.

Primitives in call order: EventBus(capacity, enabled, linger_s) -> subscribe(cb)... -> run() (a task) ->
publish(event)... -> flush() (tests, shutdown) -> stop().
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from engine.keys import ObjectKey

log = logging.getLogger("kvdepot.events")

#: the tier name of L1 in events (L2 tiers use their adapter's name: "disk", "redis", ...)
L1_TIER = "L1"


class Kind(enum.IntEnum):
    STORED = 1
    """A chunk became readable in `tier` (L1: committed; L2: written behind or loaded)."""
    REMOVED = 2
    """A chunk left `tier` (`reason`: evicted, deleted, purged, corrupt, expired)."""
    CLEARED = 3
    """Every chunk left `tier` ("" = every tier)."""
    LOOKUP = 4
    """A lookup answered: `detail` = hit tokens (in L1), `total` = tokens of its full chunks, `hits` =
    the keys of the chunks it hit for the first time, `reason` = "prefetch" when the misses are being
    loaded from L2 (an END "l2.prefetch" with tier "" follows, its `detail` = the chunks that arrived)."""
    ERROR = 5
    """An operation failed: `op`, `reason` = the error code."""
    START = 6
    """An operation began: `op`, `request_id`; ends with the END of the same `span`. The pairs:
    every data-plane operation (`op` = its message tag, `request_id` where the message names one,
    `trace` = the client's traceparent), "l2.load" per chunk loaded (tier = the adapter),
    "l2.prefetch" per request (tier "") and per adapter within it (locate + loads; END detail =
    chunks loaded), "l2.store" per batch written to an adapter, one pair per request in the batch
    (END detail = chunks written)."""
    END = 7
    """An operation ended: `op`, `span`, `reason` = "ok" or the error code, `detail` = chunks."""


class ChunkOrigin(NamedTuple):
    """What a STORED event says of a chunk's content, whatever the tier: its tokens (uint32
    little-endian, the wire format), the chunk hash of the chunk before it (b"" for the first), its
    extra key (b"" when its KV depends on tokens alone), the LoRA adapter's name when known. (A
    named tuple: one is made per reserved chunk on the store path, where a frozen dataclass's
    construction costs several times more.)"""

    tokens: bytes = b""
    parent: bytes = b""
    extra: bytes = b""
    lora_name: str = ""

    def fields(self) -> dict[str, object]:
        """The Event fields it fills (for `EventBus.emit`)."""
        return {
            "tokens": self.tokens, "parent": self.parent, "extra": self.extra, "lora_name": self.lora_name,
        }  # fmt: skip


def chain_origins(
    tokens: bytes, hashes: Sequence[bytes], extras: Sequence[bytes], chunk_bytes: int, first: int
) -> Callable[[int], ChunkOrigin]:
    """The origin of chunk `first + j` of a request's chain, for j = 0, 1, ... (built on demand)."""

    def origin(j: int) -> ChunkOrigin:
        i = first + j
        return ChunkOrigin(
            tokens[i * chunk_bytes : (i + 1) * chunk_bytes], hashes[i - 1] if i else b"",
            extras[i] if i < len(extras) else b"",
        )  # fmt: skip

    return origin


@dataclass(slots=True)
class Event:
    """One record, handed to every subscriber: treat it as immutable. (Not `frozen`: a frozen
    dataclass's __init__ costs about three times as much, on the hot path.)"""

    kind: Kind
    ts_ns: int
    """time.time_ns() when published."""
    tier: str = ""
    key: ObjectKey | None = None
    op: str = ""
    request_id: str = ""
    span: int = 0
    """Pairs a START with its END (unique per bus)."""
    reason: str = ""
    detail: int = 0
    tokens: bytes = b""
    """STORED: the chunk's tokens (uint32 little-endian, the wire format; a `ChunkOrigin`'s fields,
    these four), when the emitter knew them: a commit, a write-behind, a load for a lookup."""
    parent: bytes = b""
    """STORED: the chunk hash of the chunk before it (b"" for the first chunk, or unknown)."""
    extra: bytes = b""
    """STORED: the chunk's extra key (b"" when its KV depends on tokens alone)."""
    lora_name: str = ""
    """STORED: the LoRA adapter's name when the client said it."""
    trace: str = ""
    """START of a data-plane operation: the W3C `traceparent` the client sent with it (b"" none)."""
    total: int = 0
    """LOOKUP: the tokens of the lookup's full chunks."""
    hits: Sequence[ObjectKey] = ()
    """LOOKUP: the keys of the chunks it found in L1 that no lookup had found before."""


Subscriber = Callable[[list[Event]], object]


class EventBus:
    def __init__(
        self, *, capacity: int = 65536, enabled: bool = True, batch: int = 1024, linger_s: float = 0.0
    ) -> None:
        if capacity <= 0 or batch <= 0 or linger_s < 0:
            raise ValueError("capacity and batch must be positive, linger_s not negative")
        self.capacity = capacity
        self.enabled = enabled
        self.batch = batch
        #: after a wake-up the dispatcher waits this long, so one batch carries a burst
        self.linger_s = linger_s
        self.published = 0
        self.dropped = 0
        self.delivered = 0
        self.subscriber_errors = 0
        self._queue: deque[Event] = deque()
        self._subscribers: list[Subscriber] = []
        self._wake = asyncio.Event()
        self._spans = 0
        self._stopped = False

    # -- publishing (hot path) ------------------------------------------------------------------

    def publish(self, event: Event) -> None:
        """Queue `event`; drop it (counted) when the queue is full. Never blocks, never raises."""
        if not self.enabled:
            return
        if len(self._queue) >= self.capacity:
            self.dropped += 1
            return
        self._queue.append(event)
        self.published += 1
        if not self._wake.is_set():
            self._wake.set()

    def emit(self, kind: Kind, **fields: object) -> None:
        """Build and publish an event stamped now (a no-op, nothing built, when disabled; nothing
        built either when the queue is full: dropped and counted)."""
        if not self.enabled:
            return
        if len(self._queue) >= self.capacity:
            self.dropped += 1
            return
        self.publish(Event(kind, time.time_ns(), **fields))  # type: ignore[arg-type]

    def start(self, op: str, request_id: str = "", *, tier: str = "", trace: str = "") -> int:
        """Publish the START of `op` and answer its span id (0 when disabled: `end` ignores it).
        `trace`: the caller's W3C traceparent, when it sent one."""
        if not self.enabled:
            return 0
        self._spans += 1
        span = self._spans
        self.publish(
            Event(Kind.START, time.time_ns(), tier=tier, op=op, request_id=request_id, span=span, trace=trace)
        )
        return span

    def end(
        self, span: int, op: str, request_id: str = "", *, tier: str = "", reason: str = "ok", detail: int = 0
    ) -> None:
        if not self.enabled or span == 0:
            return
        self.publish(
            Event(
                Kind.END, time.time_ns(), tier=tier, op=op, request_id=request_id, span=span, reason=reason,
                detail=detail,
            )
        )  # fmt: skip

    def pending(self) -> int:
        return len(self._queue)

    # -- delivery (the dispatcher task) --------------------------------------------------------

    def subscribe(self, callback: Subscriber) -> None:
        self._subscribers.append(callback)

    def _deliver_batch(self) -> int:
        count = min(self.batch, len(self._queue))
        events = [self._queue.popleft() for _ in range(count)]
        for callback in self._subscribers:
            try:
                callback(events)
            except Exception:
                self.subscriber_errors += 1
                log.exception("an event subscriber failed on %d events", count)
        self.delivered += count
        return count

    def drain(self) -> int:
        """Hand what is queued to the subscribers, `batch` events at a time; answer how many."""
        n = 0
        while self._queue:
            n += self._deliver_batch()
        return n

    async def run(self) -> None:
        """Deliver until stopped; yields to the loop between batches so a burst never starves it."""
        while not self._stopped:
            await self._wake.wait()
            if self.linger_s:
                await asyncio.sleep(self.linger_s)
            self._wake.clear()
            while self._queue and not self._stopped:
                self._deliver_batch()
                await asyncio.sleep(0)

    def flush(self) -> int:
        """Deliver what is queued now (tests; shutdown before the subscribers close)."""
        return self.drain()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
