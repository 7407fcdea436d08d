"""`PATCH /l2/policy` over HTTP on a real service: the store policy and the prefetch deadline change
at runtime, the next write-behind follows the new policy, and a bad patch changes nothing."""

from __future__ import annotations

import pytest

from engine.results import SlotStatus
from tests.factories import small_layout, tokens
from tests.unit.api.conftest import ServeService

pytestmark = pytest.mark.anyio

CHUNK = 16
TWO_MOCKS = {
    "l1.chunk_size": CHUNK,
    "l2.adapters": [{"type": "mock", "name": "m1"}, {"type": "mock", "name": "m2"}],
}


def objects(listing: dict[str, object], name: str) -> int:
    adapters = listing["adapters"]
    assert isinstance(adapters, list)
    (found,) = [a for a in adapters if a["name"] == name]
    return int(found["usage"]["objects"])


async def test_patch_policy_changes_store_policy_and_deadline(serve: ServeService) -> None:
    async with serve(TWO_MOCKS) as running:
        c = running.client
        before = (await c.get("/l2/adapters")).json()["policy"]
        assert before["store_policy"] == "all"
        r = await c.patch("/l2/policy", json={"store_policy": "first", "prefetch_deadline_ms": 250})
        assert r.status_code == 200
        assert r.json()["store_policy"] == "first"
        assert r.json()["prefetch_deadline_ms"] == 250
        assert (await c.get("/l2/adapters")).json()["policy"]["prefetch_deadline_ms"] == 250

        # The next write-behind follows it: the first adapter only.
        eng = running.service.engine
        assert eng is not None and eng.l2 is not None
        eid = eng.register("m", small_layout()).engine_id
        slots = eng.store(eid, "w", tokens(2 * CHUNK), "")
        assert all(eng.commit(eid, [s.oid for s in slots if s.status is SlotStatus.RESERVED]))
        assert await eng.l2.store.wait_idle(10)
        listing = (await c.get("/l2/adapters")).json()
        assert (objects(listing, "m1"), objects(listing, "m2")) == (2, 0)


async def test_a_bad_policy_patch_is_refused_and_changes_nothing(serve: ServeService) -> None:
    async with serve(TWO_MOCKS) as running:
        c = running.client
        before = (await c.get("/l2/adapters")).json()["policy"]
        for body in ({"store_policy": "sometimes"}, {"prefetch_deadline_ms": 0}, {"other": 1}):
            assert (await c.patch("/l2/policy", json=body)).status_code == 422
        assert (await c.get("/l2/adapters")).json()["policy"] == before
