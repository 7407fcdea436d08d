from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.l1.lifecycle import TERMINAL, TRANSITIONS, Event, IllegalTransition, L1Object, ObjectState
from tests.factories import FakeClock, key, make_cache, reserve
from tests.machine_runs import machine_runs

S, E = ObjectState, Event


def obj() -> L1Object:
    return L1Object(oid=1, key=key(1), offset=0, size=4096)


def test_the_happy_path() -> None:
    o = obj()
    assert o.apply(E.RESERVE) is S.WRITE_RESERVED
    assert not o.visible
    assert o.apply(E.COMMIT) is S.READY
    assert o.apply(E.LOCK) is S.READ_LOCKED
    assert o.apply(E.LOCK) is S.READ_LOCKED
    assert o.locks == 2
    assert o.apply(E.UNLOCK) is S.READ_LOCKED
    assert o.apply(E.UNLOCK) is S.READY
    assert o.apply(E.EVICT) is S.EVICTED


def test_doomed_object_is_deleted_by_its_last_reader() -> None:
    o = obj()
    o.apply(E.RESERVE)
    o.apply(E.COMMIT)
    o.apply(E.LOCK)
    o.doomed = True
    assert o.apply(E.UNLOCK) is S.DELETED


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        ([], E.COMMIT),  # commit without a reservation
        ([E.RESERVE], E.LOCK),  # readers never see a reservation
        ([E.RESERVE], E.EVICT),  # reservations are never evicted
        ([E.RESERVE, E.COMMIT, E.LOCK], E.EVICT),  # locked objects are never evicted
        ([E.RESERVE, E.COMMIT], E.UNLOCK),  # unlock without lock
        ([E.RESERVE, E.COMMIT, E.EVICT], E.LOCK),  # terminal
    ],
)
def test_illegal_moves_raise_and_change_nothing(path: list[Event], bad: Event) -> None:
    o = obj()
    for ev in path:
        o.apply(ev)
    before = (o.state, o.locks)
    with pytest.raises(IllegalTransition):
        o.apply(bad)
    assert (o.state, o.locks) == before


@settings(max_examples=300)
@given(st.lists(st.tuples(st.sampled_from(list(Event)), st.booleans()), max_size=40))
def test_random_event_sequences_never_reach_an_illegal_state(events: list[tuple[Event, bool]]) -> None:
    o = obj()
    for ev, doom in events:
        o.doomed = o.doomed or doom
        before = o.state
        try:
            after = o.apply(ev)
        except IllegalTransition:
            assert o.state is before
            continue
        assert after in TRANSITIONS[(before, ev)]
        assert (o.locks > 0) == (after is S.READ_LOCKED)
        if before in TERMINAL:
            pytest.fail("a terminal object moved")


class CacheMachine(RuleBasedStateMachine):
    """Random operations through L1Cache's API: objects stay in legal states, memory adds up,
    locked, pinned and reserved objects are never evicted."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.cache = make_cache(8 * 4096, high=0.9, low=0.6)
        self.n = 0
        self.reserved: list[L1Object] = []
        self.locked: list[L1Object] = []
        self.pinned: list[L1Object] = []
        self.made: list[L1Object] = []  # every object reserved; the live ones are in the cache

    @rule(size=st.integers(min_value=1, max_value=3 * 4096))
    def reserve(self, size: int) -> None:
        self.n += 1
        o = reserve(self.cache, key(self.n), size, self.clock())
        if o is not None:
            self.reserved.append(o)
            self.made.append(o)

    @precondition(lambda self: self.reserved)
    @rule(data=st.data(), commit=st.booleans())
    def finish(self, data: st.DataObject, commit: bool) -> None:
        o = self.reserved.pop(data.draw(st.integers(0, len(self.reserved) - 1)))
        if o.state is not S.WRITE_RESERVED:
            return  # reaped meanwhile
        if commit:
            self.cache.commit(o.oid, self.clock())
        else:
            self.cache.abort(o)

    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        ready = [o for o in self._live() if o.visible and not o.doomed]
        if ready:
            o = data.draw(st.sampled_from(ready))
            self.cache.lock(o, self.clock())
            self.locked.append(o)

    @precondition(lambda self: self.locked)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        self.cache.unlock(self.locked.pop(data.draw(st.integers(0, len(self.locked) - 1))))

    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        visible = [o for o in self._live() if o.visible]
        if visible:
            o = data.draw(st.sampled_from(visible))
            self.cache.pin(o)
            self.pinned.append(o)

    @precondition(lambda self: self.pinned)
    @rule(data=st.data(), copied=st.booleans())
    def unpin(self, data: st.DataObject, copied: bool) -> None:
        o = self.pinned.pop(data.draw(st.integers(0, len(self.pinned) - 1)))
        self.cache.unpin(o, copied=copied)

    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        live = list(self._live())
        if live:
            self.cache.delete(data.draw(st.sampled_from(live)))

    @rule(seconds=st.floats(0, 15))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.cache.reap(self.clock())

    def _live(self) -> list[L1Object]:
        self.made = [o for o in self.made if o.state not in TERMINAL]
        assert len(self.made) == len(self.cache)
        return list(self.made)

    @invariant()
    def consistent(self) -> None:
        self.cache.allocator.check()
        live = list(self._live())
        assert sum(self.cache.allocator.aligned(o.size) for o in live) == self.cache.allocator.used
        for o in live:
            assert o.state in (S.WRITE_RESERVED, S.READY, S.READ_LOCKED)
            assert (o.locks > 0) == (o.state is S.READ_LOCKED)
        for o in self.locked:
            assert o.state is S.READ_LOCKED, "a locked object was evicted or deleted"
        for o in self.pinned:
            assert o.visible, "a pinned object was evicted or deleted"


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = machine_runs(60, 50)


@pytest.mark.parametrize("bad", [E.EVICT, E.DELETE, E.UNLOCK])
def test_a_pinned_object_cannot_be_evicted_or_deleted(bad: Event) -> None:
    o = obj()
    o.apply(E.RESERVE)
    o.apply(E.COMMIT)
    assert o.apply(E.PIN) is S.READY
    with pytest.raises(IllegalTransition):
        o.apply(bad)
    assert (o.state, o.pins, o.locks) == (S.READY, 1, 0)
    assert o.apply(E.UNPIN) is S.READY
    with pytest.raises(IllegalTransition):
        o.apply(E.UNPIN)  # unpin without a pin
