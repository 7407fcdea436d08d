"""Prefix pins with a real `kvdepot serve` process and the real connector client.

Tenant a's prefix is pinned in L1 and the disk tier (before it is stored: it is held when it
arrives), then tenants b and c store six times what L1 and the disk tier hold. a's prefix is still
served byte-identical from L1, and, once L1 is cleared, from the disk tier (and kept in L1 again).
A pin with a TTL is listed, then released by the TTL, and the next storm evicts its chunks from
both tiers; DELETE releases a's pin likewise. Pins that cannot be honoured (the pinned_bytes
quota, the share of a tier, a Redis tier) are 409 with the reason; bad bodies are 4xx and leave
the service intact."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.sidecar import SidecarProcess
from kvdepot_connector.client import KVDepotClient
from tests.integration.conftest import StartSidecar
from tests.integration.l2_helpers import blob_files
from tests.integration.redis_keys import REDIS_URL
from tests.integration.tenant_traffic import AUTH, CHUNK_BYTES, LAYOUT, TOKEN, content, http, sequence, store
from tests.integration.waiting import wait_for

CHUNKS = 3  # a's pinned prefix
STORM_SEQS, STORM_CHUNKS = 60, 8  # per storming tenant: 480 chunks of 64 KiB, 6x L1 and the disk tier
L1_GB = DISK_GB = 0.01  # 160 chunks each


def status(sc: SidecarProcess) -> dict[str, Any]:
    return dict(sc.get_json("/status"))


def written_behind(sc: SidecarProcess) -> bool:
    s = status(sc)["l2"]["store"]
    return bool(s["submitted"] == s["written"] + s["quota_refused"] + s["failed"] + s["dropped"])


def storm(c: KVDepotClient, sc: SidecarProcess, round_: int) -> None:
    for i in range(STORM_SEQS):
        for tag, salt in ((1, "b"), (2, "c")):
            which = 1000 * round_ + 10 * i + tag
            store(c, salt, tag, which, STORM_CHUNKS, f"storm-{salt}-{which}")
        if i % 5 == 4:  # 80 chunks, half of L1: write-behind keeps up, even on a busy host
            wait_for(lambda: written_behind(sc), what="write-behind of the storm", timeout=60)


def served(c: KVDepotClient, which: int, rid: str, l2: bool = True) -> list[torch.Tensor] | None:
    """a's prefix `which` as read back (`l2`: waiting for what L2 holds; else from L1 alone), or
    None when not every chunk was found."""
    reply = c.lookup(sequence(which, CHUNKS), request_id=rid, cache_salt="a", wait=l2)
    if reply.hit_chunks != CHUNKS:
        c.end_request(rid)
        return None
    outs = [torch.empty(CHUNK_BYTES // 2, dtype=torch.float16) for _ in range(CHUNKS)]
    assert c.retrieve(rid, outs)
    c.end_request(rid)
    return outs


def identical(outs: list[torch.Tensor] | None, which: int) -> bool:
    return outs is not None and all(torch.equal(o, content(0, which, i)) for i, o in enumerate(outs))


def pin_body(which: int, **fields: Any) -> dict[str, Any]:
    return {"model": "test-model", "token_ids": sequence(which, CHUNKS), "tiers": ["l1", "disk"], **fields}


def metrics(sc: SidecarProcess) -> str:
    req = urllib.request.Request(sc.http + "/metrics", headers=AUTH)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return str(resp.read().decode())


def on_disk(data_dir: Path, salt: str) -> int:
    from engine.keys import ObjectKey

    return sum(1 for key in blob_files(data_dir / "l2-disk") if ObjectKey.parse(key).salt == salt)


def test_a_pinned_prefix_survives_storms_until_its_ttl_or_delete(
    sidecar_factory: StartSidecar, redis_prefix: str, tmp_path: Path
) -> None:
    adapters = [
        {"type": "disk", "name": "disk", "fsync": "never", "capacity_gb": DISK_GB},
        {"type": "redis", "name": "shared", "url": REDIS_URL, "key_prefix": redis_prefix},
    ]
    data_dir = tmp_path / "data"
    env = {
        "KVDEPOT_L1__CHUNK_SIZE": "16", "KVDEPOT_HTTP__ADMIN_TOKEN": TOKEN, "KVDEPOT_PINS__SWEEP_S": "0.1",
        "KVDEPOT_L2__ADAPTERS": json.dumps(adapters), "KVDEPOT_L2__STORE_POLICY": "first",
        "KVDEPOT_L2__PREFETCH_DEADLINE_MS": "5000",  # a loaded machine: a slow load is not a miss here
    }  # fmt: skip
    sc = sidecar_factory(data_dir=data_dir, env=env, l1_size_gb=L1_GB)
    c = KVDepotClient(sc.url, model="test-model", layout=LAYOUT, timeout_s=30).connect()
    try:
        # Pinned before it is stored: held once it arrives.
        code, pin = http(sc, "PUT", "/pins/a", pin_body(0))
        assert code == 200, pin
        assert pin["present_chunks"] == {"l1": 0, "disk": 0} and pin["expires_at"] is None
        assert store(c, "a", 0, 0, CHUNKS, "a0").stored == CHUNKS
        wait_for(lambda: written_behind(sc), what="write-behind of a's prefix")
        listed = http(sc, "GET", "/pins")[1]["pins"]
        present = {"l1": CHUNKS, "disk": CHUNKS}
        assert [(p["id"], p["present_chunks"]) for p in listed] == [(pin["id"], present)]
        text = metrics(sc)
        assert "kvdepot_pins 1.0" in text and "kvdepot_pins_released_total 0.0" in text
        for tier in ("l1", "disk"):
            assert f'kvdepot_pinned_bytes{{tier="{tier}"}} {float(CHUNKS * CHUNK_BYTES)}' in text

        before = status(sc)
        storm(c, sc, 1)
        after = status(sc)
        l1_evicted = after["l1"]["counters"]["evicted"] - before["l1"]["counters"]["evicted"]
        disk_evicted = next(a for a in after["l2"]["adapters"] if a["name"] == "disk")["stats"]["evictions"]
        # Each tier turned over several times: every chunk it held before the storm (a's, the
        # oldest) would have gone without the pin.
        assert l1_evicted > 4 * 160 and disk_evicted > 2 * 160, (l1_evicted, disk_evicted)
        assert identical(served(c, 0, "r1", l2=False), 0)  # from L1
        assert on_disk(data_dir, "a") == CHUNKS

        # L1 cleared: the chunks come back from the disk tier, byte-identical.
        assert http(sc, "POST", "/cache/clear")[0] == 202
        wait_for(lambda: http(sc, "GET", "/cache/clear")[1]["state"] == "done", what="the clear")
        assert identical(served(c, 0, "r2"), 0)

        # A second prefix pinned for 2 s: released by its TTL, then evicted by the next storm.
        assert store(c, "a", 0, 1, CHUNKS, "a1").stored == CHUNKS
        code, short = http(sc, "PUT", "/pins/a", pin_body(1, ttl_s=2))
        assert code == 200 and short["expires_at"] == pytest.approx(short["created_at"] + 2)
        wait_for(lambda: written_behind(sc), what="write-behind of a's second prefix")
        assert {p["id"] for p in http(sc, "GET", "/pins/a")[1]["pins"]} == {pin["id"], short["id"]}
        wait_for(lambda: len(http(sc, "GET", "/pins/a")[1]["pins"]) == 1, what="the TTL", timeout=10)
        storm(c, sc, 2)
        assert served(c, 1, "r3") is None  # neither in L1 nor on disk any more
        # The pin without a TTL still holds; what the read after the clear loaded from disk stayed in
        # L1 (a pinned chunk prefetched is kept; it sits in the sidecar's own write domain, which
        # engine stores do not turn over).
        assert identical(served(c, 0, "r4", l2=False), 0)

        # DELETE releases it: the next storm evicts it from both tiers.
        assert http(sc, "DELETE", f"/pins/a?id={pin['id']}")[0] == 204
        assert http(sc, "GET", "/pins")[1] == {"pins": []}
        assert "kvdepot_pins_released_total 2.0" in metrics(sc)
        storm(c, sc, 3)
        assert on_disk(data_dir, "a") == 0  # the storm evicted it from the disk tier
        # In L1 it is in the sidecar's segments (loaded from disk above): a clear takes it, and with
        # the pin gone nothing brings it back.
        assert http(sc, "POST", "/cache/clear")[0] == 202
        wait_for(lambda: http(sc, "GET", "/cache/clear")[1]["state"] == "done", what="the second clear")
        assert served(c, 0, "r5") is None

        # Pins that cannot be honoured: 409 with the reason.
        assert http(sc, "PUT", "/quotas/d", {"pinned_bytes": 2 * CHUNK_BYTES})[0] == 200
        code, body = http(sc, "PUT", "/pins/d", pin_body(5))
        assert code == 409 and "pinned_bytes" in body["error"]["message"], body
        code, body = http(sc, "PUT", "/pins/e", pin_body(5, tiers=["shared"]))
        assert code == 409 and "cannot honour pins" in body["error"]["message"], body
        too_many = {"model": "test-model", "token_ids": [9] * (90 * 16)}  # L1 holds 163 chunks
        code, body = http(sc, "PUT", "/pins/e", too_many)
        assert code == 409 and "max_share" in body["error"]["message"], body

        # Bad bodies and salts: 4xx, nothing pinned, the service intact.
        bad: list[tuple[str, Any]] = [
            ("/pins/a", {"model": "test-model", "token_ids": [1] * 16, "tiers": ["nvme"]}),
            ("/pins/a", {"model": "test-model", "token_ids": [1] * 16, "ttl_s": "60"}),
            ("/pins/a", {"model": "test-model", "token_ids": [1] * 16, "ttl_s": 10**15}),
            ("/pins/a", {"model": "test-model", "token_ids": [2**40] * 16}),
            ("/pins/a", {"model": "test-model", "token_ids": [1] * 15}),
            ("/pins/a", {"model": ["x"], "token_ids": [1] * 16}),
            ("/pins/a", {"model": "test-model", "token_ids": {"a": 1}}),
            ("/pins/a", [1, 2, 3]),
            ("/pins/" + "s" * 400, pin_body(0)),
        ]
        for path, body in bad:
            code, answer = http(sc, "PUT", path, body)
            assert 400 <= code < 500 and answer["error"]["code"] == "invalid_input", (path, answer)
        assert http(sc, "PUT", "/pins/a", pin_body(0), token=False)[0] == 401
        # A salt with a slash and non-ASCII characters is a tenant like any other.
        code, odd = http(sc, "PUT", "/pins/t%C3%A9n/ant", pin_body(0, tiers=["l1"]))
        assert code == 200 and odd["cache_salt"] == "tén/ant", odd
        assert [p["cache_salt"] for p in http(sc, "GET", "/pins")[1]["pins"]] == ["tén/ant"]
        assert http(sc, "DELETE", "/pins/t%C3%A9n/ant")[0] == 204
        assert store(c, "a", 0, 7, CHUNKS, "a7").stored == CHUNKS
        assert status(sc)["l1"]["allocator_ok"]
    finally:
        c.close()
