"""Tenants through the engine facade: isolation by cache_salt, per-tenant LRU eviction under an L1
quota, QUOTA refusals, quota 0, lowered quotas, allowlist mode, and the ledger's figures."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict

from engine.facade import CacheEngine
from engine.keys import ObjectKey
from engine.l1.cache import Refusal
from engine.l1.lifecycle import L1Object, ObjectState
from engine.results import SlotStatus, StoreSlot
from engine.status import StatusReader
from engine.tenants.quota import L1, Quota
from tests.factories import FakeClock, admin, engine, key, make_cache, reserve, seq, small_layout
from tests.unit.engine.tenants.writes import PAGE, payload, store

CHUNK = 16  # tokens per chunk; a chunk of small_layout() is 4 KiB = one aligned page
R, E, Q, N = SlotStatus.RESERVED, SlotStatus.EXISTS, SlotStatus.QUOTA, SlotStatus.NO_SPACE


def statuses(slots: Sequence[StoreSlot]) -> list[SlotStatus]:
    return [s.status for s in slots]


def read_hits(eng: CacheEngine, eid: int, toks: bytes, salt: str) -> list[bytes]:
    """LOOKUP + RETRIEVE + RELEASE: the bytes of every chunk the lookup found."""
    hit = eng.lookup(eid, "r", toks, salt).hit_chunks
    out = []
    extents = eng.retrieve(eid, "r", 0, hit) if hit else []
    for ext in extents:
        with eng.arena.view(ext.offset, ext.size) as view:
            out.append(bytes(view))
    assert eng.release(eid, "r", [ext.oid for ext in extents]) is bool(hit)
    eng.end_request(eid, "r")
    return out


def key_of(eng: CacheEngine, eid: int, toks: bytes, salt: str, chunk: int) -> ObjectKey:
    ns = eng.registration(eid).namespace
    return ObjectKey(ns, salt, eng.hasher.chunk_hashes(toks)[chunk])


def present(eng: CacheEngine, eid: int, toks: bytes, salt: str) -> list[bool]:
    n = len(toks) // (4 * CHUNK)
    return [eng.cache.peek(key_of(eng, eid, toks, salt, i)) is not None for i in range(n)]


def assert_ledger_true(eng: CacheEngine) -> None:
    """The ledger's L1 figures are the sums over the objects in the arena, tenant by tenant."""
    truth: dict[str, list[int]] = {}
    aligned = eng.cache.allocator.aligned
    for obj in eng.cache.objects():
        t = truth.setdefault(obj.key.salt, [0, 0])
        t[0] += aligned(obj.size)
        t[1] += 1
    ledger = eng.tenants
    for salt in set(truth) | set(ledger.tenants()):
        acct = ledger.account(salt)
        got = [0, 0] if acct is None else [acct.l1.bytes, acct.l1.objects]
        assert got == truth.get(salt, [0, 0]), salt
        if acct is not None:
            assert acct.held == acct.l1.bytes  # no L2 tier reports here
            assert acct.held > 0 or ledger.quota(salt) is not None, "an empty account was kept"
    assert sum(t[0] for t in truth.values()) == eng.cache.allocator.used


# --- isolation --------------------------------------------------------------------------------


def test_random_interleaved_tenants_never_read_each_others_chunks() -> None:
    salts = ["", "a", "b", "tenant/c"]
    rng = random.Random(1234)
    # 48 pages for 4 tenants x 5 sequences x up to 6 chunks: global evictions happen too; two
    # tenants have quotas, so their own LRU evictions happen as well.
    with engine(48 * PAGE) as (eng, clock):
        eid = eng.register("m", small_layout()).engine_id
        eng.tenants.set_quota("a", Quota(l1_bytes=6 * PAGE))
        eng.tenants.set_quota("tenant/c", Quota(l1_bytes=10 * PAGE))
        hits = 0
        for _ in range(600):
            clock.advance(1)
            tag = rng.randrange(len(salts))
            salt, which, n = salts[tag], rng.randrange(5), rng.randint(1, 6)
            toks = seq(n, which)
            if rng.random() < 0.5:
                store(eng, eid, toks, salt, tag, which)
            else:
                got = read_hits(eng, eid, toks, salt)
                assert got == [payload(tag, which, i) for i in range(len(got))], "read another's bytes"
                hits += len(got)
            for limited, pages in (("a", 6), ("tenant/c", 10)):
                assert eng.tenants.held(limited, L1) <= pages * PAGE
            assert_ledger_true(eng)
        assert hits > 200  # the test saw plenty of hits, not only misses
        assert eng.cache.counters.quota_evicted > 0 and eng.cache.counters.evicted > 0


