"""CacheEngine: the data plane's one entry point (api/dataplane and the sidecar's own transfers).

State: engine registrations (engine/registry.py: engine id -> owning instance), the L1 cache, the
per-request state (engine/requests.py: read locks, lease, prefetch), counters. Owned by the event
loop; every method is synchronous and short (no I/O), so handlers run them inline.

Primitives in data-plane call order:
  register(model, layout, kv_rank, group, instance) -> Registration (engine/registry.py)
  owned(engine, instance)                           -> Registration; NotOwner for another instance's
  lookup(engine, request, tokens, salt[, holder])   -> LookupResult; hit objects read-locked, misses
                                                       prefetched from L2 (query_prefetch/wait_prefetch)
  retrieve(engine, request, first, count[, holder]) -> extents (and oids) of the locked objects;
                                                       fence_words(extents), lock_epoch(request)
  release(engine, request, oids[, holder, epoch])   -> True only if the copy is safe (see below)
  store(engine, request, tokens, salt, first_chunk, prompt_tokens) -> per-chunk StoreSlot (reserve;
      the client copies); chunks ending past prompt_tokens (when > 0) hold generated tokens
  commit(engine, oids[, holder])                    -> per-oid ok / lease expired; visible at once
      (committed generated chunks are counted; the holder's quarantine of expired ones goes);
      NotOwner (nothing done) for a reservation of another instance (abort likewise)
  free_lookup_locks / end_request / clear
Reclaiming (the work is engine/reclaim.py's; the facade keeps these names):
  suspect_holder(session)                           a client session is silent past its timeout
      (engine/workers.py): the requests it took part in lose their locks (its late RELEASE of them
      is invalid), its reservations are quarantined
  end_holder(session)                               a client session is gone (its lifeline closed):
      its reservations (and quarantine) go at once
  end_instance(instance)                            the instance's last session is gone: its
      requests (read locks) and registrations go
  reap(now)                                         -> expired leases reclaimed (run_reaper loop)

Events (engine/events.py, the bus the L1 cache was given): STORED (tier L1) at COMMIT with what
the STORE said of the chunk (engine/announce.py), LOOKUP with the hit tokens (and the keys of the
chunks hit for the first time: `L1Object.hit`), CLEARED on CLEAR of
all, REMOVED "purged" per chunk on CLEAR of one tenant; L1 REMOVED otherwise comes from the cache.

The control plane reaches the engine elsewhere: quotas and L2 administration in engine/admin.py,
status snapshots in engine/status.py (they read `engines.all()` and `locked_requests()`).

Ownership: engine ids belong to the instance that registered them (the data-plane server checks
`owned` for every message naming one); requests are keyed by engine id, reservations record their
instance. The generation check: RELEASE is valid only when every object the reader copied from
(the oids RETRIEVE gave) is still alive, i.e. the same committed, immutable object; a RELEASE
without oids is valid only while the request still held its locks. Nothing is remembered of
expired requests, so no history can overflow.

Admission and tenants (which chunks of a STORE are reserved, the request's share of L1, a
tenant's chain held while its own store runs): engine/admission.py. L2 usage is in the same
ledger, one tier per adapter name (engine/l2/tiers.py), and `l2_bytes` is enforced at write-behind
(engine/l2/store.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial

from app.errors import InvalidInput, LeaseExpired, NotFound, NotOwner
from engine.admission import StoreAdmission
from engine.announce import StoreAnnouncer
from engine.events import L1_TIER, EventBus, Kind, chain_origins
from engine.keys import KVLayout, ObjectKey, TokenHasher
from engine.l1.arena import SharedArena
from engine.l1.cache import L1Cache
from engine.l1.lifecycle import L1Object
from engine.l2.parts import L2Parts
from engine.reclaim import Reclaimer
from engine.registry import MAX_ID_LEN, EngineRegistry
from engine.requests import RequestState, RequestTable
from engine.results import EngineCounters, Extent, LookupResult, Registration, StoreSlot
from engine.tenants.ledger import TenantLedger


class CacheEngine:
    def __init__(
        self,
        *,
        arena: SharedArena,
        cache: L1Cache,
        chunk_size: int,
        read_lease_s: float,
        l2: L2Parts | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_request_share: float = 0.5,
        max_registrations: int = 1024,
        max_registrations_per_instance: int = 64,
        registration_idle_s: float = 600.0,
        events: EventBus | None = None,
    ) -> None:
        self.arena = arena
        self.cache = cache
        #: the sidecar's one event bus (the cache's: L1 REMOVED is published there)
        self.events = events if events is not None else cache.events
        if self.events is not cache.events:
            raise ValueError("the engine and its L1 cache must publish on the same event bus")
        self._announcer = StoreAnnouncer(self.events, chunk_size)
        self.tenants: TenantLedger = cache.ledger
        if l2 is not None and l2.tiers.ledger is not None and l2.tiers.ledger is not cache.ledger:
            raise ValueError("the L2 tiers must report into the L1 cache's ledger")
        self.chunk_size = chunk_size
        self.hasher = TokenHasher(chunk_size)
        self.read_lease_s = read_lease_s
        self.counters = counters = EngineCounters()
        #: requests clients would not cache, by reason (protocol.Uncacheable)
        self.uncacheable: dict[str, int] = {}
        self._clock = clock
        self.engines = EngineRegistry(
            chunk_size=chunk_size, capacity=cache.allocator.capacity, max_total=max_registrations,
            max_per_instance=max_registrations_per_instance, idle_s=registration_idle_s,
        )  # fmt: skip
        self._requests = RequestTable(cache, read_lease_s)
        self.l2 = l2
        self._admission = StoreAdmission(
            cache=cache, events=self.events, announcer=self._announcer, counters=counters,
            chunk_size=chunk_size, max_request_share=max_request_share, l2=l2,
        )  # fmt: skip
        self.reclaim = Reclaimer(
            cache=cache, requests=self._requests, engines=self.engines, announcer=self._announcer,
            counters=counters, clock=clock,
        )  # fmt: skip

    # --- registration --------------------------------------------------------------------------

    def register(
        self, model: str, layout: KVLayout, kv_rank: int = 0, group: int = 0, *, instance: str = ""
    ) -> Registration:
        return self.engines.register(model, layout, kv_rank, group, instance=instance, now=self._clock())

    def registration(self, engine_id: int) -> Registration:
        return self.engines.get(engine_id, self._clock())

    def owned(self, engine_id: int, instance: str) -> Registration:
        """The registration of `engine_id` if `instance` owns it; NotOwner otherwise."""
        reg = self.registration(engine_id)
        if reg.instance != instance:
            raise NotOwner(f"engine {engine_id} belongs to another engine instance")
        return reg

    # --- lookup and read -----------------------------------------------------------------------

    def lookup(
        self, engine_id: int, request_id: str, tokens: bytes, salt: str, extras: Sequence[bytes] = (),
        *, holder: int = 0,
    ) -> LookupResult:  # fmt: skip
        """`extras`: per chunk extra keys (`engine.keys`), from the client's request; `holder`:
        the client session asking (0: none named)."""
        reg = self.registration(engine_id)
        _check_ids(request_id, salt)
        now = self._clock()
        rid = (engine_id, request_id)
        ns = reg.namespace
        hashes = self._hashes(tokens, extras)
        n = len(hashes)
        found = self.cache.find_chain(ns, salt, hashes, now)  # no ObjectKey built for the hits
        # A repeated lookup replaces the request's previous state (its prefetch attaches no more).
        state = self._requests.lookup(rid, found, now)
        if holder:
            state.holders.add(holder)
            self.reclaim.unfence(holder, rid)
        locked = state.objects
        if locked:
            self._requests.keep(rid, state)
        hit = len(locked)
        l2 = self.l2
        pending = 0
        if l2 is not None:
            if l2.store.policy == "seen_twice":
                l2.store.note_lookup(reg, [ObjectKey(ns, salt, h) for h in hashes], locked, rid)
            if hit < n and l2.tiers.active():
                self._requests.keep(rid, state)
                missing = [ObjectKey(ns, salt, h) for h in hashes[hit:]]
                origins = None
                if self.events.enabled:
                    origins = chain_origins(tokens, hashes, extras, self.chunk_size * 4, hit)
                attach = partial(self._attach, state)
                state.prefetch = l2.prefetch.start(reg, missing, attach, request_id, origins)
                pending = n - hit
        c = self.counters
        c.lookups += 1
        c.hit_chunks += hit
        c.miss_chunks += n - hit
        self.tenants.note_lookup(salt, hit, n - hit)
        c.hit_tokens += hit * self.chunk_size
        c.miss_tokens += len(tokens) // 4 - hit * self.chunk_size
        events = self.events
        if events.enabled:
            first: list[ObjectKey] = []  # the chunks a lookup finds for the first time
            for obj in locked:
                if not obj.hit:
                    obj.hit = True
                    first.append(obj.key)
            events.emit(
                Kind.LOOKUP, tier=L1_TIER, op="lookup", request_id=request_id, detail=hit * self.chunk_size,
                total=n * self.chunk_size, hits=first, reason="prefetch" if pending else "",
            )  # fmt: skip
        return LookupResult(
            hit_chunks=hit, hit_tokens=hit * self.chunk_size, total_chunks=n, pending_chunks=pending
        )

    def _attach(self, state: RequestState, obj: L1Object) -> bool:
        """A prefetched chunk arrived, in order: read-lock it for the request that asked, unless
        it moved on (new lookup, ended, released, reaped)."""
        if not self._requests.attach(state, obj, self._clock()):
            return False
        self.counters.l2_hit_chunks += 1
        return True

    async def wait_prefetch(self, engine_id: int, request_id: str) -> LookupResult:
        """Wait until the request's prefetch finished (it ends by its deadline), then report."""
        state = self._requests.get((engine_id, request_id))
        if state is not None and state.prefetch is not None:
            await state.prefetch.done.wait()
        return self.query_prefetch(engine_id, request_id)

    def query_prefetch(self, engine_id: int, request_id: str) -> LookupResult:
        """Where a request's lookup stands now (chunks locked and ready, chunks still loading)."""
        self.registration(engine_id)
        state = self._requests.get((engine_id, request_id))
        hit = len(state.objects) if state else 0
        pending = state.pending if state else 0
        self._requests.settle((engine_id, request_id))
        return LookupResult(
            hit_chunks=hit,
            hit_tokens=hit * self.chunk_size,
            total_chunks=hit + pending,
            pending_chunks=pending,
        )

    def retrieve(
        self, engine_id: int, request_id: str, first_chunk: int, num_chunks: int, *, holder: int = 0
    ) -> list[Extent]:
        self.registration(engine_id)
        rid = (engine_id, request_id)
        entry = self._requests.get(rid)
        if entry is None:
            raise NotFound(f"request {request_id!r} holds no read locks (LOOKUP first; or its lease expired)")
        end = first_chunk + num_chunks
        if first_chunk < 0 or num_chunks < 0 or end > len(entry.objects):
            raise InvalidInput(
                f"chunks {first_chunk}..{end} outside the {len(entry.objects)} locked for {request_id!r}"
            )
        if holder:
            entry.holders.add(holder)
            self.reclaim.unfence(holder, rid)
        self.counters.retrieves += 1
        self.counters.retrieved_chunks += num_chunks
        return [Extent(o.offset, o.size, o.oid) for o in entry.objects[first_chunk:end]]

    def fence_words(self, extents: Sequence[Extent]) -> list[tuple[int, int]]:
        """The release-fence words of the segments `extents` span (engine/l1/fences.py), or []."""
        fences = self.cache.fences
        return [] if fences is None else fences.snapshot((e.offset, e.size) for e in extents)

    def lock_epoch(self, engine_id: int, request_id: str) -> int:  # which LOOKUP holds its locks
        return self._requests.epoch((engine_id, request_id))

    def release(
        self, engine_id: int, request_id: str, oids: Sequence[int] = (), *, holder: int = 0, epoch: int = 0
    ) -> bool:
        """Drop the request's read locks after it copied. True only when the copy is safe: every
        object in `oids` (those it copied from) is still alive; without oids, the request still
        held its locks. False: discard the copy; always for a request whose locks were dropped
        because `holder` went suspect. With `epoch` (the RETRIEVE's), a newer LOOKUP's locks stay
        (a RELEASE not waited for can arrive after the next LOOKUP, sent on another connection)."""
        self.registration(engine_id)
        rid = (engine_id, request_id)
        if self.reclaim.fenced(holder, rid):
            return False  # its locks went already; a newer state of the request is not its to drop
        alive = self.cache.alive
        valid = all(alive(oid) for oid in oids)  # before unlocking: a last unlock may free them
        held = self._requests.release(rid, epoch)
        return valid if oids else held > 0

    def free_lookup_locks(self, engine_id: int, request_id: str) -> int:
        self.registration(engine_id)
        return self._requests.release((engine_id, request_id))

    end_request = free_lookup_locks

    def note_uncacheable(self, reason: str) -> None:
        """A client will neither load nor store a request (it cannot key it): counted, a miss."""
        self.uncacheable[reason] = self.uncacheable.get(reason, 0) + 1

    def _hashes(self, tokens: bytes, extras: Sequence[bytes]) -> list[bytes]:
        try:
            return self.hasher.chunk_hashes(tokens, extras=extras)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None

    # --- store ---------------------------------------------------------------------------------

    def store(
        self, engine_id: int, request_id: str, tokens: bytes, salt: str, first_chunk: int = 0, *,
        holder: int = 0, extras: Sequence[bytes] = (), prompt_tokens: int = 0, lora_name: str = "",
    ) -> list[StoreSlot]:  # fmt: skip
        """Reserve slots for full chunks `first_chunk..` of `tokens`. The client copies, then
        commits. `holder`: the client session that copies (0: the sidecar copies itself);
        `prompt_tokens`: the request's prompt length: a chunk that ends after it holds generated
        tokens (0: every chunk is prompt); `lora_name`: the LoRA adapter, for the STORED events."""
        reg = self.registration(engine_id)
        _check_ids(request_id, salt)
        n = self.hasher.full_chunks(tokens)
        if not 0 <= first_chunk <= n:
            raise InvalidInput(f"first_chunk {first_chunk} outside 0..{n}")
        hashes = self._hashes(tokens, extras)
        return self._admission.reserve(
            reg, (engine_id, request_id), tokens, hashes, salt=salt, chunks=range(first_chunk, n),
            now=self._clock(), holder=holder, extras=extras, prompt_tokens=prompt_tokens, lora_name=lora_name,
        )  # fmt: skip

    def commit(self, engine_id: int, oids: list[int], holder: int = 0) -> list[bool]:
        """Make reserved chunks ready. Per oid: True, or False when its lease had expired (or it is
        unknown). NotOwner, and nothing committed, if one is another instance's reservation. The
        client session `holder` is done with these oids: what of them it held quarantined is freed."""
        reg = self.registration(engine_id)
        self._check_owner(reg, oids)
        now = self._clock()
        out: list[bool] = []
        store = self.l2.store if self.l2 is not None else None
        for oid in oids:
            try:
                obj = self.cache.commit(oid, now)
            except LeaseExpired:
                out.append(False)
                continue
            out.append(True)
            request_id, origin = self._announcer.committed(obj) if self.events.enabled else ("", None)
            if obj.generated:
                self.counters.decode_chunks_stored += 1
            if store is not None and obj.visible:
                store.submit(obj, reg, request_id, origin)
        if not all(out):
            self.cache.writer_done(holder, oids)
        return out

    def abort(self, engine_id: int, oids: list[int], holder: int = 0) -> int:
        """Drop reservations the client will not fill (a copy failed). NotOwner, and nothing
        dropped, if one is another instance's reservation. As `commit`, for `holder`'s quarantine."""
        self._check_owner(self.registration(engine_id), oids)
        self.cache.writer_done(holder, oids)
        n = 0
        for oid in oids:
            try:
                obj = self.cache.reservation(oid)
            except NotFound:
                continue
            self.cache.abort(obj)
            self._announcer.dropped(oid)
            n += 1
        return n

    def _check_owner(self, reg: Registration, oids: Sequence[int]) -> None:
        owner_of = self.cache.owner_of
        for oid in oids:
            owner = owner_of(oid)
            if owner is not None and owner != reg.instance:
                raise NotOwner(f"reservation {oid} belongs to another engine instance")

    # --- clients that are gone, expired leases (engine/reclaim.py) ------------------------------

    def suspect_holder(self, holder: int) -> tuple[int, int]:
        """The client session `holder` went silent: fenced. Returns (requests, reservations)."""
        return self.reclaim.suspect(holder)

    def end_holder(self, holder: int) -> int:
        """The client session `holder` is gone: its reservations go. Returns how many."""
        return self.reclaim.end_holder(holder)

    def end_instance(self, instance: str) -> int:
        """The last session of `instance` is gone: its requests and registrations go."""
        return self.reclaim.end_instance(instance)

    def reap(self) -> tuple[int, int]:
        """Reclaim expired write reservations and read locks. Returns (reservations, requests)."""
        return self.reclaim.reap()

    async def run_reaper(self, interval_s: float) -> None:
        """Reap every `interval_s`; a pass that fails is logged and counted, the next one runs."""
        await self.reclaim.run_reaper(interval_s)

    # --- maintenance ---------------------------------------------------------------------------

    def clear(self, salt: str | None = None) -> int:
        """Delete every object (of one tenant when `salt` is given); locked ones go when unlocked.
        Events: CLEARED (tier L1) for all; REMOVED "purged" per chunk for one tenant."""
        if salt is None:
            n = self.cache.clear(None, reason="")
            self.events.emit(Kind.CLEARED, tier=L1_TIER, op="clear", detail=n)
            return n
        return self.cache.clear(lambda o: o.key.salt == salt, reason="purged")

    def locked_requests(self) -> int:
        """Requests holding read locks now (for /status)."""
        return len(self._requests.locks)


def _check_ids(request_id: str, salt: str) -> None:
    """Bounded ids (the wire bounds them too; in-process callers are checked here)."""
    if len(request_id) > MAX_ID_LEN or len(salt) > MAX_ID_LEN:
        raise InvalidInput(f"request id and cache_salt must be at most {MAX_ID_LEN} characters")
