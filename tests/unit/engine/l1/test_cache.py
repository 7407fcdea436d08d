from __future__ import annotations

import pytest

from app.errors import LeaseExpired
from app.wiring import build_cache
from engine.l1.cache import L1Cache, Refusal
from engine.l1.lifecycle import L1Object, ObjectState
from engine.tenants.quota import L1
from tests.factories import FakeClock, key, l1_settings, make_cache, reserve

PAGE = 4096


def filled(n: int, capacity_pages: int, **kw: float) -> tuple[list, object, FakeClock]:  # type: ignore[type-arg]
    clock = FakeClock()
    cache = make_cache(capacity_pages * PAGE, **kw)
    objs = []
    for i in range(n):
        o = reserve(cache, key(i), PAGE, clock())
        assert o is not None
        cache.commit(o.oid, clock())
        clock.advance(1)
        objs.append(o)
    return objs, cache, clock


def test_lru_evicts_exactly_the_least_recently_used() -> None:
    objs, cache, clock = filled(4, 4)
    assert cache.find(key(0), clock()) is objs[0]  # touch 0: order is now 1, 2, 3, 0
    o = reserve(cache, key(10), PAGE, clock())
    assert o is not None
    assert objs[1].state is ObjectState.EVICTED
    assert [x.state for x in (objs[0], objs[2], objs[3])] == [ObjectState.READY] * 3
    o2 = reserve(cache, key(11), PAGE, clock())
    assert o2 is not None
    assert objs[2].state is ObjectState.EVICTED
    assert cache.counters.evicted == 2


def test_watermarks_evict_down_to_the_low_mark() -> None:
    objs, cache, clock = filled(8, 10, high=0.8, low=0.5)
    # 8 of 10 pages used; one more crosses 80%: evict oldest until 9 pages fit under... 50% + 1.
    assert reserve(cache, key(99), PAGE, clock()) is not None
    evicted = [o for o in objs if o.state is ObjectState.EVICTED]
    assert evicted == objs[:4]
    assert cache.allocator.used == 5 * PAGE


def test_locked_and_reserved_objects_are_never_evicted_and_no_space_is_explicit() -> None:
    objs, cache, clock = filled(3, 4)
    for o in objs:
        cache.lock(o, clock())
    pending = reserve(cache, key(50), PAGE, clock())
    assert pending is not None and pending.state is ObjectState.WRITE_RESERVED
    assert reserve(cache, key(51), PAGE, clock()) is None
    assert cache.counters.no_space == 1
    assert all(o.state is ObjectState.READ_LOCKED for o in objs)
    cache.unlock(objs[0])
    assert reserve(cache, key(51), PAGE, clock()) is not None
    assert objs[0].state is ObjectState.EVICTED


def test_reservation_is_invisible_until_commit() -> None:
    cache = make_cache(4 * PAGE)
    clock = FakeClock()
    o = reserve(cache, key(1), 100, clock())
    assert o is not None
    assert cache.find(key(1), clock()) is None
    cache.commit(o.oid, clock())
    assert cache.find(key(1), clock()) is o


def test_expired_reservation_is_reclaimed_and_a_late_commit_is_refused() -> None:
    cache = make_cache(2 * PAGE)
    clock = FakeClock()
    o = reserve(cache, key(1), PAGE, clock())
    assert o is not None
    clock.advance(cache.write_lease_s + 0.1)
    assert cache.reap(clock()) == 1
    assert cache.allocator.used == 0
    with pytest.raises(LeaseExpired):
        cache.commit(o.oid, clock())
    cache.allocator.check()


def test_delete_of_a_locked_object_waits_for_its_reader() -> None:
    objs, cache, clock = filled(1, 2)
    cache.lock(objs[0], clock())
    cache.delete(objs[0])
    assert cache.find(key(0), clock()) is None  # doomed: no new readers
    assert cache.allocator.used == PAGE  # the reader still copies from it
    cache.unlock(objs[0])
    assert objs[0].state is ObjectState.DELETED
    assert cache.allocator.used == 0


