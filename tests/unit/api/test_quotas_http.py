"""The quota endpoints of a real, in-process service: CRUD, the `_default` tenant, usage, bad input
(always a 4xx with a JSON message, never a 5xx), the admin token, persistence, /status, /metrics,
and the QUOTA answer on the data plane."""

from __future__ import annotations

import json
import random
from pathlib import Path
from urllib.parse import quote

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.results import SlotStatus
from kvdepot_connector import protocol as p
from tests.factories import tokens
from tests.unit.api.conftest import CHUNK, SMALL_CHUNKS, RunningService, ServeService, assert_error, store

pytestmark = pytest.mark.anyio

TOKEN = "quota-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PAGE = 4096


def url(salt: str) -> str:
    return "/quotas/" + quote(salt, safe="")


# --- CRUD ----------------------------------------------------------------------------------------


async def test_put_get_list_delete(serve: ServeService) -> None:
    async with serve(SMALL_CHUNKS) as running:
        c = running.client
        assert (await c.get("/quotas")).json() == {"allowlist": False, "tenants": []}
        r = await c.put("/quotas/a", json={"l1_bytes": 2 * PAGE, "l2_bytes": None})
        assert r.status_code == 200
        assert r.json() == {
            "cache_salt": "a",
            "tenant": "a",
            "quota": {"l1_bytes": 2 * PAGE, "l2_bytes": None, "pinned_bytes": None},
            "tiers": {
                "l1": {
                    "limit_bytes": 2 * PAGE, "bytes": 0, "objects": 0, "hits": 0, "misses": 0,
                    "evictions": 0, "evicted_bytes": 0, "quota_refusals": 0,
                }
            },
            "fleet": {},
            "fleet_errors": {},
        }  # fmt: skip
        assert store(running.service, "a", 3) == [SlotStatus.RESERVED] * 2 + [SlotStatus.QUOTA]
        got = (await c.get("/quotas/a")).json()
        assert got["tiers"]["l1"]["bytes"] == 2 * PAGE and got["tiers"]["l1"]["quota_refusals"] == 1
        r = await c.put("/quotas/a", json={"l1_bytes": None})  # replace: unlimited now
        assert r.json()["quota"] == {"l1_bytes": None, "l2_bytes": None, "pinned_bytes": None}
        assert store(running.service, "a", 3) == [SlotStatus.EXISTS] * 2 + [SlotStatus.RESERVED]
        listed = (await c.get("/quotas")).json()["tenants"]
        assert [t["cache_salt"] for t in listed] == ["a"]
        assert (await c.delete("/quotas/a")).status_code == 204
        still = await c.get("/quotas/a")  # no quota any more, but it holds bytes: still listed
        assert still.status_code == 200 and still.json()["quota"] is None
        assert still.json()["tiers"]["l1"]["limit_bytes"] is None
        assert_error(await c.delete("/quotas/a"), 404, "not_found", "no quota")


async def test_the_empty_salt_is_written_default(serve: ServeService) -> None:
    async with serve(SMALL_CHUNKS) as running:
        c = running.client
        r = await c.put("/quotas/_default", json={"l1_bytes": 0})
        assert r.status_code == 200
        assert (r.json()["cache_salt"], r.json()["tenant"]) == ("", "_default")
        assert store(running.service, "", 2) == [SlotStatus.QUOTA] * 2
        assert store(running.service, "_default-not", 1) == [SlotStatus.RESERVED]
        listed = {t["tenant"]: t for t in (await c.get("/quotas")).json()["tenants"]}
        assert set(listed) == {"_default", "_default-not"}
        assert (await c.delete("/quotas/_default")).status_code == 204
        assert_error(await c.get("/quotas/_default"), 404, "not_found")


async def test_any_salt_is_addressable_percent_encoded(serve: ServeService) -> None:
    async with serve(SMALL_CHUNKS) as running:
        c = running.client
        for salt in ("with/slash", "ü ñ ✓", "a%2Fb", "x" * 256, "?#&="):
            r = await c.put(url(salt), json={"l1_bytes": 5})
            assert r.status_code == 200, salt
            assert r.json()["cache_salt"] == salt
            assert (await c.get(url(salt))).json()["cache_salt"] == salt
        assert running.service.engine is not None
        assert running.service.engine.tenants.limit("with/slash", "l1") == 5
        for salt in ("with/slash", "ü ñ ✓", "a%2Fb", "x" * 256, "?#&="):
            assert (await c.delete(url(salt))).status_code == 204
        assert (await c.get("/quotas")).json()["tenants"] == []


