"""FleetLedger: a shared Redis adapter's per-tenant usage and quotas, kept in Redis itself, so that
every sidecar on that Redis sees one figure and enforces one limit (`scope: "fleet"`).

Role: per tenant (cache_salt) five meta keys under the adapter's key prefix, all with the same
hash tag so that on a Redis Cluster they live in one slot and one Lua script updates them at once:
  <prefix>__fleet:{s<hex salt>}:used     the ledger: bytes reserved by the tenant's blobs
  <prefix>__fleet:{s<hex salt>}:sizes    hash: blob key -> its reserved size
  <prefix>__fleet:{s<hex salt>}:keys     sorted set: blob key -> reservation time (Redis TIME, µs)
  <prefix>__fleet:{s<hex salt>}:pending  set: blob keys whose write has not returned yet
  <prefix>__fleet:{s<hex salt>}:quota    the tenant's fleet l2_bytes (-1: unlimited; absent: each
                                         sidecar's own quota applies)
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

Drift (blobs expired by ttl_s, deleted by hand, written by a `scope: "local"` sidecar or a tool,
writes that failed after their reservation) only ever makes `used` too high; hand edits of the meta
keys may make it anything. `reconcile` repairs both: SCAN of every node by prefix at a bounded rate,
STRLEN of each blob, then per tenant: reservations whose blob is gone (EXISTS after the scan) and not
pending within grace_s are released, blobs found without a reservation (or of another size) are
adopted, `used` is set to the sum of sizes.

State: the router and prefix (shared with the adapter), grace_s. No local state: every figure is
read from Redis. Event loop only.

Primitives in call order: reserve(salt, key, size, fallback_limit) / reserve_many(items),
commit(salt, keys),
forget(salt, key, score),
oldest(salt, nbytes), usage(salt), set_quota(salt, l2_bytes) / drop_quota(salt) / quota(salt),
scan(keys_per_s), reconcile(keys_per_s).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from app.errors import BackendError
from storage.redis_scan import as_text, scan_names

if TYPE_CHECKING:  # redis-py loads only where a Redis tier is configured
    from redis.asyncio.client import Pipeline

    from storage.redis_router import RedisRouter

META = "__fleet:"
"""After the key prefix: the meta keys. No blob key starts so (they start with their version)."""

_RESERVE = """
local q = redis.call('GET', KEYS[4])
local limit = tonumber(ARGV[3])
if q then limit = tonumber(q) end
local old = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
local delta = tonumber(ARGV[2]) - old
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
if limit >= 0 and delta > 0 and used + delta > limit then return {0, used, limit} end
local t = redis.call('TIME')
redis.call('INCRBY', KEYS[1], delta)
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[3], t[1] .. string.format('%06d', tonumber(t[2])), ARGV[1])
redis.call('SADD', KEYS[5], ARGV[1])
return {1, used + delta, limit}
"""

_FORGET = """
local s = redis.call('ZSCORE', KEYS[3], ARGV[1])
if ARGV[2] ~= '' and s ~= ARGV[2] then return -1 end
if ARGV[3] ~= '' and s and redis.call('SISMEMBER', KEYS[5], ARGV[1]) == 1 then
  local t = redis.call('TIME')
  if tonumber(t[1]) * 1000000 + tonumber(t[2]) - tonumber(s) < tonumber(ARGV[3]) then return -1 end
