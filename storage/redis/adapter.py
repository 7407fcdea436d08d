"""RedisAdapter: Redis or Valkey as a shared L2. Control commands and small values go through
redis.asyncio (hiredis parser); large values through the bulk lane (storage/redis/lane.py).

State (event loop only): the router (storage/redis/router.py): per Redis node a redis-py
connection pool (max_connections) with a semaphore that keeps batches from ever asking it for more
connections than it has, and a bulk lane (its own pool of at most max_connections blocking
connections, used only by the executor's threads); in a Redis Cluster, the slot map. What this
adapter wrote: key -> size in write order (`_held`, which reports every change to the owner's
accounting), for `usage()`, the tenant ledger and evict_salt.

Keys are `key_prefix + serialized key`. Only single-key commands are sent (SET, EXISTS, GET,
GETRANGE, UNLINK on redis-py; SET, STRLEN and GETRANGE on the lane), so the same commands work
against Redis Cluster, where keys of one batch live in different slots: a batch is one pipeline per
node, each lane command goes to its key's node's lane. A MOVED reply moves the slot and the command
is sent once more to its new node (both paths); an ASK reply is followed with ASKING by redis-py
(a lane command that gets one is sent again through redis-py). A cluster node that is down or frozen
turns only its slots' keys into ERROR (misses) within timeout_s; the other nodes answer.

Bounded reads: load_into never receives more than header + len(out) + 1 bytes of a value (a
GETRANGE of that many on redis-py, storage/redis/read.py on the lane), so a huge value planted
under a chunk key costs no memory: it is refused unread (too_long), counted, a miss (never deleted:
the tier is shared, storage/common.py). `load` (whole blobs of any length, for tools) is a GET.

Which path: a stored blob of `bulk_min_kib` or more, and a load_into whose blob would be that big,
take the lane; everything else is one redis-py pipeline per batch (transaction=False). Both run
concurrently within a batch (storage/redis/paths.py). `load` (whole blobs, no destination) always
uses redis-py. With rediss:// (TLS) or bulk_min_kib None there is no lane: everything goes through
redis-py, and blobs of JOIN_INLINE_BYTES and more are joined into one value in the executor, never
on the loop.

Copies on the lane: a SET is sent as [RESP header, blob header, payload, CRLF] (sendmsg, nothing
joined); load_into receives a raw blob's payload straight into the caller's out and answers with
the header (in place), any other blob whole (see storage/redis/lane.py for why the reads are
GETRANGE pieces in a sliding window, and how a value replaced during a read is told apart).

Failures: every socket operation has `timeout_s`. On redis-py, a dropped connection is reconnected
and the batch retried once (all commands are idempotent), a timeout is not retried. The lane bounds
each command by timeout_s of no progress (and timeout_s + its bytes at 64 MB/s overall), retries a
connection that died while idle once, and after a failure fails the rest of the batch at once. A
Redis that is down, unreachable or frozen therefore turns a batch into ERROR results within about
`timeout_s` (at once when the connection is refused) and health into "down" (a cluster node:
"degraded", its keys ERROR, the slot map read again); the next batch that
succeeds after Redis comes back turns health back to "ok" through "degraded". An error reply for one
command (e.g. OOM when Redis is out of memory: NO_SPACE) affects only that key. A cancelled batch
(close(), a caller's deadline) shuts its lane sockets down and returns only once the lane's threads
are done with the caller's buffers.

usage() and the per-tenant figures reported to the owner: bytes and objects that THIS adapter
stored and has not seen deleted; keys found missing on load/contains (expired by ttl_s, evicted by
Redis, deleted by another sidecar) are forgotten then, so until then they still count. It does not
see other sidecars' writes, even of the same keys. capacity_bytes is config.capacity_gb, 0 when
unset (unknown: Redis evicts by its own maxmemory policy). set_capacity only changes the reported
figure.

evict_salt(salt, nbytes): the tenant's keys this adapter wrote, oldest written first (loads do not
refresh them: Redis keeps no recency we can read cheaply), UNLINKed in one pipeline; each key is
forgotten once its UNLINK answered (a key already gone counts as freed too), a key whose UNLINK
failed is kept.

Fleet scope (config.scope "fleet", the default): `fleet` is the tenant ledger kept in Redis itself
(storage/redis/fleet.py), shared by every sidecar on the prefix. The write-behind reserves in it
before storing; `delete` releases the reservations of the keys it UNLINKed; evict_salt then evicts
the tenant's oldest blobs fleet-wide (whoever wrote them; only keys that name the tenant: see
FleetLedger.oldest), quotas sealed with `keys`. `usage()` and the per-tenant figures above stay
this sidecar's own.

Primitives in call order: store, contains, load, load_into, delete, usage, set_capacity,
evict_salt, close (AdapterCore)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from redis.asyncio.client import Pipeline
from redis.exceptions import OutOfMemoryError, ResponseError

from app.errors import BackendError
from storage.auth import BlobKeys
from storage.base import MISS, OK, BuildContext, Capabilities, LoadResult, OpResult, Status, key_salt
from storage.codec import EncodedBlob, blob_header
from storage.common import AdapterCore
from storage.redis import read as redis_read
from storage.redis.config import RedisAdapterConfig
from storage.redis.fleet import FleetLedger, scan_blobs
from storage.redis.lane import RespLane
from storage.redis.paths import LanePath, split
from storage.redis.router import RedisRouter

JOIN_INLINE_BYTES = 256 * 1024

R = TypeVar("R", OpResult, LoadResult)


def _unlink(pipe: Pipeline, _: int, key: bytes) -> object:
    return pipe.unlink(key)


class RedisAdapter(AdapterCore[None]):
    kind = "redis"
    shared = True

    def __init__(
        self,
        config: RedisAdapterConfig,
        executor: ThreadPoolExecutor | None = None,
        *,
        owns_executor: bool = False,
        keys: BlobKeys | None = None,
    ) -> None:
        super().__init__(config.name, int(config.capacity_gb * (1 << 30)) if config.capacity_gb else 0)
        self.config = config
        self._prefix = config.key_prefix.encode("utf-8")
        self._executor = executor
        self._owns_executor = owns_executor
        lanes = executor is not None and config.bulk_min_kib is not None
        self.router = RedisRouter(config, lanes=lanes)
        self._bulk_min = (config.bulk_min_kib or 0) * 1024
        self._lanes = None if executor is None else LanePath(
            config.name, self.router, executor, self.redis_key, self._backend_down
        )
        self.fleet: FleetLedger | None = None
        if config.scope == "fleet":
            self.fleet = FleetLedger(
                self.router, config.key_prefix, config.grace_s, on_down=self._fleet_down, keys=keys,
                keys_per_s=config.scan_keys_per_s, reconcile_interval_s=config.reconcile_interval_s,
            )  # fmt: skip

    def capabilities(self) -> Capabilities:
        """The fleet ledger (scope "fleet") and a scan of every blob under the prefix; no pins
        (Redis evicts by its own maxmemory policy)."""
        return Capabilities(fleet=self.fleet, scan=self)

    async def scan_keys(self) -> AsyncIterator[list[str]]:
        """Every blob key under the prefix (the fleet ledger's own keys left out), whoever wrote
        it, from every node, at most scan_keys_per_s keys a second (storage/redis/scan.py)."""
        async for batch in scan_blobs(self.router, self.config.key_prefix, self.config.scan_keys_per_s):
            yield batch

    @property
    def lane(self) -> RespLane | None:
        """The bulk lane of the URL's (first) node."""
        return self.router.first.lane

    def redis_key(self, key: str) -> bytes:
        return self._prefix + key.encode("utf-8")

    def _on_lane(self, key: str, nbytes: int) -> bool:
        return nbytes >= self._bulk_min and self.router.lane_for(self.redis_key(key)) is not None

    # --- plumbing ------------------------------------------------------------------------------

    async def _each(self, keys: list[str], command: Callable[[Pipeline, int, bytes], object]) -> list[Any]:
        """`command(pipe, i, redis key)` for each key, one pipeline per node (storage/redis/router.py);
        per-command error replies come back as exceptions. A node that failed: its keys' replies
        are BackendError objects, or, when every key was lost with it, BackendError is raised."""
        rkeys = [self.redis_key(key) for key in keys]
        replies = await self.router.pipeline(rkeys, lambda pipe, i: command(pipe, i, rkeys[i]))
        lost = [r for r in replies if isinstance(r, BackendError)]
        if lost and len(lost) == len(replies):
            raise lost[0]
        return replies

    async def _join(self, blob: EncodedBlob) -> bytes:
        if self._executor is None or blob.nbytes < JOIN_INLINE_BYTES:
            return blob.to_bytes()
        return await asyncio.get_running_loop().run_in_executor(self._executor, blob.to_bytes)

    async def _call_lane(
        self, error: Callable[[str], R], key: str, fn: Callable[..., R], *args: Any
    ) -> R | None:
        assert self._lanes is not None  # only keys `_on_lane` take it: there is an executor
        return await self._lanes.call(error, key, fn, *args)

    def _forget(self, key: str) -> None:
        self._held.pop(key)

    def _remember(self, key: str, size: int) -> None:
        self._held.put(key, None, size)

    # --- operations ----------------------------------------------------------------------------

    async def _store(self, items: list[tuple[str, EncodedBlob]]) -> list[OpResult]:
        await self.router.start()
        on_lane = [i for i, (key, blob) in enumerate(items) if self._on_lane(key, blob.nbytes)]

        async def lane_call(i: int) -> OpResult:
            key, blob = items[i]
            ttl = self.config.ttl_s
            result = await self._call_lane(OpResult.error, key, RespLane.set, blob.segments, ttl)
            return result if result is not None else (await self._store_pipelined([items[i]]))[0]

        async def pipelined(indices: list[int]) -> list[OpResult]:
            return await self._store_pipelined([items[i] for i in indices])

        down = self._backend_down
        results = await split(len(items), on_lane, lane_call, pipelined, OpResult.error, backend_down=down)
        for (key, blob), result in zip(items, results, strict=True):
            if result.ok:
                self._remember(key, blob.nbytes)
        return results

    async def _store_pipelined(self, items: list[tuple[str, EncodedBlob]]) -> list[OpResult]:
        values = [await self._join(blob) for _, blob in items]
        ttl = self.config.ttl_s

        def command(pipe: Pipeline, i: int, rkey: bytes) -> object:
            return pipe.set(rkey, values[i], ex=ttl)

        results: list[OpResult] = []
        for reply in await self._each([key for key, _ in items], command):
            if isinstance(reply, OutOfMemoryError):
                results.append(OpResult(Status.NO_SPACE, f"redis out of memory: {reply}"))
            elif isinstance(reply, ResponseError):
                results.append(OpResult.error(f"redis: {reply}"))
            elif isinstance(reply, Exception):
                results.append(OpResult.error(f"redis: {type(reply).__name__}: {reply}"))
            else:
                results.append(OK)
        return results

    async def _contains(self, keys: list[str]) -> list[OpResult]:
        await self.router.start()
        results: list[OpResult] = []
        for key, reply in zip(keys, await self._each(keys, lambda pipe, _, k: pipe.exists(k)), strict=True):
            if isinstance(reply, Exception):
                results.append(OpResult.error(f"redis: {reply}"))
            elif reply:
                results.append(OK)
            else:
                self._forget(key)
                results.append(MISS)
        return results

    async def _load(self, keys: list[str]) -> list[LoadResult]:
        await self.router.start()
        results: list[LoadResult] = []
        for key, reply in zip(keys, await self._each(keys, lambda pipe, _, k: pipe.get(k)), strict=True):
            if isinstance(reply, Exception):
                results.append(LoadResult.error(f"redis: {reply}"))
            elif reply is None:
                self._forget(key)
                results.append(LoadResult(Status.MISS))
            else:
                results.append(LoadResult.hit(reply))
        return results

    async def _load_into(self, keys: list[str], outs: list[memoryview]) -> list[LoadResult]:
        await self.router.start()
        head_lens = [blob_header.header_size(key) for key in keys]
        on_lane = [i for i, out in enumerate(outs) if self._on_lane(keys[i], head_lens[i] + out.nbytes)]

        async def lane_call(i: int) -> LoadResult:
            get_into = RespLane.get_into
            result = await self._call_lane(LoadResult.error, keys[i], get_into, head_lens[i], outs[i])
            if result is None:  # ASK: through redis-py
                return (await self._load_upto([keys[i]], [head_lens[i] + outs[i].nbytes]))[0]
            if result.status is Status.MISS:
                self._forget(keys[i])
            return result

        async def pipelined(indices: list[int]) -> list[LoadResult]:
            return await self._load_upto(
                [keys[i] for i in indices], [head_lens[i] + outs[i].nbytes for i in indices]
            )

        return await split(
            len(keys), on_lane, lane_call, pipelined, LoadResult.error, backend_down=self._backend_down
        )

    async def _load_upto(self, keys: list[str], limits: list[int]) -> list[LoadResult]:
        """Each key's value when it is at most its limit long (GETRANGE of limit + 1 bytes: a
        longer value shows as such without being sent whole), whole, as from load."""

        def command(pipe: Pipeline, i: int, rkey: bytes) -> object:
            return pipe.getrange(rkey, 0, limits[i])

        results: list[LoadResult] = []
        for key, limit, reply in zip(keys, limits, await self._each(keys, command), strict=True):
            if isinstance(reply, Exception):
                results.append(LoadResult.error(f"redis: {reply}"))
            elif not reply:  # no such key: GETRANGE answers an empty string
                self._forget(key)
                results.append(LoadResult(Status.MISS))
            elif len(reply) > limit:
                results.append(redis_read.too_long(len(reply), limit))
            else:
                results.append(LoadResult.hit(reply))
        return results

    async def _delete(self, keys: list[str]) -> list[OpResult]:
        await self.router.start()
        results: list[OpResult] = []
        for key, reply in zip(keys, await self._each(keys, _unlink), strict=True):
            if isinstance(reply, Exception):
                results.append(OpResult.error(f"redis: {reply}"))
                continue
            self._forget(key)
            results.append(OK if reply else MISS)
        if self.fleet is not None:  # after the UNLINKs answered: never below what Redis holds
            for key, result in zip(keys, results, strict=True):
                salt = key_salt(key)
                if result.status is not Status.ERROR and salt is not None:
                    await self.fleet.forget(salt, key)
        return results

    async def _evict_salt(self, salt: str, nbytes: int) -> int:
        if self.fleet is not None:
            return await self._evict_fleet(self.fleet, salt, nbytes)
        victims = [(key, self._held.entry(key)) for key in self._held.oldest(salt, nbytes)]
        if not victims:
            return 0
        await self.router.start()
        replies = await self._each([key for key, _ in victims], _unlink)
        freed = 0
        for (key, held), reply in zip(victims, replies, strict=True):
            if isinstance(reply, Exception) or held is None:
                continue
            # Unless the key was written again while its UNLINK was on the way: that newer write
            # stays in the books (Redis may hold it or not; a later miss will tell).
            if self._held.discard(key, held, evicted=True):
                freed += held.size
                self._count_eviction(held.size)
        return freed

    def _fleet_down(self, message: str) -> None:
        self._stats.errors += 1
        self._health.failure(f"fleet ledger: {message}", down=not self.router.cluster)

    async def _evict_fleet(self, fleet: FleetLedger, salt: str, nbytes: int) -> int:
        """The tenant's oldest blobs in the whole fleet's ledger (whoever wrote them; none reserved
        within grace_s), UNLINKed, then their reservations released (unless reserved again
        meanwhile). Bytes released."""
        await self.router.start()
        victims = await fleet.oldest(salt, nbytes)
        if not victims:
            return 0
        replies = await self._each([key for key, _, _ in victims], _unlink)
        freed = 0
        for (key, score, _), reply in zip(victims, replies, strict=True):
            if isinstance(reply, Exception):
                continue
            released = await fleet.forget(salt, key, score)
            if released < 0:
                continue  # reserved again: a newer write of the key is on its way
            freed += released
            self._count_eviction(released)
            held = self._held.entry(key)
            if held is not None:
                self._held.discard(key, held, evicted=True)
        return freed

    async def _close(self) -> None:
        try:
            await self.router.close()
        finally:
            if self._owns_executor and self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)


def build(config: RedisAdapterConfig, context: BuildContext) -> RedisAdapter:
    """The registry's builder (storage/registry.py): config.transfer_threads() threads for the bulk
    lane's blocking sockets (and, without a lane, for joining large blobs into one value); the
    deployment's keys seal the fleet ledger's quotas."""
    threads = config.transfer_threads()
    executor = ThreadPoolExecutor(threads, thread_name_prefix=f"kvdepot-l2-{config.name}")
    return RedisAdapter(config, executor, owns_executor=True, keys=context.keys)