# --- pins (copies to L2), counted apart from read locks -----------------------------------------


def test_a_pinned_object_stays_readable_and_is_never_evicted() -> None:
    objs, cache, clock = filled(2, 2)
    cache.pin(objs[0])
    assert objs[0].state is ObjectState.READY and objs[0].in_l2
    assert cache.find(key(0), clock()) is objs[0]
    cache.lock(objs[0], clock())
    cache.unlock(objs[0])
    assert objs[0].pins == 1 and objs[0].locks == 0
    assert reserve(cache, key(10), PAGE, clock()) is not None  # room made from the unpinned one
    assert (objs[0].state, objs[1].state) == (ObjectState.READY, ObjectState.EVICTED)
    assert reserve(cache, key(11), PAGE, clock()) is None
    assert cache.unpin(objs[0], copied=True) is True  # nothing holds it any more
    assert objs[0].in_l2
    assert reserve(cache, key(11), PAGE, clock()) is not None
    assert objs[0].state is ObjectState.EVICTED


def test_unpin_says_whether_a_reader_still_holds_it_and_records_a_failed_copy() -> None:
    objs, cache, clock = filled(1, 1)
    cache.pin(objs[0])
    cache.lock(objs[0], clock())
    assert cache.unpin(objs[0], copied=False) is False
    assert not objs[0].in_l2
    assert objs[0].state is ObjectState.READ_LOCKED


def test_a_pinned_object_deleted_or_temporary_goes_at_its_last_unpin() -> None:
    clock = FakeClock()
    cache = make_cache(4 * PAGE)
    temp = cache.try_reserve(key(1), PAGE, clock(), temporary=True)
    doomed = reserve(cache, key(2), PAGE, clock())
    assert isinstance(temp, L1Object) and doomed is not None
    for o in (temp, doomed):
        cache.commit(o.oid, clock())
        cache.pin(o)
        cache.lock(o, clock())
    cache.delete(doomed)
    assert doomed.doomed and doomed.state is ObjectState.READ_LOCKED
    for o in (temp, doomed):
        cache.unlock(o)
        assert o.state is ObjectState.READY  # still pinned: its copy is being read
        assert cache.unpin(o, copied=True) is True
        assert o.state is ObjectState.DELETED
    assert len(cache) == 0 and cache.allocator.used == 0


def test_make_ordinary_keeps_a_temporary_object_after_its_last_reader() -> None:
    clock = FakeClock()
    cache = make_cache(PAGE)
    o = cache.try_reserve(key(1), PAGE, clock(), temporary=True)
    assert isinstance(o, L1Object)
    cache.commit(o.oid, clock())
    cache.lock(o, clock())
    cache.make_ordinary(o)
    cache.unlock(o)
    assert o.state is ObjectState.READY and cache.find(key(1), clock()) is o


def test_a_reservation_busy_for_io_is_not_reaped_until_the_io_ends() -> None:
    clock = FakeClock()
    cache = make_cache(PAGE)
    o = reserve(cache, key(1), PAGE, clock())
    assert o is not None
    clock.advance(60)
    with cache.busy_for_io(o):
        assert cache.reap(clock()) == 0
    assert cache.reap(clock()) == 1
    assert o.state is ObjectState.DELETED


def fenced_cache(capacity_pages: int, cap_pages: int, total_pages: int | None = None) -> L1Cache:
    """A cache whose instances may each hold `cap_pages` quarantined or in flight, and all of them
    `total_pages` (default: the whole cache)."""
    total = (capacity_pages if total_pages is None else total_pages) * PAGE
    settings = l1_settings().model_copy(
        update={"quarantine_max_bytes": cap_pages * PAGE, "quarantine_total_max_bytes": total}
    )
    return build_cache(settings, capacity_pages * PAGE)


