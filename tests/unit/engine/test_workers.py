"""The worker registry's state machine: alive -> suspect on silence -> alive on a heartbeat; dead
is terminal; the dead kept are bounded; a worker that never heartbeated is never suspected."""

from __future__ import annotations

import pytest

from engine.workers import IllegalWorkerMove, WorkerRegistry, WorkerState

A = "a" * 32


def test_silence_makes_a_heartbeating_worker_suspect_and_a_heartbeat_revives_it() -> None:
    reg = WorkerRegistry(timeout_s=10, heartbeat_s=2)
    w = reg.add(1, A, "worker", 0, now=0)
    reg.attach(1, 4242, now=0.5)
    assert reg.beat(1, now=1) is False and w.state is WorkerState.ALIVE
    assert reg.sweep(now=10.9) == []  # silent 9.9 s
    assert reg.sweep(now=11) == [w] and w.state is WorkerState.SUSPECT
    assert reg.sweep(now=30) == []  # suspect once, not again
    assert reg.beat(1, now=31) is True and w.state is WorkerState.ALIVE
    assert (w.suspected, w.revived, w.heartbeats, w.pid) == (1, 1, 2, 4242)
    assert (reg.totals.suspect, reg.totals.revived) == (1, 1)
    assert reg.sweep(now=41) == [w]  # silent again: suspect again
    assert w.suspected == 2


def test_a_worker_that_never_heartbeated_is_never_suspect() -> None:
    reg = WorkerRegistry(timeout_s=1, heartbeat_s=0.2)
    w = reg.add(1, A, now=0)
    assert reg.sweep(now=1e6) == [] and w.state is WorkerState.ALIVE


def test_dead_is_terminal_from_alive_or_suspect() -> None:
    reg = WorkerRegistry(timeout_s=1, heartbeat_s=0.2)
    a = reg.add(1, A, "scheduler", now=0)
    b = reg.add(2, A, "worker", 1, now=0)
    reg.beat(2, now=0)
    assert reg.sweep(now=2) == [b]
    assert reg.dead(1, now=3) is a and reg.dead(2, now=3) is b
    assert a.state is b.state is WorkerState.DEAD and reg.totals.dead == 2
    assert reg.dead(1, now=4) is None  # once
    assert reg.beat(2, now=5) is False and b.state is WorkerState.DEAD  # a late heartbeat revives nothing
    with pytest.raises(IllegalWorkerMove):
        b.move(WorkerState.ALIVE)
    assert reg.by_state() == {WorkerState.ALIVE: 0, WorkerState.SUSPECT: 0, WorkerState.DEAD: 2}
    assert [w.id for w in reg.instances()[A]] == [1, 2]


def test_the_dead_kept_are_bounded_oldest_dropped() -> None:
    reg = WorkerRegistry(timeout_s=1, heartbeat_s=0.2, dead_kept=3)
    for i in range(1, 11):
        reg.add(i, f"{i:032x}", now=i)
        reg.dead(i, now=i)
    assert reg.totals.dead == 10 and reg.by_state()[WorkerState.DEAD] == 3
    assert [w.id for ws in reg.instances().values() for w in ws] == [8, 9, 10]
    assert reg.get(1) is None and reg.get(10) is not None


def test_registering_a_live_id_twice_is_refused() -> None:
    reg = WorkerRegistry()
    reg.add(1, A, now=0)
    with pytest.raises(ValueError, match="registered already"):
        reg.add(1, A, now=1)
    with pytest.raises(ValueError, match="positive"):
        WorkerRegistry(timeout_s=0)
