"""Runtime L2 reconfiguration over HTTP while a client stores and retrieves: no operation fails;
bad requests get the documented 4xx."""

from __future__ import annotations

import json
import threading

import httpx
import redis
import torch

from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import LAYOUT, chunk_data, client, request_tokens
from tests.integration.redis_keys import REDIS_URL

TOKEN = "s3cret-admin"


class Workload(threading.Thread):
    """Stores a new request, looks it up, retrieves and checks it; over and over, until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.done = 0
        self.failures: list[str] = []

    def run(self) -> None:
        c = client(self.url)
        seed = 1000
        try:
            while not self.stop.is_set():
                seed += 1
                try:
                    toks = request_tokens(seed, 4)
                    outcome = c.store(toks, [chunk_data(seed, i) for i in range(4)], request_id=f"w{seed}")
                    if outcome.stored + outcome.existing != 4:
                        self.failures.append(f"store {seed}: {outcome}")
                    hit = c.lookup(toks, request_id=f"r{seed}", wait=True).hit_chunks
                    outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(hit)]
                    if hit and not c.retrieve(f"r{seed}", outs):
                        self.failures.append(f"retrieve {seed}: lease expired")
                    if not all(torch.equal(o, chunk_data(seed, i)) for i, o in enumerate(outs)):
                        self.failures.append(f"retrieve {seed}: wrong bytes")
                    if hit != 4:
                        self.failures.append(f"lookup {seed}: hit {hit} of 4")
                    self.done += 1
                except Exception as exc:
                    self.failures.append(f"{seed}: {type(exc).__name__}: {exc}")
        finally:
            c.close()


def test_add_redis_then_drain_disk_under_load(sidecar_factory: StartSidecar, redis_prefix: str) -> None:
    env = {
        "KVDEPOT_L1__CHUNK_SIZE": "16",
        "KVDEPOT_HTTP__ADMIN_TOKEN": TOKEN,
        "KVDEPOT_L2__ADAPTERS": json.dumps([{"type": "disk", "name": "disk"}]),
    }
    sc = sidecar_factory(env=env, l1_size_gb=0.01)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    redis_config = {"type": "redis", "name": "shared", "url": REDIS_URL, "key_prefix": redis_prefix}
    work = Workload(sc.url)
    work.start()
    try:
        with httpx.Client(base_url=sc.http, timeout=30) as http:
            # Bad requests first, each with its documented status and a JSON error body.
            for method, path, body, status in [
                ("POST", "/l2/adapters", {"type": "tape", "name": "x"}, 422),
                ("POST", "/l2/adapters", {"type": "redis", "name": "x", "timeout_s": -1}, 422),
                ("POST", "/l2/adapters", {"type": "redis", "name": "bad name!"}, 422),
                ("POST", "/l2/adapters", {"type": "disk", "name": "disk"}, 409),
                ("DELETE", "/l2/adapters/nope", None, 404),
                ("DELETE", "/l2/adapters/disk?mode=explode", None, 422),
                ("PATCH", "/l2/adapters/nope", {"capacity_gb": 1}, 404),
                ("PATCH", "/l2/adapters/disk", {"capacity_gb": -1}, 422),
                ("PATCH", "/l2/adapters/disk", {"capacity_gb": 1, "colour": "red"}, 422),
            ]:
                r = http.request(method, path, json=body, headers=auth)
                assert r.status_code == status, (method, path, r.text)
                assert r.json()["error"]["message"]
            r = http.post(
                "/l2/adapters", content=b"{not json", headers=auth | {"content-type": "application/json"}
            )
            assert r.status_code == 422
            assert http.post("/l2/adapters", json=redis_config).status_code == 401

            assert http.post("/l2/adapters", json=redis_config, headers=auth).status_code == 201
            names = [a["name"] for a in http.get("/l2/adapters").json()["adapters"]]
            assert names == ["disk", "shared"]
            assert http.patch("/l2/adapters/disk", json={"capacity_gb": 2}, headers=auth).json()["usage"][
                "capacity_bytes"
            ] == 2 * (1 << 30)
            done_before = work.done
            r = http.delete("/l2/adapters/disk?mode=drain", headers=auth)
            assert r.status_code == 204
            adapters = http.get("/l2/adapters").json()["adapters"]
            assert [a["name"] for a in adapters] == ["shared"]
            assert adapters[0]["health"]["state"] == "ok"
        # Keep the workload running a little after the detach, then stop it.
        target = max(work.done, done_before) + 5
        while work.done < target and work.is_alive() and not work.failures:
            work.stop.wait(0.05)
    finally:
        work.stop.set()
        work.join(30)
    assert work.failures == []
    assert work.done >= 10
    with redis.Redis.from_url(REDIS_URL) as r:
        written = any(True for _ in r.scan_iter(match=redis_prefix + "*"))
        assert written, "the added Redis tier received writes"