def test_an_expired_client_reservation_is_quarantined_until_its_holder_is_gone() -> None:
    cache = fenced_cache(3, cap_pages=3)
    stalled = cache.try_reserve(key(1), PAGE, 0.0, owner="a", holder=7)
    sidecar_own = cache.try_reserve(key(2), PAGE, 0.0, owner="a")  # holder 0: the sidecar writes
    assert isinstance(stalled, L1Object) and isinstance(sidecar_own, L1Object)
    assert cache.reap(100.0) == 2
    assert stalled.state is ObjectState.QUARANTINED and sidecar_own.state is ObjectState.DELETED
    assert (cache.quarantine.bytes, cache.quarantine.objects, cache.quarantine.of("a")) == (PAGE, 1, PAGE)
    with pytest.raises(LeaseExpired):
        cache.commit(stalled.oid, 100.0)
    # The key is free at once, and never gets the quarantined extent: nor does anything else.
    offsets = set()
    for i in (1, 3):
        again = cache.try_reserve(key(i), PAGE, 100.0, owner="b", holder=8)
        assert isinstance(again, L1Object)
        offsets.add(again.offset)
    assert stalled.offset not in offsets
    assert cache.try_reserve(key(4), PAGE, 100.0, owner="b", holder=8) is Refusal.NO_SPACE
    assert cache.ledger.held("", L1) == 2 * PAGE  # the tenant holds only its live reservations
    cache.release_holder(8)  # another holder: the quarantine stays
    assert stalled.state is ObjectState.QUARANTINED and cache.allocator.used == PAGE
    cache.release_holder(7)
    assert stalled.state is ObjectState.DELETED and cache.allocator.used == 0
    assert (cache.quarantine.bytes, cache.quarantine.objects, cache.quarantine.of("a")) == (0, 0, 0)
    cache.allocator.check()


def test_an_instance_over_its_quarantine_cap_is_refused_and_others_are_not() -> None:
    cache = fenced_cache(8, cap_pages=2)
    for i in range(2):
        assert isinstance(cache.try_reserve(key(i), PAGE, 0.0, owner="a", holder=1), L1Object)
    cache.reap(100.0)
    assert cache.quarantine.of("a") == 2 * PAGE
    assert cache.try_reserve(key(10), PAGE, 100.0, owner="a", holder=2) is Refusal.NO_SPACE
    assert cache.counters.quarantine_refused == 1
    assert isinstance(cache.try_reserve(key(11), PAGE, 100.0, owner="b", holder=3), L1Object)
    cache.release_holder(1)
    assert isinstance(cache.try_reserve(key(10), PAGE, 100.0, owner="a", holder=2), L1Object)


def test_find_chain_sees_exactly_what_find_sees_through_every_lifecycle_move() -> None:
    """`find_chain` reads a second index: it must agree with `find` after every kind of change."""
    clock = FakeClock()
    cache = make_cache(8 * PAGE, high=1.0, low=1.0)
    ns = key(0).namespace

    def chain(salt: str = "", n: int = 6) -> list[int]:
        found = cache.find_chain(ns, salt, [key(i, salt).chunk_hash for i in range(n)], clock())
        by_find = []
        for i in range(n):
            o = cache.find(key(i, salt), clock())
            if o is None:
                break
            by_find.append(o)
        assert found == by_find
        return [o.oid for o in found]

    objs = [reserve(cache, key(i), PAGE, clock()) for i in range(4)]
    assert all(o is not None for o in objs)
    assert chain() == []  # reserved: invisible
    for o in objs[:3]:
        assert o is not None
        cache.commit(o.oid, clock())
    assert chain() == [o.oid for o in objs[:3] if o is not None]  # stops at the reservation
    other = reserve(cache, key(0, "tenant-b"), PAGE, clock())
    assert other is not None
    cache.commit(other.oid, clock())
    assert chain("tenant-b") == [other.oid] and chain("tenant-c") == []
    a, b, c, d = objs
    assert a is not None and b is not None and c is not None and d is not None
    cache.lock(b, clock())
    cache.delete(b)  # doomed while locked: no longer found, freed at the unlock
    assert chain() == [a.oid]
    cache.unlock(b)
    assert chain() == [a.oid] and cache.peek(key(1)) is None
    cache.abort(d)
    again = reserve(cache, key(1), PAGE, clock())  # the key is free again: a new object
    assert again is not None
    cache.commit(again.oid, clock())
    assert chain() == [a.oid, again.oid, c.oid]
    for i in range(10, 16):  # fill the arena: the least recently used go, tenant-b's, then a
        o = reserve(cache, key(i), PAGE, clock())
        assert o is not None
        cache.commit(o.oid, clock())
    assert chain() == []
    assert cache.find_chain(ns, "", [key(1).chunk_hash, key(2).chunk_hash], clock()) == [again, c]


