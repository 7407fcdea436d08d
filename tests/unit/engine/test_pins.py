"""Prefix pins through the engine facade: a pinned prefix survives an eviction storm by other
tenants in L1 and is served byte-identical after; the TTL and DELETE release it; limits refuse
(Conflict, with the reason); bad input is InvalidInput; a prefix pinned before it is stored is held
when it arrives; pinned chunks count against the tenant's own quota."""

from __future__ import annotations

import asyncio
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from app.errors import BackendError, Conflict, InvalidInput, NotFound
from engine.facade import CacheEngine
from engine.keys import Namespace, ObjectKey
from engine.l1.lifecycle import L1Object
from engine.pins.config import PinSettings
from engine.pins.service import PinService
from engine.pins.table import Pin, PinTable
from engine.results import SlotStatus
from engine.tenants.quota import L1, Quota
from tests.factories import FakeClock, engine, key, make_cache, small_layout

pytestmark = pytest.mark.anyio

CHUNK = 16  # tokens per chunk; a chunk of small_layout() is 4 KiB = one aligned page
PAGE = 4096
R, N, Q = SlotStatus.RESERVED, SlotStatus.NO_SPACE, SlotStatus.QUOTA


def seq(n_chunks: int, which: int) -> list[int]:
    return list(range(which * 10_000, which * 10_000 + n_chunks * CHUNK))


def payload(salt: str, which: int, chunk: int) -> bytes:
    head = struct.pack("<HH", which, chunk) + salt.encode()[:32]
    return head + bytes([(which * 7 + chunk) % 251 + 1]) * (PAGE - len(head))


def store(eng: CacheEngine, eid: int, ids: list[int], salt: str, which: int) -> list[SlotStatus]:
    slots = eng.store(eid, "w", tokens_of(ids), salt)
    for s in slots:
        if s.status is R:
            with eng.arena.view(s.offset, s.size) as view:
                view[:] = payload(salt, which, s.chunk)
    eng.commit(eid, [s.oid for s in slots if s.status is R])
    return [s.status for s in slots]