# --- per-tenant eviction ------------------------------------------------------------------------


def test_over_quota_tenant_evicts_its_own_lru_chunks_and_never_another_tenants() -> None:
    with engine(64 * PAGE) as (eng, clock):
        eid = eng.register("m", small_layout()).engine_id
        eng.tenants.set_quota("a", Quota(l1_bytes=4 * PAGE))
        store(eng, eid, seq(3, 0), "b", tag=2)
        clock.advance(1)
        store(eng, eid, seq(4, 1), "a", tag=1, which=1)  # a is at its quota now
        clock.advance(1)
        assert len(read_hits(eng, eid, seq(2, 1), "a")) == 2  # a's LRU order: chunks 2, 3, 0, 1
        clock.advance(1)
        slots = store(eng, eid, seq(2, 2), "a", tag=1, which=2)
        assert statuses(slots) == [R, R]
        assert present(eng, eid, seq(4, 1), "a") == [True, True, False, False]  # exactly its LRU two
        assert present(eng, eid, seq(3, 0), "b") == [True, True, True]
        assert read_hits(eng, eid, seq(3, 0), "b") == [payload(2, 0, i) for i in range(3)]
        assert eng.tenants.held("a", L1) == 4 * PAGE
        acct_a, acct_b = eng.tenants.account("a"), eng.tenants.account("b")
        assert acct_a is not None and acct_b is not None
        assert (acct_a.l1.evictions, acct_b.l1.evictions) == (2, 0)
        assert eng.cache.counters.quota_evicted == 2
        assert_ledger_true(eng)


def test_chunks_that_do_not_fit_are_quota_and_later_chunks_of_the_store_too() -> None:
    with engine(64 * PAGE) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        eng.tenants.set_quota("a", Quota(l1_bytes=2 * PAGE + 100))  # room for two pages, not three
        slots = store(eng, eid, seq(5, 0), "a", commit=False)
        # Reservations are charged and never evicted: the third chunk cannot fit.
        assert statuses(slots) == [R, R, Q, Q, Q]
        assert eng.counters.quota_chunks == 3
        assert eng.cache.counters.quota_refused == 1  # tried once; the rest refused without trying
        acct = eng.tenants.account("a")
        assert acct is not None and acct.l1.quota_refusals == 3
        assert eng.tenants.held("a", L1) == 2 * PAGE
        assert eng.counters.no_space_chunks == 0
        assert_ledger_true(eng)


def test_a_store_never_evicts_its_own_chain_to_make_room_for_its_continuation() -> None:
    with engine(64 * PAGE) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        eng.tenants.set_quota("a", Quota(l1_bytes=3 * PAGE))
        store(eng, eid, seq(3, 0), "a")
        slots = store(eng, eid, seq(5, 0), "a")  # its first three chunks are the ones above
        assert statuses(slots) == [E, E, E, Q, Q]
        assert present(eng, eid, seq(3, 0), "a") == [True, True, True]
        assert eng.cache.state_counts()["read_locked"] == 0  # held only while the store ran
        assert len(read_hits(eng, eid, seq(5, 0), "a")) == 3


def test_uncommitted_reservations_count_until_their_lease_expires() -> None:
    with engine(64 * PAGE, write_lease_s=5) as (eng, clock):
        eid = eng.register("m", small_layout()).engine_id
        eng.tenants.set_quota("a", Quota(l1_bytes=2 * PAGE))
        assert statuses(store(eng, eid, seq(2, 0), "a", commit=False)) == [R, R]
        assert statuses(store(eng, eid, seq(1, 1), "a")) == [Q]
        clock.advance(5.1)
        assert eng.reap() == (2, 0)
        assert eng.tenants.held("a", L1) == 0
        assert statuses(store(eng, eid, seq(1, 1), "a")) == [R]
        assert_ledger_true(eng)


def test_quota_zero_stores_nothing_and_evicts_what_the_tenant_held() -> None:
    with engine(64 * PAGE) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        store(eng, eid, seq(3, 0), "z")
        eng.tenants.set_quota("z", Quota(l1_bytes=0))
        slots = store(eng, eid, seq(4, 1), "z")
        assert statuses(slots) == [Q] * 4
        assert eng.tenants.held("z", L1) == 0
        assert present(eng, eid, seq(3, 0), "z") == [False] * 3
        assert statuses(store(eng, eid, seq(3, 0), "z")) == [Q] * 3
        assert read_hits(eng, eid, seq(4, 1), "z") == []
        assert reserve(eng.cache, key_of(eng, eid, seq(1, 5), "z", 0), PAGE, 0.0) is None  # L2 loads too
        acct = eng.tenants.account("z")
        assert acct is not None and acct.l1.quota_refusals == 8
        assert_ledger_true(eng)


