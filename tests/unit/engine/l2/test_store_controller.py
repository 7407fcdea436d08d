"""The write-behind store controller through the engine as app/main wires it (real L1 cache and
arena, in-memory L2 adapters): drop-oldest when its queue is full, shedding of queued chunks when
L1 or a tenant's L1 quota has no other room, and the `first` and `seen_twice` store policies.

The controller's workers are not running unless a test starts them, so what is queued stays
queued until the test lets it be written."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from engine.facade import CacheEngine
from engine.keys import ObjectKey
from engine.l1.lifecycle import L1Object
from engine.results import SlotStatus, StoreSlot
from engine.tenants.quota import Quota
from storage.mock.adapter import MockAdapter
from storage.mock.config import MockAdapterConfig
from tests.factories import l2_engine, seq, small_layout

pytestmark = pytest.mark.anyio

CHUNK = 16  # tokens per chunk; a chunk of small_layout() is 4 KiB
PAGE = 4096
R = SlotStatus.RESERVED


def store(eng: CacheEngine, eid: int, toks: bytes, salt: str = "") -> list[StoreSlot]:
    slots = eng.store(eid, "w", toks, salt)
    assert all(eng.commit(eid, [s.oid for s in slots if s.status is R]))
    return slots


def objects(eng: CacheEngine, eid: int, toks: bytes, salt: str = "") -> list[L1Object | None]:
    ns = eng.registration(eid).namespace
    return [eng.cache.peek(ObjectKey(ns, salt, h)) for h in eng.hasher.chunk_hashes(toks)]


def names(eng: CacheEngine, eid: int, toks: bytes, salt: str = "") -> list[str]:
    ns = eng.registration(eid).namespace
    return [ObjectKey(ns, salt, h).serialize() for h in eng.hasher.chunk_hashes(toks)]


def held(eng: CacheEngine, name: str) -> set[str]:
    assert eng.l2 is not None
    adapter = eng.l2.tiers.get(name).adapter
    assert isinstance(adapter, MockAdapter)
    return set(adapter.keys_lru())


@asynccontextmanager
async def writing(eng: CacheEngine) -> AsyncIterator[None]:
    """Run one write-behind worker, and wait until what is queued was written."""
    assert eng.l2 is not None
    worker = asyncio.get_running_loop().create_task(eng.l2.store.run_worker())
    try:
        yield
        assert await eng.l2.store.wait_idle(10)
    finally:
        worker.cancel()
        await asyncio.wait([worker])


# --- drop-oldest -------------------------------------------------------------------------------


async def test_a_full_queue_drops_its_oldest_chunk_and_releases_it() -> None:
    async with l2_engine(1 << 20, [MockAdapterConfig(name="m1")], store_workers=0) as (eng, _):
        assert eng.l2 is not None
        eng.l2.store.queue.max_depth = 2
        eid = eng.register("m", small_layout()).engine_id
        toks = seq(3, 0)
        store(eng, eid, toks)
        first, second, third = objects(eng, eid, toks)
        assert first is not None and second is not None and third is not None
        assert eng.l2.store.counters.dropped == 1
        assert eng.l2.store.depth == 2
        # The dropped chunk is no longer held for write-behind (it may be evicted); the queued are.
        assert first.evictable
        assert not second.evictable and not third.evictable
        async with writing(eng):
            pass
        assert held(eng, "m1") == set(names(eng, eid, toks)[1:])
        assert second.evictable and third.evictable


# --- shedding ----------------------------------------------------------------------------------


async def test_a_full_l1_lets_go_of_the_oldest_queued_chunk_to_make_room() -> None:
    async with l2_engine(4 * PAGE, [MockAdapterConfig(name="m1")], store_workers=0) as (eng, _):
        assert eng.l2 is not None
        eid = eng.register("m", small_layout()).engine_id
        old = seq(4, 0)
        store(eng, eid, old)  # L1 is full, every chunk held by the queue
        new = seq(1, 1)
        assert [s.status for s in store(eng, eid, new)] == [R]
        assert eng.l2.store.counters.dropped == 1
        left = objects(eng, eid, old)
        assert left[0] is None  # let go, then evicted
        assert all(o is not None and not o.evictable for o in left[1:])
        async with writing(eng):
            pass
        assert held(eng, "m1") == set(names(eng, eid, old)[1:] + names(eng, eid, new))


async def test_shedding_counts_only_bytes_it_unpinned() -> None:
    """The oldest queued chunk is also read-locked by a request: letting it go frees nothing, so
    the next one is let go too."""
    async with l2_engine(4 * PAGE, [MockAdapterConfig(name="m1")], store_workers=0) as (eng, _):
        assert eng.l2 is not None
        eid = eng.register("m", small_layout()).engine_id
        old = seq(4, 0)
        store(eng, eid, old)
        assert eng.lookup(eid, "reader", old[: CHUNK * 4], "").hit_chunks == 1
        assert [s.status for s in store(eng, eid, seq(1, 1))] == [R]
        assert eng.l2.store.counters.dropped == 2
        left = objects(eng, eid, old)
        assert left[0] is not None and left[0].visible  # the reader still has it
        assert left[1] is None
        assert eng.release(eid, "reader")
        async with writing(eng):
            pass
        assert held(eng, "m1") == set(names(eng, eid, old)[2:] + names(eng, eid, seq(1, 1)))


async def test_a_tenant_over_its_l1_quota_lets_go_of_its_own_oldest_queued_chunk_only() -> None:
    async with l2_engine(8 * PAGE, [MockAdapterConfig(name="m1")], store_workers=0) as (eng, _):
        assert eng.l2 is not None
        eid = eng.register("m", small_layout()).engine_id
        eng.tenants.set_quota("a", Quota(l1_bytes=2 * PAGE))
        other = seq(1, 9)
        store(eng, eid, other, "b")  # the oldest in the queue, of another tenant
        mine = seq(2, 0)
        store(eng, eid, mine, "a")  # a's limit reached, both held by the queue
        assert [s.status for s in store(eng, eid, seq(1, 1), "a")] == [R]
        assert eng.l2.store.counters.dropped == 1
        (b0,) = objects(eng, eid, other, "b")
        a0, a1 = objects(eng, eid, mine, "a")
        assert a0 is None
        assert b0 is not None and not b0.evictable
        assert a1 is not None and not a1.evictable
        assert eng.l2.store.depth == 3


async def test_nothing_queued_of_the_tenant_means_a_quota_refusal() -> None:
    async with l2_engine(8 * PAGE, [MockAdapterConfig(name="m1")], store_workers=0) as (eng, _):
        assert eng.l2 is not None
        eid = eng.register("m", small_layout()).engine_id
        eng.tenants.set_quota("a", Quota(l1_bytes=PAGE))
        store(eng, eid, seq(1, 9), "b")
        store(eng, eid, seq(1, 0), "a")
        assert eng.lookup(eid, "reader", seq(1, 0), "a").hit_chunks == 1  # a's only chunk is read
        assert [s.status for s in store(eng, eid, seq(1, 1), "a")] == [SlotStatus.QUOTA]
        assert eng.l2.store.counters.dropped == 1  # a's queued chunk; b's stays queued
        (b0,) = objects(eng, eid, seq(1, 9), "b")
        assert b0 is not None and not b0.evictable


# --- store policies ----------------------------------------------------------------------------


@pytest.mark.parametrize(("policy", "in_m2"), [("all", True), ("first", False)])
async def test_policy_first_writes_to_the_first_tier_only(policy: str, in_m2: bool) -> None:
    adapters = [MockAdapterConfig(name="m1"), MockAdapterConfig(name="m2")]
    async with l2_engine(1 << 20, adapters, store_policy=policy) as (eng, _):
        assert eng.l2 is not None
        eid = eng.register("m", small_layout()).engine_id
        toks = seq(2, 0)
        store(eng, eid, toks)
        assert await eng.l2.store.wait_idle(10)
        assert held(eng, "m1") == set(names(eng, eid, toks))
        assert held(eng, "m2") == (set(names(eng, eid, toks)) if in_m2 else set())


async def test_seen_twice_counts_a_lookup_and_the_store_of_one_request_as_one_sighting() -> None:
    """The connector looks a request up, then stores what missed: that chunk was seen once."""
    adapters = [MockAdapterConfig(name="m1")]
    async with l2_engine(1 << 20, adapters, store_policy="seen_twice") as (eng, _):
        assert eng.l2 is not None
        eid = eng.register("m", small_layout()).engine_id
        toks = seq(2, 0)
        assert eng.lookup(eid, "a", toks, "").hit_chunks == 0
        slots = eng.store(eid, "a", toks, "")
        assert all(eng.commit(eid, [s.oid for s in slots if s.status is R]))
        eng.end_request(eid, "a")
        assert await eng.l2.store.wait_idle(10)
        assert held(eng, "m1") == set()
        assert eng.l2.store.counters.not_admitted == 2
        assert eng.lookup(eid, "b", toks, "").hit_chunks == 2  # another request: the second sighting
        assert await eng.l2.store.wait_idle(10)
        assert held(eng, "m1") == set(names(eng, eid, toks))
        eng.end_request(eid, "b")


async def test_policy_seen_twice_writes_only_chunks_seen_twice() -> None:
    adapters = [MockAdapterConfig(name="m1")]
    async with l2_engine(1 << 20, adapters, store_policy="seen_twice") as (eng, _):
        assert eng.l2 is not None
        eid = eng.register("m", small_layout()).engine_id
        once, twice = seq(2, 0), seq(2, 1)
        store(eng, eid, once)
        store(eng, eid, twice)
        assert await eng.l2.store.wait_idle(10)
        assert held(eng, "m1") == set()
        assert eng.l2.store.counters.not_admitted == 4  # every chunk seen once so far, counted
        assert eng.lookup(eid, "r", twice, "").hit_chunks == 2  # seen a second time
        assert await eng.l2.store.wait_idle(10)
        assert held(eng, "m1") == set(names(eng, eid, twice))
        assert eng.l2.store.counters.not_admitted == 4
        assert eng.release(eid, "r")
