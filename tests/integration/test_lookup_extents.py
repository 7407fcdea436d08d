"""A LOOKUP asked for extents, with a real sidecar process: the scheduler's LOOKUP names the hits as
a RETRIEVE would, and the worker of the same engine instance copies from them with no round trip
of its own, then releases as after a RETRIEVE. Every way the copy could be wrong is refused: memory
reused after the lookup moves its fences (the release asks and hears invalid), and a worker still
mapping the arena of a sidecar that has since restarted cannot copy from the new one's extents.
Chunks still coming from L2 are not named until a waited lookup has them."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from bench.sidecar import SidecarProcess
from kvdepot_connector.client import KVDepotClient
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import LAYOUT, chunk_data, request_tokens
from tests.integration.test_l2_roundtrip import adapter_env
from tests.integration.test_ownership import reuse_memory
from tests.integration.waiting import wait_for

ENV = {"KVDEPOT_L1__CHUNK_SIZE": "16", "KVDEPOT_L2__ADAPTERS": "[]"}
SMALL_L1 = 1 / 1024  # 1 MiB: 16 chunks of 64 KiB


@contextmanager
def engine(url: str) -> Iterator[tuple[KVDepotClient, KVDepotClient]]:
    """A scheduler's client (maps no arena) and a worker's, of one engine instance, as vLLM has;
    closed on leaving."""
    scheduler = KVDepotClient(url, model="test-model", layout=LAYOUT, timeout_s=10, map_arena=False,
                              role="scheduler", rank=0).connect()  # fmt: skip
    worker = KVDepotClient(url, model="test-model", layout=LAYOUT, timeout_s=10, instance=scheduler.instance,
                           role="worker", rank=0).connect()  # fmt: skip
    try:
        yield scheduler, worker
    finally:
        worker.close()
        scheduler.close()


Engine = tuple[SidecarProcess, KVDepotClient, KVDepotClient]


@pytest.fixture
def l1_only(sidecar_factory: StartSidecar) -> Iterator[Engine]:
    """A sidecar with a 1 MiB L1 and no L2, and an engine's scheduler and worker clients."""
    sc = sidecar_factory(env=ENV, l1_size_gb=SMALL_L1)
    with engine(sc.url) as (scheduler, worker):
        yield sc, scheduler, worker


def stored(worker: KVDepotClient, seed: int) -> tuple[list[int], list[torch.Tensor]]:
    """Four chunks of `seed`'s tokens stored for tenant "t": (tokens, chunk bytes)."""
    toks, mine = request_tokens(seed, 4), [chunk_data(seed, i) for i in range(4)]
    assert worker.store(toks, mine, request_id="w", cache_salt="t").stored == 4
    return toks, mine


def copy(views: list[torch.Tensor]) -> list[torch.Tensor]:
    return [v.clone().view(torch.float16) for v in views]


def test_the_worker_copies_from_the_schedulers_lookup_and_releases_without_a_round_trip(
    l1_only: Engine,
) -> None:
    sc, scheduler, worker = l1_only
    toks, mine = stored(worker, 5)
    plain = scheduler.lookup(toks, request_id="r", cache_salt="t")
    assert plain.hit_chunks == 4 and plain.extents == []  # not asked: none named
    reply = scheduler.lookup(toks, request_id="r", cache_salt="t", extents=True)
    assert (reply.hit_chunks, len(reply.extents)) == (4, 4) and reply.fences and reply.epoch > 0
    locked = worker.locked_from(reply, first_chunk=1, num_chunks=3)  # chunk 0 computed locally
    got = copy(locked.views)
    assert worker.release("r", locked.oids, fences=locked.fences, epoch=locked.epoch) is True
    assert worker.released_unasked == 1
    assert all(torch.equal(g, m) for g, m in zip(got, mine[1:], strict=True))
    # What a RETRIEVE of the same lookup's locks names is what the LOOKUP named.
    again = scheduler.lookup(toks, request_id="r2", cache_salt="t", extents=True)
    retrieved = worker.locked("r2", first_chunk=0, num_chunks=4)
    assert [e.oid for e in again.extents] == retrieved.oids and again.epoch == retrieved.epoch
    assert worker.release("r2", retrieved.oids, fences=retrieved.fences, epoch=retrieved.epoch) is True
    assert scheduler.end_request("r") == 0 and scheduler.end_request("r2") == 0
    assert sc.get_json("/status")["l1"]["locked_requests"] == 0
    # More chunks than the lookup named, or none: refused before any copy.
    with pytest.raises(ValueError, match="no such extents"):
        worker.locked_from(reply, first_chunk=2, num_chunks=3)
    missed = scheduler.lookup(request_tokens(6, 4), request_id="m", cache_salt="t", extents=True)
    assert missed.hit_chunks == 0 and missed.extents == []
    with pytest.raises(ValueError, match="no such extents"):
        worker.locked_from(missed, first_chunk=0, num_chunks=1)


