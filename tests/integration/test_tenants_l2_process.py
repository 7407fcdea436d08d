"""Tenants in the L2 tiers with a real sidecar process, for each adapter kind (disk with real files,
Redis with a key prefix of the test's own, mock): random traffic of several tenants storing
overlapping token sequences with different bytes per tenant, L1 cleared (data-plane CLEAR) before
every read so that hits come from L2, checked byte for byte: no lookup ever returns another
tenant's chunk. Quotas per adapter hold all along (l2_bytes), quota 0 keeps a tenant out of L2,
and at the end /quotas shows per tenant exactly what the backend holds."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
import torch

from bench.sidecar import SidecarProcess
from engine.keys import ObjectKey
from storage.redis.fleet import META as FLEET_META
from tests.integration import cluster_nodes
from tests.integration.conftest import CLUSTER_URL, StartSidecar
from tests.integration.dp_client import client
from tests.integration.l2_helpers import blob_files, slab_blobs
from tests.integration.redis_keys import REDIS_URL
from tests.integration.tenant_traffic import CHUNK_BYTES, content, http, read, store
from tests.integration.waiting import wait_for

NAMES = {"disk": "disk", "slab": "slab", "redis": "shared", "redis-cluster": "shared", "mock": "mem"}
SALTS = ["", "a", "z", "c/d"]
A_LIMIT = 5 * CHUNK_BYTES + 1000  # five blobs (a header of a few hundred bytes each), not six
CD_LIMIT = 9 * CHUNK_BYTES + 2000


def adapter_config(kind: str, redis_prefix: str) -> dict[str, Any]:
    configs: dict[str, dict[str, Any]] = {
        "disk": {"type": "disk", "name": "disk", "fsync": "never"},
        "slab": {"type": "slab", "name": "slab", "fsync": "never", "slot_bytes": 68 << 10,
                 "size_bytes": 4096 + 400 * (68 << 10)},
        "redis": {"type": "redis", "name": "shared", "url": REDIS_URL, "key_prefix": redis_prefix,
                  "bulk_min_kib": 32},
        "redis-cluster": {"type": "redis", "name": "shared", "url": CLUSTER_URL, "key_prefix": redis_prefix,
                          "bulk_min_kib": 32},
        "mock": {"type": "mock", "name": "mem", "capacity_gb": 0.1},
    }  # fmt: skip
    return configs[kind]


def written_behind(sc: SidecarProcess) -> bool:
    """Every chunk queued for write-behind was written, refused by a quota, failed or dropped."""
    s = sc.get_json("/status")["l2"]["store"]
    return bool(s["submitted"] == s["written"] + s["quota_refused"] + s["failed"] + s["dropped"])


def backend_truth(kind: str, data_dir: Path, redis_prefix: str) -> dict[str, tuple[int, int]] | None:
    """Per salt, (bytes, blobs) the backend holds, read from the backend itself (None for mock)."""
    sizes: dict[str, int] = {}
    if kind == "disk":
        sizes = {key: path.stat().st_size for key, path in blob_files(data_dir / "l2-disk").items()}
    elif kind == "slab":
        sizes = slab_blobs(data_dir / "l2-slab")
    elif kind == "redis":
        with redis.Redis.from_url(REDIS_URL) as r:
            for name in r.scan_iter(match=redis_prefix + "*"):
                if not name.decode()[len(redis_prefix) :].startswith(FLEET_META):  # ledger keys
                    sizes[name.decode()[len(redis_prefix) :]] = int(r.strlen(name))
    elif kind == "redis-cluster":  # every node's own keys
        for port in cluster_nodes.PORTS:
            with cluster_nodes.client(port) as r:
                for name in r.scan_iter(match=redis_prefix + "*"):
                    if not name.decode()[len(redis_prefix) :].startswith(FLEET_META):
                        sizes[name.decode()[len(redis_prefix) :]] = int(r.strlen(name))
    else:
        return None
    truth: dict[str, tuple[int, int]] = {}
    for key, size in sizes.items():
        salt = ObjectKey.parse(key).salt
        b, n = truth.get(salt, (0, 0))
        truth[salt] = (b + size, n + 1)
    return truth


@pytest.mark.parametrize("kind", ["disk", "slab", "redis", "redis-cluster", "mock"])
def test_random_tenants_reading_from_l2_never_see_each_others_bytes_and_quotas_hold(
    sidecar_factory: StartSidecar,
    redis_prefix: str,
    tmp_path: Path,
    kind: str,
    request: pytest.FixtureRequest,
) -> None:
    if kind == "redis-cluster":
        request.getfixturevalue("redis_cluster")
    name = NAMES[kind]
    data_dir = tmp_path / "data"
    env = {
        "KVDEPOT_L1__CHUNK_SIZE": "16",
        "KVDEPOT_L2__ADAPTERS": json.dumps([adapter_config(kind, redis_prefix)]),
        "KVDEPOT_L2__PREFETCH_DEADLINE_MS": "5000",
    }
    sc = sidecar_factory(data_dir=data_dir, env=env, l1_size_gb=3 / 1024)
    assert http(sc, "PUT", "/quotas/a", {"l2_bytes": A_LIMIT})[0] == 200
    assert http(sc, "PUT", "/quotas/z", {"l2_bytes": 0})[0] == 200
    assert http(sc, "PUT", "/quotas/" + quote("c/d", safe=""), {"l2_bytes": CD_LIMIT})[0] == 200
    rng = random.Random(7 + len(kind.removesuffix("-cluster")))  # the same traffic on single and cluster
    c = client(sc.url)
    hits = dict.fromkeys(SALTS, 0)
    try:
        for step in range(160):
            tag = rng.randrange(len(SALTS))
            salt, which, chunks = SALTS[tag], rng.randrange(4), rng.randint(1, 6)
            if rng.random() < 0.5:
                store(c, salt, tag, which, chunks, f"w{step}")
                wait_for(lambda: written_behind(sc), what="write-behind")
                if salt in ("a", "c/d"):
                    tiers = http(sc, "GET", "/quotas/" + quote(salt, safe=""))[1]["tiers"]
                    assert tiers.get(name, {"bytes": 0})["bytes"] <= (A_LIMIT if salt == "a" else CD_LIMIT)
                continue
            for each in SALTS:  # L1, every tenant (one by one: the data plane clears by salt)
                c.clear(cache_salt=each)  # what is found comes from L2
            got = read(c, salt, which, chunks, f"r{step}", wait=True)
            for i, out in enumerate(got):
                assert torch.equal(out, content(tag, which, i)), f"{salt!r} read bytes it did not write"
            hits[salt] += len(got)
    finally:
        c.close()

    assert hits["z"] == 0  # quota 0: nothing in L2, and L1 was cleared before every read
    assert hits[""] > 10 and hits["c/d"] > 10 and hits["a"] > 0, hits
    status = sc.get_json("/status")["l2"]
    assert status["prefetch"]["chunks_loaded"] >= sum(hits.values())
    assert status["store"]["quota_refused"] + status["store"]["skipped_quota"] > 0

    tenants = {t["cache_salt"]: t for t in sc.get_json("/quotas")["tenants"]}
    a = tenants["a"]["tiers"][name]
    assert a["limit_bytes"] == A_LIMIT and 0 < a["bytes"] <= A_LIMIT and a["evictions"] > 0
    z = tenants["z"]["tiers"][name]
    assert (z["bytes"], z["objects"]) == (0, 0) and z["quota_refusals"] > 0
    ledger = {salt: (t["tiers"][name]["bytes"], t["tiers"][name]["objects"])
              for salt, t in tenants.items() if t["tiers"].get(name, {}).get("objects")}  # fmt: skip
    usage = sc.get_json("/l2/adapters")["adapters"][0]["usage"]
    assert (sum(b for b, _ in ledger.values()), sum(n for _, n in ledger.values())) == (
        usage["bytes_used"],
        usage["objects"],
    )
    truth = backend_truth(kind, data_dir, redis_prefix)
    if truth is not None:
        assert ledger == truth
