"""The directory's intake: messages charged in bytes against a budget all subscriptions share;
what does not fit is dropped, counted and flags the instance for a resync."""

from __future__ import annotations

import asyncio
from typing import Any

from fleet.http.intake import OVERHEAD, Budget, Intake, rcvhwm


def make(budget: Budget, drops: list[int]) -> Intake:
    sub: Any = None  # put/get/close never touch the socket unless start() ran
    return Intake(sub, budget, drops.append)


def test_messages_past_the_shared_budget_are_dropped_counted_and_flag_a_resync() -> None:
    budget = Budget(3 * (OVERHEAD + 1000))
    drops: list[int] = []
    a, b = make(budget, drops), make(budget, drops)
    frame = [b"t", b"x" * 999]
    assert a.put(frame) and a.put(frame) and b.put(frame)
    assert not b.put(frame) and not a.put(frame)  # the budget is the instances' together
    assert (a.dropped, b.dropped, len(drops)) == (1, 1, 2)
    assert a.take_overflow() and not a.take_overflow()
    assert budget.bytes == 3 * (OVERHEAD + 1000)

    async def drain() -> None:
        assert await a.get(wait_s=0) == frame
        assert b.put(frame)  # room again
        await a.close()  # what it held goes back to the budget
        assert await a.get(wait_s=0) is None

    asyncio.run(drain())
    assert budget.bytes == 2 * (OVERHEAD + 1000)


def test_libzmq_holds_few_messages_per_socket() -> None:
    assert rcvhwm(32 << 20, 2 << 20) == 16  # the defaults: 32 MiB at the largest message size
    assert rcvhwm(16 << 20, 16 << 20) == 2
    assert rcvhwm(1 << 40, 1 << 16) == 1000
