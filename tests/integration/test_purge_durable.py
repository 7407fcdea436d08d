"""A purge answered 202 survives a SIGKILL right after the answer, and a purge leaves nothing of the
tenant, with real sidecar processes: sixteen purges asked back to back, the sidecar killed at the
last 202 and started again on the same data_dir, each finishes by itself (a private Redis scanned
slowly keeps them running past the kill); and a tenant whose write-behind backlog (a disk tier
with fsync) is still being written when its purge starts holds no blob and no L1 chunk once the
purge says done and the write-behind has drained, while another tenant keeps every chunk."""

from __future__ import annotations

import json
from pathlib import Path

import redis

from bench.sidecar import SidecarProcess
from engine.keys import ObjectKey
from kvdepot_connector.client import KVDepotClient
from storage.redis.fleet import META
from tests.integration.conftest import StartSidecar
from tests.integration.l2_helpers import PrivateRedis, blob_files
from tests.integration.test_kv_events_sidecar import LAYOUT, env
from tests.integration.test_purge_process import call, data, finished, tokens
from tests.integration.waiting import wait_for

TENANTS = tuple(f"p{i}" for i in range(16))
SEEDS = 2


def written_behind(sc: SidecarProcess) -> bool:
    """Every chunk queued was written, refused, failed, dropped, or let go for a purge."""
    s = sc.get_json("/status")["l2"]["store"]
    done = s["written"] + s["quota_refused"] + s["failed"] + s["dropped"] + s["skipped_purge"]
    return bool(s["submitted"] == done)


def _salts_in(url: str) -> dict[str, int]:
    out: dict[str, int] = {}
    with redis.Redis.from_url(url) as r:
        for raw in r.scan_iter(match="kv:*"):
            key = raw.decode()[3:]
            if not key.startswith(META):
                salt = ObjectKey.parse(key).salt
                out[salt] = out.get(salt, 0) + 1
    return out


def test_purges_answered_202_survive_a_sigkill_right_after_the_answer(
    sidecar_factory: StartSidecar, tmp_path: Path
) -> None:
    server = PrivateRedis()
    server.start()
    try:
        adapters = json.dumps([{"type": "redis", "name": "shared", "url": server.url, "key_prefix": "kv:",
                                "scan_keys_per_s": 50}])  # fmt: skip
        data_dir = tmp_path / "data"
        sc = sidecar_factory(data_dir=data_dir, env=env(KVDEPOT_L2__ADAPTERS=adapters), l1_size_gb=0.02)
        c = KVDepotClient(sc.url, model="test-model", layout=LAYOUT, timeout_s=10).connect()
        for tag, salt in enumerate((*TENANTS, "q")):
            for seed in range(SEEDS):
                c.store(tokens(seed), data(tag, seed), request_id=f"{salt}{seed}", cache_salt=salt)
        c.close()
        wait_for(lambda: written_behind(sc), what="write-behind")
        before = _salts_in(server.url)
        assert all(before[s] == SEEDS * 3 for s in (*TENANTS, "q")), before

        for salt in TENANTS:
            assert call(sc, "DELETE", f"/tenants/{salt}/cache")[0] == 202
        sc.kill()  # at once, after the last answer

        sc = sidecar_factory(data_dir=data_dir, env=env(KVDEPOT_L2__ADAPTERS=adapters), l1_size_gb=0.02)
        lost = [s for s in TENANTS if call(sc, "GET", f"/tenants/{s}/cache/purge")[0] == 404]
        assert not lost, f"{len(lost)} of {len(TENANTS)} purges answered 202 were lost: {lost}"
        for salt in TENANTS:
            assert finished(sc, f"/tenants/{salt}/cache/purge")["state"] == "done"
        after = _salts_in(server.url)
        assert not set(TENANTS) & set(after), after
        assert after["q"] == SEEDS * 3
    finally:
        server.kill()


def test_a_purge_racing_the_write_behind_leaves_nothing_of_the_tenant(
    sidecar_factory: StartSidecar, tmp_path: Path
) -> None:
    adapters = json.dumps([{"type": "disk", "name": "disk", "fsync": "always", "io_threads": 1}])
    data_dir = tmp_path / "data"
    sc = sidecar_factory(data_dir=data_dir, env=env(KVDEPOT_L2__ADAPTERS=adapters), l1_size_gb=0.05)
    c = KVDepotClient(sc.url, model="test-model", layout=LAYOUT, timeout_s=10).connect()
    try:
        for seed in range(4):
            c.store(tokens(seed), data(1, seed), request_id=f"q{seed}", cache_salt="q")
        wait_for(lambda: written_behind(sc), what="q's write-behind")
        for seed in range(200):  # a backlog: the purge starts while most of it is still queued
            c.store(tokens(seed), data(0, seed), request_id=f"p{seed}", cache_salt="p")
        assert call(sc, "DELETE", "/tenants/p/cache")[0] == 202
        assert finished(sc, "/tenants/p/cache/purge")["state"] == "done"
        wait_for(lambda: written_behind(sc), what="write-behind drained")
        left = [k for k in blob_files(data_dir / "l2-disk") if ObjectKey.parse(k).salt == "p"]
        assert not left, f"{len(left)} of p's blobs on disk after its purge said done"
        hits = 0
        for seed in range(200):
            hits += c.lookup(tokens(seed), request_id=f"lp{seed}", cache_salt="p", wait=True).hit_chunks
            c.end_request(f"lp{seed}")
        assert hits == 0
        q = [k for k in blob_files(data_dir / "l2-disk") if ObjectKey.parse(k).salt == "q"]
        assert len(q) == 4 * 3
    finally:
        c.close()
