"""The fleet ledger in Redis against a malicious Redis writer (a plain redis-py client), with a real
sidecar process: a tenant's quota key overwritten with "unlimited" (or any value not signed with
the deployment's key) counts as the configured quota, so the tenant still holds at most its quota;
and a reservation planted in a tenant's ledger naming another tenant's blob is never UNLINKed when
the tenant's own blobs are evicted (an eviction removes only keys whose structure says the
tenant's salt), while the tenant's quota still holds."""

from __future__ import annotations

import redis

from bench.sidecar import SidecarProcess
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import client
from tests.integration.l2_helpers import request_keys
from tests.integration.tenant_traffic import CHUNK_BYTES, http, store
from tests.integration.test_fleet_quota_process import REDIS_URL, scan, start
from tests.integration.test_tenants_l2_process import written_behind
from tests.integration.waiting import wait_for

QUOTA_BLOBS = 10
LIMIT = QUOTA_BLOBS * CHUNK_BYTES + QUOTA_BLOBS * 400  # ten blobs with their headers, not eleven


def meta(prefix: str, salt: str, part: str) -> str:
    return f"{prefix}__fleet:{{s{salt.encode().hex()}}}:{part}"


def blobs_of(prefix: str, salt: str) -> dict[str, int]:
    return scan("redis", prefix).get(salt, {})


def write(sc: SidecarProcess, salt: str, first: int, count: int) -> None:
    c = client(sc.url)
    try:
        for which in range(first, first + count):  # one chunk each: `count` blobs
            store(c, salt, 0, which, 1, f"{salt}{which}")
            wait_for(lambda: written_behind(sc), what="write-behind")
    finally:
        c.close()


def test_a_quota_key_set_to_unlimited_by_a_redis_writer_is_the_configured_quota(
    sidecar_factory: StartSidecar, redis_prefix: str
) -> None:
    sc = start(sidecar_factory, REDIS_URL, redis_prefix)
    assert http(sc, "PUT", "/quotas/t", {"l2_bytes": LIMIT})[0] == 200
    with redis.Redis.from_url(REDIS_URL) as attacker:
        attacker.set(meta(redis_prefix, "t", "quota"), "-1")  # unlimited, as the ledger writes it
    write(sc, "t", 0, 24)
    held = blobs_of(redis_prefix, "t")
    assert len(held) <= QUOTA_BLOBS, f"{len(held)} blobs under a {QUOTA_BLOBS}-blob quota"
    assert sum(held.values()) <= LIMIT


def test_a_planted_reservation_naming_another_tenants_blob_is_never_unlinked(
    sidecar_factory: StartSidecar, redis_prefix: str
) -> None:
    sc = start(sidecar_factory, REDIS_URL, redis_prefix)
    write(sc, "v", 500, 4)  # the victim: no quota, four blobs
    victim = blobs_of(redis_prefix, "v")
    assert len(victim) == 4
    assert http(sc, "PUT", "/quotas/t", {"l2_bytes": 3 * CHUNK_BYTES + 1500})[0] == 200
    with redis.Redis.from_url(REDIS_URL) as attacker:
        for key, size in victim.items():  # in t's ledger, older than anything of t's
            attacker.hset(meta(redis_prefix, "t", "sizes"), key, size)
            attacker.zadd(meta(redis_prefix, "t", "keys"), {key: 1})
            attacker.incrby(meta(redis_prefix, "t", "used"), size)
    write(sc, "t", 0, 6)
    assert blobs_of(redis_prefix, "v") == victim, "the victim's blobs were unlinked by t's eviction"
    t_held = blobs_of(redis_prefix, "t")
    assert 1 <= len(t_held) <= 3
    assert set(t_held) <= {request_keys(w, 8, "t")[0] for w in range(6)}
