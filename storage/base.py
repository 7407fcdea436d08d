"""The L2 boundary: the adapter interface, the capabilities an adapter may have, and the small
values they return. The engine uses adapters through this module only (and storage/config.py for
their configs); which adapter types exist is storage/registry.py. Imports nothing else from
storage/ but the codec's EncodedBlob and BlobCheck (and, for the checker, BlobKeys).

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
                           (storage/codec/__init__.py), so nothing past that is ever read: a longer value is
                           refused unread (`LoadResult.too_long` from the subclass), counted in
                           `stats.integrity_failures`, deleted (not from a `shared` adapter),
                           and answered MISS.
                           `check` (a codec.BlobCheck, optional): the caller's check of each blob.
                           An adapter that reads in threads of its own may run it there, right
                           after the read (no hop back to the loop and into another executor):
                           then an OK result says `checked` (its payload passed and lies in out,
                           decoded when it was not raw), and a failed check is a MISS carrying the
                           IntegrityError in `failed_check`, for the caller to count, log and
                           delete as if its own check had failed. An adapter that does not run it
                           answers as without it (`checked` False): the caller checks
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

Every adapter also says `shared`: whether other sidecars use its blobs (Redis). A blob failing its
check in a shared adapter is a miss, never deleted by this sidecar (it may be a fleet-mate's).

Capabilities: what an adapter may have beyond the operations above, asked for with
`capabilities()`; a field is None where the adapter lacks it, and the engine then does without:
  pins    Pinnable: eviction here skips the keys prefix pins hold (`bind_pins`, engine/pins/); None:
          pins on this tier are refused (its backend evicts by a policy of its own)
  fleet   FleetQuota: tenants' usage and l2_bytes quotas kept in the shared backend itself, one
          figure and one limit for every sidecar on it (Redis, scope "fleet"): the write-behind
          reserves a blob's bytes before writing it and commits them after, quotas are written
          there, the ledger is reconciled with the backend every `reconcile_interval_s`; None: the
          tier's figures and limits are this sidecar's own ledger's
  scan    KeyScan: every blob key the backend holds, whoever wrote it, at the adapter's bounded
          rate (a purge, a clear); None: `held_keys()` is all the adapter holds
What a config says of itself (secrets redacted, local paths, the shared location) is
storage/config.py. A builder (storage/registry.py) gets a `BuildContext` (below) besides the config.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol
from urllib.parse import unquote

from app.errors import IntegrityError
from storage.codec import BlobCheck, EncodedBlob

if TYPE_CHECKING:
    from storage.auth import BlobKeys
    from storage.health import LatencyRecorder


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
    when `in_place` (load_into only), the blob's header while its payload lies in the caller's out.
    `checked` (load_into with a check only): the adapter ran the caller's check and it passed;
    `failed_check`: it ran it and the blob failed (a MISS)."""

    status: Status
    data: bytes | memoryview | None = None
    message: str = ""
    in_place: bool = False
    oversized: bool = False
    checked: bool = False
    failed_check: IntegrityError | None = None

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    @classmethod
    def hit(cls, data: bytes | memoryview) -> LoadResult:
        return cls(Status.OK, data)

    @classmethod
    def placed(cls, header: bytes | memoryview, *, checked: bool = False) -> LoadResult:
        """OK for load_into: the payload is in the caller's out, `header` is the blob's header."""
        return cls(Status.OK, header, in_place=True, checked=checked)

    @classmethod
    def check_failed(cls, exc: IntegrityError) -> LoadResult:
        """load_into: the caller's check, run by the adapter, refused the blob: a miss."""
        return cls(Status.MISS, None, str(exc), failed_check=exc)

    @classmethod
    def error(cls, message: str) -> LoadResult:
        return cls(Status.ERROR, None, message)

    @classmethod
    def too_long(cls, message: str) -> LoadResult:
        """load_into: the stored value is longer than any blob for the out; it was not read."""
        return cls(Status.MISS, None, message, oversized=True)


LOAD_MISS = LoadResult(Status.MISS)

HealthState = Literal["ok", "degraded", "down"]


def key_salt(key: str) -> str | None:
    """The cache_salt of a serialized chunk key (engine/keys.py ObjectKey), None when `key` is not
    one (storage does not import the engine: the `s=` field, percent-quoted)."""
    parts = key.split("/")
    if len(parts) != 7 or not parts[0].startswith("kvd") or not parts[5].startswith("s="):
        return None
    return unquote(parts[5][2:])


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


