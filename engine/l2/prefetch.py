"""PrefetchController: brings chunks a LOOKUP missed in L1 back from L2, within a deadline.

State: one `Prefetch` handle per request in flight (its task, how many chunks it tries, how many
are loaded, a done event; the request's state keeps it), the chunks being loaded (a future each,
shared by every prefetch that wants them), a semaphore bounding chunk loads across all requests,
counters. Owned by the event loop; adapters read into the arena from their own threads, blob
checks and decodes run there (disk) or in the codec executor.

One prefetch, in order:
  1. locate: ask the active tiers, in order, which of the missing chunks they hold; the run is the
     contiguous prefix found somewhere (policy: the first tier that has each chunk)
  2. reserve temporary L1 objects for the run (`cache.try_reserve(..., temporary=True)`: in the
     sidecar's own write domain, or when it has no room in the asking engine's, where the load
     counts as that engine's write; a chunk being loaded by someone else, or no room, ends the run)
  3. load straight into the reservations (adapter.load_into: a raw blob's payload lands in L1,
     checked there by codec.verify_in_place; any other blob is decoded into it by
     codec.decode_into: key, layout, checksum, and for a tier with `authenticate` the MAC with the
     deployment's keys), at most `max_inflight` chunks at once over all requests. The check goes
     to the adapter with the load (a codec.BlobCheck): an adapter that reads in threads of its own
     (disk) runs it in the thread that read the blob; for any other the codec executor runs it
  4. in chunk order, commit each loaded chunk and hand it to the request (`attach`), which
     read-locks it; the first failure (miss, error, integrity) ends the run
At the deadline whatever has not been attached is a miss: the request's hit is the prefix attached
so far. A chunk that arrives for a request that moved on is kept as an ordinary L1 object
(`cache.make_ordinary`). A reservation is busy for I/O (`cache.busy_for_io`: never reaped) while
threads read or copy into it, and is aborted only after they have finished, so its memory is
never reused while a thread still writes it. A blob that fails its check is a miss, counted; it is
deleted from its tier only when the tier is this sidecar's own (disk, slab, mock: `tiers.is_shared`
False) and the blob did not name a key id this sidecar does not hold (`UnknownKey`: a fleet-mate's
blob under another key list, counted as `auth_unknown_key` and logged once per key id and tier).

Events: START/END "l2.prefetch" (request_id) around the whole prefetch (tier "", END detail =
chunks handed to the request) and around each adapter's part of it (tier = the adapter: from asking
it which chunks it holds to its last load, END detail = chunks loaded from it),
START/END "l2.load" (tier = the adapter) around each load, STORED (tier L1, op "l2.load",
reason = the tier it came from, the chunk's tokens, parent and extra key from the lookup's chain)
when a loaded chunk is committed, REMOVED "corrupt" for a blob that
failed its check and is deleted, ERROR "l2.load" for a load that failed.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import structlog

from app.errors import AuthenticationError, IntegrityError, LeaseExpired, UnknownKey
from engine.events import L1_TIER, ChunkOrigin, EventBus, Kind
from engine.keys import ObjectKey
from engine.l1.arena import SharedArena
from engine.l1.cache import L1Cache, Refusal
from engine.l1.lifecycle import L1Object, ObjectState
from engine.l2.prefetch_spans import PrefetchSpans as _Spans
from engine.l2.tiers import L2Tiers, Tier, is_shared
from engine.results import Registration
from engine.tenants.quota import L1
from storage import codec
from storage.auth import BlobKeys
from storage.base import LoadResult
from storage.inflight import settled

log = structlog.get_logger("kvdepot.l2.prefetch")

Attach = Callable[[L1Object], bool]
"""Hands an arrived chunk to the request that asked (read-locks it); False: the request moved on."""


@dataclass(slots=True)
class PrefetchCounters:
    started: int = 0
    chunks_located: int = 0
    chunks_loaded: int = 0
    bytes_loaded: int = 0
    deadline_expired: int = 0
    load_errors: int = 0
    integrity_failures: int = 0
    auth_failures: int = 0
    auth_unknown_key: int = 0
    no_space: int = 0
    quota_refused: int = 0


@dataclass(eq=False)
class Prefetch:
    """The handle of one request's prefetch (kept in its engine/requests.RequestState); changed
    by this controller only."""

    trying: int
    loaded: int = 0
    finished: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


@dataclass(eq=False, slots=True)
class _Slot:
    key: ObjectKey
    name: str
    tier: Tier
    obj: L1Object | None = None  # our reservation
    ready: L1Object | None = None  # already in L1
    waiting: asyncio.Future[L1Object | None] | None = None  # being loaded by another prefetch
    task: asyncio.Task[bool] | None = None


def _reserved(obj: L1Object) -> bool:
    return obj.state is ObjectState.WRITE_RESERVED


class PrefetchController:
    def __init__(
        self,
        *,
        cache: L1Cache,
        arena: SharedArena,
        tiers: L2Tiers,
        deadline_s: float,
        max_inflight: int,
        executor: Executor,
        clock: Callable[[], float],
        keys: BlobKeys | None = None,
        events: EventBus | None = None,
    ) -> None:
        self.cache = cache
        self.arena = arena
        self.tiers = tiers
        self.events = events if events is not None else cache.events
        self.deadline_s = deadline_s
        self.counters = PrefetchCounters()
        self._slots = asyncio.Semaphore(max_inflight)
        self._executor = executor
        self._clock = clock
        # Without the deployment's keys nothing from an authenticating tier can pass its check.
        self._keys = keys if keys is not None else BlobKeys([secrets.token_bytes(32)])
        self._running: set[asyncio.Task[Any]] = set()
        self._loading: dict[ObjectKey, asyncio.Future[L1Object | None]] = {}
        self._unknown_logged: set[tuple[str, str]] = set()  # (tier, key id) said once

    def start(
        self, reg: Registration, keys: list[ObjectKey], attach: Attach, request_id: str = "",
        origins: Callable[[int], ChunkOrigin] | None = None,
    ) -> Prefetch:  # fmt: skip
        """Bring `keys` (a lookup's misses, in chain order) from L2 for `request_id`; `origins(j)`:
        what the STORED event of keys[j] says of the chunk (tokens, parent, ...)."""
        p = Prefetch(trying=len(keys))
        run = self._run(p, reg, keys, attach, _Spans(self.events, request_id), origins=origins)
        p.task = asyncio.get_running_loop().create_task(run, name="prefetch")
        self._running.add(p.task)
        p.task.add_done_callback(self._on_done)
        self.counters.started += 1
        return p

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        self._running.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("prefetch_crashed", error=repr(task.exception()), exc_info=task.exception())

    async def close(self) -> None:
        for task in list(self._running):
            task.cancel()
        if self._running:
            await asyncio.wait(set(self._running), timeout=5)

    # --- one prefetch --------------------------------------------------------------------------

    async def _run(
        self, p: Prefetch, reg: Registration, keys: list[ObjectKey], attach: Attach, spans: _Spans, *,
        origins: Callable[[int], ChunkOrigin] | None,
    ) -> None:  # fmt: skip
        slots: list[_Slot] = []
        served: dict[str, int] = {}  # chunks handed to the request, by the tier that served them
        outcome = "ok"
        spans.begin("")
        try:
            async with asyncio.timeout(self.deadline_s):
                slots = await self._locate(keys, spans)
                self.counters.chunks_located += len(slots)
                self._reserve(slots, reg)
                p.trying = len(slots)
                for slot in slots:
                    if slot.obj is not None:
                        spans.loading(slot.tier.name)
                        slot.task = asyncio.get_running_loop().create_task(self._load(slot, reg, spans))
                spans.located()
                for j, slot in enumerate(slots):
                    late_l1 = slot.ready is not None  # in L1 by the time it was reserved
                    obj = await self._arrive(slot, origins(j) if origins is not None else None)
                    if obj is None:
                        break
                    if not attach(obj):
                        # The request moved on: keep the chunk as an ordinary L1 object.
                        self.cache.make_ordinary(obj)
                        continue
                    p.loaded += 1
                    by = L1 if late_l1 else slot.tier.name
                    served[by] = served.get(by, 0) + 1
        except TimeoutError:
            self.counters.deadline_expired += 1
            outcome = "deadline"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            ledger = self.tiers.ledger
            if ledger is not None and keys:
                for tier, hits in served.items():
                    ledger.note_hits(keys[0].salt, tier, hits)
            p.finished = True
            p.done.set()
            try:
                await self._cleanup(slots)
            finally:
                spans.close(outcome, p.loaded)

    async def _arrive(self, slot: _Slot, origin: ChunkOrigin | None) -> L1Object | None:
        """The slot's chunk, ready in L1 (committed if we loaded it, announced with `origin`), or None."""
        if slot.ready is not None:
            return slot.ready if slot.ready.visible else None
        if slot.waiting is not None:
            obj = await asyncio.shield(slot.waiting)
            return obj if obj is not None and obj.visible else None
        assert slot.task is not None
        assert slot.obj is not None
        if not await slot.task:
            return None
        try:
            obj = self.cache.commit(slot.obj.oid, self._clock())
        except LeaseExpired:
            return None
        finally:
            slot.obj = None
        self._resolve(slot.key, obj)
        if self.events.enabled:
            self.events.emit(
                Kind.STORED, tier=L1_TIER, key=obj.key, op="l2.load", reason=slot.tier.name,
                **(origin.fields() if origin is not None else {}),
            )  # fmt: skip
        self.counters.chunks_loaded += 1
        self.counters.bytes_loaded += obj.size
        slot.ready = obj
        return obj

    def _resolve(self, key: ObjectKey, obj: L1Object | None) -> None:
        fut = self._loading.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(obj)

    async def _locate(self, keys: list[ObjectKey], spans: _Spans) -> list[_Slot]:
        names = [k.serialize() for k in keys]
        where: list[Tier | None] = [None] * len(keys)
        for tier in self.tiers.active():
            todo = [i for i, t in enumerate(where) if t is None]
            if not todo:
                break
            spans.begin(tier.name)
            with tier.use():
                results = await tier.adapter.contains([names[i] for i in todo])
            for i, result in zip(todo, results, strict=True):
                if result.ok:
                    where[i] = tier
        slots = []
        for key, name, found in zip(keys, names, where, strict=True):
            if found is None:
                break
            slots.append(_Slot(key, name, found))
        return slots

    def _reserve(self, slots: list[_Slot], reg: Registration) -> None:
        now = self._clock()
        for i, slot in enumerate(slots):
            present = self.cache.peek(slot.key)
            if present is not None:
                ready = self.cache.find(slot.key, now)
                if ready is not None:
                    slot.ready = ready
                    continue
                loading = self._loading.get(slot.key)
                if loading is None:  # being written by a client: the run ends here
                    del slots[i:]
                    return
                slot.waiting = loading
                continue
            obj = self.cache.try_reserve(
                slot.key, reg.chunk_bytes, now, temporary=True, overflow=reg.instance
            )
            if not isinstance(obj, L1Object):
                if obj is Refusal.QUOTA:
                    self.counters.quota_refused += 1
                else:
                    self.counters.no_space += 1
                del slots[i:]
                return
            slot.obj = obj
            self._loading[slot.key] = asyncio.get_running_loop().create_future()

    async def _load(self, slot: _Slot, reg: Registration, spans: _Spans) -> bool:
        loaded = False
        try:
            loaded = await self._load_one(slot, reg)
            return loaded
        finally:
            spans.loaded(slot.tier.name, loaded)

    async def _load_one(self, slot: _Slot, reg: Registration) -> bool:
        assert slot.obj is not None
        obj = slot.obj
        async with self._slots:
            if not _reserved(obj):  # reaped while waiting for a slot
                return False
            out = self.arena.view(obj.offset, obj.size)
            # Threads write into the reservation from here (the adapter's reads, then the check or
            # decode): it must not be reaped, aborted or reused until they are done. load_into
            # returns, even when cancelled, only once its threads are done with `out`.
            with self.cache.busy_for_io(obj):
                events = self.events
                span = events.start("l2.load", tier=slot.tier.name) if events.enabled else 0
                got: LoadResult | None = None
                # The MAC with the deployment's keys where the tier authenticates, else the checksum.
                check = codec.BlobCheck(
                    reg.namespace.layout_fp, self._keys if slot.tier.config.authenticate else None
                )
                with slot.tier.use():
                    try:
                        result = got = (await slot.tier.adapter.load_into([slot.name], [out], check))[0]
                    finally:
                        if span:
                            status = "cancelled" if got is None else got.status.value
                            events.end(span, "l2.load", tier=slot.tier.name, reason=status)
                if result.failed_check is not None:  # the check, run in the adapter's thread
                    self._failed_check(slot, result.failed_check)
                    return False
                if not result.ok or result.data is None:
                    if result.status.value == "error":
                        self.counters.load_errors += 1
                        events.emit(Kind.ERROR, tier=slot.tier.name, key=obj.key, op="l2.load", reason="load")
                    return False
                if not _reserved(obj):
                    return False
                if result.checked:
                    return True
                job = self._executor.submit(check, slot.name, result.data, out, result.in_place)
                try:
                    # Cancelled, it waits until the thread is done with the reservation, before
                    # that can be aborted and its memory handed to someone else.
                    await settled(job)
                except IntegrityError as exc:
                    self._failed_check(slot, exc)
                    return False
                return True

    def _failed_check(self, slot: _Slot, exc: IntegrityError) -> None:
        """A miss, counted. Deleted only from a tier of this sidecar's own, and never a blob of a
        key id this sidecar does not hold (another key list may verify it)."""
        stats = slot.tier.adapter.stats
        self.counters.integrity_failures += 1
        stats.integrity_failures += 1
        if isinstance(exc, AuthenticationError):
            self.counters.auth_failures += 1
            stats.auth_failures += 1
        if isinstance(exc, UnknownKey):
            self.counters.auth_unknown_key += 1
            stats.auth_unknown_key += 1
            said = (slot.tier.name, str(exc))
            if said not in self._unknown_logged and len(self._unknown_logged) < 1024:
                self._unknown_logged.add(said)
                log.warning("l2_auth_unknown_key", adapter=slot.tier.name, error=str(exc))
            return
        log.warning("l2_integrity_failure", adapter=slot.tier.name, key=slot.name, error=str(exc))
        if not is_shared(slot.tier.adapter):
            self.events.emit(Kind.REMOVED, tier=slot.tier.name, key=slot.key, reason="corrupt")
            self._spawn_delete(slot.tier, slot.name)

    def _spawn_delete(self, tier: Tier, name: str) -> None:
        async def delete() -> None:
            with tier.use():
                await tier.adapter.delete([name])

        task = asyncio.get_running_loop().create_task(delete(), name="l2-delete-corrupt")
        self._running.add(task)
        task.add_done_callback(self._on_done)

    async def _cleanup(self, slots: list[_Slot]) -> None:
        pending = [s.task for s in slots if s.task is not None and not s.task.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        for slot in slots:
            if slot.obj is not None and slot.obj.state is ObjectState.WRITE_RESERVED:
                self.cache.abort(slot.obj)
                self._resolve(slot.key, None)
