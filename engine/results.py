"""Small result types the engine facade hands to api/. Frozen, slotted, no behaviour.

The per-chunk ones (`StoreSlot`, `Extent`) are named tuples: as immutable, and built several times
faster than a frozen dataclass (whose fields are set one `object.__setattr__` at a time), which
counts at one per chunk of every STORE and RETRIEVE.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from engine.keys import KVLayout, Namespace


@dataclass(frozen=True, slots=True)
class Registration:
    engine_id: int
    namespace: Namespace
    layout: KVLayout
    chunk_bytes: int
    instance: str = ""
    """The engine instance that owns this engine id (never part of a cache key)."""


@dataclass(frozen=True, slots=True)
class LookupResult:
    hit_chunks: int
    hit_tokens: int
    total_chunks: int
    pending_chunks: int = 0
    """Chunks still being loaded from L2; poll with `query_prefetch`."""


class SlotStatus(enum.Enum):
    RESERVED = "reserved"
    EXISTS = "exists"
    NO_SPACE = "no_space"
    QUOTA = "quota"


class StoreSlot(NamedTuple):
    chunk: int
    status: SlotStatus
    oid: int = 0
    offset: int = 0
    size: int = 0


class Extent(NamedTuple):
    offset: int
    size: int
    oid: int = 0


@dataclass(slots=True)
class EngineCounters:
    lookups: int = 0
    hit_chunks: int = 0
    miss_chunks: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    store_requests: int = 0
    stored_chunks: int = 0
    decode_chunks_stored: int = 0
    existing_chunks: int = 0
    no_space_chunks: int = 0
    quota_chunks: int = 0
    retrieves: int = 0
    retrieved_chunks: int = 0
    expired_locks: int = 0
    l2_hit_chunks: int = 0
    reaper_errors: int = 0
    instances_gone: int = 0
    gone_locks: int = 0
    gone_reservations: int = 0
    suspect_locks: int = 0
    """Requests whose read locks were dropped because a client taking part went suspect."""
    suspect_reservations: int = 0
    """Reservations quarantined because their writer went suspect."""
    suspect_releases: int = 0
    """Late RELEASEs of such requests (answered invalid)."""
