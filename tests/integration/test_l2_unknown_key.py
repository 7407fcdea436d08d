"""Two real sidecars on one real Redis whose key lists differ (a typo, a rotation half done): a blob
signed by a key id the reader does not hold is a miss, counted as `auth_unknown_key` (in /status and
/metrics), and never removed from the shared tier; a blob failing its check under no key at all
(a plain writer's blob) is not removed from the shared tier either, while the reader's own store of
the chunk replaces it."""

from __future__ import annotations

import urllib.request

import redis

from bench.sidecar import SidecarProcess
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import chunk_data, client, request_tokens
from tests.integration.l2_helpers import request_keys
from tests.integration.test_l2_auth import (
    KEY_1,
    KEY_2,
    REDIS_URL,
    adapter_stats,
    env,
    well_formed_blob,
)
from tests.integration.waiting import wait_for

BLOBS = 20
SEEDS = range(500, 500 + BLOBS)
L1_GB = 4 / 1024


def _metrics(sc: SidecarProcess) -> str:
    with urllib.request.urlopen(sc.http + "/metrics", timeout=5) as resp:
        text: str = resp.read().decode()
        return text


def _blobs_left(prefix: str, keys: list[str]) -> int:
    with redis.Redis.from_url(REDIS_URL) as r:
        return sum(int(r.exists(prefix + k)) for k in keys)


def test_a_fleet_mate_with_another_first_key_misses_and_never_deletes_the_shared_blobs(
    sidecar_factory: StartSidecar, redis_prefix: str
) -> None:
    writer = sidecar_factory(env=env(redis_prefix, [KEY_1]), l1_size_gb=L1_GB)
    c = client(writer.url)
    try:  # 20 prompts of one chunk each: 20 prefixes
        for seed in SEEDS:
            assert c.store(request_tokens(seed, 1), [chunk_data(seed, 0)], request_id=f"w{seed}").stored == 1
        wait_for(lambda: writer.get_json("/status")["l2"]["store"]["written"] >= BLOBS)
    finally:
        c.close()
    keys = [k for seed in SEEDS for k in request_keys(seed, 1)]
    assert _blobs_left(redis_prefix, keys) == BLOBS

    typo = sidecar_factory(env=env(redis_prefix, [KEY_2]), l1_size_gb=L1_GB)
    c = client(typo.url)
    try:
        for seed in SEEDS:
            assert c.lookup(request_tokens(seed, 1), request_id=f"r{seed}", wait=True).hit_chunks == 0
            c.release(f"r{seed}")
    finally:
        c.close()
    assert _blobs_left(redis_prefix, keys) == BLOBS, "blobs of a key the reader does not hold were deleted"
    stats = adapter_stats(typo)
    assert stats["auth_unknown_key"] >= BLOBS
    assert typo.get_json("/status")["l2"]["prefetch"]["auth_unknown_key"] >= BLOBS
    assert "kvdepot_l2_auth_unknown_key_total" in _metrics(typo)

    # The operator fixes the list (the old key verifies again): every blob still serves.
    fixed = sidecar_factory(env=env(redis_prefix, [KEY_2, KEY_1]), l1_size_gb=L1_GB)
    c = client(fixed.url)
    try:
        hits = [c.lookup(request_tokens(s, 1), request_id=f"a{s}", wait=True).hit_chunks for s in SEEDS]
        assert sum(hits) == BLOBS
    finally:
        c.close()


def test_a_blob_failing_its_check_is_never_removed_from_the_shared_tier(
    sidecar_factory: StartSidecar, redis_prefix: str, attacker: redis.Redis
) -> None:
    sc = sidecar_factory(env=env(redis_prefix, [KEY_1]), l1_size_gb=L1_GB)
    (key,) = request_keys(61, 1)
    attacker.set(redis_prefix + key, well_formed_blob(key, bytes(64 * 1024)))  # unsigned
    c = client(sc.url)
    try:
        assert c.lookup(request_tokens(61, 1), request_id="r", wait=True).hit_chunks == 0
        c.release("r")
        wait_for(lambda: adapter_stats(sc)["auth_failures"] >= 1)
        assert adapter_stats(sc)["auth_unknown_key"] == 0
        assert attacker.exists(redis_prefix + key) == 1
    finally:
        c.close()