class L2Adapter(Protocol):
    """One L2 tier. See the module docstring for the contract of each operation."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str:
        """The adapter's type in the registry (storage/registry.py): disk, slab, redis, mock, ..."""
        ...

    @property
    def shared(self) -> bool:
        """Whether other sidecars use the same blobs (module docstring)."""
        ...

    @property
    def stats(self) -> AdapterStats: ...

    @property
    def latency(self) -> LatencyRecorder: ...

    async def start(self) -> None: ...

    async def store(self, items: Sequence[tuple[str, EncodedBlob]]) -> list[OpResult]: ...

    async def contains(self, keys: Sequence[str]) -> list[OpResult]: ...

    async def load(self, keys: Sequence[str]) -> list[LoadResult]: ...

    async def load_into(
        self, keys: Sequence[str], outs: Sequence[memoryview], check: BlobCheck | None = None
    ) -> list[LoadResult]: ...

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

    def capabilities(self) -> Capabilities:
        """What the adapter has beyond the operations (module docstring); None where it lacks it."""
        ...

    async def close(self) -> None: ...


# --- capabilities --------------------------------------------------------------------------------


class Pinnable(Protocol):
    def bind_pins(self, kept: Kept | None) -> None:
        """Eviction (for capacity or a tenant's quota) never chooses a key `kept` says a pin holds;
        None: no pins."""
        ...


@dataclass(frozen=True, slots=True)
class Reservation:
    """A fleet ledger's answer to a reservation of a blob's bytes."""

    ok: bool
    used: int
    """The tenant's fleet bytes after (ok) or before (refused) the reservation."""
    limit: int | None


@dataclass(slots=True)
class ReconcileReport:
    """What a fleet ledger's reconcile found and repaired."""

    keys_scanned: int = 0
    tenants: int = 0
    released_bytes: int = 0
    adopted_bytes: int = 0
    ledger_fixed: int = 0
    """Tenants whose `used` differed from the sum of their sizes (hand edits)."""
    per_salt: dict[str, tuple[int, int]] = field(default_factory=dict)
    """What the scan found per tenant: (bytes, blobs)."""


class FleetQuota(Protocol):
    """Tenants' usage and quotas kept in a shared backend (storage/redis/fleet.py). Every call may
    raise app.errors.BackendError when the backend does not answer."""

    @property
    def reconcile_interval_s(self) -> float | None:
        """How often the owner reconciles the ledger (`reconcile`); None: only when asked."""
        ...

    async def reserve(self, salt: str, key: str, size: int, fallback_limit: int | None) -> Reservation:
        """Reserve `size` bytes for blob `key` of `salt` unless that takes the tenant over its fleet
        quota (`fallback_limit`, this sidecar's, when it has none there)."""
        ...

    async def reserve_many(self, items: list[tuple[str, str, int, int | None]]) -> list[Reservation | None]:
        """`reserve` of each (salt, key, size, fallback_limit) in order; None where it failed."""
        ...

    async def commit(self, salt: str, keys: list[str]) -> None:
        """The writes of `keys` returned: their reservations are no longer in flight."""
        ...

    async def usage(self, salt: str) -> tuple[int, int, int | None]:
        """The tenant's fleet (bytes, blobs, limit)."""
        ...

    async def set_quota(self, salt: str, l2_bytes: int | None) -> None: ...

    async def drop_quota(self, salt: str) -> None: ...

    async def reconcile(self) -> ReconcileReport:
        """Make the ledger what the backend holds."""
        ...


class KeyScan(Protocol):
    def scan_keys(self) -> AsyncIterator[list[str]]:
        """Every blob key the backend holds (serialized keys; whoever wrote them), in batches, at
        the adapter's bounded rate. BackendError when the backend does not answer."""
        ...


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What an adapter has beyond the L2Adapter operations; None: it lacks it."""

    pins: Pinnable | None = None
    fleet: FleetQuota | None = None
    scan: KeyScan | None = None


@dataclass(frozen=True, slots=True)
class BuildContext:
    """What a builder (storage/registry.py) may use besides the config: the data directory (the
    default home of a local tier's files) and the deployment's keys (the fleet ledger seals
    quotas with them)."""

    data_dir: Path
    keys: BlobKeys | None = None
