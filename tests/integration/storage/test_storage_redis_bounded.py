"""A huge value planted under a chunk key costs the Redis adapter no memory: load_into never
receives more than header + chunk + 1 bytes of it, refuses it and counts it (a miss; the tier is
shared, so it is left where it is). Checked on
each read path: redis-py (small chunks), the lane's single GETRANGE, the lane's window of pieces."""

from __future__ import annotations

import tracemalloc

import pytest
from redis.asyncio import Redis

from storage.base import Status
from storage.redis.adapter import RedisAdapter
from tests.integration.storage.redis_servers import MakeRedis

pytestmark = pytest.mark.anyio

KiB = 1 << 10
MiB = 1 << 20
CHUNK = 4 * KiB
PLANTED = 64 * MiB


def adapter_for(make_redis: MakeRedis, path: str) -> RedisAdapter:
    if path == "redis-py":
        return make_redis(bulk_min_kib=None)
    adapter = make_redis(bulk_min_kib=1)  # a 4 KiB chunk takes the lane
    assert adapter.lane is not None
    adapter.lane.whole_get_max = 1 << 40 if path == "lane-get" else 0
    return adapter


@pytest.mark.parametrize("path", ["redis-py", "lane-get", "lane-window"])
async def test_a_huge_value_under_a_chunk_key_is_refused_without_reading_it(
    make_redis: MakeRedis, raw_redis: Redis, path: str
) -> None:
    adapter = adapter_for(make_redis, path)
    await raw_redis.set(adapter.redis_key("chunk"), b"\x5a" * PLANTED)
    out = bytearray(CHUNK)
    tracemalloc.start()  # every Python allocation, in any thread (the lane's included)
    try:
        (result,) = await adapter.load_into(["chunk"], [memoryview(out)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * MiB, f"{path}: {peak / MiB:.1f} MiB allocated to refuse a {PLANTED // MiB} MiB value"
    assert result.status is Status.MISS
    assert adapter.stats.integrity_failures == 1
    assert await raw_redis.exists(adapter.redis_key("chunk")) == 1  # a shared tier: never deleted
