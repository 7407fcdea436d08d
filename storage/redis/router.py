"""RedisRouter: which Redis node serves a key, for both paths of the Redis adapter.

Role: a single Redis (or Valkey) is one node that serves every key. A Redis Cluster is a slot map
(storage/redis/cluster.py) over nodes, each with its own redis-py pool (and semaphore, so a batch
never asks a pool for more connections than it has) and its own bulk lane (storage/redis/lane.py):
a node that is down or frozen costs only the keys of its slots, within timeout_s, while the other
nodes answer.

Mode (config.cluster): false -> the URL's node; true -> CLUSTER SLOTS from the first seed that
answers; auto -> INFO cluster on the first seed that answers says which. Cluster mode needs
database 0 (a clear BackendError otherwise; the next batch asks again).

State (event loop only; the lanes' own state is theirs): the nodes by address, the slot map, the
refresh task.

Redirections: a MOVED reply moves its slot in the map at once and the command is sent again, once,
to the new node; an ASK reply sends it once more to the node named, preceded by ASKING. Any
redirection or a node's failure also schedules a refresh of the whole map (CLUSTER SLOTS from
the first node that answers, at most one at a time, at most every REFRESH_MIN_S).

Primitives in call order: RedisRouter(config, lanes=...), start(), pipeline(keys, command) (redis-py,
replies per key: a BackendError object for a key whose node failed), lane_for(key), moved(redirect),
refresh_soon(), refreshed(), close().
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AskError, MovedError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from app.errors import BackendError
from storage.inflight import gather_all
from storage.redis.cluster import Node, Redirect, SlotMap, node_url, seed_urls, url_db
from storage.redis.config import RedisAdapterConfig
from storage.redis.lane import RespLane
from storage.redis.resp import target_from_url

REFRESH_MIN_S = 0.5

Command = Callable[[Pipeline, int], object]


@dataclass(frozen=True, slots=True)
class _Lost:
    """A node's failure, as the result of its pipeline (gather_all would raise an exception)."""

    error: BackendError


