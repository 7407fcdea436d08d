"""Against real Redis: the shared one at 127.0.0.1:6379 (a unique key prefix per test, keys deleted
afterwards) and private redis-server processes for stopping, restarting and out-of-memory."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis

from app.settings import RedisAdapterConfig
from storage import codec
from storage.base import Status
from storage.codec import CodecOptions, EncodedBlob
from storage.redis_adapter import RedisAdapter

pytestmark = pytest.mark.anyio

SHARED_URL = "redis://127.0.0.1:6379/0"
FP = b"layoutfp"
MiB = 1 << 20

MakeRedis = Callable[..., RedisAdapter]


def blob(key: str, size: int = 1000) -> EncodedBlob:
    return codec.encode(key, FP, bytes([7]) * size, CodecOptions())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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
        executor = ThreadPoolExecutor(2, thread_name_prefix="test-redis-copy")
        adapter = RedisAdapter(config, executor, owns_executor=True)
        made.append(adapter)
        return adapter

    yield make
    for adapter in made:
        await adapter.close()
    async for key in raw_redis.scan_iter(match=f"{prefix}*"):
        await raw_redis.unlink(key)


class RedisServer:
    """A private redis-server on a free port, stopped and started by the test."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.args = args
        self.proc: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", *self.args],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # the server says when it accepts connections
            if "Ready to accept connections" in line:
                return
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            assert self.proc.stdout is not None
            self.proc.stdout.close()
            self.proc = None


@pytest.fixture
def redis_server() -> Iterator[Callable[..., RedisServer]]:
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
