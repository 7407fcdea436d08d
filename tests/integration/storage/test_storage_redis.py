"""Against real Redis: the shared one at 127.0.0.1:6379 (a unique key prefix per test, keys deleted
afterwards) and private redis-server processes for stopping, restarting and out-of-memory."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis

from storage import codec
from storage.base import Status
from storage.codec import CodecOptions, EncodedBlob
from tests.integration.storage.redis_servers import MakeRedis, RedisServer
from tests.ports import free_port

pytestmark = pytest.mark.anyio

FP = b"layoutfp"
MiB = 1 << 20


def blob(key: str, size: int = 1000) -> EncodedBlob:
    return codec.encode(key, FP, bytes([7]) * size, CodecOptions())


async def test_store_contains_load_delete(make_redis: MakeRedis) -> None:
    adapter = make_redis()
    items = [(f"k{i}", blob(f"k{i}", 100 + i)) for i in range(10)]
    assert all(r.ok for r in await adapter.store(items))
    statuses = [r.status for r in await adapter.contains(["k3", "missing", "k9"])]
    assert statuses == [Status.OK, Status.MISS, Status.OK]
    loaded = await adapter.load(["k5", "missing"])
    assert [r.status for r in loaded] == [Status.OK, Status.MISS]
    assert loaded[0].data == items[5][1].to_bytes()
    out = bytearray(105)
    assert loaded[0].data is not None
    codec.decode_into(loaded[0].data, "k5", FP, out)
    assert [r.status for r in await adapter.delete(["k5", "k5"])] == [Status.OK, Status.MISS]
    usage = adapter.usage()
    assert usage.objects == 9
    assert usage.bytes_used == sum(b.nbytes for k, b in items if k != "k5")
    assert usage.capacity_bytes == 0  # unknown unless configured
    assert adapter.health().state == "ok"


async def test_keys_are_prefixed_and_expire_with_ttl(make_redis: MakeRedis, raw_redis: Redis) -> None:
    adapter = make_redis(ttl_s=100)
    await adapter.store([("k", blob("k"))])
    ttl = await raw_redis.ttl(adapter.redis_key("k"))
    assert 0 < ttl <= 100
    assert adapter.redis_key("k").startswith(adapter.config.key_prefix.encode())
    await raw_redis.unlink(adapter.redis_key("k"))  # as if it expired
    assert (await adapter.load(["k"]))[0].status is Status.MISS
    assert adapter.usage().objects == 0  # forgotten once seen missing


async def test_twenty_mib_value(make_redis: MakeRedis) -> None:
    adapter = make_redis(capacity_gb=1.0)
    big = codec.encode("big", FP, bytes(range(256)) * (20 * MiB // 256), CodecOptions())
    assert (await adapter.store([("big", big)]))[0].ok
    (result,) = await adapter.load(["big"])
    assert result.data is not None
    out = bytearray(20 * MiB)
    codec.decode_into(result.data, "big", FP, out)
    assert out == big.payload
    assert adapter.usage().capacity_bytes == 1 << 30


async def test_nothing_listening_is_errors_within_the_timeout(make_redis: MakeRedis) -> None:
    adapter = make_redis(url=f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    config = adapter.config
    for op in ("store", "contains", "load", "delete"):
        started = time.perf_counter()
        if op == "store":
            results: list[Any] = await adapter.store([("a", blob("a")), ("b", blob("b"))])
        else:
            results = await getattr(adapter, op)(["a", "b"])
        assert time.perf_counter() - started < config.timeout_s + 0.5
        assert [r.status for r in results] == [Status.ERROR, Status.ERROR]
    health = adapter.health()
    assert health.state == "down"
    assert health.errors_total == 8
    assert health.last_error is not None


async def test_a_server_that_never_answers_is_errors_within_the_timeout(make_redis: MakeRedis) -> None:
    with socket.socket() as silent:  # the kernel accepts connections; nobody ever replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        adapter = make_redis(url=f"redis://127.0.0.1:{port}/0", timeout_s=0.5)
        started = time.perf_counter()
        results = await adapter.load(["a", "b"])
        assert time.perf_counter() - started < 0.5 + 0.5
        assert [r.status for r in results] == [Status.ERROR, Status.ERROR]
        assert adapter.health().state == "down"
        await adapter.close()


async def test_works_again_when_redis_comes_back(
    redis_server: Callable[..., RedisServer], make_redis: MakeRedis
) -> None:
    server = redis_server()
    adapter = make_redis(url=server.url, timeout_s=1.0)
    assert (await adapter.store([("k", blob("k"))]))[0].ok
    server.stop()
    assert (await adapter.load(["k"]))[0].status is Status.ERROR
    assert adapter.health().state == "down"
    server.start()  # a fresh, empty server on the same port
    assert (await adapter.load(["k"]))[0].status is Status.MISS
    assert (await adapter.store([("k", blob("k"))]))[0].ok
    assert (await adapter.load(["k"]))[0].ok
    assert adapter.health().state == "degraded"  # recent errors, but working


async def test_out_of_memory_is_no_space(
    redis_server: Callable[..., RedisServer], make_redis: MakeRedis
) -> None:
    server = redis_server("--maxmemory", "8mb", "--maxmemory-policy", "noeviction")
    adapter = make_redis(url=server.url)
    statuses = [(await adapter.store([(f"k{i}", blob(f"k{i}", MiB))]))[0].status for i in range(12)]
    assert statuses[0] is Status.OK
    assert statuses[-1] is Status.NO_SPACE
    assert set(statuses) == {Status.OK, Status.NO_SPACE}
    assert adapter.stats.no_space == statuses.count(Status.NO_SPACE)


async def test_close_ends_operations_in_flight(make_redis: MakeRedis) -> None:
    with socket.socket() as silent:  # operations wait on a server that never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        adapter = make_redis(url=f"redis://127.0.0.1:{silent.getsockname()[1]}/0", timeout_s=60)
        answers: list[list[Status]] = []

        async def run(op: str) -> None:
            if op == "store":
                answers.append([r.status for r in await adapter.store([("a", blob("a", MiB))])])
            else:
                answers.append([r.status for r in await getattr(adapter, op)(["a", "b"])])

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                for op in ("store", "load", "contains", "delete"):
                    tg.start_soon(run, op)
                await anyio.wait_all_tasks_blocked()
                assert answers == []
                await adapter.close()
    assert sorted(answers) == [[Status.ERROR]] + [[Status.ERROR] * 2] * 3
    assert (await adapter.load(["a"]))[0].message == "adapter closed"


def tenant_of(key: str) -> str:
    return key.split(":", 1)[0]


class Books:
    """The owner's side of the accounting hook: bytes and objects per tenant, as reported."""

    def __init__(self) -> None:
        self.held: dict[str, list[int]] = {}
        self.evicted = 0

    def __call__(self, key: str, delta_bytes: int, delta_objects: int, evicted: bool) -> None:
        figures = self.held.setdefault(tenant_of(key), [0, 0])
        figures[0] += delta_bytes
        figures[1] += delta_objects
        self.evicted += evicted

    def of(self, tenant: str) -> tuple[int, int]:
        b, n = self.held.get(tenant, [0, 0])
        return b, n


