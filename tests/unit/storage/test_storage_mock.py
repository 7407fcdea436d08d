from __future__ import annotations

import asyncio
import time

import anyio
import pytest

from app.errors import IntegrityError
from storage import codec
from storage.base import MISS, L2Adapter, Status
from storage.codec import CodecOptions, EncodedBlob
from storage.mock.adapter import MockAdapter
from storage.mock.config import MockAdapterConfig

pytestmark = pytest.mark.anyio

FP = b"layoutfp"


def blob(key: str, size: int = 1000) -> EncodedBlob:
    return codec.encode(key, FP, bytes([len(key) % 256]) * size, CodecOptions())


def mock(**fields: object) -> MockAdapter:
    return MockAdapter(MockAdapterConfig.model_validate(fields))


async def test_store_contains_load_delete_answer_per_key_in_order() -> None:
    adapter: L2Adapter = mock()
    a, b = blob("a"), blob("bb")
    assert [r.status for r in await adapter.store([("a", a), ("bb", b)])] == [Status.OK, Status.OK]
    assert [r.status for r in await adapter.contains(["bb", "zz", "a"])] == [
        Status.OK,
        Status.MISS,
        Status.OK,
    ]
    loaded = await adapter.load(["zz", "a"])
    assert [r.status for r in loaded] == [Status.MISS, Status.OK]
    assert loaded[1].data == a.to_bytes()
    assert [r.status for r in await adapter.delete(["a", "a"])] == [Status.OK, Status.MISS]
    assert await adapter.load([]) == []
    usage = adapter.usage()
    assert (usage.objects, usage.bytes_used) == (1, b.nbytes)
    assert adapter.stats.stores == 2
    assert adapter.stats.loads == 1
    assert adapter.stats.misses == 1
    assert adapter.latency.ops["load"].count == 1  # empty batches are not timed
    assert adapter.health().state == "ok"
    await adapter.close()


async def test_capacity_evicts_least_recently_used_first() -> None:
    adapter = mock()
    one = blob("k0").nbytes
    await adapter.set_capacity(3 * one)
    for key in ("k0", "k1", "k2"):
        await adapter.store([(key, blob(key))])
    await adapter.load(["k0"])  # k0 becomes the most recently used
    await adapter.store([("k3", blob("k3"))])
    assert adapter.keys_lru() == ["k2", "k0", "k3"]
    assert adapter.stats.evictions == 1
    await adapter.set_capacity(2 * one)
    assert adapter.keys_lru() == ["k0", "k3"]
    too_big = codec.encode("big", FP, bytes(3 * one), CodecOptions())
    assert (await adapter.store([("big", too_big)]))[0].status is Status.NO_SPACE
    assert adapter.usage() == type(adapter.usage())(2 * one, 2, 2 * one)
    await adapter.close()


async def test_error_rate_is_deterministic_for_a_seed() -> None:
    keys = [f"k{i}" for i in range(64)]

    async def pattern(seed: int) -> list[Status]:
        adapter = mock(error_rate=0.5, seed=seed)
        results = await adapter.store([(k, blob(k, 10)) for k in keys])
        await adapter.close()
        return [r.status for r in results]

    first = await pattern(7)
    assert first == await pattern(7)
    assert {Status.OK, Status.ERROR} == set(first)


async def test_errors_show_in_health_and_stats() -> None:
    adapter = mock(error_rate=1.0)
    results = await adapter.load(["a", "b"])
    assert [r.status for r in results] == [Status.ERROR, Status.ERROR]
    assert results[0].message == "injected fault"
    health = adapter.health()
    assert health.state == "degraded"
    assert health.errors_total == 2
    assert adapter.stats.errors == 2
    await adapter.close()
    assert adapter.health().state == "down"


async def test_corrupt_loads_are_caught_by_the_codec() -> None:
    adapter = mock(corrupt_rate=1.0)
    original = blob("a")
    await adapter.store([("a", original)])
    for _ in range(20):
        (result,) = await adapter.load(["a"])
        assert result.data is not None
        assert result.data != original.to_bytes()
        with pytest.raises(IntegrityError):
            codec.decode_into(result.data, "a", FP, bytearray(1000))
    await adapter.close()


async def test_hanging_operations_end_with_errors_when_closed() -> None:
    adapter = mock(hang=True)
    results: dict[str, list[Status]] = {}

    async def run(op: str) -> None:
        if op == "store":
            results[op] = [r.status for r in await adapter.store([("a", blob("a")), ("b", blob("b"))])]
        elif op == "load":
            results[op] = [r.status for r in await adapter.load(["a", "b", "c"])]
        else:
            results[op] = [r.status for r in await adapter.contains(["a"])]

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for op in ("store", "load", "contains"):
                tg.start_soon(run, op)
            await anyio.wait_all_tasks_blocked()
            assert results == {}  # all three are stuck
            await adapter.close()
    assert results == {
        "store": [Status.ERROR] * 2,
        "load": [Status.ERROR] * 3,
        "contains": [Status.ERROR],
    }
    assert [r.message for r in await adapter.delete(["a"])] == ["adapter closed"]


