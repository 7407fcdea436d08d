"""A suspect client session (engine/workers.py) holds nothing that blocks others: the requests it
took part in lose their locks (its late RELEASE is invalid), its reservations are quarantined
(their memory kept, their commit refused) until it is gone."""

from __future__ import annotations

from engine.facade import CacheEngine
from engine.results import Extent, SlotStatus
from tests.factories import engine, small_layout, tokens

CHUNK = 16
SCHED, WORKER, OTHER = 11, 12, 13


def test_a_suspect_workers_locks_go_and_its_reservations_are_quarantined() -> None:
    with engine(1 << 20) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        toks = tokens(2 * CHUNK)
        slots = eng.store(eid, "w", toks, "", holder=OTHER)
        assert all(eng.commit(eid, [s.oid for s in slots]))
        assert eng.lookup(eid, "r", toks, "", holder=SCHED).hit_chunks == 2
        extents = eng.retrieve(eid, "r", 0, 2, holder=WORKER)
        assert eng.lookup(eid, "kept", toks, "", holder=SCHED).hit_chunks == 2  # not the worker's
        late = eng.store(eid, "late", tokens(2 * CHUNK, start=7), "", holder=WORKER)
        assert [s.status for s in late] == [SlotStatus.RESERVED] * 2
        assert eng.suspect_holder(WORKER) == (1, 2)
        assert eng.locked_requests() == 1  # "kept": only the scheduler looked it up
        assert eng.cache.quarantine.objects == 2
        assert eng.commit(eid, [s.oid for s in late]) == [False, False]  # late writes refused
        assert eng.lookup(eid, "x", tokens(2 * CHUNK, start=7), "").hit_chunks == 0  # never served
        # The objects it copied from are unchanged, but its copy is answered invalid all the same.
        assert eng.release(eid, "r", [e.oid for e in extents], holder=WORKER) is False
        assert eng.counters.suspect_releases == 1
        # Alive again, it works with a clean state: a new lookup and retrieve, a valid release.
        assert eng.lookup(eid, "r", toks, "", holder=SCHED).hit_chunks == 2
        extents = eng.retrieve(eid, "r", 0, 2, holder=WORKER)
        assert eng.release(eid, "r", [e.oid for e in extents], holder=WORKER) is True
        # Its lifeline closes: the quarantine is freed.
        eng.end_holder(WORKER)
        assert eng.cache.quarantine.objects == 0 and eng.cache.allocator.check() is None
        c = eng.counters
        assert (c.suspect_locks, c.suspect_reservations) == (1, 2)


def test_the_scheduler_suspect_drops_the_requests_it_looked_up() -> None:
    with engine(1 << 20) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        toks = tokens(2 * CHUNK)
        slots = eng.store(eid, "w", toks, "")
        assert all(eng.commit(eid, [s.oid for s in slots]))
        eng.lookup(eid, "r", toks, "", holder=SCHED)
        assert eng.suspect_holder(SCHED) == (1, 0)
        assert eng.cache.state_counts()["read_locked"] == 0
        assert eng.suspect_holder(SCHED) == (0, 0)  # nothing left: idempotent


def retrieved(eng: CacheEngine) -> tuple[int, bytes, list[Extent]]:
    """Two chunks stored, looked up by the scheduler and retrieved by the worker: (engine id,
    tokens, the extents copied from)."""
    eid = eng.register("m", small_layout()).engine_id
    toks = tokens(2 * CHUNK)
    slots = eng.store(eid, "w", toks, "")
    assert all(eng.commit(eid, [s.oid for s in slots]))
    eng.lookup(eid, "r", toks, "", holder=SCHED)
    return eid, toks, eng.retrieve(eid, "r", 0, 2, holder=WORKER)


def test_a_late_release_leaves_a_newer_lookup_of_the_request_alone() -> None:
    with engine(1 << 20) as (eng, _):
        eid, toks, extents = retrieved(eng)
        assert eng.suspect_holder(WORKER) == (1, 0)
        eng.lookup(eid, "r", toks, "", holder=SCHED)  # the scheduler asks again meanwhile
        assert eng.release(eid, "r", [e.oid for e in extents], holder=WORKER) is False
        assert eng.locked_requests() == 1  # the scheduler's new locks stay


def test_a_release_naming_a_replaced_lookup_leaves_the_newer_one_its_locks() -> None:
    # A worker's RELEASE sent without waiting can reach the sidecar after the scheduler's next
    # LOOKUP of the request (another connection): it names the epoch it copied under.
    with engine(1 << 20) as (eng, _):
        eid, toks, extents = retrieved(eng)
        first = eng.lock_epoch(eid, "r")
        eng.lookup(eid, "r", toks, "", holder=SCHED)  # preempted and resumed: asked again
        second = eng.lock_epoch(eid, "r")
        assert 0 < first < second
        # the late RELEASE: its copy is valid (the objects live on), the new locks stay
        assert eng.release(eid, "r", [e.oid for e in extents], holder=WORKER, epoch=first) is True
        assert eng.locked_requests() == 1 and eng.cache.state_counts()["read_locked"] == 2
        assert len(eng.retrieve(eid, "r", 0, 2, holder=WORKER)) == 2
        assert eng.release(eid, "r", [e.oid for e in extents], holder=WORKER, epoch=second) is True
        assert eng.locked_requests() == 0 and eng.cache.state_counts()["read_locked"] == 0
        assert eng.lock_epoch(eid, "r") == 0
