"""The audit log of a real, in-process service: a quota change appears with its before and after,
an adapter attached and a policy changed too, a refused mutation (bad token) appears with its
outcome and changed nothing, GET /audit needs the token and bounds its limit, and the token never
appears in the log output or in any answer."""

from __future__ import annotations

import hashlib

import pytest
import structlog

from tests.unit.api.conftest import ServeService

pytestmark = pytest.mark.anyio

TOKEN = "audit-admin-token-5f2c"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FP = hashlib.sha256(TOKEN.encode()).hexdigest()[:8]


async def test_mutations_are_audited_with_before_after_and_outcome(serve: ServeService) -> None:
    with structlog.testing.capture_logs() as logs:
        async with serve({"http.admin_token": TOKEN, "l1.chunk_size": 16}) as running:
            c = running.client
            assert (await c.put("/quotas/tenant-a", json={"l1_bytes": 4096}, headers=AUTH)).status_code == 200
            put2 = await c.put("/quotas/tenant-a", json={"l1_bytes": 8192, "l2_bytes": 0}, headers=AUTH)
            assert put2.status_code == 200
            wrong = {"Authorization": "Bearer not-the-token"}
            assert (await c.delete("/quotas/tenant-a", headers=wrong)).status_code == 401
            assert (await c.delete("/quotas/tenant-a")).status_code == 401
            disk = {"type": "mock", "name": "m1", "capacity_gb": 0.01}
            assert (await c.post("/l2/adapters", json=disk, headers=AUTH)).status_code == 201
            policy_change = await c.patch("/l2/policy", json={"store_policy": "first"}, headers=AUTH)
            assert policy_change.status_code == 200
            assert (await c.put("/quotas/tenant-b", json={"l1_bytes": -1}, headers=AUTH)).status_code == 422

            assert (await c.get("/audit")).status_code == 401
            assert (await c.get("/audit?limit=0", headers=AUTH)).status_code == 422
            assert (await c.get("/audit?limit=1001", headers=AUTH)).status_code == 422
            answer = await c.get("/audit?limit=1000", headers=AUTH)
            assert answer.status_code == 200
            body = answer.json()
            one = (await c.get("/audit?limit=1", headers=AUTH)).json()
            answers_text = answer.text + one.__repr__()

    records = body["records"]  # newest first
    assert body["recorded"] == len(records) == 7
    assert one["records"] == records[:1]
    bad_put, policy, attach, no_token, bad_token, second, first = records
    assert first["method"] == "PUT" and first["resource"] == "quotas" and first["target"] == "tenant-a"
    assert first["before"] is None
    assert first["after"] == {"l1_bytes": 4096, "l2_bytes": None, "pinned_bytes": None}
    assert first["outcome"] == {"status": 200, "code": None}
    assert first["caller"]["token"] == FP and first["caller"]["peer"].startswith("127.0.0.1:")
    assert second["before"] == {"l1_bytes": 4096, "l2_bytes": None, "pinned_bytes": None}
    assert second["after"] == {"l1_bytes": 8192, "l2_bytes": 0, "pinned_bytes": None}
    for refused, token in ((bad_token, hashlib.sha256(b"not-the-token").hexdigest()[:8]), (no_token, None)):
        assert refused["method"] == "DELETE"
        assert refused["outcome"] == {"status": 401, "code": "unauthorized"}
        assert refused["caller"]["token"] == token
        unchanged = {"l1_bytes": 8192, "l2_bytes": 0, "pinned_bytes": None}
        assert refused["before"] == refused["after"] == unchanged  # nothing changed
    assert attach["resource"] == "l2.adapters" and attach["outcome"]["status"] == 201
    assert "m1" not in (attach["before"] or {})
    assert attach["after"]["m1"]["config"]["capacity_gb"] == 0.01
    assert policy["before"]["store_policy"] != "first" and policy["after"]["store_policy"] == "first"
    assert bad_put["outcome"] == {"status": 422, "code": "invalid_input"}
    assert bad_put["before"] is None and bad_put["after"] is None

    lines = [entry for entry in logs if entry.get("event") == "admin_call"]
    assert len(lines) == 7
    assert all("target" not in line or line["resource"] != "quotas" for line in lines)  # salts: fingerprinted
    assert {line.get("target_fp") for line in lines if line["resource"] == "quotas"} == {
        hashlib.sha256(b"tenant-a").hexdigest()[:8], hashlib.sha256(b"tenant-b").hexdigest()[:8]
    }
    assert TOKEN not in repr(logs)
    assert TOKEN not in answers_text


async def test_a_full_ring_keeps_the_newest(serve: ServeService) -> None:
    async with serve() as running:
        c = running.client
        audit = running.service.control
        assert audit is not None
        for i in range(1005):
            audit.audit.record({"ts": 0.0, "method": "PUT", "resource": "quotas", "target": f"t{i}",
                                "caller": {"peer": None, "token": None}, "before": None, "after": None,
                                "outcome": {"status": 200, "code": None}})  # fmt: skip
        body = (await c.get("/audit?limit=1000")).json()
        assert body["recorded"] == 1005
        assert len(body["records"]) == 1000
        assert body["records"][0]["target"] == "t1004" and body["records"][-1]["target"] == "t5"


async def test_a_flood_of_refused_calls_is_aggregated_not_logged_line_by_line(serve: ServeService) -> None:
    """120 mutations without the token: each is refused (401) and counted, a bounded number are
    logged and kept one by one, the rest summed into one line; the real calls before them stay in
    the ring (a flood cannot push them out)."""
    flood = 120
    with structlog.testing.capture_logs() as logs:
        async with serve({"http.admin_token": TOKEN}) as running:
            c = running.client
            assert (await c.put("/quotas/tenant-a", json={"l1_bytes": 4096}, headers=AUTH)).status_code == 200
            for i in range(flood):
                assert (await c.delete(f"/quotas/t{i}")).status_code == 401
            # a call after the window: the suppressed ones are summed in one line
            audit = running.service.control
            assert audit is not None
            audit.audit.clock = lambda: 1e12
            assert (await c.delete("/quotas/late")).status_code == 401
            body = (await c.get("/audit?limit=1000", headers=AUTH)).json()
            text = (await c.get("/metrics")).text
    refused_lines = [e for e in logs if e.get("event") == "admin_call" and e["outcome"]["status"] == 401]
    assert len(refused_lines) <= 21, len(refused_lines)
    summaries = [e for e in logs if e.get("event") == "admin_calls_refused"]
    assert len(summaries) == 1 and summaries[0]["unlogged"] == flood - (len(refused_lines) - 1)
    assert body["refused"] == flood + 1 and body["refused_unlogged"] == summaries[0]["unlogged"]
    assert body["records"][-1]["resource"] == "quotas" and body["records"][-1]["outcome"]["status"] == 200
    assert f"kvdepot_audit_refused_calls_total {float(flood + 1)}" in text
    assert f"kvdepot_audit_refused_unlogged_total {float(summaries[0]['unlogged'])}" in text
