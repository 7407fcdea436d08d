"""GET /workers: the admin token's, typed, instance nonces never shown; the worker metrics."""

from __future__ import annotations

import time

import pytest

from tests.unit.api.conftest import ServeService

pytestmark = pytest.mark.anyio

TOKEN = "workers-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NONCE = "ab" * 16


async def test_workers_lists_instances_with_states_and_ages(serve: ServeService) -> None:
    async with serve({"http.admin_token": TOKEN}) as running:
        dp = running.service.dataplane
        assert dp is not None and dp.workers is not None
        reg = dp.workers.registry
        now = time.monotonic()
        reg.add(101, NONCE, "scheduler", 0, now=now - 30)
        reg.add(102, NONCE, "worker", 1, now=now - 30)
        reg.attach(102, 4242, now - 29)
        reg.beat(102, now - 20)
        reg.add(103, "private-103", now=now)
        dp.workers.sweep()  # 102 is silent for 20 s > 10 s: suspect
        reg.dead(101, now)
        r = await running.client.get("/workers")
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        r = await running.client.get("/workers", headers=AUTH)
        assert r.status_code == 200
        body = r.json()
        assert NONCE not in r.text
        assert (body["heartbeat_s"], body["worker_timeout_s"]) == (2.0, 10.0)
        assert body["states"] == {"alive": 1, "suspect": 1, "dead": 1}
        assert body["totals"] == {"suspect": 1, "dead": 1, "revived": 0, "heartbeats": 1}
        by_id = {w["id"]: w for i in body["instances"] for w in i["workers"]}
        assert by_id[102]["state"] == "suspect" and by_id[102]["pid"] == 4242
        assert by_id[102]["last_seen_age_s"] >= 20 and by_id[102]["first_seen_age_s"] >= 30
        assert by_id[101]["state"] == "dead" and by_id[101]["ended_age_s"] is not None
        names = sorted(i["instance"] for i in body["instances"])
        assert names[0] == "private-103" and names[1].startswith("sha256:")
        metrics = (await running.client.get("/metrics", headers=AUTH)).text
        assert 'kvdepot_workers{state="suspect"} 1.0' in metrics
        assert "kvdepot_worker_suspect_total 1.0" in metrics
        assert "kvdepot_worker_dead_total 1.0" in metrics
        assert "/workers" in (await running.client.get("/openapi.json")).json()["paths"]
