"""Release fences with a real sidecar process: a copy whose fences held is released without
waiting (one round trip per retrieve), and every way the bytes could have changed under a copy
moves a fence, so that the release asks the sidecar and hears invalid. (A stalled, suspect worker
releasing with its fences: tests/integration/test_workers.py; the fences' descriptor refused
read-write like every other: tests/integration/test_write_domains.py.)"""

from __future__ import annotations

import torch

from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import LAYOUT, chunk_data, client, request_tokens
from tests.integration.test_ownership import reuse_memory

ENV = {"KVDEPOT_L1__CHUNK_SIZE": "16", "KVDEPOT_L2__ADAPTERS": "[]"}
SMALL_L1 = 1 / 1024  # 1 MiB: 16 chunks of 64 KiB


def copy(views: list[torch.Tensor]) -> list[torch.Tensor]:
    return [v.clone().view(torch.float16) for v in views]


def test_a_copy_whose_fences_held_is_released_without_waiting(sidecar_factory: StartSidecar) -> None:
    sc = sidecar_factory(env=ENV, l1_size_gb=SMALL_L1)
    c = client(sc.url)
    try:
        toks = request_tokens(5, 4)
        mine = [chunk_data(5, i) for i in range(4)]
        assert c.store(toks, mine, request_id="w", cache_salt="t").stored == 4
        assert c.lookup(toks, request_id="r", cache_salt="t").hit_chunks == 4
        locked = c.locked("r", first_chunk=0, num_chunks=4)
        assert locked.fences, "the RETRIEVE named no fences"
        got = copy(locked.views)
        assert c.release("r", locked.oids, fences=locked.fences) is True
        assert c.released_unasked == 1  # answered here: no round trip
        assert all(torch.equal(g, m) for g, m in zip(got, mine, strict=True))
        # The RELEASE went all the same, ahead of the next call on this connection: no lock is left.
        assert c.end_request("r") == 0
        assert sc.get_json("/status")["l1"]["locked_requests"] == 0
        # retrieve() takes the same path
        assert c.lookup(toks, request_id="r2", cache_salt="t").hit_chunks == 4
        outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(4)]
        assert c.retrieve("r2", outs) is True
        assert c.released_unasked == 2 and c.posted_errors == 0
        assert all(torch.equal(o, m) for o, m in zip(outs, mine, strict=True))
    finally:
        c.close()


def test_memory_reused_under_a_copying_reader_moves_its_fences_and_the_release_asks(
    sidecar_factory: StartSidecar,
) -> None:
    # One client stands for the scheduler (lookup, end_request) and the worker (copies) of one engine.
    sc = sidecar_factory(env=ENV, l1_size_gb=SMALL_L1)
    c = client(sc.url)
    try:
        toks = request_tokens(3, 4)
        assert c.store(toks, [chunk_data(3, i) for i in range(4)], request_id="w", cache_salt="t").stored == 4
        assert c.lookup(toks, request_id="r", cache_salt="t").hit_chunks == 4
        locked = c.locked("r", first_chunk=0, num_chunks=4)  # the worker copies from these...
        assert c.end_request("r") == 4  # ...the scheduler is done with the request meanwhile
        reuse_memory(c, "t")  # freed and written again by another store
        assert c.release("r", locked.oids, fences=locked.fences) is False
        assert c.released_unasked == 0
    finally:
        c.close()


def test_an_object_freed_elsewhere_in_the_segment_costs_a_round_trip_not_validity(
    sidecar_factory: StartSidecar,
) -> None:
    sc = sidecar_factory(env=ENV, l1_size_gb=0.02)  # segments of 1.25 MiB: 20 chunks each
    c = client(sc.url)
    try:
        kept, gone = request_tokens(7, 2), request_tokens(8, 2)
        mine = [chunk_data(7, i) for i in range(2)]
        assert c.store(kept, mine, request_id="w1", cache_salt="a").stored == 2
        assert (
            c.store(gone, [chunk_data(8, i) for i in range(2)], request_id="w2", cache_salt="b").stored == 2
        )
        assert c.lookup(kept, request_id="r", cache_salt="a").hit_chunks == 2
        locked = c.locked("r", first_chunk=0, num_chunks=2)
        got = copy(locked.views)
        assert len(locked.fences) == 1  # one segment holds all four (one writer)
        assert c.clear("b") == 2  # another tenant's chunks leave the same segment
        assert c.release("r", locked.oids, fences=locked.fences) is True  # asked, and still valid
        assert c.released_unasked == 0
        assert all(torch.equal(g, m) for g, m in zip(got, mine, strict=True))
    finally:
        c.close()


def test_a_release_that_arrives_after_the_next_lookup_leaves_that_lookup_its_locks(
    sidecar_factory: StartSidecar,
) -> None:
    # The worker's RELEASE (sent without waiting) may reach the sidecar after the scheduler's next
    # LOOKUP of the request (a preempted request resumed): it names the epoch it copied under, and
    # the newer LOOKUP's locks stay for the worker's next RETRIEVE.
    sc = sidecar_factory(env=ENV, l1_size_gb=SMALL_L1)
    c = client(sc.url)
    try:
        toks = request_tokens(8, 4)
        assert c.store(toks, [chunk_data(8, i) for i in range(4)], request_id="w", cache_salt="t").stored == 4
        assert c.lookup(toks, request_id="r", cache_salt="t").hit_chunks == 4
        first = c.locked("r", first_chunk=0, num_chunks=4)
        copy(first.views)
        assert c.lookup(toks, request_id="r", cache_salt="t").hit_chunks == 4  # asked again
        assert c.release("r", first.oids, epoch=first.epoch) is True
        second = c.locked("r", first_chunk=0, num_chunks=4)  # the locks are there
        assert second.epoch > first.epoch > 0
        assert c.release("r", second.oids, epoch=second.epoch) is True
        assert c.end_request("r") == 0
        assert sc.get_json("/status")["l1"]["locked_requests"] == 0
    finally:
        c.close()
