"""The prefetch controller through the engine as app/main wires it (real L1 cache and arena,
in-memory L2 adapters): concurrent requests for the same missing chunk share one load, a slow or
hanging tier ends at the deadline with the prefix that arrived, and a chunk that arrives for a
request that moved on stays in L1 as an ordinary object."""

from __future__ import annotations

import time

import pytest

from engine.facade import CacheEngine
from engine.keys import ObjectKey
from engine.results import SlotStatus
from storage.mock.adapter import MockAdapter
from storage.mock.config import MockAdapterConfig
from tests.factories import l2_engine, seq, small_layout

pytestmark = pytest.mark.anyio

CHUNK = 16  # tokens per chunk; a chunk of small_layout() is 4 KiB
R = SlotStatus.RESERVED


def names(eng: CacheEngine, eid: int, toks: bytes) -> list[str]:
    ns = eng.registration(eid).namespace
    return [ObjectKey(ns, "", h).serialize() for h in eng.hasher.chunk_hashes(toks)]


def mock(eng: CacheEngine, name: str) -> MockAdapter:
    assert eng.l2 is not None
    adapter = eng.l2.tiers.get(name).adapter
    assert isinstance(adapter, MockAdapter)
    return adapter


async def in_l2_only(eng: CacheEngine, eid: int, toks: bytes) -> None:
    """Store `toks`, wait until written behind, then empty L1: the chunks are in L2 only."""
    assert eng.l2 is not None
    slots = eng.store(eid, "w", toks, "")
    assert all(eng.commit(eid, [s.oid for s in slots if s.status is R]))
    assert await eng.l2.store.wait_idle(10)
    eng.clear()
    assert len(eng.cache) == 0


# --- load de-duplication -----------------------------------------------------------------------


async def test_two_requests_missing_the_same_chunks_share_one_load_each() -> None:
    async with l2_engine(1 << 20, [MockAdapterConfig(name="m1", latency_ms=20)]) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        toks = seq(3, 0)
        await in_l2_only(eng, eid, toks)
        adapter = mock(eng, "m1")
        loads = adapter.stats.loads
        assert eng.lookup(eid, "r1", toks, "").pending_chunks == 3
        assert eng.lookup(eid, "r2", toks, "").pending_chunks == 3
        one = await eng.wait_prefetch(eid, "r1")
        two = await eng.wait_prefetch(eid, "r2")
        assert (one.hit_chunks, two.hit_chunks) == (3, 3)
        assert adapter.stats.loads - loads == 3
        assert eng.release(eid, "r1") and eng.release(eid, "r2")


# --- deadline ----------------------------------------------------------------------------------


async def test_a_slow_tier_ends_at_the_deadline_with_the_prefix_that_arrived() -> None:
    adapters = [MockAdapterConfig(name="fast"), MockAdapterConfig(name="slow")]
    async with l2_engine(1 << 20, adapters) as (eng, _):
        assert eng.l2 is not None
        eid = eng.register("m", small_layout()).engine_id
        toks = seq(3, 0)
        await in_l2_only(eng, eid, toks)
        _, *rest = names(eng, eid, toks)
        assert all(r.ok for r in await mock(eng, "fast").delete(rest))  # chunk 0 comes from here
        slow = mock(eng, "slow")
        slow.config = slow.config.model_copy(update={"bandwidth_gbps": 1e-6})  # a load takes ~an hour
        eng.l2.prefetch.deadline_s = 0.3
        start = time.monotonic()
        assert eng.lookup(eid, "r", toks, "").pending_chunks == 3
        got = await eng.wait_prefetch(eid, "r")
        assert time.monotonic() - start < 5
        assert (got.hit_chunks, got.pending_chunks) == (1, 0)
        assert eng.l2.prefetch.counters.deadline_expired == 1
        assert len(eng.retrieve(eid, "r", 0, 1)) == 1
        assert eng.release(eid, "r")


async def test_a_hanging_tier_ends_at_the_deadline_with_nothing_and_no_error() -> None:
    async with l2_engine(1 << 20, [MockAdapterConfig(name="m1")]) as (eng, _):
        assert eng.l2 is not None
        eid = eng.register("m", small_layout()).engine_id
        toks = seq(2, 0)
        await in_l2_only(eng, eid, toks)
        m1 = mock(eng, "m1")
        m1.config = m1.config.model_copy(update={"hang": True})
        eng.l2.prefetch.deadline_s = 0.2
        start = time.monotonic()
        assert eng.lookup(eid, "r", toks, "").pending_chunks == 2
        got = await eng.wait_prefetch(eid, "r")
        assert time.monotonic() - start < 5
        assert (got.hit_chunks, got.pending_chunks, got.total_chunks) == (0, 0, 0)
        assert eng.l2.prefetch.counters.deadline_expired == 1
        assert len(eng.cache) == 0  # its reservations were given back


# --- detach ------------------------------------------------------------------------------------


@pytest.mark.parametrize("moved_on", ["ended", "newer_lookup"])
async def test_a_chunk_arriving_after_the_request_moved_on_stays_as_an_ordinary_object(moved_on: str) -> None:
    async with l2_engine(1 << 20, [MockAdapterConfig(name="m1", latency_ms=20)]) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        toks = seq(2, 0)
        await in_l2_only(eng, eid, toks)
        assert eng.lookup(eid, "r1", toks, "").pending_chunks == 2
        if moved_on == "ended":
            eng.end_request(eid, "r1")
        else:
            assert eng.lookup(eid, "r1", seq(1, 5), "").hit_chunks == 0  # other tokens, not in L2
        # A second request for the same chunks shares r1's loads: when it has them, so has L1.
        assert eng.lookup(eid, "r2", toks, "").pending_chunks == 2
        assert (await eng.wait_prefetch(eid, "r2")).hit_chunks == 2
        assert eng.release(eid, "r2")
        # Not temporary: the chunks outlive their last reader and hit in L1.
        assert len(eng.cache) == 2
        again = eng.lookup(eid, "r3", toks, "")
        assert (again.hit_chunks, again.pending_chunks) == (2, 0)
        assert eng.release(eid, "r3")
        # Nothing was locked for the request that moved on: once read, every chunk may be evicted.
        assert eng.cache.state_counts()["read_locked"] == 0
