"""FleetLedger: a shared Redis adapter's per-tenant usage and quotas, kept in Redis itself, so that
every sidecar on that Redis sees one figure and enforces one limit (`scope: "fleet"`).

Role: per tenant (cache_salt) five meta keys under the adapter's key prefix, all with the same
hash tag so that on a Redis Cluster they live in one slot and one Lua script updates them at once:
  <prefix>__fleet:{s<hex salt>}:used     the ledger: bytes reserved by the tenant's blobs
  <prefix>__fleet:{s<hex salt>}:sizes    hash: blob key -> its reserved size
  <prefix>__fleet:{s<hex salt>}:keys     sorted set: blob key -> reservation time (Redis TIME, µs)
  <prefix>__fleet:{s<hex salt>}:pending  set: blob keys whose write has not returned yet
  <prefix>__fleet:{s<hex salt>}:quota    the tenant's fleet l2_bytes (-1: unlimited), sealed with the
                                         deployment's key (storage/redis/fleet_quota.py); absent, or a value
                                         not sealed so: each sidecar's own quota applies
`used` always equals the sum of `sizes` (every script changes both). A blob and its tenant's meta
keys live in different slots, so a write and its accounting cannot be one transaction. Instead the
size is *reserved* before the blob is written (`reserve`: refused when the tenant would go over its
limit; the key becomes pending), the reservation is committed once the write returned (`commit`),
and it is released only once the blob is gone (`forget`, after the UNLINK answered). Eviction picks
the tenant's oldest reservations fleet-wide, whoever wrote them, skipping pending ones younger than
grace_s; reconcile releases a pending reservation only past grace_s too.

The in-flight bound: the bytes a tenant holds in Redis never exceed `used`, and `used` never
exceeds its limit (once the limit is set), except by writes that land after their reservation was
released: (a) a write still running grace_s after its reservation (the adapter refuses
grace_s <= timeout_s, so only one that outlived its own timeout); (b) two sidecars writing the same
key at once, one evicted right after the first commit, the other's SET landing after the UNLINK:
at most one blob per such duplicate write. Overshoot <= the bytes of the tenant's writes of kinds (a)
and (b) in flight, 0 when no write outlives grace_s and no key is written by two sidecars at once.
A blob written again reserves its new size in place of the old one (sizes is per key), so sidecars
sharing a prefix do not count a blob twice.

Writers of the Redis without the key: a quota value they set fails its seal (the sidecar's own
quota applies, never unlimited: RESERVE is passed the limit the caller verified, and applies it only
while the quota key still holds the value verified); an entry they plant in a tenant's ledger that
names a key not of that tenant (`oldest`: the key's structure says its salt) is released, never
UNLINKed. Edits of `used`/`sizes` are undone by the next reconcile (the scan is the truth).

Drift (blobs expired by ttl_s, deleted by hand, written by a `scope: "local"` sidecar or a tool,
writes that failed after their reservation) only ever makes `used` too high; hand edits of the meta
keys may make it anything. `reconcile` repairs both: SCAN of every node by prefix at a bounded rate,
STRLEN of each blob, then per tenant: reservations whose blob is gone (EXISTS after the scan) and not
pending within grace_s are released, blobs found without a reservation (or of another size) are
adopted, `used` is set to the sum of sizes.

State: the router and prefix (shared with the adapter), grace_s. No local state: every figure is
read from Redis. Event loop only.

The adapter hands it to the engine as its `fleet` capability (storage/base.py FleetQuota: reserve,
reserve_many, commit, usage, set_quota, drop_quota, reconcile, reconcile_interval_s); forget and
oldest are the adapter's own (delete, evict_salt).

Primitives in call order: reserve(salt, key, size, fallback_limit) / reserve_many(items),
commit(salt, keys),
forget(salt, key, score),
oldest(salt, nbytes), usage(salt), set_quota(salt, l2_bytes) / drop_quota(salt) / quota(salt),
scan(keys_per_s), reconcile(keys_per_s), scan_blobs(router, prefix, keys_per_s) (a purge's walk).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import structlog

from app.errors import BackendError
from storage.auth import BlobKeys
from storage.base import ReconcileReport, Reservation, key_salt
from storage.redis.fleet_lua import ADOPT, COMMIT, FORGET, OLDEST, RESERVE, SETTLE, USAGE
from storage.redis.fleet_quota import INVALID, QuotaSeal
from storage.redis.scan import as_text, scan_names

if TYPE_CHECKING:  # redis-py loads only where a Redis tier is configured
    from redis.asyncio.client import Pipeline

    from storage.redis.router import RedisRouter

log = structlog.get_logger("kvdepot.storage.fleet")

MAX_QUOTAS_KEPT = 1 << 16
META = "__fleet:"
"""After the key prefix: the meta keys. No blob key starts so (they start with their version)."""

class FleetLedger:
    def __init__(
        self, router: RedisRouter, prefix: str, grace_s: float,
        salt_of: Callable[[str], str | None] | None = None,
        on_down: Callable[[str], None] | None = None, *, keys: BlobKeys | None = None,
        keys_per_s: int = 2000, reconcile_interval_s: float | None = None,
    ) -> None:  # fmt: skip
        self.router = router
        self.prefix = prefix
        self.keys_per_s = keys_per_s
        """Keys a reconcile's SCAN reads a second, at most (the config's scan_keys_per_s)."""
        self.reconcile_interval_s = reconcile_interval_s
        """How often the owner reconciles (engine/l2/reconcile.py); None: only when asked."""
        self.grace_us = int(grace_s * 1_000_000)
        self._salt_of = salt_of or key_salt
        self._on_down = on_down
        self._seal = QuotaSeal(keys, prefix)
        self._quotas: dict[str, bytes] = {}  # salt -> the quota value last read ("" none)
        self.invalid_quotas = 0
        self.foreign_entries = 0
        """Ledger entries of a tenant naming a key not of that tenant (released, never UNLINKed)."""
        """Quota values read that were not sealed with a key of this deployment (a Redis writer's)."""

    # --- keys ----------------------------------------------------------------------------------

    def meta(self, salt: str) -> list[bytes]:
        base = f"{self.prefix}{META}{{s{salt.encode('utf-8').hex()}}}:"
        return [(base + part).encode("utf-8") for part in ("used", "sizes", "keys", "quota", "pending")]

    def salt_of_meta(self, rkey: str) -> str | None:
        """The tenant whose `sizes` key `rkey` (prefix included) is; None for other keys."""
        rest = rkey[len(self.prefix) + len(META) :]
        if not (rest.startswith("{s") and rest.endswith("}:sizes")):
            return None
        try:
            return bytes.fromhex(rest[2 : -len("}:sizes")]).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            return None

    async def _script(self, salt: str, script: str, *args: str | int | bytes) -> Any:
        keys = self.meta(salt)

        def command(pipe: Pipeline, _: int) -> object:
            return pipe.eval(script, 5, *keys, *args)

        await self.router.start()  # cluster mode: the slot map first
        (reply,) = await self.router.pipeline([keys[0]], command)
        if isinstance(reply, BackendError) and self._on_down is not None:
            self._on_down(str(reply))  # the node is lost: the adapter's health says so
        if isinstance(reply, Exception):
            raise BackendError(f"redis fleet ledger: {type(reply).__name__}: {reply}")
        return reply

    # --- accounting ----------------------------------------------------------------------------

    def _quota_args(self, salt: str, fallback_limit: int | None) -> tuple[int, bytes]:
        """(the limit to apply, the quota value it was read from): the tenant's sealed fleet quota,
        else (none, or one that fails its seal) `fallback_limit`; -1 for unlimited."""
        raw = self._quotas.get(salt, b"")
        opened = self._seal.open(salt, raw)
        limit = fallback_limit if isinstance(opened, str) else opened
        return (-1 if limit is None else int(limit)), raw

    def _saw_quota(self, salt: str, raw: Any) -> None:
        value = raw if isinstance(raw, bytes) else str(raw).encode()
        if len(self._quotas) >= MAX_QUOTAS_KEPT:
            self._quotas.clear()
        self._quotas[salt] = value
        if value and self._seal.open(salt, value) == INVALID:
            self.invalid_quotas += 1
            if self.invalid_quotas == 1:  # the tenant is not named: its salt is a secret
                log.warning("fleet_quota_not_sealed", prefix=self.prefix,
                            detail="a tenant's quota key holds a value not sealed with this "
                            "deployment's key; its own quota applies")  # fmt: skip

    @staticmethod
    def _reservation(reply: Any) -> Reservation | None:
        """A reserve script's answer; None when the quota changed since it was read."""
        status, used, limit = reply
        if int(status) == 2:
            return None
        return Reservation(bool(status), int(used), None if int(limit) < 0 else int(limit))

    async def reserve(self, salt: str, key: str, size: int, fallback_limit: int | None) -> Reservation:
        """Reserve `size` bytes for blob `key` of `salt` (replacing its earlier reservation) unless
        that takes the tenant over its fleet quota (or `fallback_limit` when it has none, or one
        that is not sealed with the deployment's key). BackendError when the quota keeps changing."""
        for _ in range(3):
            limit, raw = self._quota_args(salt, fallback_limit)
            reply = await self._script(salt, RESERVE, key, size, limit, raw)
            got = self._reservation(reply)
            if got is not None:
                return got
            self._saw_quota(salt, reply[2])
        raise BackendError("redis fleet ledger: the tenant's quota changed under every reservation")

    async def reserve_many(
        self, items: list[tuple[str, str, int, int | None]]
    ) -> list[Reservation | None]:
        """`reserve` of each (salt, key, size, fallback_limit), one pipeline per node, in order;
        None where that node failed (BackendError when all did)."""
        keys = [self.meta(salt) for salt, _, _, _ in items]
        quotas = [self._quota_args(salt, fallback) for salt, _, _, fallback in items]

        def command(pipe: Pipeline, i: int) -> object:
            _, key, size, _ = items[i]
            return pipe.eval(RESERVE, 5, *keys[i], key, size, *quotas[i])

        await self.router.start()
        replies = await self.router.pipeline([k[0] for k in keys], command)
        out: list[Reservation | None] = []
        for reply in replies:
            if isinstance(reply, Exception):
                if isinstance(reply, BackendError) and self._on_down is not None:
                    self._on_down(str(reply))
                out.append(None)
                continue
            out.append(self._reservation(reply))
            if out[-1] is None:  # the quota changed since it was read: once more, alone
                salt, key, size, fallback = items[len(out) - 1]
                self._saw_quota(salt, reply[2])
                out[-1] = await self.reserve(salt, key, size, fallback)
        if items and all(r is None for r in out):
            raise BackendError("redis fleet ledger: no node answered")
        return out

    async def commit(self, salt: str, keys: list[str]) -> None:
        """The writes of `keys` returned: their reservations are no longer in flight."""
        if keys:
            await self._script(salt, COMMIT, *keys)

    async def forget(self, salt: str, key: str, score: str = "", *, min_age: bool = False) -> int:
        """Release `key`'s reservation (only if its reservation time is still `score`, when given;
        only if older than grace_s, when `min_age`). Bytes released; -1 when kept."""
        grace = str(self.grace_us) if min_age else ""
        return int(await self._script(salt, FORGET, key, score, grace))

    async def oldest(self, salt: str, nbytes: int, limit: int = 512) -> list[tuple[str, str, int]]:
        """`salt`'s oldest reservations older than grace_s, enough for `nbytes`: (key, score, size),
        only keys whose structure names `salt` (what eviction may UNLINK). An entry naming any
        other key (planted by a writer of the Redis: another tenant's blob, a meta key) is
        released from the ledger, counted in `foreign_entries`, its key never touched."""
        flat = await self._script(salt, OLDEST, nbytes, self.grace_us, limit)
        out = []
        for i in range(0, len(flat), 3):
            key, score, size = as_text(flat[i]), as_text(flat[i + 1]), int(flat[i + 2])
            if self._salt_of(key) == salt:
                out.append((key, score, size))
                continue
            self.foreign_entries += 1
            await self.forget(salt, key, score)
        return out

    async def usage(self, salt: str) -> tuple[int, int, int | None]:
        """(bytes, blobs, fleet l2_bytes quota or None) of `salt` (None too for a quota value that
        is not sealed with the deployment's key)."""
        used, count, quota = await self._script(salt, USAGE)
        self._saw_quota(salt, quota)
        opened = self._seal.open(salt, quota)
        return int(used), int(count), (None if isinstance(opened, str) else opened)

    async def set_quota(self, salt: str, l2_bytes: int | None) -> None:
        key = self.meta(salt)[3]
        value = self._seal.seal(salt, l2_bytes)
        await self._plain(key, lambda pipe, k: pipe.set(k, value))
        self._saw_quota(salt, value)

    async def drop_quota(self, salt: str) -> None:
        await self._plain(self.meta(salt)[3], lambda pipe, k: pipe.delete(k))
        self._quotas.pop(salt, None)

    async def _plain(self, key: bytes, call: Callable[[Pipeline, bytes], object]) -> None:
        await self.router.start()
        (reply,) = await self.router.pipeline([key], lambda pipe, _: call(pipe, key))
        if isinstance(reply, Exception):
            raise BackendError(f"redis fleet quota: {type(reply).__name__}: {reply}")

    # --- reconcile -----------------------------------------------------------------------------

    async def scan(self, keys_per_s: int) -> tuple[dict[str, dict[str, int]], set[str], int]:
        """Every blob of the prefix by tenant (key -> STRLEN), the tenants with meta keys, and the
        number of keys of the prefix seen; at most `keys_per_s` keys examined a second."""
        found: dict[str, dict[str, int]] = {}
        metas: set[str] = set()
        scanned = 0
        async for names in scan_names(self.router, self.prefix, keys_per_s, "redis fleet reconcile: scan"):
            scanned += len(names)
            blobs: list[tuple[str, str]] = []
            for key in names:
                if key.startswith(META):
                    salt = self.salt_of_meta(self.prefix + key)
                    if salt is not None:
                        metas.add(salt)
                    continue
                salt = self._salt_of(key)
                if salt is not None:
                    blobs.append((salt, key))
            if blobs:
                rkeys = [(self.prefix + k).encode("utf-8") for _, k in blobs]
                sizes = await self.router.pipeline(rkeys, partial(_each, rkeys, "strlen"))
                for (salt, key), size in zip(blobs, sizes, strict=True):
                    if isinstance(size, int) and size > 0:
                        found.setdefault(salt, {})[key] = size
        return found, metas, scanned

    async def reconcile(self, keys_per_s: int | None = None) -> ReconcileReport:
        """Make every tenant's ledger what Redis holds (module docstring), scanning at most
        `keys_per_s` (default: the ledger's own) keys a second."""
        found, metas, scanned = await self.scan(self.keys_per_s if keys_per_s is None else keys_per_s)
        report = ReconcileReport(keys_scanned=scanned)
        for salt in sorted(set(found) | metas):
            blobs = found.get(salt, {})
            report.per_salt[salt] = (sum(blobs.values()), len(blobs))
            sizes_key = self.meta(salt)[1]
            (held,) = await self.router.pipeline([sizes_key], partial(_hgetall, sizes_key))
            if isinstance(held, Exception):
                raise BackendError(f"redis fleet reconcile: {held}")
            reserved = {as_text(k): int(v) for k, v in held.items()}
            gone = [k for k in reserved if k not in blobs]
            if gone:  # not seen by the scan: gone unless written since (EXISTS says)
                rkeys = [(self.prefix + k).encode("utf-8") for k in gone]
                exists = await self.router.pipeline(rkeys, partial(_each, rkeys, "exists"))
                for key, there in zip(gone, exists, strict=True):
                    if there == 0:
                        released = await self.forget(salt, key, min_age=True)
                        report.released_bytes += max(released, 0)
            for key, size in blobs.items():
                if reserved.get(key) != size:
                    report.adopted_bytes += int(await self._script(salt, ADOPT, key, size, self.grace_us))
            before, total = await self._script(salt, SETTLE)
            report.ledger_fixed += int(before) != int(total)
            report.tenants += 1
        return report


async def scan_blobs(router: RedisRouter, prefix: str, keys_per_s: int) -> AsyncIterator[list[str]]:
    """The blob keys under `prefix` (without it; the fleet ledger's keys left out), a batch per
    SCAN reply, from every node of a cluster, at most `keys_per_s` keys a second. BackendError
    when a node does not answer."""
    async for names in scan_names(router, prefix, keys_per_s, "redis scan"):
        batch = [n for n in names if not n.startswith(META)]
        if batch:
            yield batch


def _each(keys: list[bytes], command: str, pipe: Pipeline, i: int) -> object:
    return getattr(pipe, command)(keys[i])


def _hgetall(key: bytes, pipe: Pipeline, _: int) -> object:
    return pipe.hgetall(key)
