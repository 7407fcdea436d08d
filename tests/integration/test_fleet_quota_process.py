"""Fleet-wide L2 quotas (storage/redis/fleet.py) with two real sidecar processes on one Redis (a
single node, and the 3-node cluster), the same key prefix of the test's own: a tenant's bytes in
Redis, counted by scanning every node, never exceed its l2_bytes quota, whichever sidecar writes;
a quota set on one sidecar is enforced by the other, and so is a quota lowered on the other; the
tenant's oldest blobs are evicted whoever wrote them. Then drift: blobs expire (ttl_s on one
sidecar's adapter), some are deleted by hand, the ledger key of one tenant is overwritten by hand;
one reconcile makes every tenant's ledger equal to the scan, on both sidecars."""

from __future__ import annotations

import contextlib
import json
import random
from typing import Any

import pytest
import redis

from bench.sidecar import SidecarProcess
from engine.keys import ObjectKey
from storage.redis.cluster import SlotMap
from storage.redis.fleet import META
from tests.integration import cluster_nodes
from tests.integration.conftest import CLUSTER_URL, StartSidecar
from tests.integration.dp_client import client
from tests.integration.l2_helpers import request_keys
from tests.integration.redis_keys import REDIS_URL
from tests.integration.tenant_traffic import CHUNK_BYTES, TOKEN, http, store
from tests.integration.test_tenants_l2_process import written_behind
from tests.integration.waiting import wait_for

LIMIT = 6 * CHUNK_BYTES + 3000  # six blobs (headers of a few hundred bytes each), not seven
LOWER = 3 * CHUNK_BYTES + 1500
W_LIMIT = 3 * CHUNK_BYTES + 1500  # three blobs
DEPLOYMENT_KEY = "5e" * 32


def clients(kind: str) -> list[redis.Redis]:
    if kind == "redis":
        return [redis.Redis.from_url(REDIS_URL)]
    return [cluster_nodes.client(port) for port in cluster_nodes.PORTS]


def scan(kind: str, prefix: str) -> dict[str, dict[str, int]]:
    """Per salt, key -> bytes of every blob under `prefix`, read from every node."""
    out: dict[str, dict[str, int]] = {}
    for r in clients(kind):
        with r:
            for raw in r.scan_iter(match=prefix + "*", count=500):
                key = raw.decode()[len(prefix) :]
                if key.startswith(META):
                    continue
                size = int(r.strlen(raw))
                if size:
                    out.setdefault(ObjectKey.parse(key).salt, {})[key] = size
    return out


def unlink(kind: str, prefix: str, key: str) -> None:
    for r in clients(kind):
        with r, contextlib.suppress(redis.ResponseError):  # MOVED: another node's key
            r.unlink(prefix + key)


def fleet(sc: SidecarProcess, salt: str) -> dict[str, Any]:
    status, body = http(sc, "GET", "/quotas/" + salt)
    if status == 404:
        return {"bytes": 0, "objects": 0, "limit_bytes": None}
    assert status == 200, body
    return dict(body["fleet"].get("shared", {"bytes": 0, "objects": 0, "limit_bytes": None}))


def start(factory: StartSidecar, url: str, prefix: str, **extra: Any) -> SidecarProcess:
    adapter = {"type": "redis", "name": "shared", "url": url, "key_prefix": prefix, "bulk_min_kib": 32,
               "timeout_s": 1.0, "fleet_grace_s": 2.0, "reconcile_interval_s": None} | extra  # fmt: skip
    env = {
        "KVDEPOT_L1__CHUNK_SIZE": "16",
        "KVDEPOT_L2__ADAPTERS": json.dumps([adapter]),
        "KVDEPOT_HTTP__ADMIN_TOKEN": TOKEN,
        "KVDEPOT_L2__AUTH_KEYS": json.dumps([DEPLOYMENT_KEY]),  # one deployment: its quotas are sealed
    }
    return factory(env=env, l1_size_gb=3 / 1024)


