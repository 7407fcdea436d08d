"""The L2 adapter interface and the small values it returns. Imports nothing else from storage/
but the codec's EncodedBlob.

Every adapter is driven from the one event loop. Its batch operations take string keys (serialized
ObjectKeys) and answer with exactly one result per key, in order: never None, never a shorter list,
never an exception. A failed backend shows up as ERROR results and in `health()`.

Primitives in call order:
  start()                  ready the adapter (the disk adapter rebuilds its index); idempotent, and
                           the first operation calls it when the owner did not
  store(items)             write blobs: OK, NO_SPACE (no room can be made), ERROR
  contains(keys)           OK = present, MISS = absent, ERROR = could not tell
  load(keys)               OK with the blob bytes, MISS, ERROR. Integrity is the caller's check
                           (codec.decode_into); on a failed check the caller counts it in
                           `stats.integrity_failures` (and `stats.auth_failures` when the MAC
                           check failed, `stats.auth_unknown_key` too when the blob names a key
                           id the caller does not hold) and it is a miss. The caller deletes it
                           only from an adapter that is not `shared` (storage/common.py), and
                           never one of an unknown key
  load_into(keys, outs)    the zero-copy load: each out is the writable region (exactly the chunk's
                           original payload size) the blob decodes into. A raw blob whose payload is
                           exactly len(out) (blob_header.fits_in_place) is read with its payload straight
                           into out: OK with `in_place` set and `data` = the header bytes alone, to
                           be checked with codec.verify_in_place. Any other blob (FP8, lz4, or one
                           that does not fit) comes back whole, as from load, for codec.decode_into.
                           MISS and ERROR as for load; a failed or short read is never OK. An out
                           whose result is not OK may hold garbage: the caller discards it. When
                           load_into returns (or is cancelled), nothing writes into the outs any more.
                           Bounded: no blob of a key is longer than blob_header.header_size(key) + len(out)
                           (storage/codec.py), so nothing past that is ever read: a longer value is
                           refused unread (`LoadResult.too_long` from the subclass), counted in
                           `stats.integrity_failures`, deleted (not from a `shared` adapter),
                           and answered MISS
  delete(keys)             OK = removed, MISS = was not there, ERROR
  usage() / health()       cheap snapshots for /status and metrics
  set_capacity(bytes)      runtime resize; shrinking evicts (least recently used first)
  evict_salt(salt, nbytes) evict one tenant's blobs, its least recently used first (each adapter
                           says what its order is), until `nbytes` of them are gone or it holds
                           none: the owner's per-tenant quota. Never another tenant's blob. Returns
                           the bytes freed; never raises
  close()                  operations in flight end with ERROR results; later calls answer ERROR

Accounting: keys are opaque here. The owner binds, before start(), a `SaltOf` (which tenant a key
belongs to) and a `HoldingsHook`; the adapter then reports on the loop every change of what it
holds, one call per key: (key, delta_bytes, delta_objects, evicted). A new key is (+size, +1), a key
stored again (+new - old, 0), a key gone (-size, -1): deleted, found missing, evicted (then
`evicted` is True: for capacity or by evict_salt), or failed its check. What is held already when
the hook is bound (the disk adapter's index) is reported at once. Hence the sums of the reports per
tenant equal the bytes of the blobs the adapter holds per tenant, at all times (Redis: of what this
adapter wrote and has not seen deleted).

`stats` (counters) and `latency` (a tiny histogram per operation) are read by the metrics exporter.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from storage.codec import EncodedBlob


class Status(enum.Enum):
    OK = "ok"
    MISS = "miss"
    ERROR = "error"
    NO_SPACE = "no_space"


@dataclass(frozen=True, slots=True)
class OpResult:
    """The outcome of one key of a store, contains or delete."""

    status: Status
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    @classmethod
    def error(cls, message: str) -> OpResult:
        return cls(Status.ERROR, message)


OK = OpResult(Status.OK)
MISS = OpResult(Status.MISS)


@dataclass(frozen=True, slots=True)
class LoadResult:
    """The outcome of one key of a load. `data` is set only when status is OK: the whole blob, or,
    when `in_place` (load_into only), the blob's header while its payload lies in the caller's out."""

    status: Status
    data: bytes | memoryview | None = None
    message: str = ""
    in_place: bool = False
    oversized: bool = False

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    @classmethod
    def hit(cls, data: bytes | memoryview) -> LoadResult:
        return cls(Status.OK, data)

    @classmethod
    def placed(cls, header: bytes | memoryview) -> LoadResult:
        """OK for load_into: the payload is in the caller's out, `header` is the blob's header."""
        return cls(Status.OK, header, in_place=True)

    @classmethod
    def error(cls, message: str) -> LoadResult:
        return cls(Status.ERROR, None, message)

    @classmethod
    def too_long(cls, message: str) -> LoadResult:
        """load_into: the stored value is longer than any blob for the out; it was not read."""
        return cls(Status.MISS, None, message, oversized=True)


LOAD_MISS = LoadResult(Status.MISS)

HealthState = Literal["ok", "degraded", "down"]

SaltOf = Callable[[str], str]
"""The tenant (cache_salt) a key belongs to; given by the owner, since keys are opaque here."""
HoldingsHook = Callable[[str, int, int, bool], None]
"""(key, delta_bytes, delta_objects, evicted): one change of what an adapter holds."""
Kept = Callable[[str], bool]
"""True for a key a pin holds in this adapter (engine/pins/): never evicted while it says so."""


@dataclass(frozen=True, slots=True)
class Usage:
    """Bytes and objects held; `capacity_bytes` 0 means unknown (e.g. Redis without a set capacity)."""

    bytes_used: int
    objects: int
    capacity_bytes: int


@dataclass(frozen=True, slots=True)
class Health:
    """ok: working; degraded: recent errors; down: unreachable or closed."""

    state: HealthState
    last_error: str | None
    errors_total: int


@dataclass(slots=True)
class AdapterStats:
    """Counters since start, exported as metrics. Mutated only on the event loop."""

    stores: int = 0
    store_bytes: int = 0
    loads: int = 0
    load_bytes: int = 0
    misses: int = 0
    deletes: int = 0
    no_space: int = 0
    errors: int = 0
    integrity_failures: int = 0
    auth_failures: int = 0
    auth_unknown_key: int = 0
    evictions: int = 0
    evicted_bytes: int = 0


LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


@dataclass(slots=True)
class Histogram:
    """Per-bucket counts (not cumulative); the last slot counts what exceeds every bound."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    count: int = 0
    sum_s: float = 0.0

    def observe(self, seconds: float) -> None:
        index = len(self.bounds)
        for i, bound in enumerate(self.bounds):
            if seconds <= bound:
                index = i
                break
        self.counts[index] += 1
        self.count += 1
        self.sum_s += seconds


