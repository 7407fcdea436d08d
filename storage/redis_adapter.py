"""RedisAdapter: Redis or Valkey as a shared L2 (redis.asyncio, hiredis parser).

State (event loop only): one connection pool (max_connections), a semaphore that keeps batches
from ever asking the pool for more connections than it has, and what this adapter wrote: key ->
size, for `usage()`.

Keys are `key_prefix + serialized key`. Each batch is one pipeline with transaction=False made of
single-key commands only (SET, EXISTS, GET, UNLINK), so the same commands work against Redis
Cluster, where keys of one batch live in different slots.

Failures: every socket operation has `timeout_s`; a dropped connection is reconnected and the batch
retried once (all commands are idempotent), a timeout is not retried. A Redis that is down or
unreachable therefore turns a batch into ERROR results within about `timeout_s` (at once when the
connection is refused) and health into "down"; the next batch that succeeds after Redis comes back
turns health back to "ok" through "degraded". An error reply for one command (e.g. OOM when Redis is
out of memory: NO_SPACE) affects only that key.

Copies: SET needs the blob as one value, so header and payload are joined (one copy); blobs of
JOIN_INLINE_BYTES and more are joined in the executor passed in, never on the loop. Replies are
parsed by hiredis in the loop's thread.

usage(): bytes and objects that THIS adapter stored and has not deleted; keys found missing on
load/contains (expired by ttl_s, evicted by Redis, deleted by another sidecar) are forgotten then.
It does not see other sidecars' writes. capacity_bytes is config.capacity_gb, 0 when unset
(unknown: Redis evicts by its own maxmemory policy). set_capacity only changes the reported figure.

Primitives in call order: store, contains, load, delete, usage, set_capacity, close (AdapterCore).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, RedisError, ResponseError

from app.errors import BackendError
from app.settings import RedisAdapterConfig
from storage.base import MISS, OK, LoadResult, OpResult, Status, Usage
from storage.codec import EncodedBlob
from storage.common import AdapterCore

JOIN_INLINE_BYTES = 256 * 1024


class RedisAdapter(AdapterCore):
    kind = "redis"

    def __init__(
        self,
        config: RedisAdapterConfig,
        executor: ThreadPoolExecutor | None = None,
        *,
        owns_executor: bool = False,
    ) -> None:
        super().__init__(config.name)
        self.config = config
        self._prefix = config.key_prefix.encode("utf-8")
        self._executor = executor
        self._owns_executor = owns_executor
        self._capacity = int(config.capacity_gb * (1 << 30)) if config.capacity_gb else 0
        self._pool: ConnectionPool = ConnectionPool.from_url(
            config.url,
            max_connections=config.max_connections,
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s,
            retry=Retry(NoBackoff(), retries=1, supported_errors=(RedisConnectionError,)),
        )
        self._client = Redis(connection_pool=self._pool)
        self._slots = asyncio.Semaphore(config.max_connections)
        self._sizes: dict[str, int] = {}
        self._bytes = 0

    def redis_key(self, key: str) -> bytes:
        return self._prefix + key.encode("utf-8")

    # --- plumbing ------------------------------------------------------------------------------

    async def _run(self, build: Callable[[Pipeline], object]) -> list[Any]:
        """One non-transactional pipeline; per-command error replies come back as exceptions."""
        async with self._slots:
            try:
                async with self._client.pipeline(transaction=False) as pipe:
                    build(pipe)
                    return list(await pipe.execute(raise_on_error=False))
            except (RedisError, OSError) as exc:
                raise BackendError(f"redis {self.config.name}: {type(exc).__name__}: {exc}") from exc

    async def _join(self, blob: EncodedBlob) -> bytes:
        if self._executor is None or blob.nbytes < JOIN_INLINE_BYTES:
            return blob.to_bytes()
        return await asyncio.get_running_loop().run_in_executor(self._executor, blob.to_bytes)

    def _forget(self, key: str) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self._bytes -= size

    # --- operations ----------------------------------------------------------------------------

    async def _store(self, items: list[tuple[str, EncodedBlob]]) -> list[OpResult]:
        values = [await self._join(blob) for _, blob in items]
        ttl = self.config.ttl_s

        def build(pipe: Pipeline) -> None:
            for (key, _), value in zip(items, values, strict=True):
                pipe.set(self.redis_key(key), value, ex=ttl)

        replies = await self._run(build)
        results: list[OpResult] = []
        for (key, blob), reply in zip(items, replies, strict=True):
            if isinstance(reply, OutOfMemoryError):
                results.append(OpResult(Status.NO_SPACE, f"redis out of memory: {reply}"))
            elif isinstance(reply, ResponseError):
                results.append(OpResult.error(f"redis: {reply}"))
            elif isinstance(reply, Exception):
                results.append(OpResult.error(f"redis: {type(reply).__name__}: {reply}"))
            else:
                self._forget(key)
                self._sizes[key] = blob.nbytes
                self._bytes += blob.nbytes
                results.append(OK)
        return results

    async def _contains(self, keys: list[str]) -> list[OpResult]:
        def build(pipe: Pipeline) -> None:
            for key in keys:
                pipe.exists(self.redis_key(key))

        results: list[OpResult] = []
        for key, reply in zip(keys, await self._run(build), strict=True):
            if isinstance(reply, Exception):
                results.append(OpResult.error(f"redis: {reply}"))
            elif reply:
                results.append(OK)
            else:
                self._forget(key)
                results.append(MISS)
        return results

    async def _load(self, keys: list[str]) -> list[LoadResult]:
        def build(pipe: Pipeline) -> None:
            for key in keys:
                pipe.get(self.redis_key(key))

        results: list[LoadResult] = []
        for key, reply in zip(keys, await self._run(build), strict=True):
            if isinstance(reply, Exception):
                results.append(LoadResult.error(f"redis: {reply}"))
            elif reply is None:
                self._forget(key)
                results.append(LoadResult(Status.MISS))
            else:
                results.append(LoadResult.hit(reply))
        return results

    async def _delete(self, keys: list[str]) -> list[OpResult]:
        def build(pipe: Pipeline) -> None:
            for key in keys:
                pipe.unlink(self.redis_key(key))

        results: list[OpResult] = []
        for key, reply in zip(keys, await self._run(build), strict=True):
            if isinstance(reply, Exception):
                results.append(OpResult.error(f"redis: {reply}"))
                continue
            self._forget(key)
            results.append(OK if reply else MISS)
        return results

    def _usage(self) -> Usage:
        return Usage(bytes_used=self._bytes, objects=len(self._sizes), capacity_bytes=self._capacity)

    async def _set_capacity(self, capacity_bytes: int) -> None:
        self._capacity = capacity_bytes

    async def _close(self) -> None:
        try:
            await self._client.aclose()
            await self._pool.aclose()
        finally:
            if self._owns_executor and self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
