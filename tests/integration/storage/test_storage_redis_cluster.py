"""Against the real 3-node Redis Cluster on 127.0.0.1:7101-7103 (tests/redis_cluster.sh): the slot
map on both paths (redis-py pipelines per node, the bulk lane per node), MOVED after a slot was
resharded, ASK while it migrates, seed lists, database 0 only, and a frozen node costing only the
keys of its slots. Each test uses a key prefix of its own; slots a test moves are moved back."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import anyio
import pydantic
import pytest
from redis.crc import key_slot

from storage import codec
from storage.base import Status
from storage.codec import CodecOptions, EncodedBlob
from storage.redis.adapter import RedisAdapter
from storage.redis.cluster import Node
from storage.redis.config import RedisAdapterConfig
from tests.integration import cluster_nodes as nodes
from tests.integration.storage.redis_servers import MakeRedis, redis_adapters
from tests.ports import free_port

pytestmark = pytest.mark.anyio

FP = b"layoutfp"
MiB = 1 << 20
SMALL = 1000  # through redis-py pipelines
LARGE = MiB  # through the bulk lanes (bulk_min_kib 256)


def blob(key: str, size: int) -> EncodedBlob:
    return codec.encode(key, FP, random.Random(key).randbytes(size), CodecOptions())


@pytest.fixture
async def make_cluster(redis_cluster: str, redis_prefix: str) -> AsyncIterator[MakeRedis]:
    """Adapters on the cluster (closed at teardown), keys under the test's own prefix (deleted from
    every node at teardown: `redis_prefix`)."""
    async with redis_adapters(redis_cluster, redis_prefix) as make:
        yield make


def keys_on(adapter: RedisAdapter, port: int, count: int, tag: str = "k") -> list[str]:
    """`count` keys whose slots the node on `port` serves."""
    found = []
    i = 0
    while len(found) < count:
        key = f"{tag}{i}"
        if nodes.owner(key_slot(adapter.redis_key(key))) == port:
            found.append(key)
        i += 1
    return found


async def round_trip(adapter: RedisAdapter, keys: list[str], size: int) -> list[Status]:
    """load_into of `keys` (stored with blob(key, size)): the statuses, and every hit checked."""
    outs = [bytearray(size) for _ in keys]
    results = await adapter.load_into(keys, [memoryview(o) for o in outs])
    for key, out, result in zip(keys, outs, results, strict=True):
        if result.ok:
            assert result.data is not None
            if result.in_place:
                codec.verify_in_place(result.data, key, FP, out)
            else:
                codec.decode_into(result.data, key, FP, out)
            assert bytes(out) == random.Random(key).randbytes(size)
    return [r.status for r in results]


@pytest.mark.parametrize("size", [SMALL, LARGE])
async def test_keys_are_stored_on_the_node_that_serves_their_slot(make_cluster: MakeRedis, size: int) -> None:
    adapter = make_cluster()
    keys = [f"k{i}" for i in range(24)]
    assert all(r.ok for r in await adapter.store([(k, blob(k, size)) for k in keys]))
    assert adapter.router.cluster
    ports = {nodes.owner(key_slot(adapter.redis_key(k))) for k in keys}
    assert ports == set(nodes.PORTS)  # the batch really spans the three nodes
    for key in keys:
        with nodes.client(nodes.owner(key_slot(adapter.redis_key(key)))) as c:
            assert c.get(adapter.redis_key(key)) == blob(key, size).to_bytes()
    assert await round_trip(adapter, keys, size) == [Status.OK] * len(keys)
    assert [r.status for r in await adapter.contains(keys)] == [Status.OK] * len(keys)
    assert [r.status for r in await adapter.delete(keys)] == [Status.OK] * len(keys)
    assert await round_trip(adapter, keys, size) == [Status.MISS] * len(keys)
    assert adapter.health().state == "ok"


@pytest.mark.parametrize("size", [SMALL, LARGE])
async def test_a_resharded_slot_is_followed_after_moved(make_cluster: MakeRedis, size: int) -> None:
    adapter = make_cluster()
    (key,) = keys_on(adapter, 7101, 1)
    slot = key_slot(adapter.redis_key(key))
    assert (await adapter.store([(key, blob(key, size))]))[0].ok  # the map says 7101
    with nodes.slot_moved_back(slot):
        nodes.move_slot(slot, 7101, 7102)
        assert await round_trip(adapter, [key], size) == [Status.OK]  # MOVED, then 7102
        slot_map = adapter.router.slot_map
        assert slot_map is not None
        assert slot_map.owner(slot) is not None and slot_map.owner(slot).port == 7102  # type: ignore[union-attr]
        other = f"{key}-again"
        assert (await adapter.store([(other, blob(other, size))]))[0].ok
        assert await round_trip(adapter, [key], size) == [Status.OK]
    assert adapter.health().state == "ok"


@pytest.mark.parametrize("size", [SMALL, LARGE])
async def test_ask_during_a_migration_is_followed(make_cluster: MakeRedis, size: int) -> None:
    adapter = make_cluster()
    moved, staying = keys_on(adapter, 7101, 2)
    fresh = "{" + moved + "}new"  # same slot as `moved` (hash tag), not stored yet
    slots = {key_slot(adapter.redis_key(k)) for k in (moved, staying)}
    assert all(r.ok for r in await adapter.store([(k, blob(k, size)) for k in (moved, staying)]))
    slot = key_slot(adapter.redis_key(moved))
    with nodes.slot_moved_back(slot):
        nodes.begin_migration(slot, 7101, 7103)
        nodes.migrate_keys(slot, 7101, 7103, [adapter.redis_key(moved)])
        # 7101 still owns the slot but no longer has `moved`: it answers ASK 7103.
        assert nodes.count_keys(7103, slot) == 1
        assert await round_trip(adapter, [moved], size) == [Status.OK]
        if key_slot(adapter.redis_key(staying)) == slot:
            assert await round_trip(adapter, [staying], size) == [Status.OK]
        # A new key of a migrating slot goes to the importing node (ASK on SET).
        if key_slot(adapter.redis_key(fresh)) == slot:
            assert (await adapter.store([(fresh, blob(fresh, size))]))[0].ok
            assert nodes.count_keys(7103, slot) == 2
            assert await round_trip(adapter, [fresh], size) == [Status.OK]
    assert len(slots) >= 1
    assert await round_trip(adapter, [moved, staying], size) == [Status.OK, Status.OK]


async def test_seed_list_skips_a_seed_that_does_not_answer(make_cluster: MakeRedis) -> None:
    dead = free_port()
    adapter = make_cluster(url=f"redis://127.0.0.1:{dead},127.0.0.1:7102/0")
    keys = [f"s{i}" for i in range(12)]
    assert all(
        r.ok
        for r in await adapter.store([(k, blob(k, LARGE if i % 2 else SMALL)) for i, k in enumerate(keys)])
    )
    assert adapter.router.cluster
    statuses = [r.status for r in await adapter.contains(keys)]
    assert statuses == [Status.OK] * len(keys)


async def test_cluster_mode_needs_database_0(make_cluster: MakeRedis) -> None:
    with pytest.raises(pydantic.ValidationError, match="database 0 only"):
        RedisAdapterConfig(url="redis://127.0.0.1:7101/2", cluster=True)
    with pytest.raises(pydantic.ValidationError, match="need cluster mode"):
        RedisAdapterConfig(url="redis://127.0.0.1:7101,127.0.0.1:7102/0", cluster=False)
    adapter = make_cluster(url="redis://127.0.0.1:7101/2")  # cluster: auto finds out
    (result,) = await adapter.store([("k", blob("k", SMALL))])
    assert result.status is Status.ERROR
    assert "database 0 only" in (adapter.health().last_error or "")
    assert adapter.health().state == "down"


async def test_a_frozen_node_costs_only_its_slots_within_the_timeout(make_cluster: MakeRedis) -> None:
    adapter = make_cluster(timeout_s=0.5)
    by_port = {port: keys_on(adapter, port, 4, tag=f"f{port}-") for port in nodes.PORTS}
    for port, keys in by_port.items():
        items = [(k, blob(k, LARGE if i % 2 else SMALL)) for i, k in enumerate(keys)]
        assert all(r.ok for r in await adapter.store(items)), port
    everything = [k for keys in by_port.values() for k in keys]
    sizes = {k: LARGE if i % 2 else SMALL for keys in by_port.values() for i, k in enumerate(keys)}

    async def load_all() -> dict[str, Status]:
        statuses = {}
        for size in (SMALL, LARGE):
            keys = [k for k in everything if sizes[k] == size]
            statuses.update(zip(keys, await round_trip(adapter, keys, size), strict=True))
        return statuses

    with nodes.frozen(7102):
        with anyio.fail_after(20):  # a bound against a hang, far above 2 x timeout_s
            statuses = await load_all()
            stored = await adapter.store([(k, blob(k, SMALL)) for k in by_port[7102][:1] + by_port[7103][:1]])
    for port, keys in by_port.items():
        expected = Status.ERROR if port == 7102 else Status.OK
        assert [statuses[k] for k in keys] == [expected] * len(keys), port
    assert [r.status for r in stored] == [Status.ERROR, Status.OK]
    assert adapter.health().state != "down"  # the other nodes answered: degraded, not down
    # Thawed: the node's keys are hits again at once (fresh connections; nothing was marked dead).
    with anyio.fail_after(20):
        assert set((await load_all()).values()) == {Status.OK}


async def test_no_seed_answering_fails_batches_not_the_start(make_cluster: MakeRedis) -> None:
    """Added while no seed answers (the sidecar starting before Redis): the adapter starts and its
    batches are errors (each asks the seeds again); with one seed answering it works."""
    dead = free_port()
    down = make_cluster(url=f"redis://127.0.0.1:{dead},127.0.0.1:{free_port()}/0")
    await down.start()
    (result,) = await down.store([("k", blob("k", SMALL))])
    assert result.status is Status.ERROR
    assert "no seed node answered" in (down.health().last_error or "")
    up = make_cluster(url=f"redis://127.0.0.1:{dead},127.0.0.1:7103/0")
    await up.start()
    assert (await up.store([("k", blob("k", SMALL))]))[0].ok


async def test_a_moved_reply_refreshes_the_whole_map(make_cluster: MakeRedis) -> None:
    """Two slots resharded at once: a MOVED for one makes the adapter read the whole map again,
    so the other is routed right before any command for it was redirected."""
    adapter = make_cluster()
    first, *others = keys_on(adapter, 7101, 8, tag="m")
    s1 = key_slot(adapter.redis_key(first))
    second = next(k for k in others if key_slot(adapter.redis_key(k)) != s1)  # a slot of its own
    s2 = key_slot(adapter.redis_key(second))
    assert all(r.ok for r in await adapter.store([(k, blob(k, SMALL)) for k in (first, second)]))
    with nodes.slot_moved_back(s1), nodes.slot_moved_back(s2):
        nodes.move_slot(s1, 7101, 7103)
        nodes.move_slot(s2, 7101, 7103)
        assert await round_trip(adapter, [first], SMALL) == [Status.OK]  # MOVED
        await adapter.router.refreshed()
        slot_map = adapter.router.slot_map
        assert slot_map is not None
        assert slot_map.owner(s2) == Node("127.0.0.1", 7103)
        assert await round_trip(adapter, [second], SMALL) == [Status.OK]


async def test_a_killed_node_costs_only_its_slots_and_is_used_again_once_back(
    make_cluster: MakeRedis,
) -> None:
    adapter = make_cluster(timeout_s=0.5)
    by_port = {port: keys_on(adapter, port, 2, tag=f"d{port}-") for port in nodes.PORTS}
    everything = [k for keys in by_port.values() for k in keys]
    assert all(r.ok for r in await adapter.store([(k, blob(k, LARGE)) for k in everything]))
    with nodes.killed(7103):
        with anyio.fail_after(20):
            statuses = dict(zip(everything, await round_trip(adapter, everything, LARGE), strict=True))
        for port, keys in by_port.items():
            assert [statuses[k] for k in keys] == [Status.ERROR if port == 7103 else Status.OK] * 2, port
    # Back, empty (nothing persisted): its keys are misses, and it takes writes again.
    assert await round_trip(adapter, by_port[7103], LARGE) == [Status.MISS] * 2
    assert all(r.ok for r in await adapter.store([(k, blob(k, LARGE)) for k in by_port[7103]]))
    assert await round_trip(adapter, everything, LARGE) == [Status.OK] * len(everything)