async def test_a_cancelled_caller_is_cancelled_not_answered() -> None:
    adapter = mock(hang=True)
    task = asyncio.create_task(adapter.load(["a"]))
    await anyio.wait_all_tasks_blocked()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await adapter.close()


async def test_latency_and_bandwidth_are_simulated() -> None:
    adapter = mock(latency_ms=30.0, bandwidth_gbps=0.001)  # 1 MB/s
    started = time.perf_counter()
    await adapter.store([("a", blob("a", 20_000))])  # 20 KB -> 20 ms, plus 30 ms
    assert time.perf_counter() - started >= 0.05
    await adapter.close()


# --- load_into ----------------------------------------------------------------------------------


async def test_load_into_places_raw_payloads_and_returns_other_blobs_whole() -> None:
    adapter = mock()
    raw = codec.encode("raw", FP, bytes(range(256)) * 8, CodecOptions())
    packed = codec.encode("lz4", FP, bytes(4096), CodecOptions(lz4=True))
    small = codec.encode("small", FP, bytes(100), CodecOptions())
    await adapter.store([("raw", raw), ("lz4", packed), ("small", small)])
    outs = [bytearray(2048), bytearray(4096), bytearray(10), bytearray(200)]
    results = await adapter.load_into(["raw", "lz4", "missing", "small"], [memoryview(o) for o in outs])
    assert [r.status for r in results] == [Status.OK, Status.OK, Status.MISS, Status.OK]
    assert [r.in_place for r in results] == [True, False, False, False]
    assert results[0].data == raw.header
    assert outs[0] == raw.payload
    codec.verify_in_place(results[0].data, "raw", FP, outs[0])
    assert results[1].data == packed.to_bytes()  # the caller decodes it
    assert results[3].data == small.to_bytes()  # shorter than this out: whole, decode_into says why
    assert adapter.stats.loads == 3
    assert adapter.stats.load_bytes == raw.nbytes + packed.nbytes + small.nbytes  # in place: payload too
    assert adapter.stats.misses == 1
    await adapter.close()


async def test_load_into_refuses_a_value_longer_than_any_blob_of_the_chunk_and_deletes_it() -> None:
    adapter = mock()
    raw = codec.encode("raw", FP, bytes(range(256)) * 8, CodecOptions())
    await adapter.store([("raw", raw)])
    out = bytearray(2047)  # one byte short of this blob: no blob for this out is that long
    (result,) = await adapter.load_into(["raw"], [memoryview(out)])
    assert result.status is Status.MISS
    assert adapter.stats.integrity_failures == 1
    assert await adapter.contains(["raw"]) == [MISS]  # deleted
    await adapter.close()


async def test_load_into_corruption_is_caught_by_verify_in_place_or_decode_into() -> None:
    adapter = mock(corrupt_rate=1.0, seed=3)
    original = codec.encode("a", FP, bytes(range(256)) * 4, CodecOptions())
    await adapter.store([("a", original)])
    for _ in range(40):
        out = bytearray(1024)
        (result,) = await adapter.load_into(["a"], [memoryview(out)])
        assert result.data is not None
        check = codec.verify_in_place if result.in_place else codec.decode_into
        with pytest.raises(IntegrityError):
            check(result.data, "a", FP, out)
    await adapter.close()


async def test_load_into_needs_one_writable_out_per_key() -> None:
    adapter = mock()
    with pytest.raises(ValueError, match="2 keys and 1 outputs"):
        await adapter.load_into(["a", "b"], [memoryview(bytearray(1))])
    with pytest.raises(ValueError, match="writable"):
        await adapter.load_into(["a"], [memoryview(b"read-only")])
    await adapter.close()


async def test_evict_salt_takes_the_tenants_least_recently_used_and_every_change_is_reported() -> None:
    changes: list[tuple[str, int, int, bool]] = []
    adapter = mock()
    await adapter.store([("a:0", blob("a:0"))])  # held before the hook is bound: reported at binding
    adapter.bind_accounting(lambda key: key.split(":")[0], lambda *c: changes.append(c))
    one = blob("a:0").nbytes
    assert changes == [("a:0", one, 1, False)]
    await adapter.store([(k, blob(k)) for k in ("b:0", "a:1", "a:2")])
    await adapter.load(["a:0"])  # a's order: a:1, a:2, a:0
    await adapter.store([("a:2", blob("a:2", 1500))])  # again: a:2 is now a's newest
    assert changes[-1] == ("a:2", 500, 0, False)
    assert await adapter.evict_salt("a", one + 1) == 2 * one  # a:1, then a:0
    assert adapter.keys_lru() == ["b:0", "a:2"]
    assert changes[-2:] == [("a:1", -one, -1, True), ("a:0", -one, -1, True)]
    assert await adapter.evict_salt("nobody", 100) == 0
    assert adapter.held_per_salt() == {"a": (one + 500, 1), "b": (one, 1)}
    assert adapter.stats.evictions == 2
    await adapter.close()  # drops every blob, reported
    assert sum(c[1] for c in changes) == 0 and sum(c[2] for c in changes) == 0