class RedisNode:
    """One Redis server: a redis-py pool and client, a semaphore of its size, its bulk lane."""

    def __init__(self, url: str, config: RedisAdapterConfig, *, lane: bool) -> None:
        self.url = url
        self.pool: ConnectionPool = ConnectionPool.from_url(
            url,
            max_connections=config.max_connections,
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s,
            retry=Retry(NoBackoff(), retries=1, supported_errors=(RedisConnectionError,)),
        )
        self.client = Redis(connection_pool=self.pool)
        self.slots = asyncio.Semaphore(config.max_connections)
        target = target_from_url(url)
        self.lane: RespLane | None = None
        if lane and target is not None:
            self.lane = RespLane(target, max_connections=config.max_connections, timeout_s=config.timeout_s)
        self.describe = target.describe() if target is not None else url.rpartition("@")[2]

    async def run(self, name: str, entries: list[tuple[int, bool]], command: Command) -> list[Any]:
        """One non-transactional pipeline of `command(pipe, i)` for each (i, asking) entry (ASKING
        first where asked); per-command error replies come back as exceptions, a failure of the
        node as BackendError."""
        async with self.slots:
            try:
                async with self.client.pipeline(transaction=False) as pipe:
                    positions = []
                    for i, asking in entries:
                        if asking:
                            pipe.execute_command("ASKING")
                        command(pipe, i)
                        positions.append(len(pipe.command_stack) - 1)
                    replies = await pipe.execute(raise_on_error=False)
                    return [replies[p] for p in positions]
            except (RedisError, OSError) as exc:
                raise BackendError(f"redis {name} {self.describe}: {type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        if self.lane is not None:
            self.lane.close()  # closes sockets only: never blocks
        await self.client.aclose()
        await self.pool.aclose()


class RedisRouter:
    def __init__(self, config: RedisAdapterConfig, *, lanes: bool) -> None:
        self.config = config
        self._lanes = lanes
        self._seeds = seed_urls(config.url)
        self._map: SlotMap | None = None  # None: not (yet) in cluster mode
        self._nodes: dict[Node, RedisNode] = {}
        self._refresh: asyncio.Task[None] | None = None
        self._refreshed_at = 0.0
        self._started = False
        self._starting = asyncio.Lock()
        # The first seed: the only node of a single Redis, one of the cluster's otherwise.
        self.first = RedisNode(self._seeds[0], config, lane=lanes)

    @property
    def cluster(self) -> bool:
        return self._map is not None

    @property
    def slot_map(self) -> SlotMap | None:
        return self._map

    # --- start ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Decide the mode (config.cluster) and, in cluster mode, read the slot map. Called by
        every batch (at once once done): a Redis that does not answer when the adapter is added
        fails batches (BackendError), never the sidecar's start; the next batch asks again."""
        if self._started:
            return
        async with self._starting:
            if not self._started:
                await self._start()

    async def _start(self) -> None:
        if self.config.cluster is False:
            self._started = True
            return
        probes = [self.first, *(RedisNode(url, self.config, lane=False) for url in self._seeds[1:])]
        try:
            errors: list[str] = []
            for url, probe in zip(self._seeds, probes, strict=True):
                try:
                    await self._start_from(url, probe)
                    self._started = True
                    return
                except (RedisError, OSError, ValueError) as exc:
                    errors.append(f"{probe.describe}: {type(exc).__name__}: {exc}")
            raise BackendError(f"redis {self.config.name}: no seed node answered ({'; '.join(errors)})")
        finally:
            for probe in probes[1:]:
                await probe.close()

    async def _start_from(self, url: str, probe: RedisNode) -> None:
        name = self.config.name
        cluster = self.config.cluster is True or await self._is_cluster(probe)
        if not cluster and len(self._seeds) > 1:
            raise BackendError(f"redis {name}: {probe.describe} is not a cluster node")
        if not cluster:
            return
        if url_db(url) != 0:
            raise BackendError(
                f"redis {name}: {probe.describe} is a Redis Cluster node, which has database 0 only; "
                f"the url selects database {url_db(url)}"
            )
        self._map = await self._read_map(probe)
        target = target_from_url(self.first.url)
        if target is not None:
            self._nodes[Node(target.host, target.port)] = self.first

    @staticmethod
    async def _is_cluster(probe: RedisNode) -> bool:
        try:
            info = await probe.client.info("cluster")
        except ResponseError as exc:
            # "SELECT is not allowed in cluster mode" (a database other than 0) is a cluster; any
            # other refusal (INFO not allowed for this user) leaves cluster mode to the config.
            return "cluster mode" in str(exc)
        return bool(info.get("cluster_enabled"))

    async def _read_map(self, node: RedisNode) -> SlotMap:
        reply = await node.client.execute_command("CLUSTER SLOTS")  # type: ignore[no-untyped-call]
        target = target_from_url(node.url)
        return SlotMap.from_reply(reply, target.host if target is not None else "127.0.0.1")

    # --- routing -------------------------------------------------------------------------------

    def node_at(self, node: Node) -> RedisNode:
        found = self._nodes.get(node)
        if found is None:
            found = RedisNode(node_url(self._seeds[0], node), self.config, lane=self._lanes)
            self._nodes[node] = found
        return found

    def node_for(self, key: bytes) -> RedisNode | None:
        """The node that serves `key` (None: no node serves its slot)."""
        if self._map is None:
            return self.first
        owner = self._map.node_for(key)
        return None if owner is None else self.node_at(owner)

    def lane_for(self, key: bytes) -> RespLane | None:
        node = self.node_for(key)
        return None if node is None else node.lane

    def moved(self, redirect: Redirect) -> RedisNode:
        """A MOVED reply: its slot is served by redirect.node from now on (a refresh follows)."""
        if self._map is not None and not redirect.ask:
            self._map.move(redirect.slot, redirect.node)
        self.refresh_soon()
        return self.node_at(redirect.node)

    async def pipeline(self, keys: list[bytes], command: Command) -> list[Any]:
        """command(pipe, i) for every key, one pipeline per node, all nodes concurrently; the
        replies in key order. A redirected command is sent once more where it was sent to; a key
        whose node failed (or that no node serves) gets a BackendError object as its reply."""
        replies: list[Any] = [None] * len(keys)
        targets: dict[int, tuple[RedisNode | None, bool]] = {
            i: (self.node_for(k), False) for i, k in enumerate(keys)
        }
        for attempt in (0, 1):
            groups: dict[int, tuple[RedisNode, list[tuple[int, bool]]]] = {}
            for i, (node, asking) in targets.items():
                if node is None:
                    replies[i] = BackendError(
                        f"redis {self.config.name}: no node serves slot {SlotMap.slot(keys[i])}"
                    )
                    self.refresh_soon()
                    continue
                groups.setdefault(id(node), (node, []))[1].append((i, asking))
            results = await gather_all(
                self._run_or_error(node, entries, command) for node, entries in groups.values()
            )
            retry: dict[int, tuple[RedisNode | None, bool]] = {}
            for (_, entries), result in zip(groups.values(), results, strict=True):
                if isinstance(result, _Lost):
                    for i, _ in entries:
                        replies[i] = result.error
                    continue
                for (i, _), reply in zip(entries, result, strict=True):
                    if attempt == 0 and isinstance(reply, MovedError):
                        retry[i] = (
                            self.moved(Redirect(False, reply.slot_id, Node(reply.host, reply.port))),
                            False,
                        )
                    elif attempt == 0 and isinstance(reply, AskError):
                        retry[i] = (self.node_at(Node(reply.host, reply.port)), True)
                        self.refresh_soon()
                    else:
                        replies[i] = reply
            if not retry:
                break
            targets = retry
        return replies

    async def _run_or_error(
        self, node: RedisNode, entries: list[tuple[int, bool]], command: Command
    ) -> list[Any] | _Lost:
        try:
            return await node.run(self.config.name, entries, command)
        except BackendError as exc:
            if self._map is not None:
                self.refresh_soon()
            return _Lost(exc)

    # --- topology ------------------------------------------------------------------------------

    def refresh_soon(self) -> None:
        """Read the slot map again in the background (cluster mode; one refresh at a time)."""
        if self._map is None or (self._refresh is not None and not self._refresh.done()):
            return
        if time.monotonic() - self._refreshed_at < REFRESH_MIN_S:
            return
        self._refreshed_at = time.monotonic()
        self._refresh = asyncio.get_running_loop().create_task(self._refresh_map())

    async def refreshed(self) -> None:
        """Wait for the refresh in flight, if any (the map is the cluster's as of then)."""
        if self._refresh is not None:
            await asyncio.shield(self._refresh)

    async def _refresh_map(self) -> None:
        """CLUSTER SLOTS from the first node that answers within timeout_s (the seeds last)."""
        candidates = [self.node_at(n) for n in sorted(self._nodes)]
        probes = [RedisNode(url, self.config, lane=False) for url in self._seeds]
        try:
            for node in [*candidates, *probes]:
                try:
                    self._map = await asyncio.wait_for(self._read_map(node), self.config.timeout_s)
                    return
                except (RedisError, OSError, ValueError, TimeoutError):
                    continue
        finally:
            for probe in probes:
                await probe.close()

    async def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._refresh
        for node in {id(n): n for n in [self.first, *self._nodes.values()]}.values():
            await node.close()