def test_a_store_never_reserves_more_than_its_instance_may_still_quarantine() -> None:
    cache = fenced_cache(8, cap_pages=2)
    first = [cache.try_reserve(key(i), PAGE, 0.0, owner="a", holder=1) for i in range(3)]
    assert isinstance(first[0], L1Object) and isinstance(first[1], L1Object)
    assert first[2] is Refusal.NO_SPACE  # two in flight: both may yet be quarantined
    assert cache.quarantine.exposure("a") == 2 * PAGE and cache.counters.quarantine_refused == 1
    cache.commit(first[0].oid, 0.0)  # committed: no longer at risk
    assert isinstance(cache.try_reserve(key(5), PAGE, 0.0, owner="a", holder=1), L1Object)
    assert isinstance(cache.try_reserve(key(6), PAGE, 0.0, owner="a"), L1Object)  # the sidecar's: not counted
    aborted = cache.try_reserve(key(7), PAGE, 0.0, owner="b", holder=2)
    assert isinstance(aborted, L1Object)
    cache.abort(aborted)
    assert cache.quarantine.exposure("b") == 0
    cache.reap(100.0)  # every writer stalls
    assert cache.quarantine.of("a") == 2 * PAGE and cache.quarantine.in_flight == 0


def test_stalled_writers_of_many_instances_quarantine_at_most_the_total() -> None:
    cache = fenced_cache(16, cap_pages=4, total_pages=6)
    ours = reserve(cache, key(1000), PAGE, 0.0)  # another tenant's chunk, committed
    assert ours is not None
    cache.commit(ours.oid, 0.0)
    got = {}
    for n, instance in enumerate("abc"):
        slots = [cache.try_reserve(key(100 * n + i), PAGE, 0.0, owner=instance, holder=n + 1)
                 for i in range(8)]  # fmt: skip
        got[instance] = sum(isinstance(o, L1Object) for o in slots)
    assert got == {"a": 4, "b": 2, "c": 0}  # per instance, then in all
    cache.reap(100.0)  # all of them stalled
    assert (cache.quarantine.bytes, cache.quarantine.in_flight) == (6 * PAGE, 0)
    assert cache.peek(key(1000)) is ours and ours.state is ObjectState.READY  # never pushed out
    cache.release_holder(1)  # a's writer is gone: its share is free for others again
    assert isinstance(cache.try_reserve(key(999), PAGE, 100.0, owner="c", holder=3), L1Object)
    cache.allocator.check()


def test_a_late_commit_or_abort_by_its_writer_frees_its_quarantined_memory() -> None:
    cache = fenced_cache(8, cap_pages=8)
    mine = [cache.try_reserve(key(i), PAGE, 0.0, owner="a", holder=1) for i in range(3)]
    theirs = cache.try_reserve(key(9), PAGE, 0.0, owner="a", holder=2)  # another session of "a"
    assert all(isinstance(o, L1Object) for o in [*mine, theirs])
    cache.reap(100.0)
    assert cache.quarantine.objects == 4
    oids = [o.oid for o in mine if isinstance(o, L1Object)]
    assert cache.writer_done(2, oids) == 0  # not its writer: nothing goes
    assert cache.writer_done(1, oids[:2]) == 2  # its writer is done with two of them
    assert (cache.quarantine.objects, cache.quarantine.of("a")) == (2, 2 * PAGE)
    assert cache.writer_done(0, oids) == 0 and cache.allocator.used == 2 * PAGE
    cache.release_holder(1)
    cache.release_holder(2)
    assert cache.quarantine.objects == 0 and cache.allocator.used == 0
    cache.allocator.check()
