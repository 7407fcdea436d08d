"""Purge and clear with a real sidecar process: two tenants store the same token sequences (so the
same chunk hashes, different keys) into L1, the disk tier (real files) and Redis (a prefix of the
test's own); `DELETE /tenants/p/cache` leaves no chunk of p in any tier (L1 by lookups and the
ledger, the blob files, a scan of Redis) and every byte of q where it was; the KV events announce
p's blocks removed in every medium and none of q's. `POST /cache/clear` then clears L1 (and, asked,
the Redis tier: every blob under the prefix), announced as AllBlocksCleared. A purge on another
sidecar, started after the first stopped, finds in Redis what the first wrote (it re-scans)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from bench.sidecar import SidecarProcess
from engine.keys import ObjectKey
from kvdepot_connector.client import KVDepotClient
from storage.redis.fleet import META
from tests.integration import cluster_nodes
from tests.integration.conftest import StartSidecar
from tests.integration.l2_helpers import PrivateRedis, blob_files
from tests.integration.metrics_sidecar import metric
from tests.integration.redis_keys import REDIS_URL
from tests.integration.tenant_traffic import http
from tests.integration.test_kv_events_sidecar import LAYOUT, TOKEN, Events, env, of_type
from tests.integration.waiting import wait_for
from tests.ports import free_ports

SEQS, CHUNKS = 3, 3


def call(sc: SidecarProcess, method: str, path: str, token: bool = True) -> tuple[int, Any]:
    """`http` with this sidecar's admin token (tests/integration/test_kv_events_sidecar's)."""
    return http(sc, method, path, token=TOKEN if token else False)


def tokens(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 60_000, (CHUNKS * 16,), generator=g).tolist()


def data(tag: int, seed: int) -> list[torch.Tensor]:
    return [torch.full((LAYOUT.chunk_bytes // 2,), float(tag * 100 + seed * 10 + i), dtype=torch.float16)
            for i in range(CHUNKS)]  # fmt: skip


def redis_blobs(prefix: str) -> dict[str, dict[str, str]]:
    """Per salt, key -> sha256 of the value, of every blob under `prefix`."""
    out: dict[str, dict[str, str]] = {}
    with redis.Redis.from_url(REDIS_URL) as r:
        for raw in r.scan_iter(match=prefix + "*"):
            key = raw.decode()[len(prefix) :]
            if not key.startswith(META):
                value = r.get(raw)
                assert value is not None
                out.setdefault(ObjectKey.parse(key).salt, {})[key] = hashlib.sha256(value).hexdigest()
    return out


def disk_blobs(data_dir: Path) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for key, path in blob_files(data_dir / "l2-disk").items():
        out.setdefault(ObjectKey.parse(key).salt, {})[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def written_behind(sc: SidecarProcess) -> bool:
    s = sc.get_json("/status")["l2"]["store"]
    return bool(s["submitted"] == s["written"] + s["quota_refused"] + s["failed"] + s["dropped"])


def finished(sc: SidecarProcess, path: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while True:
        status, job = call(sc, "GET", path)
        assert status == 200, job
        if job["state"] != "running":
            return dict(job)
        assert time.monotonic() < deadline, job
        time.sleep(0.05)


def hashes(events: list[dict[str, Any]], kind: str) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for e in of_type(events, kind):
        out.setdefault(e["medium"], set()).update(e["block_hashes"])
    return out


def test_purge_removes_one_tenant_from_every_tier_and_clear_empties_tiers(
    sidecar_factory: StartSidecar, redis_prefix: str, tmp_path: Path
) -> None:
    pub, replay = free_ports(2)
    adapters = [
        {"type": "disk", "name": "disk", "fsync": "never"},
        {"type": "redis", "name": "shared", "url": REDIS_URL, "key_prefix": redis_prefix},
    ]
    data_dir = tmp_path / "data"
    sc = sidecar_factory(
        "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}", data_dir=data_dir,
        env=env(KVDEPOT_KV_EVENTS__REPLAY_ENDPOINT=f"tcp://127.0.0.1:{replay}",
                KVDEPOT_KV_EVENTS__ALLOW_PLAINTEXT_TCP="true",
                KVDEPOT_L2__ADAPTERS=json.dumps(adapters)),
        l1_size_gb=0.02,
    )  # fmt: skip
    ev = Events(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    c = KVDepotClient(sc.url, model="test-model", layout=LAYOUT, timeout_s=10).connect()
    try:
        wait_for(lambda: metric(sc, "kvdepot_kv_events_subscribers") >= 1, what="the subscription")
        stored: dict[str, dict[str, set[int]]] = {}
        for tag, salt in enumerate(("p", "q")):  # the same tokens: the same block hashes' inputs
            for seed in range(SEQS):
                rid = f"{salt}{seed}"
                assert c.store(tokens(seed), data(tag, seed), request_id=rid, cache_salt=salt).stored
            wait_for(lambda: written_behind(sc), what="write-behind")
            got = ev.read(lambda e: len(of_type(e, "BlockStored")) >= 3 * SEQS * CHUNKS)
            stored[salt] = hashes(got, "BlockStored")
        assert set(stored["p"]) == {"CPU", "DISK", "SHARED"}
        assert all(not stored["p"][m] & stored["q"][m] for m in stored["p"])  # salts change hashes
        q_disk, q_redis = disk_blobs(data_dir)["q"], redis_blobs(redis_prefix)["q"]
        assert len(q_disk) == len(q_redis) == len(disk_blobs(data_dir)["p"]) == SEQS * CHUNKS

        # Bad input and no token: refused, nothing started.
        assert call(sc, "DELETE", "/tenants/p/cache", token=False)[0] == 401
        status, body = call(sc, "DELETE", "/tenants/" + "x" * 300 + "/cache")
        assert status == 422 and body["error"]["code"] == "invalid_input"
        assert call(sc, "GET", "/tenants/never/cache/purge")[0] == 404
        status, body = call(sc, "POST", "/cache/clear?tiers=l1,nosuch")
        assert status == 422 and "nosuch" in body["error"]["message"]

        status, job = call(sc, "DELETE", "/tenants/p/cache")
        assert status == 202 and job["tenant"] == "p" and job["tiers"] == ["l1", "disk", "shared"]
        job = finished(sc, "/tenants/p/cache/purge")
        assert job["state"] == "done", job
        assert job["l1_chunks"] == SEQS * CHUNKS
        assert {n: p["removed"] for n, p in job["progress"].items()} == {"disk": 9, "shared": 9}

        removed = hashes(ev.read(lambda e: sum(len(r["block_hashes"]) for r in of_type(e, "BlockRemoved"))
                                 >= sum(len(h) for h in stored["p"].values())), "BlockRemoved")  # fmt: skip
        for medium, blocks in stored["p"].items():
            assert removed[medium] == blocks, medium
        assert "p" not in disk_blobs(data_dir) and "p" not in redis_blobs(redis_prefix)
        assert disk_blobs(data_dir)["q"] == q_disk and redis_blobs(redis_prefix)["q"] == q_redis
        status, p = call(sc, "GET", "/quotas/p")
        assert status == 404 or (p["tiers"]["l1"]["bytes"], p["tiers"]["l1"]["objects"]) == (0, 0)
        for seed in range(SEQS):  # nothing of p anywhere (L2 prefetch included); q's bytes as written
            assert c.lookup(tokens(seed), request_id=f"lp{seed}", cache_salt="p", wait=True).hit_chunks == 0
            c.end_request(f"lp{seed}")
            assert c.lookup(tokens(seed), request_id=f"lq{seed}", cache_salt="q").hit_chunks == CHUNKS
            outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(CHUNKS)]
            assert c.retrieve(f"lq{seed}", outs)
            assert all(torch.equal(o, d) for o, d in zip(outs, data(1, seed), strict=True))

        # Clear L1 (the default), then the Redis tier: AllBlocksCleared for each; disk untouched.
        status, job = call(sc, "POST", "/cache/clear")
        assert status == 202 and job["tiers"] == ["l1"]
        assert finished(sc, "/cache/clear")["l1_chunks"] == SEQS * CHUNKS
        status, job = call(sc, "POST", "/cache/clear?tiers=shared")
        assert status == 202
        assert finished(sc, "/cache/clear")["progress"]["shared"]["removed"] == SEQS * CHUNKS
        # vLLM's AllBlocksCleared names no medium: one for L1, one for the Redis tier.
        cleared = ev.read(lambda e: len(of_type(e, "AllBlocksCleared")) >= 2)
        assert len(of_type(cleared, "AllBlocksCleared")) == 2
        assert redis_blobs(redis_prefix) == {} and disk_blobs(data_dir)["q"] == q_disk
    finally:
        c.close()
        ev.close()


@pytest.mark.parametrize("kind", ["redis", "redis-cluster"])
def test_a_purge_on_another_sidecar_finds_in_redis_what_the_first_wrote(
    sidecar_factory: StartSidecar, redis_prefix: str, kind: str, request: pytest.FixtureRequest
) -> None:
    url = REDIS_URL if kind == "redis" else request.getfixturevalue("redis_cluster")

    def redis_blobs(prefix: str) -> dict[str, dict[str, str]]:  # every node's own keys
        out: dict[str, dict[str, str]] = {}
        nodes = [redis.Redis.from_url(REDIS_URL)] if kind == "redis" else [
            cluster_nodes.client(port) for port in cluster_nodes.PORTS
        ]  # fmt: skip
        for r in nodes:
            with r:
                for raw in r.scan_iter(match=prefix + "*"):
                    key = raw.decode()[len(prefix) :]
                    if not key.startswith(META):
                        value = r.get(raw)
                        assert value is not None
                        digest = hashlib.sha256(value).hexdigest()
                        out.setdefault(ObjectKey.parse(key).salt, {})[key] = digest
        return out

    adapters = json.dumps([{"type": "redis", "name": "shared", "url": url, "key_prefix": redis_prefix}])
    first = sidecar_factory(env=env(KVDEPOT_L2__ADAPTERS=adapters), l1_size_gb=0.02)
    c = KVDepotClient(first.url, model="test-model", layout=LAYOUT, timeout_s=10).connect()
    for tag, salt in enumerate(("p", "q")):
        for seed in range(SEQS):
            c.store(tokens(seed), data(tag, seed), request_id=f"{salt}{seed}", cache_salt=salt)
    c.close()
    wait_for(lambda: written_behind(first), what="write-behind")
    first.stop()
    q_before = redis_blobs(redis_prefix)["q"]
    assert len(redis_blobs(redis_prefix)["p"]) == SEQS * CHUNKS

    second = sidecar_factory(env=env(KVDEPOT_L2__ADAPTERS=adapters), l1_size_gb=0.02)
    assert http(second, "DELETE", "/tenants/p/cache")[0] == 401  # tenant_traffic's token is not this one
    assert call(second, "DELETE", "/tenants/p/cache")[0] == 202
    job = finished(second, "/tenants/p/cache/purge")
    assert job["state"] == "done" and job["progress"]["shared"]["removed"] == SEQS * CHUNKS
    assert "p" not in redis_blobs(redis_prefix) and redis_blobs(redis_prefix)["q"] == q_before
    # Again: nothing left to remove, the same answer otherwise.
    assert call(second, "DELETE", "/tenants/p/cache")[0] == 202
    assert finished(second, "/tenants/p/cache/purge")["progress"]["shared"]["removed"] == 0


def test_a_purge_interrupted_by_a_restart_goes_on_by_itself(
    sidecar_factory: StartSidecar, tmp_path: Path
) -> None:
    """A private Redis scanned at 10 keys a second (the bound on shared tiers): the purge is still
    running when the sidecar stops; started again on the same data_dir it finishes the purge."""
    server = PrivateRedis()
    server.start()
    try:
        adapters = json.dumps([{"type": "redis", "name": "shared", "url": server.url, "key_prefix": "kv:",
                                "scan_keys_per_s": 10}])  # fmt: skip
        data_dir = tmp_path / "data"
        sc = sidecar_factory(data_dir=data_dir, env=env(KVDEPOT_L2__ADAPTERS=adapters), l1_size_gb=0.02)
        c = KVDepotClient(sc.url, model="test-model", layout=LAYOUT, timeout_s=10).connect()
        for tag, salt in enumerate(("p", "q")):
            for seed in range(8):
                c.store(tokens(seed), data(tag, seed), request_id=f"{salt}{seed}", cache_salt=salt)
        c.close()
        wait_for(lambda: written_behind(sc), what="write-behind")

        def blobs() -> dict[str, set[str]]:
            out: dict[str, set[str]] = {}
            with redis.Redis.from_url(server.url) as r:
                for raw in r.scan_iter(match="kv:*"):
                    key = raw.decode()[3:]
                    if not key.startswith(META):
                        out.setdefault(ObjectKey.parse(key).salt, set()).add(key)
            return out

        before = blobs()
        assert len(before["p"]) == len(before["q"]) == 8 * CHUNKS
        assert call(sc, "DELETE", "/tenants/p/cache")[0] == 202
        time.sleep(1.0)  # a second of a purge that needs several: the restart interrupts it
        assert call(sc, "GET", "/tenants/p/cache/purge")[1]["state"] == "running"
        sc.stop()
        assert blobs().get("p"), "the purge ended before the restart: nothing to resume"
        pending = json.loads((data_dir / "purges.json").read_text())["pending"]
        assert [(p["kind"], p["salt"]) for p in pending] == [("purge", "p")]

        sc = sidecar_factory(data_dir=data_dir, env=env(KVDEPOT_L2__ADAPTERS=adapters), l1_size_gb=0.02)
        job = finished(sc, "/tenants/p/cache/purge")  # resumed at start, nobody asked again
        assert job["state"] == "done", job
        after = blobs()
        assert "p" not in after and after["q"] == before["q"]
        assert json.loads((data_dir / "purges.json").read_text())["pending"] == []
    finally:
        server.kill()
