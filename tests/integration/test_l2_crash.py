"""A sidecar SIGKILLed while writing behind to disk, to Redis or to a Redis Cluster: after a restart
every chunk whose write had completed is served, byte-identical; a corrupted or truncated blob is a
miss, never wrong bytes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis
import torch
from redis.crc import key_slot

from tests.integration import cluster_nodes
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import LAYOUT, chunk_data, client, request_tokens
from tests.integration.l2_helpers import blob_files, request_keys
from tests.integration.redis_keys import REDIS_URL
from tests.integration.waiting import wait_for

ENV = {
    "KVDEPOT_L1__CHUNK_SIZE": "16",
    "KVDEPOT_L2__ADAPTERS": json.dumps([{"type": "disk", "name": "disk", "fsync": "always"}]),
    "KVDEPOT_L2__PREFETCH_DEADLINE_MS": "5000",
}
REQUESTS, CHUNKS = 24, 8
SEEDS = range(100, 100 + REQUESTS)


def expected_prefix(keys: list[str], on_disk: dict[str, Path]) -> int:
    n = 0
    while n < len(keys) and keys[n] in on_disk:
        n += 1
    return n


def served(sc_url: str, seed: int, rid: str) -> int:
    """Look the request up (waiting for L2), retrieve what hits and check every byte."""
    c = client(sc_url)
    try:
        hit = c.lookup(request_tokens(seed, CHUNKS), request_id=rid, wait=True)
        if hit.hit_chunks:
            outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(hit.hit_chunks)]
            assert c.retrieve(rid, outs)
            for i, out in enumerate(outs):
                assert torch.equal(out, chunk_data(seed, i)), f"request {seed} chunk {i}: wrong bytes"
        return hit.hit_chunks
    finally:
        c.close()


def test_restart_after_sigkill_serves_completed_writes_and_never_corrupt_ones(
    sidecar_factory: StartSidecar, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    first = sidecar_factory(data_dir=data_dir, env=ENV, l1_size_gb=0.05)
    c = client(first.url)
    for n, seed in enumerate(SEEDS):
        toks = request_tokens(seed, CHUNKS)
        outcome = c.store(toks, [chunk_data(seed, i) for i in range(CHUNKS)], request_id=f"w{seed}")
        assert outcome.stored == CHUNKS
        if n == 2:  # three requests surely on disk before the burst
            deadline = time.monotonic() + 60
            while first.get_json("/status")["l2"]["store"]["written"] < 3 * CHUNKS:
                assert time.monotonic() < deadline, "write-behind made no progress"
                time.sleep(0.01)
    c.close()
    first.kill()  # SIGKILL right after the burst: its writes are being worked through

    on_disk = blob_files(data_dir / "l2-disk")
    expected = {seed: expected_prefix(request_keys(seed, CHUNKS), on_disk) for seed in SEEDS}
    assert any(expected.values()), "nothing reached the disk before the kill"

    second = sidecar_factory(data_dir=data_dir, env=ENV, l1_size_gb=0.05)
    startup = second.get_json("/status")["l2"]["adapters"][0]["usage"]
    assert startup["objects"] >= len(on_disk)
    for seed in SEEDS:
        assert served(second.url, seed, f"r{seed}") == expected[seed]

    # Damage two files of fully written requests: one flipped payload byte, one truncated.
    full = [seed for seed in SEEDS if expected[seed] == CHUNKS]
    assert len(full) >= 3, expected
    flip_seed, cut_seed = full[0], full[1]
    flipped = on_disk[request_keys(flip_seed, CHUNKS)[2]]
    data = bytearray(flipped.read_bytes())
    data[-100] ^= 0xFF
    flipped.write_bytes(bytes(data))
    truncated = on_disk[request_keys(cut_seed, CHUNKS)[5]]
    truncated.write_bytes(truncated.read_bytes()[:-4096])

    assert served(second.url, flip_seed, "flip") == 2
    assert served(second.url, cut_seed, "cut") == 5
    status = second.get_json("/status")["l2"]
    assert status["prefetch"]["integrity_failures"] >= 1
    assert not flipped.exists(), "a blob that failed its check is deleted"

    # And after one more restart the truncated file is found at start-up, not served.
    second.stop()
    third = sidecar_factory(data_dir=data_dir, env=ENV, l1_size_gb=0.05)
    assert served(third.url, cut_seed, "cut2") == 5
    assert served(third.url, full[2], "whole") == CHUNKS


def node_of(kind: str, rkey: bytes) -> redis.Redis:
    """A client of the Redis node that holds `rkey`."""
    if kind == "redis":
        return redis.Redis.from_url(REDIS_URL)
    return cluster_nodes.client(cluster_nodes.owner(key_slot(rkey)))


@pytest.mark.parametrize("kind", ["redis", "redis-cluster"])
def test_restart_after_sigkill_mid_write_behind_to_redis_serves_what_redis_holds(
    sidecar_factory: StartSidecar,
    tmp_path: Path,
    redis_prefix: str,
    kind: str,
    request: pytest.FixtureRequest,
) -> None:
    """SIGKILL while writing behind to Redis (single or Cluster); after a restart (same data dir:
    same deployment key) exactly the prefixes Redis holds are served, byte-identical; a value
    with a flipped byte or cut short is a miss (and left in Redis: a shared tier never deletes)."""
    url = REDIS_URL if kind == "redis" else request.getfixturevalue("redis_cluster")
    adapter = {"type": "redis", "name": "redis", "url": url, "key_prefix": redis_prefix}
    env = {**ENV, "KVDEPOT_L2__ADAPTERS": json.dumps([adapter])}
    data_dir = tmp_path / "data"
    first = sidecar_factory(data_dir=data_dir, env=env, l1_size_gb=0.05)
    c = client(first.url)
    for n, seed in enumerate(SEEDS):
        toks = request_tokens(seed, CHUNKS)
        assert (
            c.store(toks, [chunk_data(seed, i) for i in range(CHUNKS)], request_id=f"w{seed}").stored
            == CHUNKS
        )
        if n == 2:
            wait_for(lambda: first.get_json("/status")["l2"]["store"]["written"] >= 3 * CHUNKS)
    c.close()
    first.kill()

    def held(key: str) -> bool:
        rkey = (redis_prefix + key).encode()
        with node_of(kind, rkey) as r:
            return bool(r.exists(rkey))

    in_redis = {seed: [held(k) for k in request_keys(seed, CHUNKS)] for seed in SEEDS}
    expected = {seed: [*flags, False].index(False) for seed, flags in in_redis.items()}
    assert any(expected.values()), "nothing reached Redis before the kill"

    second = sidecar_factory(data_dir=data_dir, env=env, l1_size_gb=0.05)
    for seed in SEEDS:
        assert served(second.url, seed, f"r{seed}") == expected[seed]

    full = [seed for seed in SEEDS if expected[seed] == CHUNKS]
    assert len(full) >= 2, expected
    flipped = (redis_prefix + request_keys(full[0], CHUNKS)[2]).encode()
    cut = (redis_prefix + request_keys(full[1], CHUNKS)[5]).encode()
    with node_of(kind, flipped) as r:
        value = bytearray(r.get(flipped) or b"")
        value[-100] ^= 0xFF
        r.set(flipped, bytes(value))
    with node_of(kind, cut) as r:
        r.set(cut, (r.get(cut) or b"")[:-4096])
    second.stop()
    third = sidecar_factory(data_dir=data_dir, env=env, l1_size_gb=0.05)  # an empty L1 again
    assert served(third.url, full[0], "flip") == 2
    assert served(third.url, full[1], "cut") == 5
    with node_of(kind, flipped) as r:
        assert r.exists(flipped), "a shared tier: a blob that failed its check is a miss, never deleted"
