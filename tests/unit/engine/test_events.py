"""The event bus and every place the sidecar publishes on it, through real engines (arena, L1,
in-memory L2 adapters) and the data-plane server driven in-process."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from api.dataplane.server import DataPlaneServer
from engine.events import L1_TIER, Event, EventBus, Kind
from engine.facade import CacheEngine
from engine.results import SlotStatus
from kvdepot_connector import protocol as p
from storage.mock.config import MockAdapterConfig
from tests.factories import engine, l2_engine, small_layout, tokens

CHUNK = 16  # tokens per chunk; a chunk of small_layout() is 4 KiB
R = SlotStatus.RESERVED


class Recorder:
    """A subscriber that keeps what it is given."""

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus
        self.events: list[Event] = []
        bus.subscribe(self.events.extend)

    def take(self, *kinds: Kind) -> list[Event]:
        """Deliver what is queued; answer the events of `kinds` (all without) since the last take."""
        self.bus.flush()
        got = [e for e in self.events if not kinds or e.kind in kinds]
        self.events.clear()
        return got


def store_all(eng: CacheEngine, eid: int, toks: bytes, salt: str = "", rid: str = "w", lora: str = "") -> int:
    slots = eng.store(eid, rid, toks, salt, lora_name=lora)
    oids = [s.oid for s in slots if s.status is R]
    assert all(eng.commit(eid, oids))
    return len(oids)


@pytest.fixture
def bus() -> EventBus:
    return EventBus(capacity=1024)


@pytest.fixture
def small(bus: EventBus) -> Iterator[tuple[CacheEngine, Recorder]]:
    """An engine of 4 chunks of L1 on `bus`."""
    with engine(4 * 4096, chunk_size=CHUNK, events=bus) as (eng, _):
        yield eng, Recorder(bus)


# --- the bus -----------------------------------------------------------------------------------


def test_a_full_queue_drops_the_newest_and_counts_them() -> None:
    bus = EventBus(capacity=3)
    rec = Recorder(bus)
    for i in range(5):
        bus.emit(Kind.LOOKUP, detail=i)
    assert (bus.published, bus.dropped, bus.pending()) == (3, 2, 3)
    assert [e.detail for e in rec.take()] == [0, 1, 2]
    assert bus.pending() == 0
    bus.emit(Kind.LOOKUP, detail=9)  # room again
    assert [e.detail for e in rec.take()] == [9]


def test_a_disabled_bus_publishes_nothing_and_builds_no_span() -> None:
    bus = EventBus(enabled=False)
    rec = Recorder(bus)
    bus.emit(Kind.LOOKUP)
    assert bus.start("store", "r") == 0
    bus.end(0, "store", "r")
    assert (rec.take(), bus.published, bus.dropped) == ([], 0, 0)


@pytest.mark.anyio
async def test_the_dispatcher_delivers_in_batches_and_a_raising_subscriber_stops_no_one() -> None:
    bus = EventBus(capacity=100, batch=4, linger_s=0.001)
    seen: list[int] = []
    enough = asyncio.Event()

    def bad(events: list[Event]) -> None:
        raise RuntimeError("subscriber bug")

    def good(events: list[Event]) -> None:
        assert len(events) <= 4
        seen.extend(e.detail for e in events)
        if len(seen) == 10:
            enough.set()

    bus.subscribe(bad)
    bus.subscribe(good)
    task = asyncio.get_running_loop().create_task(bus.run())
    for i in range(10):
        bus.emit(Kind.LOOKUP, detail=i)
    await asyncio.wait_for(enough.wait(), 10)
    bus.stop()
    await asyncio.wait_for(task, 10)
    assert seen == list(range(10))
    assert bus.subscriber_errors == 3  # one per batch of 4, 4, 2
    assert bus.delivered == 10


# --- L1 ----------------------------------------------------------------------------------------


def test_nothing_is_announced_at_store_and_stored_at_commit_carries_the_chunk(
    small: tuple[CacheEngine, Recorder],
) -> None:
    eng, rec = small
    eid = eng.register("m", small_layout()).engine_id
    toks = tokens(3 * CHUNK + 5)  # 3 full chunks and a tail that is not stored
    extras = [b"", b"\x01" * p.EXTRA_KEY_BYTES, b""]
    slots = eng.store(eid, "req-7", toks, "t", extras=extras, lora_name="sql")
    assert rec.take(Kind.STORED) == []
    assert all(eng.commit(eid, [s.oid for s in slots if s.status is R]))
    stored = rec.take(Kind.STORED)
    assert [e.tier for e in stored] == [L1_TIER] * 3
    assert b"".join(e.tokens for e in stored) == toks[: 3 * CHUNK * 4]  # the tokens rebuild the prefix
    hashes = eng.hasher.chunk_hashes(toks, extras=extras)
    assert [e.key.chunk_hash for e in stored if e.key] == hashes
    assert [e.parent for e in stored] == [b"", hashes[0], hashes[1]]
    assert [e.extra for e in stored] == extras
    said = {(e.lora_name, e.request_id, e.key.salt if e.key else None) for e in stored}
    assert said == {("sql", "req-7", "t")}


def test_an_aborted_or_expired_reservation_announces_nothing_and_is_forgotten() -> None:
    bus = EventBus()
    with engine(8 * 4096, chunk_size=CHUNK, events=bus, write_lease_s=1.0) as (eng, clock):
        rec = Recorder(bus)
        eid = eng.register("m", small_layout()).engine_id
        slots = eng.store(eid, "a", tokens(2 * CHUNK), "")
        eng.abort(eid, [s.oid for s in slots])
        late = eng.store(eid, "b", tokens(2 * CHUNK, start=500), "")
        clock.advance(2)
        eng.reap()
        assert eng.commit(eid, [s.oid for s in late]) == [False, False]
        assert rec.take(Kind.STORED) == []
        assert len(eng._announcer) == 0


def test_eviction_is_removed_evicted(small: tuple[CacheEngine, Recorder]) -> None:
    eng, rec = small
    eid = eng.register("m", small_layout()).engine_id
    store_all(eng, eid, tokens(4 * CHUNK))
    first = [e.key for e in rec.take(Kind.STORED)]
    store_all(eng, eid, tokens(2 * CHUNK, start=9000))  # L1 holds 4 chunks: 2 are evicted (LRU)
    removed = rec.take(Kind.REMOVED)
    assert [(e.tier, e.reason) for e in removed] == [(L1_TIER, "evicted")] * 2
    assert [e.key for e in removed] == first[:2]


def test_purge_of_a_tenant_and_clear_of_all(small: tuple[CacheEngine, Recorder]) -> None:
    eng, rec = small
    eid = eng.register("m", small_layout()).engine_id
    store_all(eng, eid, tokens(2 * CHUNK), salt="a")
    store_all(eng, eid, tokens(2 * CHUNK), salt="b")
    rec.take()
    assert eng.clear("a") == 2
    removed = rec.take()
    assert [(e.kind, e.reason, e.key.salt if e.key else None) for e in removed] == [
        (Kind.REMOVED, "purged", "a")
    ] * 2
    assert eng.clear() == 2
    assert [(e.kind, e.tier, e.detail) for e in rec.take()] == [(Kind.CLEARED, L1_TIER, 2)]


def test_a_locked_chunk_cleared_is_removed_when_its_reader_lets_go(
    small: tuple[CacheEngine, Recorder],
) -> None:
    eng, rec = small
    eid = eng.register("m", small_layout()).engine_id
    toks = tokens(CHUNK)
    store_all(eng, eid, toks)
    assert eng.lookup(eid, "r", toks, "").hit_chunks == 1
    rec.take()
    eng.clear("")
    assert rec.take(Kind.REMOVED) == []  # still read by "r"
    eng.release(eid, "r")
    assert [e.reason for e in rec.take(Kind.REMOVED)] == ["deleted"]


def test_lookup_says_its_hit_tokens(small: tuple[CacheEngine, Recorder]) -> None:
    eng, rec = small
    eid = eng.register("m", small_layout()).engine_id
    toks = tokens(3 * CHUNK)
    store_all(eng, eid, toks[: 2 * CHUNK * 4])
    eng.lookup(eid, "r", toks, "")
    (look,) = rec.take(Kind.LOOKUP)
    assert (look.detail, look.request_id, look.tier) == (2 * CHUNK, "r", L1_TIER)


def test_a_disabled_bus_sees_a_whole_cycle_publish_nothing() -> None:
    bus = EventBus(enabled=False)
    with engine(4 * 4096, chunk_size=CHUNK, events=bus) as (eng, _):
        rec = Recorder(bus)
        eid = eng.register("m", small_layout()).engine_id
        store_all(eng, eid, tokens(4 * CHUNK))
        store_all(eng, eid, tokens(2 * CHUNK, start=9000))  # evicts
        eng.lookup(eid, "r", tokens(4 * CHUNK), "")
        eng.release(eid, "r")
        eng.clear()
        assert (rec.take(), bus.published, len(eng._announcer)) == ([], 0, 0)


# --- L2 ----------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_write_behind_load_and_l2_removal() -> None:
    bus = EventBus()
    rec = Recorder(bus)
    tiny = 3 * 4200 / (1 << 30)  # the mock holds 3 blobs of one chunk at most
    config = MockAdapterConfig(name="m1", capacity_gb=tiny)
    async with l2_engine(1 << 20, [config], events=bus) as (eng, _):
        assert eng.l2 is not None
        eid = eng.register("m", small_layout()).engine_id
        toks = tokens(2 * CHUNK)
        store_all(eng, eid, toks)
        assert await eng.l2.store.wait_idle(10)
        events = rec.take()
        keys = [e.key for e in events if e.kind is Kind.STORED and e.tier == L1_TIER]
        assert [e.key for e in events if e.kind is Kind.STORED and e.tier == "m1"] == keys
        starts = [e for e in events if e.kind is Kind.START and e.op == "l2.store"]
        ends = [e for e in events if e.kind is Kind.END and e.op == "l2.store"]
        assert [s.span for s in starts] == [e.span for e in ends] and starts
        assert {(e.tier, e.reason) for e in ends} == {("m1", "ok")} and sum(e.detail for e in ends) == 2

        eng.clear()
        rec.take()
        assert eng.lookup(eid, "r", toks, "").pending_chunks == 2
        assert (await eng.wait_prefetch(eid, "r")).hit_chunks == 2
        events = rec.take()
        loaded = [e for e in events if e.kind is Kind.STORED]
        assert [(e.tier, e.op, e.reason) for e in loaded] == [(L1_TIER, "l2.load", "m1")] * 2
        assert [e.key for e in loaded] == keys
        starts = {e.span for e in events if e.kind is Kind.START and e.op == "l2.load"}
        ends = {e.span: e for e in events if e.kind is Kind.END and e.op == "l2.load"}
        assert starts == set(ends) and len(starts) == 2
        assert {(e.tier, e.reason) for e in ends.values()} == {("m1", "ok")}
        eng.release(eid, "r")  # the loaded chunks were for "r" alone: they leave L1
        assert [(e.tier, e.reason) for e in rec.take(Kind.REMOVED)] == [(L1_TIER, "deleted")] * 2

        store_all(eng, eid, tokens(2 * CHUNK, start=7000))  # 4 blobs for a mock of 3: the old go
        assert await eng.l2.store.wait_idle(10)
        removed = rec.take(Kind.REMOVED)
        assert [(e.tier, e.reason) for e in removed] == [("m1", "evicted")] * 2
        assert [e.key for e in removed] == keys  # the least recently used, in that order

        await eng.l2.tiers.remove("m1", "drain")
        assert [(e.kind, e.tier) for e in rec.take(Kind.CLEARED)] == [(Kind.CLEARED, "m1")]


@pytest.mark.anyio
async def test_a_corrupt_blob_is_removed_corrupt() -> None:
    bus = EventBus()
    rec = Recorder(bus)
    config = MockAdapterConfig(name="bad", corrupt_rate=1.0)
    async with l2_engine(1 << 20, [config], events=bus) as (eng, _):
        assert eng.l2 is not None
        eid = eng.register("m", small_layout()).engine_id
        toks = tokens(CHUNK)
        store_all(eng, eid, toks)
        assert await eng.l2.store.wait_idle(10)
        eng.clear()
        rec.take()
        eng.lookup(eid, "r", toks, "")
        assert (await eng.wait_prefetch(eid, "r")).hit_chunks == 0
        reasons = [(e.tier, e.reason) for e in rec.take(Kind.REMOVED)]
        assert ("bad", "corrupt") in reasons


# --- the data plane ----------------------------------------------------------------------------


def test_every_data_plane_operation_is_a_start_end_pair_with_its_request_id(
    small: tuple[CacheEngine, Recorder],
) -> None:
    eng, rec = small
    server = DataPlaneServer(
        eng, url="ipc:///unused", max_frame_bytes=1 << 20, max_tokens=4096, lifeline_path="unused"
    )

    def call(msg: p.Request) -> p.Reply:
        reply = server.handle(p.encode(msg), b"peer")
        assert isinstance(reply, bytes)
        return p.reply_decoder.decode(reply)

    said = call(p.Hello(id=1, version=p.PROTOCOL_VERSION, instance="a1" * 16))
    assert isinstance(said, p.HelloReply) and server.sessions.hold(said.lifeline_token)  # its lifeline
    layout = p.Layout(
        dtype="float16", num_layers=2, num_kv_heads=1, head_dim=32, block_size=16, kind="test",
        chunk_size=CHUNK,
    )  # fmt: skip
    reg = call(p.Register(id=2, model="m", layout=layout))
    assert isinstance(reg, p.RegisterReply)
    toks = tokens(2 * CHUNK)
    st = call(p.Store(id=3, engine_id=reg.engine_id, request_id="req-1", tokens=toks, lora_name="sql"))
    assert isinstance(st, p.StoreReply)
    call(p.Commit(id=4, engine_id=reg.engine_id, oids=[s.oid for s in st.slots]))
    call(p.Lookup(id=5, engine_id=reg.engine_id, request_id="req-2", tokens=toks))
    bad = call(p.Retrieve(id=6, engine_id=reg.engine_id, request_id="nobody", num_chunks=1))
    assert isinstance(bad, p.ErrorReply)
    events = rec.take()
    pairs = [(e.kind, e.op, e.request_id) for e in events if e.kind in (Kind.START, Kind.END)]
    assert pairs == [
        (k, op, rid)
        for op, rid in [("hello", ""), ("register", ""), ("store", "req-1"), ("commit", ""),
                        ("lookup", "req-2"), ("retrieve", "nobody")]
        for k in (Kind.START, Kind.END)
    ]  # fmt: skip
    spans = [e.span for e in events if e.kind in (Kind.START, Kind.END)]
    assert spans[0::2] == spans[1::2] and len(set(spans)) == 6
    ends = {e.op: e.reason for e in events if e.kind is Kind.END}
    assert ends["store"] == "ok" and ends["retrieve"] == "not_found"
    (error,) = [e for e in events if e.kind is Kind.ERROR]
    assert (error.op, error.request_id, error.reason) == ("retrieve", "nobody", "not_found")
    assert {e.lora_name for e in events if e.kind is Kind.STORED} == {"sql"}