end
local size = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('SREM', KEYS[5], ARGV[1])
if size > 0 then redis.call('DECRBY', KEYS[1], size) end
return size
"""

_OLDEST = """
local t = redis.call('TIME')
local cutoff = tonumber(t[1]) * 1000000 + tonumber(t[2]) - tonumber(ARGV[2])
local items = redis.call('ZRANGE', KEYS[3], 0, tonumber(ARGV[3]) - 1, 'WITHSCORES')
local out = {}
local freed = 0
for i = 1, #items, 2 do
  if freed >= tonumber(ARGV[1]) then break end
  if tonumber(items[i + 1]) < cutoff or redis.call('SISMEMBER', KEYS[5], items[i]) == 0 then
    local size = redis.call('HGET', KEYS[2], items[i]) or '0'
    out[#out + 1] = items[i]
    out[#out + 1] = items[i + 1]
    out[#out + 1] = size
    freed = freed + tonumber(size)
  end
end
return out
"""

_ADOPT = """
local old = redis.call('HGET', KEYS[2], ARGV[1])
if old == ARGV[2] then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
if old and redis.call('SISMEMBER', KEYS[5], ARGV[1]) == 1 then
  local s = tonumber(redis.call('ZSCORE', KEYS[3], ARGV[1]) or '0')
  if now - s < tonumber(ARGV[3]) then return 0 end
end
local delta = tonumber(ARGV[2]) - tonumber(old or '0')
redis.call('INCRBY', KEYS[1], delta)
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
if not old then redis.call('ZADD', KEYS[3], t[1] .. string.format('%06d', tonumber(t[2])), ARGV[1]) end
return delta
"""

_SETTLE = """
local sum = 0
for _, v in ipairs(redis.call('HVALS', KEYS[2])) do sum = sum + tonumber(v) end
local before = tonumber(redis.call('GET', KEYS[1]) or '0')
if sum == 0 then
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[5])
else
  redis.call('SET', KEYS[1], sum)
end
return {before, sum}
"""

_COMMIT = """
for i = 1, #ARGV do redis.call('SREM', KEYS[5], ARGV[i]) end
return #ARGV
"""

_USAGE = """
return {tonumber(redis.call('GET', KEYS[1]) or '0'), redis.call('HLEN', KEYS[2]),
  redis.call('GET', KEYS[4]) or ''}
"""


@dataclass(frozen=True, slots=True)
class Reservation:
    ok: bool
    used: int
    """The tenant's fleet bytes after (ok) or before (refused) the reservation."""
    limit: int | None


@dataclass(slots=True)
class ReconcileReport:
    keys_scanned: int = 0
    tenants: int = 0
    released_bytes: int = 0
    adopted_bytes: int = 0
    ledger_fixed: int = 0
    """Tenants whose `used` differed from the sum of their sizes (hand edits)."""
    per_salt: dict[str, tuple[int, int]] = field(default_factory=dict)
    """What the scan found per tenant: (bytes, blobs)."""


class FleetLedger:
    def __init__(
        self, router: RedisRouter, prefix: str, grace_s: float,
        salt_of: Callable[[str], str | None] | None = None,
        on_down: Callable[[str], None] | None = None,
    ) -> None:  # fmt: skip
        self.router = router
        self.prefix = prefix
        self.grace_us = int(grace_s * 1_000_000)
        self._salt_of = salt_of or key_salt
        self._on_down = on_down

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

    async def _script(self, salt: str, script: str, *args: str | int) -> Any:
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

    async def reserve(self, salt: str, key: str, size: int, fallback_limit: int | None) -> Reservation:
        """Reserve `size` bytes for blob `key` of `salt` (replacing its earlier reservation) unless
        that takes the tenant over its fleet quota (or `fallback_limit` when it has none)."""
        fallback = -1 if fallback_limit is None else fallback_limit
        ok, used, limit = await self._script(salt, _RESERVE, key, size, fallback)
        return Reservation(bool(ok), int(used), None if int(limit) < 0 else int(limit))

    async def reserve_many(
        self, items: list[tuple[str, str, int, int | None]]
    ) -> list[Reservation | None]:
        """`reserve` of each (salt, key, size, fallback_limit), one pipeline per node, in order;
        None where that node failed (BackendError when all did)."""
        keys = [self.meta(salt) for salt, _, _, _ in items]

        def command(pipe: Pipeline, i: int) -> object:
            _, key, size, fallback = items[i]
            return pipe.eval(_RESERVE, 5, *keys[i], key, size, -1 if fallback is None else fallback)

        await self.router.start()
        replies = await self.router.pipeline([k[0] for k in keys], command)
        out: list[Reservation | None] = []
        for reply in replies:
            if isinstance(reply, Exception):
                if isinstance(reply, BackendError) and self._on_down is not None:
                    self._on_down(str(reply))
                out.append(None)
                continue
            ok, used, limit = reply
            out.append(Reservation(bool(ok), int(used), None if int(limit) < 0 else int(limit)))
        if items and all(r is None for r in out):
            raise BackendError("redis fleet ledger: no node answered")
        return out

    async def commit(self, salt: str, keys: list[str]) -> None:
        """The writes of `keys` returned: their reservations are no longer in flight."""
        if keys:
            await self._script(salt, _COMMIT, *keys)

    async def forget(self, salt: str, key: str, score: str = "", *, min_age: bool = False) -> int:
        """Release `key`'s reservation (only if its reservation time is still `score`, when given;
        only if older than grace_s, when `min_age`). Bytes released; -1 when kept."""
        grace = str(self.grace_us) if min_age else ""
        return int(await self._script(salt, _FORGET, key, score, grace))

    async def oldest(self, salt: str, nbytes: int, limit: int = 512) -> list[tuple[str, str, int]]:
        """`salt`'s oldest reservations older than grace_s, enough for `nbytes`: (key, score, size)."""
        flat = await self._script(salt, _OLDEST, nbytes, self.grace_us, limit)
        out = []
        for i in range(0, len(flat), 3):
            key, score, size = flat[i : i + 3]
            out.append((as_text(key), as_text(score), int(size)))
        return out

    async def usage(self, salt: str) -> tuple[int, int, int | None]:
        """(bytes, blobs, fleet l2_bytes quota or None) of `salt`."""
        used, count, quota = await self._script(salt, _USAGE)
        text = as_text(quota)
        return int(used), int(count), (None if text in ("", "-1") else int(text))

    async def set_quota(self, salt: str, l2_bytes: int | None) -> None:
        key = self.meta(salt)[3]
        value = -1 if l2_bytes is None else l2_bytes
        await self._plain(key, lambda pipe, k: pipe.set(k, value))

    async def drop_quota(self, salt: str) -> None:
        await self._plain(self.meta(salt)[3], lambda pipe, k: pipe.delete(k))

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

    async def reconcile(self, keys_per_s: int = 2000) -> ReconcileReport:
        """Make every tenant's ledger what Redis holds (module docstring)."""
        found, metas, scanned = await self.scan(keys_per_s)
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
                    report.adopted_bytes += int(await self._script(salt, _ADOPT, key, size, self.grace_us))
            before, total = await self._script(salt, _SETTLE)
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


def key_salt(key: str) -> str | None:
    """The cache_salt of a serialized chunk key (engine/keys.py ObjectKey), None when `key` is not
    one (storage does not import the engine: the `s=` field, percent-quoted)."""
    parts = key.split("/")
    if len(parts) != 7 or not parts[0].startswith("kvd") or not parts[5].startswith("s="):
        return None
    return unquote(parts[5][2:])
