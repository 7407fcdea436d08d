"""AdapterCore: what every L2 adapter shares, so each adapter only says how it talks to its backend.

State (event loop only): the adapter's counters, latency histograms, health tracker
(storage/health.py), the gate of operations in flight (storage/inflight.py), the capacity, and
`_held` (storage/holdings.py): what the adapter holds, key -> (its value, size), which the subclass
keeps its index in, so that every change is reported to the owner's accounting hook. Usage is read
from `_held` and the capacity, the same for every adapter. Subclasses implement `_store`,
`_contains`, `_load`, `_delete` (batch in, one result per key out; `_forget_each` pops a delete's
keys from `_held`), and optionally `_load_into` (default: `_load`, every blob returned whole),
`_load_checked` (load_into with the caller's check, run in the adapter's reading threads;
default: `_load_into`, the check left to the caller), `_evict_salt` (default: the tenant's oldest
entries are forgotten, for a backend that keeps nothing but `_held`), `_capacity_changed`
(default: nothing but the reported figure changes), `_start` and `_close`.

Primitives in call order:
  start()                       runs `_start` once (the first operation calls it when nobody did)
  store/contains/load/load_into/delete
                                each batch runs inside the OpGate, is timed, counted and turned into
                                ERROR results if anything escapes: callers never see an exception.
                                load_into is timed and counted as "load" (payload bytes included);
                                its `too_long` answers (values it refused unread) are counted as
                                integrity failures, deleted (unless `shared`) and answered MISS
  usage() / health()            snapshots: bytes and objects in `_held`, the capacity; health
  set_capacity(bytes)           runtime resize: the capacity, then `_capacity_changed`
  bind_accounting(salt_of, hook) / unbind_accounting()
                                the owner's per-tenant accounting (storage.base), on `_held`
  capabilities()                (storage.base) `pins` where `honours_pins`; a subclass adds its own
  bind_pins(kept)               (adapters whose `honours_pins` is True) which keys pins hold:
                                never chosen by eviction for capacity or quota
  evict_salt(salt, nbytes)      inside the OpGate, timed as "evict": the subclass's `_evict_salt`;
                                a failure frees nothing more and shows in health, never raises
  close()                       gate closes (in-flight batches end with ERROR), then `_close`

A subclass raises app.errors.BackendError when the backend as a whole failed (unreachable, timed
out): every key of the batch becomes ERROR and health turns "down" until a batch succeeds again.
ERROR results it returns itself make health "degraded" for DEGRADED_WINDOW_S; when some keys of a
batch were answered and others were lost with the backend, it calls `_backend_down(message)` and
returns per-key results: health turns "down" all the same.

A subclass whose `_load_into` hands outs to threads must not return, nor let a cancellation
through, before those threads are done with them (the caller reuses the memory at once).
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from typing import ClassVar, Generic, TypeVar

import structlog

from app.errors import BackendError
from storage.base import (
    MISS,
    OK,
    AdapterStats,
    Capabilities,
    Health,
    HoldingsHook,
    Kept,
    LoadResult,
    OpResult,
    SaltOf,
    Status,
    Usage,
)
from storage.codec import BlobCheck, EncodedBlob
from storage.health import HealthTracker, LatencyRecorder
from storage.holdings import Holdings
from storage.inflight import CLOSED_MESSAGE, GateClosed, OpGate

log = structlog.get_logger("kvdepot.storage")

T = TypeVar("T")
R = TypeVar("R", OpResult, LoadResult)
V = TypeVar("V")


def _writable_bytes(out: memoryview) -> memoryview:
    view = out if out.format == "B" and out.ndim == 1 else out.cast("B")
    if view.readonly:
        raise ValueError("load_into needs writable outputs")
    return view


class AdapterCore(ABC, Generic[V]):
    """Base of every adapter: the public L2Adapter operations around the subclass's primitives.
    `V` is what the subclass keeps per key in `_held`."""

    kind: ClassVar[str]
    #: whether eviction here skips the keys pins hold (`bind_pins`); an adapter that cannot (its
    #: backend evicts by its own policy) leaves it False and pins on it are refused
    honours_pins: ClassVar[bool] = False
    #: whether other sidecars use the same blobs (Redis): nothing that fails a check here is
    #: deleted by this sidecar (it may be a fleet-mate's, signed with a key list of its own)
    shared: ClassVar[bool] = False

    def __init__(self, name: str, capacity_bytes: int = 0) -> None:
        self._name = name
        self._capacity = capacity_bytes
        self._stats = AdapterStats()
        self._latency = LatencyRecorder()
        self._health = HealthTracker()
        self._gate = OpGate()
        self._started = False
        self._start_lock = asyncio.Lock()
        self._closed = False
        self._held: Holdings[V] = Holdings()
        self._kept: Kept | None = None

    # --- identity and snapshots ----------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def stats(self) -> AdapterStats:
        return self._stats

    def held_keys(self) -> list[str]:
        return self._held.keys()

    @property
    def latency(self) -> LatencyRecorder:
        return self._latency

    @property
    def closed(self) -> bool:
        return self._closed

    def usage(self) -> Usage:
        return Usage(bytes_used=self._held.bytes, objects=len(self._held), capacity_bytes=self._capacity)

    def health(self) -> Health:
        return self._health.snapshot(self._closed)

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        async with self._start_lock:
            if not self._started and not self._closed:
                await self._start()
                self._started = True

    async def set_capacity(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity must be positive")
        self._capacity = capacity_bytes
        await self._capacity_changed(capacity_bytes)

    def bind_accounting(self, salt_of: SaltOf, hook: HoldingsHook) -> None:
        self._held.bind(salt_of, hook)

    def unbind_accounting(self) -> None:
        self._held.unbind()

    def capabilities(self) -> Capabilities:
        """Pins where `honours_pins`; a subclass with more says so (storage.base)."""
        return Capabilities(pins=self if self.honours_pins else None)

    def bind_pins(self, kept: Kept | None) -> None:
        """Keys `kept` says a pin holds are never evicted (None: no pins). Only where `honours_pins`."""
        if not self.honours_pins:
            raise ValueError(f"L2 adapter {self._name!r} ({self.kind}) cannot honour pins")
        self._kept = kept

    async def evict_salt(self, salt: str, nbytes: int) -> int:
        """See storage.base. Returns the bytes freed (0 when closed or on a backend failure)."""
        if nbytes <= 0 or self._closed:
            return 0
        started = time.perf_counter()
        try:
            freed = await self._gate.run(self._started_then(lambda: self._evict_salt(salt, nbytes)))
        except GateClosed:
            return 0
        except BackendError as exc:
            self._stats.errors += 1
            self._health.failure(f"evict: {exc}", down=True)
            return 0
        except Exception as exc:
            log.exception("l2_evict_failed", adapter=self._name)
            self._stats.errors += 1
            self._health.failure(f"evict: {type(exc).__name__}: {exc}")
            return 0
        self._latency.observe("evict", time.perf_counter() - started)
        return freed

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._gate.close()
        try:
            await self._close()
        except Exception as exc:
            log.warning("l2_close_failed", adapter=self._name, error=repr(exc))

    # --- batch operations ----------------------------------------------------------------------

    async def store(self, items: Sequence[tuple[str, EncodedBlob]]) -> list[OpResult]:
        items = list(items)
        results = await self._batch("store", len(items), lambda: self._store(items), OpResult.error)
        for (_, blob), result in zip(items, results, strict=True):
            if result.status is Status.OK:
                self._stats.stores += 1
                self._stats.store_bytes += blob.nbytes
            elif result.status is Status.NO_SPACE:
                self._stats.no_space += 1
        return results

    async def contains(self, keys: Sequence[str]) -> list[OpResult]:
        keys = list(keys)
        return await self._batch("contains", len(keys), lambda: self._contains(keys), OpResult.error)

    async def load(self, keys: Sequence[str]) -> list[LoadResult]:
        keys = list(keys)
        results = await self._batch("load", len(keys), lambda: self._load(keys), LoadResult.error)
        for result in results:
            if result.status is Status.OK and result.data is not None:
                self._stats.loads += 1
                self._stats.load_bytes += len(result.data)
            elif result.status is Status.MISS:
                self._stats.misses += 1
        return results

    async def load_into(
        self, keys: Sequence[str], outs: Sequence[memoryview], check: BlobCheck | None = None
    ) -> list[LoadResult]:
        """See storage.base. Raises ValueError (a caller's bug) when keys and outs differ in number
        or an out is read-only."""
        keys = list(keys)
        views = [_writable_bytes(out) for out in outs]
        if len(views) != len(keys):
            raise ValueError(f"load_into got {len(keys)} keys and {len(views)} outputs")
        results = await self._batch(
            "load", len(keys), lambda: self._load_bounded(keys, views, check), LoadResult.error
        )
        for result, out in zip(results, views, strict=True):
            if result.status is Status.OK and result.data is not None:
                self._stats.loads += 1
                self._stats.load_bytes += len(result.data) + (out.nbytes if result.in_place else 0)
            elif result.status is Status.MISS:
                self._stats.misses += 1
        return results

    async def delete(self, keys: Sequence[str]) -> list[OpResult]:
        keys = list(keys)
        results = await self._batch("delete", len(keys), lambda: self._delete(keys), OpResult.error)
        self._stats.deletes += sum(1 for r in results if r.status is Status.OK)
        return results

    async def _batch(
        self,
        op: str,
        count: int,
        call: Callable[[], Awaitable[list[R]]],
        error: Callable[[str], R],
    ) -> list[R]:
        if count == 0:
            return []
        if self._closed:
            return [error(CLOSED_MESSAGE)] * count
        started = time.perf_counter()
        try:
            results = await self._gate.run(self._started_then(call))
            if len(results) != count:
                raise RuntimeError(f"{op} answered {len(results)} results for {count} keys")
        except GateClosed:
            return [error(CLOSED_MESSAGE)] * count
        except BackendError as exc:
            self._stats.errors += count
            self._health.failure(f"{op}: {exc}", count, down=True)
            results = [error(f"{op}: {exc}")] * count
        except Exception as exc:
            log.exception("l2_batch_failed", adapter=self._name, op=op)
            message = f"{op}: {type(exc).__name__}: {exc}"
            self._stats.errors += count
            self._health.failure(message, count)
            results = [error(message)] * count
        else:
            failed = [r for r in results if r.status is Status.ERROR]
            if failed:
                self._stats.errors += len(failed)
                self._health.failure(f"{op}: {failed[0].message}", len(failed))
            else:
                self._health.success()
        self._latency.observe(op, time.perf_counter() - started)
        return results

    async def _load_bounded(
        self, keys: list[str], outs: list[memoryview], check: BlobCheck | None
    ) -> list[LoadResult]:
        """`_load_into` (`_load_checked` with a check), then values longer than any blob for their
        out (refused unread) counted as integrity failures, deleted (best effort; never from a
        shared tier) and answered MISS."""
        if check is None:
            results = await self._load_into(keys, outs)
        else:
            results = await self._load_checked(keys, outs, check)
        oversized = [i for i, result in enumerate(results) if result.oversized]
        if not oversized:
            return results
        self._stats.integrity_failures += len(oversized)
        log.warning("l2_oversized_value", adapter=self._name, keys=[keys[i] for i in oversized[:8]],
                    error=results[oversized[0]].message)  # fmt: skip
        if self.shared:
            return [LoadResult(Status.MISS) if r.oversized else r for r in results]
        try:
            await self._delete([keys[i] for i in oversized])
        except BackendError as exc:
            self._backend_down(f"delete of oversized values: {exc}")
        for i in oversized:
            results[i] = LoadResult(Status.MISS)
        return results

    def _forget_each(self, keys: list[str]) -> tuple[list[OpResult], list[V]]:
        """Pop each key from `_held`: OK or MISS per key, and the values popped (what the subclass
        then removes from its backend)."""
        results: list[OpResult] = []
        popped: list[V] = []
        for key in keys:
            held = self._held.pop(key)
            if held is None:
                results.append(MISS)
            else:
                popped.append(held.value)
                results.append(OK)
        return results, popped

    def _backend_down(self, message: str) -> None:
        """The backend failed under a batch that still answers per key: health turns "down"."""
        self._health.failure(message, 0, down=True)

    async def _started_then(self, call: Callable[[], Awaitable[T]]) -> T:
        await self.start()
        return await call()

    # --- what a subclass provides --------------------------------------------------------------

    async def _start(self) -> None:
        """Ready the backend. Default: nothing to do."""

    async def _close(self) -> None:
        """Release the backend's resources. Default: nothing to release."""

    @abstractmethod
    async def _store(self, items: list[tuple[str, EncodedBlob]]) -> list[OpResult]: ...

    @abstractmethod
    async def _contains(self, keys: list[str]) -> list[OpResult]: ...

    @abstractmethod
    async def _load(self, keys: list[str]) -> list[LoadResult]: ...

    async def _load_into(self, keys: list[str], outs: list[memoryview]) -> list[LoadResult]:
        """Default: nothing is read in place; every blob comes back whole for decode_into."""
        del outs
        return await self._load(keys)

    async def _load_checked(
        self, keys: list[str], outs: list[memoryview], check: BlobCheck
    ) -> list[LoadResult]:
        """load_into with the caller's check (storage.base). Default: the check is the caller's
        (results unchecked); an adapter that reads in threads of its own runs it there."""
        del check
        return await self._load_into(keys, outs)

    @abstractmethod
    async def _delete(self, keys: list[str]) -> list[OpResult]: ...

    async def _evict_salt(self, salt: str, nbytes: int) -> int:
        """Default, for a backend that keeps nothing but `_held` (memory): forget the tenant's
        least recently used entries (those pins hold stay). Returns the bytes freed."""
        freed = 0
        for key in self._held.oldest(salt, nbytes, self._kept):
            held = self._held.pop(key, evicted=True)
            if held is not None:
                freed += held.size
                self._count_eviction(held.size)
        return freed

    def _count_eviction(self, nbytes: int) -> None:
        self._stats.evictions += 1
        self._stats.evicted_bytes += nbytes

    async def _capacity_changed(self, capacity_bytes: int) -> None:
        """The capacity is now `capacity_bytes` (`_capacity`). Default: only the reported figure
        changes; an adapter that enforces its capacity evicts here."""
