from __future__ import annotations

import shutil
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from redis.asyncio import Redis

from storage.config import RedisAdapterConfig
from storage.redis_adapter import RedisAdapter
from tests.integration.storage.redis_servers import MakeRedis, RedisServer

SHARED_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def raw_redis() -> AsyncIterator[Redis]:
    client = Redis.from_url(SHARED_URL)
    yield client
    await client.aclose()


@pytest.fixture
async def make_redis(raw_redis: Redis) -> AsyncIterator[MakeRedis]:
    """Adapters (closed at teardown) with a prefix unique to this test; their keys in the shared
    Redis are deleted at teardown."""
    prefix = f"kvdepot-test:{uuid.uuid4().hex}:"
    made: list[RedisAdapter] = []

    def make(url: str = SHARED_URL, **fields: Any) -> RedisAdapter:
        config = RedisAdapterConfig.model_validate({"url": url, "key_prefix": prefix, **fields})
        executor = ThreadPoolExecutor(4, thread_name_prefix="test-redis-io")
        adapter = RedisAdapter(config, executor, owns_executor=True)
        made.append(adapter)
        return adapter

    yield make
    for adapter in made:
        await adapter.close()
    async for key in raw_redis.scan_iter(match=f"{prefix}*"):
        await raw_redis.unlink(key)


@pytest.fixture
def redis_server() -> Iterator[Callable[..., RedisServer]]:
    """Private redis-servers (arguments appended to the command line), stopped at teardown."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    servers: list[RedisServer] = []

    def make(*args: str) -> RedisServer:
        server = RedisServer(*args)
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        server.stop()
