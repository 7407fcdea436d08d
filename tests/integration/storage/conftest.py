from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from storage.slab.adapter import SlabAdapter
from storage.slab.config import SlabAdapterConfig
from tests.integration.redis_keys import REDIS_URL
from tests.integration.storage.redis_servers import MakeRedis, RedisServer, redis_adapters
from tests.integration.storage.slab_helpers import SLOT, KiB, MakeSlab
from tests.integration.tools import need_tool


@pytest.fixture
async def raw_redis() -> AsyncIterator[Redis]:
    client = Redis.from_url(REDIS_URL)
    yield client
    await client.aclose()


@pytest.fixture
async def make_redis(redis_prefix: str) -> AsyncIterator[MakeRedis]:
    """Adapters on the shared Redis (closed at teardown), keys under the test's own prefix (deleted
    at teardown: `redis_prefix`)."""
    async with redis_adapters(REDIS_URL, redis_prefix) as make:
        yield make


@pytest.fixture
def redis_server() -> Iterator[Callable[..., RedisServer]]:
    """Private redis-servers (arguments appended to the command line), stopped at teardown."""
    need_tool("redis-server", "redis-server")
    servers: list[RedisServer] = []

    def make(*args: str) -> RedisServer:
        server = RedisServer(*args)
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
async def make_slab(tmp_path: Path) -> AsyncIterator[MakeSlab]:
    """Slab adapters on real files under tmp_path (settings overridable), closed at teardown."""
    made: list[SlabAdapter] = []

    def make(clock: Callable[[], float] = time.monotonic, **fields: Any) -> SlabAdapter:
        fields = {"paths": [tmp_path / "slab0"], "size_bytes": 4 * KiB + 16 * SLOT, "slot_bytes": SLOT,
                  "fsync": "never", "io_threads": 2, **fields}  # fmt: skip
        config = SlabAdapterConfig.model_validate(fields)
        executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="test-slab-io")
        adapter = SlabAdapter(
            config,
            tmp_path / "default.slab",
            tmp_path / "slab.index",
            executor,
            owns_executor=True,
            clock=clock,
        )
        made.append(adapter)
        return adapter

    yield make
    for adapter in made:
        await adapter.close()
