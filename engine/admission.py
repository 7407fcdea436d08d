"""StoreAdmission: which chunks of a STORE get a write reservation in L1, and why the others do not.

Role: the facade's (engine/facade.py) STORE, chunk by chunk in order: a chunk present already is
EXISTS; the others are reserved (engine/l1/cache.py `try_reserve`) until the first refusal, and
every later chunk of the chain is refused the same way (a chain is useless past its first gap):
QUOTA (the tenant's L1 limit) or NO_SPACE (no room, or the request's share of L1 taken).

Admission: a store by a tenant without an L1 limit reserves at most `max_request_share` of L1
(at least one chunk); the chunks beyond are refused as no_space.

Tenants: a store by a tenant with an L1 limit first meets a lowered limit (`fit_quota`), then holds
(read-locks) the chunks of that store which are present already, until it returns, so the
reservations of the same store never evict them to make room within the quota: a chain is never
cut by its own continuation.

State: none across calls but the collaborators it was given (the L1 cache, the tenant ledger, the
engine's counters, the STORED announcer, the L2 parts for the "seen_twice" store policy). Owned by
the event loop; synchronous and short (no I/O).

Primitives: reserve(reg, rid, tokens, hashes, salt=, chunks=, now=, ...) -> one StoreSlot per chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.announce import StoreAnnouncer
from engine.events import EventBus
from engine.keys import ObjectKey
from engine.l1.cache import L1Cache
from engine.l1.lifecycle import L1Object
from engine.l1.results import Refusal
from engine.l2.parts import L2Parts
from engine.requests import RequestId
from engine.results import EngineCounters, Registration, SlotStatus, StoreSlot
from engine.tenants.ledger import TenantLedger
from engine.tenants.quota import L1


@dataclass(slots=True)
class _Store:
    """One STORE under way: what it asked, what it took so far."""

    reg: Registration
    rid: RequestId
    salt: str
    tokens: bytes
    hashes: Sequence[bytes]
    extras: Sequence[bytes]
    now: float
    holder: int
    prompt_tokens: int
    lora_name: str
    limited: bool
    share: int | None
    charge: int
    seen: bool
    taken: int = 0
    refused: SlotStatus | None = None
    held: list[L1Object] = field(default_factory=list)


class StoreAdmission:
    def __init__(
        self, *, cache: L1Cache, events: EventBus, announcer: StoreAnnouncer, counters: EngineCounters,
        chunk_size: int, max_request_share: float, l2: L2Parts | None,
    ) -> None:  # fmt: skip
        self._cache = cache
        self._events = events
        self._announcer = announcer
        self._tenants: TenantLedger = cache.ledger
        self._counters = counters
        self._chunk_size = chunk_size
        self.max_request_share = max_request_share
        self._l2 = l2

    def reserve(
        self, reg: Registration, rid: RequestId, tokens: bytes, hashes: Sequence[bytes], *, salt: str,
        chunks: range, now: float, holder: int, extras: Sequence[bytes], prompt_tokens: int,
        lora_name: str,
    ) -> list[StoreSlot]:  # fmt: skip
        """A StoreSlot for each chunk index in `chunks` (see the module docstring)."""
        cache = self._cache
        limited = self._tenants.limit(salt, L1) is not None
        run = _Store(
            reg, rid, salt, tokens, hashes, extras, now, holder, prompt_tokens, lora_name, limited,
            share=None if limited else max(int(self.max_request_share * cache.allocator.capacity), 1),
            charge=cache.allocator.aligned(reg.chunk_bytes),
            seen=self._l2 is not None and self._l2.store.policy == "seen_twice",
        )  # fmt: skip
        self._counters.store_requests += 1
        if limited:
            cache.fit_quota(salt)
        try:
            return [self._slot(run, i) for i in chunks]
        finally:
            for obj in run.held:
                cache.unlock(obj)

    def _slot(self, run: _Store, i: int) -> StoreSlot:
        key = ObjectKey(run.reg.namespace, run.salt, run.hashes[i])
        if run.seen:
            assert self._l2 is not None
            self._l2.store.note_seen(key, run.rid)
        c = self._counters
        present = self._cache.peek(key)
        if present is not None:
            if run.limited and present.visible:
                self._cache.lock(present, run.now)
                run.held.append(present)
            c.existing_chunks += 1
            return StoreSlot(i, SlotStatus.EXISTS)
        refused = run.refused
        if refused is None and run.share is not None and run.taken and run.taken + run.charge > run.share:
            refused = SlotStatus.NO_SPACE  # one request may not take more than its share
        elif refused is None:
            got = self._try(run, i, key)
            if isinstance(got, StoreSlot):
                return got
            refused = got
        elif refused is SlotStatus.QUOTA:
            self._tenants.note_refusal(run.salt, L1)  # the first one was counted by the cache
        # Later chunks of a chain are useless without this one: refuse them too, explicitly.
        run.refused = refused
        if refused is SlotStatus.QUOTA:
            c.quota_chunks += 1
        else:
            c.no_space_chunks += 1
        return StoreSlot(i, refused)

    def _try(self, run: _Store, i: int, key: ObjectKey) -> StoreSlot | SlotStatus:
        """Reserve chunk `i`: its slot, or why it was refused."""
        generated = 0 < run.prompt_tokens < (i + 1) * self._chunk_size
        reg = run.reg
        got = self._cache.try_reserve(
            key, reg.chunk_bytes, run.now, owner=reg.instance, holder=run.holder, generated=generated
        )
        if not isinstance(got, L1Object):
            return SlotStatus.QUOTA if got is Refusal.QUOTA else SlotStatus.NO_SPACE
        if self._events.enabled:
            self._announcer.reserved(
                got.oid, run.rid[1], run.tokens, i, hashes=run.hashes, extras=run.extras,
                lora_name=run.lora_name,
            )  # fmt: skip
        self._counters.stored_chunks += 1
        run.taken += run.charge
        return StoreSlot(i, SlotStatus.RESERVED, got.oid, got.offset, got.size)