def test_memory_reused_between_the_lookup_and_the_copy_is_reported_invalid(l1_only: Engine) -> None:
    _, scheduler, worker = l1_only
    toks, _ = stored(worker, 3)
    reply = scheduler.lookup(toks, request_id="r", cache_salt="t", extents=True)
    assert scheduler.end_request("r") == 4  # the scheduler gave the request up meanwhile...
    reuse_memory(worker, "t")  # ...its chunks were freed and their memory written again
    locked = worker.locked_from(reply, first_chunk=0, num_chunks=4)
    copy(locked.views)
    assert worker.release("r", locked.oids, fences=locked.fences, epoch=locked.epoch) is False
    assert worker.released_unasked == 0


def test_a_worker_still_mapping_a_restarted_sidecars_old_arena_cannot_copy_from_the_new_one(
    sidecar_factory: StartSidecar, tmp_path: Path
) -> None:
    """The scheduler's client has met the restarted sidecar; the worker's has not yet (it maps the
    old arena): the new arena's offsets in the old one's memory would be wrong bytes."""
    first = sidecar_factory(env=ENV, l1_size_gb=SMALL_L1, data_dir=tmp_path / "data")
    with engine(first.url) as (scheduler, worker):
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        second = sidecar_factory(env=ENV, l1_size_gb=SMALL_L1, data_dir=tmp_path / "data")
        assert second.url == first.url
        toks = request_tokens(9, 2)
        mine = [chunk_data(9, i) for i in range(2)]
        other = KVDepotClient(second.url, model="test-model", layout=LAYOUT, timeout_s=10).connect()
        assert other.store(toks, mine, request_id="w", cache_salt="").stored == 2
        other.close()
        reply = scheduler.lookup(toks, request_id="r", extents=True)  # says HELLO to the new one
        assert reply.hit_chunks == 2 and reply.arena == second.started["arena"]
        with pytest.raises(ValueError, match="no such extents"):
            worker.locked_from(reply, first_chunk=0, num_chunks=2)
        locked = worker.locked("r", first_chunk=0, num_chunks=2)  # asks: HELLO, the new arena
        got = copy(locked.views)
        assert worker.release("r", locked.oids, fences=locked.fences, epoch=locked.epoch) is True
        assert all(torch.equal(g, m) for g, m in zip(got, mine, strict=True))


def test_chunks_still_coming_from_l2_are_named_once_the_query_or_the_waited_lookup_has_them(
    sidecar_factory: StartSidecar,
) -> None:
    sc = sidecar_factory(env=adapter_env("disk", ""), l1_size_gb=SMALL_L1)
    with engine(sc.url) as (scheduler, worker):
        for n, seed in enumerate((11, 12, 13), start=1):  # 24 chunks through a 16-chunk L1
            toks = request_tokens(seed, 8)
            assert (
                worker.store(toks, [chunk_data(seed, i) for i in range(8)], request_id=f"w{seed}").stored == 8
            )
            wait_for(lambda n=n: sc.get_json("/status")["l2"]["store"]["written"] >= 8 * n)
        toks = request_tokens(11, 8)
        coming = scheduler.lookup(toks, request_id="r", extents=True)
        assert coming.pending_chunks > 0 and coming.extents == []  # not all in L1: none named
        # Polled as the vLLM scheduler polls: named once nothing is still coming.
        deadline = time.monotonic() + 30
        while (polled := scheduler.query_prefetch("r", extents=True)).pending_chunks:
            assert polled.extents == [] and time.monotonic() < deadline, polled
            time.sleep(0.02)
        assert (polled.hit_chunks, len(polled.extents)) == (8, 8)
        locked = worker.locked_from(polled, first_chunk=0, num_chunks=8)
        got = copy(locked.views)
        assert worker.release("r", locked.oids, fences=locked.fences, epoch=locked.epoch) is True
        assert all(torch.equal(g, chunk_data(11, i)) for i, g in enumerate(got))
        # Waited for, the same.
        toks = request_tokens(12, 8)
        loaded = scheduler.lookup(toks, request_id="r2", extents=True, wait=True)
        assert (loaded.hit_chunks, loaded.pending_chunks, len(loaded.extents)) == (8, 0, 8)
        locked = worker.locked_from(loaded, first_chunk=0, num_chunks=8)
        got = copy(locked.views)
        assert worker.release("r2", locked.oids, fences=locked.fences, epoch=locked.epoch) is True
        assert all(torch.equal(g, chunk_data(12, i)) for i, g in enumerate(got))
