"""A failing, hanging or lying L2 tier is a shorter hit within the prefetch deadline: never an
error to the client, never wrong bytes; writes resume when the backend is back."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from bench.sidecar import SidecarProcess
from kvdepot_connector.client import KVDepotClient
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import LAYOUT, chunk_data, client, request_tokens
from tests.integration.l2_helpers import PrivateRedis
from tests.integration.waiting import wait_for

DEADLINE_MS = 300
# The promise is an answer by the deadline instead of a hang (the hanging tier never answers at all).
# How close to the deadline it comes is a figure for benchmarks, not for a pass/fail test on a shared
# machine: the bound leaves room for a loaded scheduler and still tells an answer from a hang.
BOUND_S = DEADLINE_MS / 1000 + 2.0


def env(adapter: dict[str, Any]) -> dict[str, str]:
    return {
        "KVDEPOT_L1__CHUNK_SIZE": "16",
        "KVDEPOT_L2__ADAPTERS": json.dumps([adapter]),
        "KVDEPOT_L2__PREFETCH_DEADLINE_MS": str(DEADLINE_MS),
    }


def store(c: KVDepotClient, seed: int, chunks: int = 4) -> None:
    toks = request_tokens(seed, chunks)
    assert c.store(toks, [chunk_data(seed, i) for i in range(chunks)], request_id=f"w{seed}").stored == chunks


def timed_lookup(c: KVDepotClient, seed: int, chunks: int, rid: str) -> tuple[int, float]:
    start = time.perf_counter()
    hit = c.lookup(request_tokens(seed, chunks), request_id=rid, wait=True)
    elapsed = time.perf_counter() - start
    assert hit.pending_chunks == 0
    return hit.hit_chunks, elapsed


def check_bytes(c: KVDepotClient, seed: int, rid: str, hit: int) -> None:
    if hit:
        outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(hit)]
        assert c.retrieve(rid, outs)
        assert all(torch.equal(o, chunk_data(seed, i)) for i, o in enumerate(outs))


@pytest.fixture
def connected(
    sidecar_factory: StartSidecar,
) -> Iterator[Callable[[dict[str, Any]], tuple[SidecarProcess, KVDepotClient]]]:
    clients: list[KVDepotClient] = []

    def start(adapter: dict[str, Any]) -> tuple[SidecarProcess, KVDepotClient]:
        sc = sidecar_factory(env=env(adapter), l1_size_gb=0.02)
        clients.append(client(sc.url))
        return sc, clients[-1]

    yield start
    for c in clients:
        c.close()


@pytest.mark.parametrize(
    "fault",
    [{"hang": True}, {"error_rate": 1.0}, {"corrupt_rate": 1.0}],
    ids=["hang", "errors", "corrupt"],
)
def test_mock_faults_give_shorter_hits_within_the_deadline(
    connected: Callable[[dict[str, Any]], tuple[SidecarProcess, KVDepotClient]], fault: dict[str, Any]
) -> None:
    sc, c = connected({"type": "mock", "name": "mock", **fault})
    store(c, 1)  # 4 chunks in L1; write-behind to the faulty tier
    if "corrupt_rate" in fault:
        wait_for(lambda: sc.get_json("/status")["l2"]["store"]["written"] >= 4)
    # L1 holds the first 4 chunks; the tier is asked for the other 4 and fails in its own way.
    hit, elapsed = timed_lookup(c, 1, 8, "longer")
    assert hit == 4
    assert elapsed <= BOUND_S
    check_bytes(c, 1, "longer", hit)
    # With L1 emptied, everything depends on the faulty tier: a miss, in time, no error.
    c.clear(cache_salt="")
    hit, elapsed = timed_lookup(c, 1, 4, "cold")
    assert hit == 0
    assert elapsed <= BOUND_S
    status = sc.get_json("/status")
    assert status["l1"]["allocator_ok"]
    if "corrupt_rate" in fault:
        assert status["l2"]["prefetch"]["integrity_failures"] >= 1
    assert sc.get_json("/ready") == {"ready": True}


def test_redis_killed_and_frozen_mid_run_then_back(
    connected: Callable[[dict[str, Any]], tuple[SidecarProcess, KVDepotClient]],
) -> None:
    redis_server = PrivateRedis()
    redis_server.start()
    try:
        sc, c = connected({"type": "redis", "name": "redis", "url": redis_server.url, "timeout_s": 0.2})

        def written() -> int:
            return int(sc.get_json("/status")["l2"]["store"]["written"])

        store(c, 10)
        wait_for(lambda: written() >= 4)
        c.clear(cache_salt="")
        hit, _ = timed_lookup(c, 10, 4, "warm")
        assert hit == 4  # served from Redis
        check_bytes(c, 10, "warm", hit)

        # Frozen (SIGSTOP): connections hang; the deadline answers.
        assert redis_server.proc is not None
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            c.clear(cache_salt="")
            hit, elapsed = timed_lookup(c, 10, 4, "frozen")
            assert hit == 0
            assert elapsed <= BOUND_S
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)

        # Killed: refused connections; stores go on in L1 and their L2 writes fail, counted.
        redis_server.kill()
        failed_before = sc.get_json("/status")["l2"]["store"]["failed"]
        store(c, 11)
        hit, elapsed = timed_lookup(c, 12, 4, "dead")
        assert hit == 0
        assert elapsed <= BOUND_S
        wait_for(lambda: sc.get_json("/status")["l2"]["store"]["failed"] > failed_before)

        # Back (empty, a fresh server on the same port): new stores reach it again.
        redis_server.start()
        before = written()
        store(c, 13)
        wait_for(lambda: written() >= before + 4, timeout=30)
        c.clear(cache_salt="")
        hit, _ = timed_lookup(c, 13, 4, "again")
        assert hit == 4
        check_bytes(c, 13, "again", hit)
        assert sc.get_json("/ready") == {"ready": True}
    finally:
        redis_server.kill()