@dataclass(slots=True)
class LatencyRecorder:
    """One histogram per operation kind ("store", "load", ...), created on first use."""

    ops: dict[str, Histogram] = field(default_factory=dict)

    def observe(self, op: str, seconds: float) -> None:
        hist = self.ops.get(op)
        if hist is None:
            hist = self.ops[op] = Histogram()
        hist.observe(seconds)


class L2Adapter(Protocol):
    """One L2 tier. See the module docstring for the contract of each operation."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str:
        """The adapter kind: disk, slab, redis or mock."""
        ...

    @property
    def stats(self) -> AdapterStats: ...

    @property
    def latency(self) -> LatencyRecorder: ...

    async def start(self) -> None: ...

    async def store(self, items: Sequence[tuple[str, EncodedBlob]]) -> list[OpResult]: ...

    async def contains(self, keys: Sequence[str]) -> list[OpResult]: ...

    async def load(self, keys: Sequence[str]) -> list[LoadResult]: ...

    async def load_into(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[LoadResult]: ...

    async def delete(self, keys: Sequence[str]) -> list[OpResult]: ...

    def usage(self) -> Usage: ...

    def health(self) -> Health: ...

    async def set_capacity(self, capacity_bytes: int) -> None: ...

    async def evict_salt(self, salt: str, nbytes: int) -> int: ...

    def bind_accounting(self, salt_of: SaltOf, hook: HoldingsHook) -> None:
        """Report every change of what the adapter holds to `hook` (see the module docstring)."""
        ...

    def unbind_accounting(self) -> None:
        """Stop reporting: the owner forgets this adapter's figures."""
        ...

    def held_keys(self) -> list[str]:
        """The serialized keys the adapter holds now (Redis: those this process wrote and has not
        seen go; keys Redis expired are still listed), least recently used first."""
        ...

    async def close(self) -> None: ...