def test_a_lowered_quota_takes_effect_at_the_tenants_next_store() -> None:
    with engine(64 * PAGE) as (eng, clock):
        eid = eng.register("m", small_layout()).engine_id
        for which in range(4):  # 8 chunks, least recently used first
            store(eng, eid, seq(2, which), "a", tag=1, which=which)
            clock.advance(1)
        store(eng, eid, seq(2, 0), "b", tag=2)
        eng.tenants.set_quota("a", Quota(l1_bytes=3 * PAGE))
        assert eng.tenants.held("a", L1) == 8 * PAGE  # nothing happens until a stores
        slots = store(eng, eid, seq(1, 9), "a", tag=1, which=9)
        assert statuses(slots) == [R]
        assert eng.tenants.held("a", L1) == 3 * PAGE
        # The survivors are its most recently used chunks; b lost nothing.
        assert present(eng, eid, seq(2, 3), "a") == [True, True]
        assert [present(eng, eid, seq(2, w), "a") for w in range(3)] == [[False, False]] * 3
        assert present(eng, eid, seq(2, 0), "b") == [True, True]
        assert_ledger_true(eng)


def test_a_store_of_present_chunks_also_meets_a_lowered_quota() -> None:
    with engine(64 * PAGE) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        store(eng, eid, seq(4, 0), "a")
        eng.tenants.set_quota("a", Quota(l1_bytes=PAGE))
        store(eng, eid, seq(4, 7), "b")
        assert eng.tenants.held("a", L1) == 4 * PAGE
        store(eng, eid, seq(1, 0), "a")  # EXISTS or not, the next store brings a within its quota
        assert eng.tenants.held("a", L1) <= PAGE


def test_global_eviction_when_the_arena_is_full_still_takes_any_tenants_lru() -> None:
    with engine(8 * PAGE) as (eng, clock):
        eid = eng.register("m", small_layout()).engine_id
        eng.tenants.set_quota("a", Quota(l1_bytes=100 * PAGE))
        store(eng, eid, seq(8, 0), "a")
        clock.advance(1)
        assert statuses(store(eng, eid, seq(2, 1), "b")) == [R, R]
        assert present(eng, eid, seq(8, 0), "a") == [False, False] + [True] * 6
        assert eng.cache.counters.quota_evicted == 0 and eng.cache.counters.evicted == 2
        assert_ledger_true(eng)


def test_read_locked_chunks_are_never_evicted_for_a_quota() -> None:
    with engine(64 * PAGE) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        eng.tenants.set_quota("a", Quota(l1_bytes=3 * PAGE))
        store(eng, eid, seq(3, 0), "a")
        store(eng, eid, seq(1, 1), "a")  # evicts chunk 0 of sequence 0 (its LRU)
        assert present(eng, eid, seq(3, 0), "a") == [False, True, True]
        eng.lookup(eid, "reader", seq(1, 1), "a")  # read-locks sequence 1's chunk
        # Two chunks of sequence 0 can make room; the locked one cannot, the reservations neither.
        assert statuses(store(eng, eid, seq(3, 2), "a")) == [R, R, Q]
        assert present(eng, eid, seq(1, 1), "a") == [True]
        eng.end_request(eid, "reader")
        assert_ledger_true(eng)


def test_a_reservation_that_cannot_fit_its_quota_evicts_nothing() -> None:
    clock = FakeClock()
    cache = make_cache(64 * PAGE)
    cache.ledger.set_quota("a", Quota(l1_bytes=4 * PAGE))
    objs = []
    for i in range(4):
        o = reserve(cache, key(i, "a"), PAGE, clock())
        assert o is not None
        cache.commit(o.oid, clock())
        objs.append(o)
    for o in objs[1:]:
        cache.lock(o, clock())
    assert cache.try_reserve(key(10, "a"), 2 * PAGE, clock()) is Refusal.QUOTA  # 1 page evictable of 2
    assert [o.state for o in objs[:2]] == [ObjectState.READY, ObjectState.READ_LOCKED]
    assert cache.counters.evicted == 0
    assert cache.try_reserve(key(11, "a"), 5 * PAGE, clock()) is Refusal.QUOTA  # larger than the limit
    got = cache.try_reserve(key(12, "a"), PAGE, clock())
    assert isinstance(got, L1Object)
    assert [o.state for o in objs[:2]] == [ObjectState.EVICTED, ObjectState.READ_LOCKED]
    assert cache.counters.quota_refused == 2 and cache.counters.quota_evicted == 1