async def test_unknown_salt_is_404_with_a_message(shared: RunningService) -> None:
    assert_error(await shared.client.get("/quotas/nobody"), 404, "not_found", "nobody")
    assert_error(await shared.client.delete("/quotas/nobody"), 404, "not_found", "nobody")


async def test_usage_without_a_quota_is_listed(serve: ServeService) -> None:
    async with serve(SMALL_CHUNKS) as running:
        store(running.service, "", 2)
        store(running.service, "b", 1)
        tenants = (await running.client.get("/quotas")).json()["tenants"]
        assert [(t["tenant"], t["quota"], t["tiers"]["l1"]["bytes"]) for t in tenants] == [
            ("_default", None, 2 * PAGE),
            ("b", None, PAGE),
        ]


async def test_usage_and_limits_per_l2_adapter_are_listed_and_in_the_metrics(serve: ServeService) -> None:
    mocks = [{"type": "mock", "name": "m1"}, {"type": "mock", "name": "shared.redis-like"}]
    async with serve(SMALL_CHUNKS | {"l2.adapters": mocks}) as running:
        limit = 2 * PAGE + 600  # two blobs (header + page), not three
        assert (await running.client.put("/quotas/a", json={"l2_bytes": limit})).status_code == 200
        l2 = running.service.l2
        assert l2 is not None
        store(running.service, "a", 2)
        store(running.service, "", 1, start=100)
        assert await l2.store.wait_idle(10)
        store(running.service, "a", 1, start=200)  # over the quota: evicts a's oldest blob
        assert await l2.store.wait_idle(10)
        tenants = {t["tenant"]: t["tiers"] for t in (await running.client.get("/quotas")).json()["tenants"]}
        assert set(tenants) == {"a", "_default"}
        blob = tenants["a"]["m1"]["bytes"] // 2
        assert PAGE < blob < PAGE + 300
        for name in ("m1", "shared.redis-like"):
            a = tenants["a"][name]
            assert (a["limit_bytes"], a["bytes"], a["objects"], a["evictions"]) == (limit, 2 * blob, 2, 1)
            assert a["evicted_bytes"] == blob
            assert tenants["_default"][name]["bytes"] == blob - 1  # the empty salt: a shorter key
        one = (await running.client.get("/quotas/a")).json()["tiers"]
        assert set(one) == {"l1", "m1", "shared.redis-like"}
        assert one["l1"]["bytes"] == 3 * PAGE
        text = (await running.client.get("/metrics")).text
        samples = {
            (s.name, s.labels.get("tenant"), s.labels.get("tier")): s.value
            for f in text_string_to_metric_families(text)
            if f.name.startswith("kvdepot_tenant_")
            for s in f.samples
        }
        assert samples[("kvdepot_tenant_bytes", "a", "m1")] == 2 * blob
        assert samples[("kvdepot_tenant_evictions_total", "a", "shared.redis-like")] == 1
        assert samples[("kvdepot_tenant_quota_bytes", "a", "m1")] == limit


async def test_an_adapter_may_not_be_named_like_the_memory_tier(serve: ServeService) -> None:
    async with serve(SMALL_CHUNKS | {"l2.adapters": [{"type": "mock", "name": "m1"}]}) as running:
        r = await running.client.post("/l2/adapters", json={"type": "mock", "name": "l1"})
        assert_error(r, 422, "invalid_input", "l1")


# --- bad input: 4xx with a JSON message, never 5xx --------------------------------------------


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"l1_bytes": -1}, ["l1_bytes", "greater than or equal to 0"]),
        ({"l2_bytes": 1.5}, ["l2_bytes", "integer"]),
        ({"l1_bytes": 1.0}, ["l1_bytes", "integer"]),
        ({"l1_bytes": "100"}, ["l1_bytes", "integer"]),
        ({"l1_bytes": True}, ["l1_bytes", "integer"]),
        ({"l1_bytes": 2**62 + 1}, ["l1_bytes", "less than or equal"]),
        ({"l1_bytes": 10**400}, ["l1_bytes"]),
        ({"l1_bytes": 1, "l3_bytes": 1}, ["l3_bytes", "Extra inputs"]),
        ([1, 2], ["object"]),
        ("l1_bytes=5", ["object"]),
        (None, ["body", "required"]),
    ],
)
async def test_bad_bodies_are_422_and_change_nothing(
    shared: RunningService, body: object, words: list[str]
) -> None:
    r = await shared.client.put("/quotas/a", json=body)
    assert_error(r, 422, "invalid_input", *words)
    assert_error(await shared.client.get("/quotas/a"), 404, "not_found")


