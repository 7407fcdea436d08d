"""A COMMIT sent without waiting (one round trip per store) with a real sidecar process: the
chunks are stored and the next call on the connection finds them; a commit the sidecar refuses
(its write lease ran out) is counted before that next call returns, and its chunks are a miss,
never bytes the writer did not finish."""

from __future__ import annotations

import torch

from kvdepot_connector.protocol import SlotStatus
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import chunk_data, client, request_tokens
from tests.integration.test_fencing import FENCE_ENV
from tests.integration.waiting import wait_for


def test_a_posted_commit_stores_and_the_next_call_sees_it(sidecar_factory: StartSidecar) -> None:
    sc = sidecar_factory(env=FENCE_ENV | {"KVDEPOT_L1__WRITE_LEASE_S": "600"}, l1_size_gb=1 / 1024)
    c = client(sc.url)
    try:
        for seed in range(3):
            toks = request_tokens(seed, 4)
            mine = [chunk_data(seed, i) for i in range(4)]
            assert c.store(toks, mine, request_id=f"w{seed}", cache_salt="t", wait=False).stored == 4
            # the LOOKUP follows the COMMIT on this connection: handled after it
            assert c.lookup(toks, request_id=f"r{seed}", cache_salt="t").hit_chunks == 4
            outs = [torch.empty_like(m) for m in mine]
            assert c.retrieve(f"r{seed}", outs) is True
            assert all(torch.equal(o, m) for o, m in zip(outs, mine, strict=True))
        assert (c.commits_posted, c.commits_refused, c.posted_errors) == (12, 0, 0)
        assert sc.get_json("/status")["l1"]["counters"]["committed"] == 12
    finally:
        c.close()


def test_a_posted_commit_refused_is_counted_before_the_next_call_returns(
    sidecar_factory: StartSidecar,
) -> None:
    sc = sidecar_factory(env=FENCE_ENV, l1_size_gb=1 / 1024)  # write leases of 1 s
    c = client(sc.url)
    try:
        toks = request_tokens(9, 4)
        reply = c.reserve(toks, request_id="late", cache_salt="t")
        slots = [s for s in reply.slots if s.status is SlotStatus.RESERVED]
        assert len(slots) == 4
        for s in slots[:2]:  # half written, then the writer stalls past its lease
            c.slot_view(s).copy_(chunk_data(9, s.chunk).view(torch.uint8))
        wait_for(lambda: sc.get_json("/status")["l1"]["counters"]["expired_reservations"] >= 4)
        assert c.commit([s.oid for s in slots], wait=False) == [True] * 4  # sent; nothing known yet
        assert c.commits_refused == 0
        # The next call reads the COMMIT's answer before its own.
        assert c.lookup(toks, request_id="r", cache_salt="t").hit_chunks == 0
        assert c.commits_refused == 4 and c.posted_errors == 0
        assert c.end_request("r") == 0
    finally:
        c.close()