def tokens_of(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


def served(eng: CacheEngine, eid: int, ids: list[int], salt: str) -> list[bytes]:
    """LOOKUP + RETRIEVE + RELEASE: the bytes of every chunk found."""
    toks = tokens_of(ids)
    hit = eng.lookup(eid, "r", toks, salt).hit_chunks
    extents = eng.retrieve(eid, "r", 0, hit) if hit else []
    out = []
    for ext in extents:
        with eng.arena.view(ext.offset, ext.size) as view:
            out.append(bytes(view))
    eng.release(eid, "r", [ext.oid for ext in extents])
    eng.end_request(eid, "r")
    return out


def storm(eng: CacheEngine, eid: int, rounds: int) -> list[SlotStatus]:
    """Tenants b and c store `rounds` distinct 2-chunk prefixes each: far more than L1 holds."""
    out: list[SlotStatus] = []
    for i in range(rounds):
        for salt in ("b", "c"):
            out += store(eng, eid, seq(2, 100 + i), salt, 100 + i)
    return out


@contextmanager
def pinned_engine(
    pages: int = 8, **limits: float
) -> Iterator[tuple[CacheEngine, int, PinService, FakeClock]]:  # fmt: skip
    with engine(pages * PAGE, chunk_size=CHUNK) as (eng, clock):
        eid = eng.register("m", small_layout()).engine_id
        yield eng, eid, PinService(eng, PinSettings(**limits), clock=clock), clock  # type: ignore[arg-type]


# --- the table ----------------------------------------------------------------------------------


def _pin(pin_id: str, salt: str, hashes: tuple[bytes, ...], tiers: tuple[str, ...] = (L1,),
         deadline: float | None = None) -> Pin:  # fmt: skip
    return Pin(
        id=pin_id, salt=salt, model="m", hashes=hashes, tiers=tiers, ttl_s=None, created_at=0.0,
        expires_at=None, deadline=deadline, chunk_bytes={t: PAGE for t in tiers},
    )  # fmt: skip


def test_table_holds_every_namespace_of_the_model_and_counts_shared_chunks() -> None:
    table = PinTable()
    h1, h2, h3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    table.put(_pin("short", "a", (h1,), (L1, "disk")))
    table.put(_pin("long", "a", (h1, h2), (L1,), deadline=10.0))
    for ns in (Namespace("m", b"\x00" * 8), Namespace("m", b"\x01" * 8, kv_rank=3, group=1)):
        assert table.kept_in_l1(ObjectKey(ns, "a", h1)) and table.kept_in_l1(ObjectKey(ns, "a", h2))
        assert not table.kept_in_l1(ObjectKey(ns, "b", h1))  # another tenant's chunk
        assert not table.kept_in_l1(ObjectKey(ns, "a", h3))
    assert not table.kept_in_l1(ObjectKey(Namespace("other", b"\x00" * 8), "a", h1))  # another model
    disk = table.kept_in("disk")
    serialized = ObjectKey(Namespace("m", b"\x00" * 8, 2), "a", h1).serialize()
    assert disk(serialized)
    assert not disk(ObjectKey(Namespace("m", b"\x00" * 8), "a", h2).serialize())
    assert not table.kept_in("other")(serialized)
    for junk in ("", "kvd1/", "kvd1/m=m/l=00/r=0/g=0/s=a/h=zz", "x" * 500, "kvd1/a/b/c/d/e/f"):
        assert not disk(junk)
    # The longer pin runs out: the chunk both hold stays held by the short one.
    assert [p.id for p in table.expire(10.0)] == ["long"]
    assert table.holds(L1, "m", "a", h1) and not table.holds(L1, "m", "a", h2)
    table.remove("a", "short")
    assert not table.holds(L1, "m", "a", h1) and not disk(serialized) and len(table) == 0
    with pytest.raises(NotFound):
        table.remove("a", "short")


# --- L1: storm, TTL, DELETE ---------------------------------------------------------------------


async def test_pinned_prefix_survives_a_storm_by_other_tenants_and_is_served_byte_identical() -> None:
    with pinned_engine() as (eng, eid, pins, _):
        prefix = seq(3, 1)
        assert store(eng, eid, prefix, "a", 1) == [R, R, R]
        answer = await pins.put("a", "m", [*prefix, 5, 6], None, [L1])  # the partial chunk is ignored
        assert (answer.chunks, answer.tokens, answer.present_chunks) == (3, 3 * CHUNK, {L1: 3})
        assert answer.pinned_bytes == {L1: 3 * PAGE}
        statuses = storm(eng, eid, 40)  # 160 chunks through an 8-page L1
        assert statuses.count(R) > 100
        assert served(eng, eid, prefix, "a") == [payload("a", 1, c) for c in range(3)]
        assert eng.cache.counters.evicted > 100
        # Scans that passed over the pinned chunks moved them on: they do not head the LRU order.
        assert not pins.table.kept_in_l1(next(eng.cache.policy.candidates()).key)
        # An unpinned prefix of the same tenant was evicted like any other.
        assert store(eng, eid, seq(1, 2), "a", 2) == [R]
        storm(eng, eid, 10)
        assert served(eng, eid, seq(1, 2), "a") == []


async def test_storm_when_everything_left_is_pinned_is_no_space_never_a_crash() -> None:
    with pinned_engine(pages=4, max_share=1.0) as (eng, eid, pins, _):
        prefix = seq(4, 1)
        store(eng, eid, prefix, "a", 1)
        await pins.put("a", "m", prefix, None, [L1])
        assert storm(eng, eid, 5) == [N] * 20  # L1 is all pinned: the others miss
        assert eng.cache.counters.no_space == 10  # one per store: the chunks after it are not tried
        assert eng.cache.counters.evicted == 0
        assert served(eng, eid, prefix, "a") == [payload("a", 1, c) for c in range(4)]


async def test_ttl_releases_the_pin_and_the_storm_then_evicts_it() -> None:
    with pinned_engine() as (eng, eid, pins, clock):
        prefix = seq(2, 1)
        store(eng, eid, prefix, "a", 1)
        pin = await pins.put("a", "m", prefix, 30, [L1])
        clock.advance(29)
        assert pins.expire() == []
        storm(eng, eid, 20)
        assert len(served(eng, eid, prefix, "a")) == 2
        clock.advance(1)
        assert [p.id for p in pins.expire()] == [pin.id]
        assert (await pins.pins()).pins == []
        storm(eng, eid, 20)
        assert served(eng, eid, prefix, "a") == []


async def test_delete_releases_one_pin_or_all_of_the_tenant() -> None:
    with pinned_engine() as (eng, eid, pins, _):
        one, two = seq(1, 1), seq(1, 2)
        store(eng, eid, one, "a", 1)
        store(eng, eid, two, "a", 2)
        first = await pins.put("a", "m", one, None, [L1])
        await pins.put("a", "m", two, None, [L1])
        assert len((await pins.pins("a")).pins) == 2
        assert await pins.delete("a", first.id) == 1
        with pytest.raises(NotFound):
            await pins.delete("a", first.id)
        storm(eng, eid, 20)
        assert served(eng, eid, one, "a") == [] and len(served(eng, eid, two, "a")) == 1
        assert await pins.delete("a") == 1
        storm(eng, eid, 20)
        assert served(eng, eid, two, "a") == []


async def test_a_prefix_pinned_before_it_is_stored_is_held_when_it_arrives() -> None:
    with pinned_engine() as (eng, eid, pins, _):
        prefix = seq(3, 1)
        answer = await pins.put("a", "m", prefix, None, [L1])
        assert answer.present_chunks == {L1: 0}
        storm(eng, eid, 5)
        store(eng, eid, prefix, "a", 1)
        storm(eng, eid, 40)
        assert served(eng, eid, prefix, "a") == [payload("a", 1, c) for c in range(3)]
        assert (await pins.pins("a")).pins[0].present_chunks == {L1: 3}


async def test_pinned_chunks_count_against_the_tenants_own_l1_quota() -> None:
    with pinned_engine() as (eng, eid, pins, _):
        await _set_quota(eng, "a", Quota(l1_bytes=3 * PAGE))
        prefix = seq(3, 1)
        store(eng, eid, prefix, "a", 1)
        await pins.put("a", "m", prefix, None, [L1])
        # Its own new chunks find no room within its quota: everything it holds is pinned.
        assert store(eng, eid, seq(1, 2), "a", 2) == [Q]
        assert served(eng, eid, prefix, "a") == [payload("a", 1, c) for c in range(3)]


# --- limits and bad input -----------------------------------------------------------------------


async def _set_quota(eng: CacheEngine, salt: str, quota: Quota) -> None:
    eng.tenants.set_quota(salt, quota)


async def test_pinned_bytes_quota_is_a_conflict_with_the_reason() -> None:
    with pinned_engine() as (eng, _, pins, _):
        await _set_quota(eng, "a", Quota(pinned_bytes=2 * PAGE))
        await pins.put("a", "m", seq(2, 1), None, [L1])
        # A longer prefix of the same tokens shares its first two chunks: counted once, 3 pages.
        with pytest.raises(Conflict, match=r"pinned_bytes.*12288 bytes in l1.*8192"):
            await pins.put("a", "m", seq(3, 1), None, [L1])
        with pytest.raises(Conflict, match="pinned_bytes"):
            await pins.put("a", "m", seq(1, 2), None, [L1])
        await pins.put("a", "m", seq(1, 1), None, [L1])  # within what it pins already
        await pins.put("b", "m", seq(2, 1), None, [L1])  # another tenant has its own limit
        assert len(pins.table) == 3


async def test_tier_quota_share_of_capacity_and_pin_count_are_conflicts() -> None:
    with pinned_engine(pages=16, max_share=0.5, max_pins=3) as (eng, _, pins, _):
        await _set_quota(eng, "q", Quota(l1_bytes=PAGE))
        with pytest.raises(Conflict, match=r"quota: .* its quota there is 4096"):
            await pins.put("q", "m", seq(2, 1), None, [L1])
        await pins.put("a", "m", seq(3, 1), None, [L1])
        with pytest.raises(Conflict, match="capacity: pins would hold 36864 bytes of l1's 65536"):
            await pins.put("b", "m", seq(6, 2), None, [L1])
        await pins.put("b", "m", seq(1, 2), None, [L1])
        await pins.put("c", "m", seq(1, 3), 5, [L1])
        await pins.put("c", "m", seq(1, 3), 9, [L1])  # the same prefix again replaces its pin
        with pytest.raises(Conflict, match="max_pins"):
            await pins.put("d", "m", seq(0, 4) + [1] * CHUNK, None, [L1])
        assert [p.ttl_s for p in (await pins.pins("c")).pins] == [9]


async def test_a_pin_counts_the_models_live_namespaces_at_most_max_namespaces() -> None:
    """On main a pin counted every namespace of the model registered since the start: 40 kv
    ranks registered by anyone made every pin 41 times its size."""
    with pinned_engine(pages=64, max_namespaces=8) as (eng, _, pins, _):
        for rank in (1, 2, 3):  # the engine's other tensor-parallel ranks: really held
            eng.register("m", small_layout(), kv_rank=rank)
        assert (await pins.put("a", "m", seq(1, 1), None, [L1])).pinned_bytes == {L1: 4 * PAGE}
        for rank in range(4, 44):
            eng.register("m", small_layout(), kv_rank=rank, instance="flood")
        answer = await pins.put("a", "m", seq(1, 1), None, [L1])
        assert answer.pinned_bytes == {L1: 8 * PAGE}  # bounded by pins.max_namespaces
        eng.engines.drop_instance("flood")
        assert (await pins.put("a", "m", seq(1, 1), None, [L1])).pinned_bytes == {L1: 4 * PAGE}
        assert (await pins.pins()).pins[0].present_chunks == {L1: 0}
        eng.engines.drop_instance("")  # no engine of the model now: those seen since the start
        assert (await pins.put("a", "m", seq(1, 1), None, [L1])).pinned_bytes == {L1: 8 * PAGE}


async def test_bad_input_is_invalid_input_and_changes_nothing() -> None:
    with pinned_engine() as (_, _, pins, _):
        bad: list[tuple[str, str, list[int], object, list[str]]] = [
            ("a", "m", seq(1, 1), None, ["nvme"]),  # unknown tier
            ("a", "m", seq(1, 1), None, []),
            ("a", "m", list(range(CHUNK - 1)), None, [L1]),  # no full chunk
            ("a", "m", [0] * (CHUNK * 4097), None, [L1]),  # past max_chunks
            ("a", "m", [-1] * CHUNK, None, [L1]),
            ("a", "m", [1 << 32] * CHUNK, None, [L1]),
            ("a", "m", seq(1, 1), 0, [L1]),
            ("a", "m", seq(1, 1), 10**9, [L1]),
            ("a", "m", seq(1, 1), 1.5, [L1]),
            ("a", "", seq(1, 1), None, [L1]),
            ("a", "m" * 300, seq(1, 1), None, [L1]),
            ("s" * 300, "m", seq(1, 1), None, [L1]),
        ]
        for salt, model, ids, ttl, tiers in bad:
            with pytest.raises(InvalidInput):
                await pins.put(salt, model, ids, ttl, tiers)  # type: ignore[arg-type]
        with pytest.raises(Conflict, match="no engine of model 'never'"):
            await pins.put("a", "never", seq(1, 1), None, [L1])
        assert len(pins.table) == 0


async def test_pins_asked_at_once_are_checked_one_after_the_other(tmp_path: Path) -> None:
    gate = threading.Event()
    with ThreadPoolExecutor(1) as executor, pinned_engine() as (eng, _, _, clock):
        pins = PinService(eng, PinSettings(), path=tmp_path / "pins.json", executor=executor, clock=clock)
        eng.tenants.set_quota("a", Quota(pinned_bytes=2 * PAGE))
        executor.submit(gate.wait)  # file writes wait behind this: a DELETE holds the writer meanwhile
        deleting = asyncio.create_task(pins.delete("a"))
        await asyncio.sleep(0)
        puts = [asyncio.create_task(pins.put("a", "m", seq(2, w), None, [L1])) for w in (1, 2)]
        await asyncio.sleep(0.05)
        gate.set()
        assert await deleting == 0
        results = await asyncio.gather(*puts, return_exceptions=True)
        assert [type(r).__name__ for r in results] == ["PinAnswer", "Conflict"]
        assert pins.pinned_bytes(L1, "a") == 2 * PAGE


async def test_a_change_whose_file_write_fails_is_not_made(tmp_path: Path) -> None:
    with ThreadPoolExecutor(1) as executor, pinned_engine() as (eng, eid, _, clock):
        state = tmp_path / "state"
        state.mkdir()
        pins = PinService(eng, PinSettings(), path=state / "pins.json", executor=executor, clock=clock)
        kept = await pins.put("a", "m", seq(1, 1), None, [L1])
        state.rename(tmp_path / "moved")  # the file can no longer be written
        with pytest.raises(BackendError, match="pins not changed"):
            await pins.put("a", "m", seq(1, 2), None, [L1])
        with pytest.raises(BackendError, match="pins not changed"):
            await pins.delete("a", kept.id)
        assert [p.id for p in pins.table.pins()] == [kept.id]
        store(eng, eid, seq(1, 1), "a", 1)
        storm(eng, eid, 20)
        assert len(served(eng, eid, seq(1, 1), "a")) == 1  # still held


def test_a_pinned_chunk_prefetched_from_l2_is_kept_after_its_reader() -> None:
    cache = make_cache(8 * PAGE)
    pinned = {key(1)}
    cache.bind_pins(pinned.__contains__)
    for k in (key(1), key(2)):
        obj = cache.try_reserve(k, PAGE, 0.0, temporary=True)
        assert isinstance(obj, L1Object)
        cache.commit(obj.oid, 0.0)
        cache.lock(obj, 0.0)
        cache.unlock(obj)  # the reader is done: a temporary object goes
    assert cache.peek(key(1)) is not None and cache.peek(key(2)) is None