@pytest.mark.parametrize(
    ("content", "headers"),
    [
        (b'{"l1_bytes": 5', {"content-type": "application/json"}),
        (b"", {"content-type": "application/json"}),
        (b"\xff\xfe", {"content-type": "application/json"}),
        (b'{"l1_bytes": NaN}', {"content-type": "application/json"}),
        (b'{"l1_bytes": 5}', {"content-type": "text/plain"}),
    ],
)
async def test_malformed_requests_are_422(
    shared: RunningService, content: bytes, headers: dict[str, str]
) -> None:
    r = await shared.client.put("/quotas/a", content=content, headers=headers)
    assert_error(r, 422, "invalid_input")
    assert r.json()["error"]["message"]


async def test_salt_of_more_than_256_characters_is_422(shared: RunningService) -> None:
    for method in ("GET", "PUT", "DELETE"):
        r = await shared.client.request(method, url("x" * 257), json={})
        assert_error(r, 422, "invalid_input", "256")
    assert_error(await shared.client.get("/quotas/"), 422, "invalid_input")


async def test_random_bodies_never_get_a_5xx(running: RunningService) -> None:
    rng = random.Random(5)
    values: list[object] = [None, 0, 1, -1, 2**62, 2**62 + 1, 2**64, 0.5, 1e30, "", "1", True, [], {}, [1]]
    keys = ["l1_bytes", "l2_bytes", "l1", "", "L1_BYTES"]
    for i in range(150):
        body = {rng.choice(keys): rng.choice(values) for _ in range(rng.randint(0, 3))}
        r = await running.client.put(f"/quotas/t{i % 7}", json=body)
        assert r.status_code in (200, 422), (body, r.text)
        if r.status_code == 422:
            assert r.json()["error"]["message"]
    for i in range(7):
        r = await running.client.get(f"/quotas/t{i}")
        assert r.status_code in (200, 404)


# --- the admin token ------------------------------------------------------------------------------


async def test_mutations_and_reads_need_the_admin_token(serve: ServeService) -> None:
    async with serve({"http.admin_token": TOKEN}) as running:
        c = running.client
        wrong = {"Authorization": "Bearer nope"}
        for headers in ({}, wrong):
            assert_error(await c.put("/quotas/a", json={"l1_bytes": 1}, headers=headers), 401, "unauthorized")
            assert_error(
                await c.put("/quotas/a", json={"l1_bytes": -1}, headers=headers), 401, "unauthorized"
            )
            assert_error(await c.delete("/quotas/a", headers=headers), 401, "unauthorized")
            # Salts are tenants' secrets: reading them needs the token too.
            assert_error(await c.get("/quotas", headers=headers), 401, "unauthorized")
            assert_error(await c.get("/quotas/a", headers=headers), 401, "unauthorized")
        assert_error(await c.get("/quotas/a", headers=AUTH), 404, "not_found")  # nothing was changed
        assert (await c.put("/quotas/a", json={"l1_bytes": 1}, headers=AUTH)).status_code == 200
        assert (await c.get("/quotas", headers=AUTH)).status_code == 200
        assert (await c.get("/quotas/a", headers=AUTH)).status_code == 200
        assert_error(await c.delete("/quotas/a", headers=wrong), 401, "unauthorized")
        assert (await c.delete("/quotas/a", headers=AUTH)).status_code == 204


# --- persistence, allowlist, status, metrics, data plane ---------------------------------------


async def test_quotas_survive_a_restart_on_the_same_data_dir(serve: ServeService, tmp_path: Path) -> None:
    data_dir = tmp_path / "kept"
    async with serve({"data_dir": data_dir}) as running:
        assert (await running.client.put("/quotas/a", json={"l1_bytes": 7, "l2_bytes": 8})).status_code == 200
        assert (await running.client.put("/quotas/_default", json={"l1_bytes": 0})).status_code == 200
    saved = json.loads((data_dir / "quotas.json").read_text())
    assert saved["quotas"] == {"": {"l1_bytes": 0, "l2_bytes": None}, "a": {"l1_bytes": 7, "l2_bytes": 8}}
    async with serve({"data_dir": data_dir}) as again:
        tenants = (await again.client.get("/quotas")).json()["tenants"]
        assert {t["tenant"]: t["quota"] for t in tenants} == {
            "_default": {"l1_bytes": 0, "l2_bytes": None, "pinned_bytes": None},
            "a": {"l1_bytes": 7, "l2_bytes": 8, "pinned_bytes": None},
        }