@pytest.mark.parametrize("kind", ["redis", "redis-cluster"])
def test_two_sidecars_share_one_quota_and_one_ledger(
    sidecar_factory: StartSidecar, redis_prefix: str, kind: str, request: pytest.FixtureRequest
) -> None:
    url = REDIS_URL
    if kind == "redis-cluster":
        url = request.getfixturevalue("redis_cluster")
        assert url == CLUSTER_URL
    a = start(sidecar_factory, url, redis_prefix)
    b = start(sidecar_factory, url, redis_prefix, ttl_s=3)  # B's blobs expire: drift for the reconcile

    # The quota is set on A only; B has no quota of its own for "t" and reads A's from Redis.
    assert http(a, "PUT", "/quotas/t", {"l2_bytes": LIMIT})[0] == 200
    assert fleet(b, "t")["limit_bytes"] == LIMIT
    assert http(b, "POST", "/l2/adapters/shared/reconcile", token=False)[0] == 401
    assert http(b, "POST", "/l2/adapters/nosuch/reconcile")[0] == 404

    rng = random.Random(17)
    ca, cb = client(a.url), client(b.url)
    a_first: set[str] = set()  # A's blobs of "t" in the first two steps (A's have no ttl)
    peak = 0
    try:
        for step in range(24):
            # Both sidecars write at once: tenant "t" (quota) and "u" (none), distinct sequences.
            for i, (sc, c) in enumerate(((a, ca), (b, cb))):
                salt = "t" if rng.random() < 0.75 else "u"
                which = 100 * i + step  # sequence of its own: no key is written by both
                chunks = rng.randint(1, 4)
                store(c, salt, i, which, chunks, f"s{step}-{i}")
                if sc is a and salt == "t" and step < 2:
                    a_first |= set(request_keys(which, 8, "t")[:chunks])
            wait_for(lambda: written_behind(a) and written_behind(b), what="write-behind")
            held = scan(kind, redis_prefix)
            t_bytes = sum(held.get("t", {}).values())
            peak = max(peak, t_bytes)
            assert t_bytes <= LIMIT, (step, t_bytes)
            if step == 1:
                assert a_first & set(held.get("t", {})), "A's first blobs were written"
        # The quota held on both sidecars' writes, and it was reached: the oldest blobs went.
        assert peak > LIMIT - 2 * CHUNK_BYTES, peak
        assert not a_first & set(scan(kind, redis_prefix).get("t", {}))
        stats = [sc.get_json("/status")["l2"]["store"] for sc in (a, b)]
        assert sum(s["quota_evicted_bytes"] for s in stats) > 0

        # B makes room for its own blobs by evicting the oldest of the tenant's, which A wrote.
        assert http(a, "PUT", "/quotas/w", {"l2_bytes": W_LIMIT})[0] == 200
        store(ca, "w", 0, 900, 3, "w-a")
        wait_for(lambda: written_behind(a), what="write-behind")
        by_a = request_keys(900, 8, "w")[:3]
        assert sorted(scan(kind, redis_prefix).get("w", {})) == sorted(by_a)
        evicted_before = b.get_json("/status")["l2"]["store"]["quota_evicted_bytes"]
        store(cb, "w", 1, 901, 2, "w-b")
        wait_for(lambda: written_behind(b), what="write-behind")
        by_b = request_keys(901, 8, "w")[:2]
        assert sorted(scan(kind, redis_prefix).get("w", {})) == sorted([by_a[2], *by_b])
        assert b.get_json("/status")["l2"]["store"]["quota_evicted_bytes"] > evicted_before

        # A quota lowered on B holds for A's writes.
        assert http(b, "PUT", "/quotas/t", {"l2_bytes": LOWER})[0] == 200
        assert fleet(a, "t")["limit_bytes"] == LOWER
        for step in range(6):
            store(ca, "t", 0, 500 + step, 2, f"low{step}")
            wait_for(lambda: written_behind(a), what="write-behind")
            assert sum(scan(kind, redis_prefix).get("t", {}).values()) <= LOWER
        # Quota 0 set on A: B's next write of the tenant brings it down to nothing.
        assert http(a, "PUT", "/quotas/t", {"l2_bytes": 0})[0] == 200
        refused = b.get_json("/status")["l2"]["store"]["quota_refused"]
        store(cb, "t", 1, 600, 1, "zero")
        wait_for(lambda: written_behind(b), what="write-behind")
        assert "t" not in scan(kind, redis_prefix)
        assert b.get_json("/status")["l2"]["store"]["quota_refused"] == refused + 1
        assert http(b, "DELETE", "/quotas/t")[0] == 204
        assert fleet(a, "t")["limit_bytes"] is None

        # Drift: B's blobs expire (ttl 3 s), a few blobs are deleted by hand, a ledger is forged.
        wait_for(lambda: expiring(kind, redis_prefix) == 0, what="B's blobs to expire")
        assert sum(len(v) for v in scan(kind, redis_prefix).values()) < _ledger_total(a)
        held = scan(kind, redis_prefix)
        for key in rng.sample(sorted(k for keys in held.values() for k in keys), 2):
            unlink(kind, redis_prefix, key)
        forged = f"{redis_prefix}{META}{{s{b'u'.hex()}}}:used"
        if kind == "redis":
            with redis.Redis.from_url(REDIS_URL) as r:
                r.set(forged, 123456789)
        else:
            with cluster_nodes.client(cluster_nodes.owner(SlotMap.slot(forged.encode()))) as r:
                r.set(forged, 123456789)

        status, report = http(a, "POST", "/l2/adapters/shared/reconcile")
        assert status == 200, report
        assert report["released_bytes"] > 0 and report["ledger_fixed"] >= 1
        truth = scan(kind, redis_prefix)
        for salt in ("t", "u", "w"):
            want = (sum(truth.get(salt, {}).values()), len(truth.get(salt, {})))
            for sc in (a, b):
                got = fleet(sc, salt)
                assert (got["bytes"], got["objects"]) == want, (salt, got, want)
    finally:
        ca.close()
        cb.close()


def _ledger_total(sc: SidecarProcess) -> int:
    """Blobs the fleet ledger counts for both tenants."""
    return sum(fleet(sc, salt)["objects"] for salt in ("t", "u", "w"))


def expiring(kind: str, prefix: str) -> int:
    """Blobs under `prefix` that have a ttl."""
    count = 0
    for r in clients(kind):
        with r:
            for raw in r.scan_iter(match=prefix + "*", count=500):
                if not raw.decode()[len(prefix) :].startswith(META) and r.ttl(raw) >= 0:
                    count += 1
    return count


def test_the_periodic_reconcile_repairs_hand_deletes_by_itself(
    sidecar_factory: StartSidecar, redis_prefix: str
) -> None:
    sc = start(sidecar_factory, REDIS_URL, redis_prefix, reconcile_interval_s=1)
    c = client(sc.url)
    try:
        for which in range(3):
            store(c, "t", 0, 700 + which, 3, f"p{which}")
        wait_for(lambda: written_behind(sc), what="write-behind")
    finally:
        c.close()
    held = scan("redis", redis_prefix)["t"]
    assert fleet(sc, "t")["objects"] == len(held) == 9
    for key in sorted(held)[:4]:
        unlink("redis", redis_prefix, key)
    wait_for(lambda: fleet(sc, "t")["objects"] == 5, timeout=30, what="the periodic reconcile")
    assert fleet(sc, "t")["bytes"] == sum(scan("redis", redis_prefix)["t"].values())
    assert sc.get_json("/status")["ready"] is True  # the supervised task is alive
