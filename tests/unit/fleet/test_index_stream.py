"""The index's bit bookkeeping and resync, and the stream tracker's gap decisions."""

from __future__ import annotations

from fleet.index import ChunkIndex
from fleet.stream import Action, StreamTracker


def test_add_remove_clear_and_counts() -> None:
    ix = ChunkIndex()
    a, b = ix.holder("a"), ix.holder("b")
    ix.add_many(a, [1, 2, 3])
    ix.add(a, 1)  # twice: counted once
    ix.add_many(b, [3, 4])
    assert ix.counts == {a: 3, b: 2} and len(ix) == 4
    ix.remove(a, 3)
    ix.remove(a, 99)  # unknown: nothing
    assert ix.get(3) == 1 << b and ix.counts[a] == 2
    ix.clear(1 << a)
    assert ix.masks == {3: 1 << b, 4: 1 << b} and ix.counts[a] == 0
    ix.drop_holders(["b"])
    assert len(ix) == 0 and ix.holder("c") == b  # the bit is recycled


def test_resync_adds_the_listing_and_removes_what_it_did_not_name() -> None:
    ix = ChunkIndex()
    a, b, other = ix.holder("a"), ix.holder("b"), ix.holder("x")
    ix.add_many(a, [1, 2, 3])
    ix.add_many(b, [5])
    ix.add_many(other, [1, 2, 3, 5])
    r = ix.begin_resync((1 << a) | (1 << b))
    r.add(a, [2, 3, 4])
    assert r.finish() == 2  # a lost 1, b lost 5
    assert {h for h, m in ix.masks.items() if m & (1 << a)} == {2, 3, 4}
    assert not any(m & (1 << b) for m in ix.masks.values())
    assert {h for h, m in ix.masks.items() if m & (1 << other)} == {1, 2, 3, 5}  # untouched
    assert ix.counts == {a: 3, b: 0, other: 4}


def test_tracker_applies_in_order_replays_gaps_and_resyncs_new_incarnations() -> None:
    t = StreamTracker()
    assert t.on_batch(0, "i1") is Action.RESYNC  # nothing known: inventory first
    t.resynced("i1", 4)
    assert t.on_batch(3, "i1") is Action.SKIP  # listed already
    assert t.on_batch(5, "i1") is Action.APPLY
    assert t.on_batch(8, "i1") is Action.REPLAY  # 6, 7 missing
    assert t.expected == 6
    # the replay from 6 starts at 6: applied in order, then the gap is closed
    assert [t.on_batch(s, "i1") for s in (6, 7, 8)] == [Action.APPLY] * 3
    assert t.replay_done(6, 8) is Action.APPLY
    assert not t.gap_unfilled(9)
    assert t.gap_unfilled(12)  # the buffer started past what we needed
    assert t.on_batch(0, "i2") is Action.RESYNC  # a restart
    t.resynced("i2", -1)
    assert t.on_batch(9, "i1") is Action.SKIP  # a late batch of the old incarnation
    assert t.on_batch(0, "i2") is Action.APPLY


def test_a_heartbeat_ahead_of_the_stream_asks_for_a_replay_after_the_grace() -> None:
    t = StreamTracker()
    t.resynced("i1", 10)
    assert t.published("i1", 10, 0.0, 2.0) is Action.SKIP  # nothing missing
    assert t.published("i1", 12, 1.0, 2.0) is Action.SKIP  # behind: wait, it may be in flight
    assert t.published("i1", 12, 2.5, 2.0) is Action.SKIP
    assert t.published("i1", 12, 3.1, 2.0) is Action.REPLAY
    assert t.published("i9", 0, 4.0, 2.0) is Action.RESYNC  # restarted, no batch seen yet


def test_in_vllms_format_a_stream_back_at_zero_is_a_restart() -> None:
    t = StreamTracker()  # batches carry no incarnation: the inventory and heartbeats name it
    assert t.on_batch(0) is Action.RESYNC
    t.resynced("i1", -1)  # a fresh sidecar: nothing published yet
    assert [t.on_batch(s) for s in (0, 1, 2)] == [Action.APPLY] * 3
    assert t.on_batch(1) is Action.SKIP  # a duplicate
    assert t.on_batch(0) is Action.RESYNC and t.resync_reason == "restart"
    t.resynced("i2", 0)
    assert t.on_batch(1) is Action.APPLY
    assert t.published("i2", 1, 0.0, 1.0) is Action.SKIP
    assert t.published("i3", 0, 0.0, 1.0) is Action.RESYNC  # its heartbeat names the new one