async def test_allowlist_mode_admits_only_tenants_with_a_quota(serve: ServeService) -> None:
    async with serve(SMALL_CHUNKS | {"tenants.allowlist": True}) as running:
        assert store(running.service, "a", 1) == [SlotStatus.QUOTA]
        assert (await running.client.put("/quotas/a", json={})).status_code == 200  # unlimited
        assert store(running.service, "a", 1) == [SlotStatus.RESERVED]
        body = (await running.client.get("/quotas")).json()
        assert body["allowlist"] is True
        assert [t["cache_salt"] for t in body["tenants"]] == ["a"]


async def test_status_has_a_tenants_summary(serve: ServeService) -> None:
    async with serve(SMALL_CHUNKS) as running:
        await running.client.put("/quotas/a", json={"l1_bytes": PAGE})
        store(running.service, "a", 2)
        store(running.service, "", 1)
        tenants = (await running.client.get("/status")).json()["tenants"]
        assert tenants == {
            "allowlist": False,
            "quotas": 1,
            "tenants_holding_bytes": 2,
            "quota_refused_chunks": 1,
            "largest": [
                {"tenant": "_default", "l1_bytes": PAGE, "l1_limit_bytes": None},
                {"tenant": "a", "l1_bytes": PAGE, "l1_limit_bytes": PAGE},
            ],
        }


async def test_metrics_are_labelled_by_tenant_and_tier(serve: ServeService) -> None:
    async with serve(SMALL_CHUNKS | {"tenants.metrics_top_n": 1}) as running:
        await running.client.put("/quotas/a", json={"l1_bytes": 3 * PAGE})
        store(running.service, "a", 4)
        store(running.service, "b", 1)
        text = (await running.client.get("/metrics")).text
        samples = {
            (s.name, s.labels.get("tenant"), s.labels.get("tier")): s.value
            for f in text_string_to_metric_families(text)
            if f.name.startswith("kvdepot_tenant_")
            for s in f.samples
        }
        assert samples[("kvdepot_tenant_bytes", "a", "l1")] == 3 * PAGE
        assert samples[("kvdepot_tenant_bytes", "other", "l1")] == PAGE
        assert samples[("kvdepot_tenant_quota_refused_chunks_total", "a", "l1")] == 1
        assert samples[("kvdepot_tenant_quota_bytes", "a", "l1")] == 3 * PAGE
        assert ("kvdepot_tenant_bytes", "b", "l1") not in samples  # only the top 1 is named


async def test_a_quota_refusal_is_answered_quota_on_the_data_plane(serve: ServeService) -> None:
    async with serve(SMALL_CHUNKS) as running:
        await running.client.put("/quotas/zero", json={"l1_bytes": 0})
        server = running.service.dataplane
        assert server is not None

        def call(msg: p.Request) -> p.Reply:
            assert server is not None
            frame = server.handle(p.encode(msg))
            assert isinstance(frame, bytes)  # REGISTER and STORE are answered inline
            return p.reply_decoder.decode(frame)

        layout = p.Layout(dtype="float16", num_layers=2, num_kv_heads=1, head_dim=32, block_size=CHUNK,
                          kind="test", chunk_size=CHUNK)  # fmt: skip
        said = call(p.Hello(id=0, version=p.PROTOCOL_VERSION))
        assert isinstance(said, p.HelloReply) and server.sessions.hold(said.lifeline_token)  # its lifeline
        reg = call(p.Register(id=1, model="m", layout=layout))
        assert isinstance(reg, p.RegisterReply)
        toks = tokens(2 * CHUNK)
        reply = call(p.Store(id=2, engine_id=reg.engine_id, request_id="w", tokens=toks, cache_salt="zero"))
        assert isinstance(reply, p.StoreReply)
        assert [s.status for s in reply.slots] == [p.SlotStatus.QUOTA] * 2
