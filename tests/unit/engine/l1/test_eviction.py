"""Eviction policies (lru, s3fifo, arc): their order on crafted traces through a real L1Cache (scan
resistance, ghost hits), per-salt views, removal of any object, bounded ghosts, and a state machine
that checks every policy against a plain reference (the live set: each candidates() pass yields
every live object exactly once, only live ones, only the salt's)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from app.settings import L1Settings
from app.wiring import build_cache
from engine.l1.cache import L1Cache
from engine.l1.eviction import POLICIES, EvictionPolicy, make_policy
from engine.l1.lifecycle import Event, L1Object, ObjectState
from tests.factories import FakeClock, key, reserve
from tests.machine_runs import machine_runs

PAGE = 4096
SMART = ["s3fifo", "arc"]


def cache_of(pages: int, eviction: str) -> L1Cache:
    l1 = L1Settings(alignment=PAGE, high_watermark=1.0, low_watermark=1.0, eviction=eviction)
    return build_cache(l1, pages * PAGE)


def put(cache: L1Cache, n: int, clock: FakeClock) -> L1Object:
    o = reserve(cache, key(n), PAGE, clock())
    assert o is not None
    cache.commit(o.oid, clock())
    clock.advance(1)
    return o


def present(cache: L1Cache, ns: list[int]) -> list[int]:
    return [n for n in ns if cache.peek(key(n)) is not None]


def test_the_setting_chooses_the_policy_and_an_unknown_name_is_refused() -> None:
    assert POLICIES == ("lru", "s3fifo", "arc")
    for name in POLICIES:
        assert cache_of(4, name).policy.name == name
    assert L1Settings().eviction == "lru"
    with pytest.raises(ValueError, match="eviction policy"):
        make_policy("lfu")


@pytest.mark.parametrize("eviction", POLICIES)
def test_a_one_time_scan_flushes_the_hot_set_only_under_lru(eviction: str) -> None:
    clock = FakeClock()
    cache = cache_of(10, eviction)
    hot = list(range(4))
    for n in hot:
        put(cache, n, clock)
    for _ in range(2):
        for n in hot:
            assert cache.find(key(n), clock()) is not None
    for n in range(100, 130):  # a scan, each chunk seen once, three times the cache
        put(cache, n, clock)
    kept = present(cache, hot)
    if eviction == "lru":
        assert kept == []
    else:
        assert kept == hot
    assert len(cache) == 10


@pytest.mark.parametrize("eviction", POLICIES)
def test_a_chunk_evicted_then_stored_again_is_kept_through_a_scan_by_the_ghost(eviction: str) -> None:
    clock = FakeClock()
    cache = cache_of(4, eviction)
    for n in range(5):  # 0 is evicted by 4: a ghost for s3fifo and arc
        put(cache, n, clock)
    assert present(cache, [0]) == []
    put(cache, 0, clock)  # a ghost hit: straight into the main / frequency part
    for n in range(200, 206):
        put(cache, n, clock)
    assert present(cache, [0]) == ([] if eviction == "lru" else [0])


@pytest.mark.parametrize("eviction", POLICIES)
def test_locked_objects_are_skipped_and_the_next_candidates_evicted(eviction: str) -> None:
    clock = FakeClock()
    cache = cache_of(4, eviction)
    objs = [put(cache, n, clock) for n in range(4)]
    for o in objs[:3]:
        cache.lock(o, clock())
    put(cache, 10, clock)
    assert objs[3].state is ObjectState.EVICTED
    assert all(o.state is ObjectState.READ_LOCKED for o in objs[:3])
    assert reserve(cache, key(11), PAGE, clock()) is not None  # 10 goes: the rest are locked


def obj(n: int, salt: str = "") -> L1Object:
    o = L1Object(oid=1000 + n, key=key(n, salt), offset=n * PAGE, size=PAGE)
    o.apply(Event.RESERVE)
    o.apply(Event.COMMIT)
    return o


def evict(policy: EvictionPolicy, o: L1Object) -> None:
    o.apply(Event.EVICT)
    policy.on_remove(o)


@pytest.mark.parametrize("eviction", POLICIES)
def test_per_salt_candidates_are_only_that_tenants_and_in_the_global_order(eviction: str) -> None:
    policy = make_policy(eviction)
    objs = [obj(n, "ab"[n % 2]) for n in range(12)]
    for o in objs:
        policy.on_insert(o)
    for o in objs[::3]:
        policy.on_access(o)
    everyone = list(policy.candidates())
    assert sorted(o.oid for o in everyone) == sorted(o.oid for o in objs)
    for salt in "ab":
        mine = list(policy.candidates(salt))
        assert {o.key.salt for o in mine} == {salt}
        assert len(mine) == 6
    assert list(policy.candidates("nobody")) == []


@pytest.mark.parametrize("eviction", POLICIES)
def test_any_object_may_be_removed_and_only_evicted_ones_become_ghosts(eviction: str) -> None:
    policy = make_policy(eviction)
    objs = [obj(n, "s") for n in range(6)]
    for o in objs:
        policy.on_insert(o)
    policy.on_access(objs[4])
    objs[2].apply(Event.DELETE)
    policy.on_remove(objs[2])
    evict(policy, objs[3])
    policy.on_remove(objs[3])  # twice: nothing happens
    policy.on_remove(obj(99))  # never inserted: nothing happens
    left = [o.oid for o in policy.candidates()]
    assert sorted(left) == sorted(o.oid for o in objs if o not in (objs[2], objs[3]))
    assert sorted(o.oid for o in policy.candidates("s")) == sorted(left)
    if eviction != "lru":
        assert policy.ghosts == 1  # type: ignore[attr-defined]
    for o in objs:
        if o.state is ObjectState.READY:
            evict(policy, o)
    assert list(policy.candidates()) == [] and list(policy.candidates("s")) == []


@pytest.mark.parametrize("eviction", SMART)
def test_ghosts_are_bounded_by_the_objects_held(eviction: str) -> None:
    clock = FakeClock()
    cache = cache_of(8, eviction)
    for n in range(5000):
        put(cache, n, clock)
    ghosts: int = cache.policy.ghosts  # type: ignore[attr-defined]
    assert 0 < ghosts <= 64


@pytest.mark.parametrize("eviction", SMART)
def test_the_frequently_used_set_survives_scans_in_a_tenants_quota_view(eviction: str) -> None:
    policy = make_policy(eviction)
    hot = [obj(n, "t") for n in range(3)]
    for o in hot:
        policy.on_insert(o)
        policy.on_access(o)
        policy.on_access(o)
    scan = [obj(n, "t") for n in range(100, 110)]
    for o in scan:
        policy.on_insert(o)
    first = []
    for o in policy.candidates("t"):
        first.append(o)
        if len(first) == 5:
            break
    assert not set(first) & set(hot)


class PolicyAgainstReference(RuleBasedStateMachine):
    """Random inserts, accesses, evictions (the first evictable candidate, as the room picks),
    deletions, locks and abandoned iterations; the reference is the set of live objects."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.policy: EvictionPolicy = make_policy(self.name)
        self.live: dict[int, L1Object] = {}
        self.locked: set[int] = set()
        self.next = 0

    @rule(salt=st.sampled_from("xyz"), again=st.integers(0, 40))
    def insert(self, salt: str, again: int) -> None:
        # an earlier key again now and then (a ghost hit when it was evicted), under a new oid
        n = again if again < self.next and again % 3 == 0 else self.next
        if any(o.key == key(n, salt) for o in self.live.values()):
            n = self.next
        self.next += 1
        o = L1Object(oid=self.next, key=key(n, salt), offset=0, size=PAGE * (1 + n % 3))
        o.apply(Event.RESERVE)
        o.apply(Event.COMMIT)
        self.policy.on_insert(o)
        self.live[o.oid] = o

    @precondition(lambda self: bool(self.live))
    @rule(i=st.integers(0, 1 << 30))
    def access(self, i: int) -> None:
        self.policy.on_access(self.pick(i))

    @precondition(lambda self: bool(self.live))
    @rule(i=st.integers(0, 1 << 30))
    def lock_or_unlock(self, i: int) -> None:
        o = self.pick(i)
        if o.oid in self.locked:
            o.apply(Event.UNLOCK)
            self.locked.discard(o.oid)
        else:
            o.apply(Event.LOCK)
            self.locked.add(o.oid)

    @rule(salt=st.sampled_from([None, "x", "y", "z"]), k=st.integers(1, 4))
    def evict_some(self, salt: str | None, k: int) -> None:
        victims = []
        for o in self.policy.candidates(salt):
            if len(victims) >= k:
                break
            assert o.oid in self.live
            if o.evictable:
                victims.append(o)
        for o in victims:
            o.apply(Event.EVICT)
            self.policy.on_remove(o)
            del self.live[o.oid]

    @precondition(lambda self: bool(self.live))
    @rule(i=st.integers(0, 1 << 30))
    def delete(self, i: int) -> None:
        o = self.pick(i)
        if o.oid in self.locked:
            return
        o.apply(Event.DELETE)
        self.policy.on_remove(o)
        del self.live[o.oid]

    @rule(stop=st.integers(0, 5))
    def abandon(self, stop: int) -> None:
        it: Iterator[L1Object] = self.policy.candidates()
        for _ in zip(range(stop), it, strict=False):
            pass

    @invariant()
    def candidates_are_the_live_objects_once_each(self) -> None:
        got = [o.oid for o in self.policy.candidates()]
        assert sorted(got) == sorted(self.live)
        for salt in "xyz":
            mine = [o.oid for o in self.policy.candidates(salt)]
            assert sorted(mine) == sorted(oid for oid, o in self.live.items() if o.key.salt == salt)

    @invariant()
    def ghosts_are_bounded(self) -> None:
        ghosts = getattr(self.policy, "ghosts", 0)
        assert ghosts <= max(2 * len(self.live), 64)

    def pick(self, i: int) -> L1Object:
        return list(self.live.values())[i % len(self.live)]


class S3FIFOAgainstReference(PolicyAgainstReference):
    name = "s3fifo"


class ARCAgainstReference(PolicyAgainstReference):
    name = "arc"


RUNS = machine_runs(50, 60)
PolicyAgainstReference.TestCase.settings = RUNS
S3FIFOAgainstReference.TestCase.settings = RUNS
ARCAgainstReference.TestCase.settings = RUNS
test_lru_against_reference = PolicyAgainstReference.TestCase
test_s3fifo_against_reference = S3FIFOAgainstReference.TestCase
test_arc_against_reference = ARCAgainstReference.TestCase