async def redis_truth(raw: Redis, adapter: Any) -> dict[str, tuple[int, int]]:
    prefix = adapter.config.key_prefix
    truth: dict[str, tuple[int, int]] = {}
    async for name in raw.scan_iter(match=f"{prefix}*"):
        size = await raw.strlen(name)
        b, n = truth.get(tenant_of(name.decode()[len(prefix) :]), (0, 0))
        truth[tenant_of(name.decode()[len(prefix) :])] = (b + size, n + 1)
    return truth


async def test_every_change_is_reported_and_evict_salt_unlinks_the_tenants_oldest_writes(
    make_redis: MakeRedis, raw_redis: Redis
) -> None:
    # The sidecar-local ledger (scope "local"): its tenants come from the bound `tenant_of`; the fleet
    # ledger reads the tenant from real chunk keys (tests/integration/test_fleet_quota_process.py).
    # Blobs of 1 KiB and more take the bulk lane.
    adapter = make_redis(bulk_min_kib=1, scope="local")
    books = Books()
    adapter.bind_accounting(tenant_of, books)
    first = [(f"a:{i}", blob(f"a:{i}", 600 * (i + 1))) for i in range(4)]
    assert all(r.ok for r in await adapter.store([*first, ("b:0", blob("b:0", 3000))]))
    assert all(r.ok for r in await adapter.store([("a:0", blob("a:0", 5000))]))  # again, larger: newest
    assert books.of("a") == (sum(b.nbytes for _, b in first[1:]) + blob("a:0", 5000).nbytes, 4)
    assert await redis_truth(raw_redis, adapter) == {"a": books.of("a"), "b": books.of("b")}

    # Oldest written first: a:1 and a:2 cover 1500 bytes; b is never touched; loads change nothing.
    await adapter.load(["a:1"])
    freed = await adapter.evict_salt("a", 1500)
    assert freed == first[1][1].nbytes + first[2][1].nbytes
    assert [r.status for r in await adapter.contains(["a:1", "a:2", "a:3", "a:0", "b:0"])] == [
        Status.MISS, Status.MISS, Status.OK, Status.OK, Status.OK,
    ]  # fmt: skip
    assert books.evicted == 2 and adapter.stats.evictions == 2
    assert await redis_truth(raw_redis, adapter) == {"a": books.of("a"), "b": books.of("b")}

    await raw_redis.unlink(adapter.redis_key("a:3"))  # gone behind its back: counted until seen
    assert books.of("a")[1] == 2
    assert (await adapter.contains(["a:3"]))[0].status is Status.MISS
    assert books.of("a") == (blob("a:0", 5000).nbytes, 1)
    assert await adapter.evict_salt("c", 10) == 0
    await adapter.delete(["b:0"])
    assert books.of("b") == (0, 0)
    adapter.unbind_accounting()
    await adapter.store([("b:1", blob("b:1"))])
    assert books.of("b") == (0, 0)  # no longer reported