# --- allowlist mode ---------------------------------------------------------------------------


def test_allowlist_mode_refuses_salts_without_a_quota() -> None:
    with engine(64 * PAGE) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        eng.tenants.allowlist = True
        eng.tenants.set_quota("ok", Quota())  # unlimited, but listed
        assert statuses(store(eng, eid, seq(2, 0), "ok")) == [R, R]
        assert statuses(store(eng, eid, seq(2, 0), "")) == [Q, Q]
        assert statuses(store(eng, eid, seq(2, 0), "stranger")) == [Q, Q]
        assert eng.tenants.account("stranger") is None  # refusals of unknown salts make no accounts
        assert eng.tenants.tenants() == ["ok"]
        assert eng.tenants.labelled(10)["other"][L1].quota_refusals == 4
        eng.tenants.allowlist = False
        assert statuses(store(eng, eid, seq(2, 0), "stranger")) == [R, R]


# --- ledger details -----------------------------------------------------------------------------


def test_storing_the_same_key_again_does_not_count_twice() -> None:
    with engine(64 * PAGE) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        store(eng, eid, seq(3, 0), "a")
        assert statuses(store(eng, eid, seq(3, 0), "a")) == [E, E, E]
        assert eng.tenants.held("a", L1) == 3 * PAGE
        acct = eng.tenants.account("a")
        assert acct is not None and acct.l1.objects == 3


def test_a_cleared_chunk_being_read_is_charged_until_its_reader_lets_go() -> None:
    with engine(64 * PAGE) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        store(eng, eid, seq(2, 0), "a")
        eng.lookup(eid, "r", seq(2, 0), "a")
        assert eng.clear("a") == 2
        assert eng.tenants.held("a", L1) == 2 * PAGE  # its memory is still in use
        eng.end_request(eid, "r")
        assert eng.tenants.held("a", L1) == 0
        assert eng.tenants.account("a") is None


def test_lookups_count_hits_and_misses_per_tenant_once_per_lookup() -> None:
    with engine(64 * PAGE) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        store(eng, eid, seq(2, 0), "a")
        eng.lookup(eid, "r", seq(5, 0), "a")
        eng.lookup(eid, "r2", seq(3, 0), "nobody")
        acct = eng.tenants.account("a")
        assert acct is not None and (acct.l1.hits, acct.l1.misses) == (2, 3)
        other = eng.tenants.labelled(5)["other"][L1]
        assert (other.hits, other.misses) == (0, 3)


def test_tenant_status_and_describe() -> None:
    with engine(64 * PAGE) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        eng.tenants.set_quota("a", Quota(l1_bytes=2 * PAGE, l2_bytes=7))
        store(eng, eid, seq(3, 0), "a")
        store(eng, eid, seq(1, 0), "")
        assert asdict(admin(eng).quota("a")) == {
            "cache_salt": "a",
            "tenant": "a",
            "quota": {"l1_bytes": 2 * PAGE, "l2_bytes": 7, "pinned_bytes": None},
            "tiers": {
                "l1": {
                    "limit_bytes": 2 * PAGE, "bytes": 2 * PAGE, "objects": 2, "hits": 0, "misses": 0,
                    "evictions": 0, "evicted_bytes": 0, "quota_refusals": 1,
                }
            },
            "fleet": {},
            "fleet_errors": {},
        }  # fmt: skip
        status = StatusReader(eng, admin(eng)).tenants()
        assert asdict(status) == {
            "allowlist": False,
            "quotas": 1,
            "tenants_holding_bytes": 2,
            "quota_refused_chunks": 1,
            "largest": [
                {"tenant": "a", "l1_bytes": 2 * PAGE, "l1_limit_bytes": 2 * PAGE},
                {"tenant": "_default", "l1_bytes": PAGE, "l1_limit_bytes": None},
            ],
        }


def test_objects_released_by_the_cache_are_credited_in_every_final_state() -> None:
    clock = FakeClock()
    with engine(6 * PAGE, write_lease_s=5) as (eng, _):
        cache = eng.cache
        objs: list[L1Object] = []
        for i in range(4):
            o = reserve(cache, key(i, "a"), PAGE, clock())
            assert o is not None
            objs.append(o)
        cache.abort(objs[0])
        cache.commit(objs[1].oid, clock())
        cache.delete(objs[1])
        cache.commit(objs[2].oid, clock())
        assert cache.evict(PAGE, "a") == PAGE
        assert objs[2].state is ObjectState.EVICTED
        clock.advance(6)
        assert cache.reap(clock()) == 1
        assert eng.tenants.held("a", L1) == 0 and cache.allocator.used == 0
        assert eng.tenants.account("a") is None
