"""The lease reaper loop outlives a failed pass: the failure is logged and counted, and the expired
leases of the passes after it are still reclaimed."""

from __future__ import annotations

import asyncio

import pytest

from app.wiring import build_cache, build_engine
from engine.results import SlotStatus
from tests.factories import arena, l1_settings, small_layout, tokens

pytestmark = pytest.mark.anyio


class FailingOnceClock:
    """The engine's clock; the reaper's first reading of it raises, as a bug in one pass would."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.fail_next = False
        self.read = asyncio.Event()

    def __call__(self) -> float:
        self.read.set()
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("one pass goes wrong")
        return self.now


async def test_the_reaper_survives_a_failing_pass_and_keeps_reclaiming() -> None:
    clock = FailingOnceClock()
    l1 = l1_settings(write_lease_s=10.0)
    with arena(1 << 20) as a:
        eng = build_engine(l1, arena=a, cache=build_cache(l1, a.size), clock=clock)
        eid = eng.register("m", small_layout()).engine_id
        slots = eng.store(eid, "w", tokens(2 * 16), "")
        assert [s.status for s in slots] == [SlotStatus.RESERVED] * 2  # never committed
        clock.now += 60  # past the write lease
        clock.fail_next = True
        reaper = asyncio.get_running_loop().create_task(eng.run_reaper(0.001))
        try:
            async with asyncio.timeout(10):
                while eng.cache.counters.expired_reservations < 2:
                    clock.read.clear()
                    read = asyncio.ensure_future(clock.read.wait())
                    await asyncio.wait({read, reaper}, return_when=asyncio.FIRST_COMPLETED)
                    read.cancel()
                    if reaper.done():
                        pytest.fail(f"the reaper stopped: {reaper.exception()!r}")
        finally:
            reaper.cancel()
        assert eng.counters.reaper_errors == 1
        assert eng.cache.state_counts().get("write_reserved", 0) == 0
