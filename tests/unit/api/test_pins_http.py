"""The pin endpoints of a real, in-process service: PUT/GET/DELETE, the admin token, the audit
record, 409 with the reason for a pin that cannot be honoured, bad bodies (always a 4xx with a
JSON message, the service intact after), and pins that survive a restart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.results import SlotStatus
from tests.unit.api.conftest import CHUNK, ServeService, assert_error, register, store

pytestmark = pytest.mark.anyio

TOKEN = "pin-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PAGE = 4096
SETTINGS = {"l1.chunk_size": CHUNK, "http.admin_token": TOKEN}


def body(chunks: int, start: int = 0, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "token_ids": list(range(start, start + chunks * CHUNK)), **fields}


async def test_put_get_delete_and_the_audit_record(serve: ServeService) -> None:
    async with serve(SETTINGS) as running:
        c, service = running.client, running.service
        assert store(service, "a", 3) == [SlotStatus.RESERVED] * 3
        assert_error(await c.put("/pins/a", json=body(3)), 401, "unauthorized")
        assert_error(await c.get("/pins"), 401, "unauthorized")
        r = await c.put("/pins/a", json=body(3, ttl_s=600, tiers=["l1"]), headers=AUTH)
        assert r.status_code == 200, r.text
        pin = r.json()
        assert (pin["cache_salt"], pin["chunks"], pin["tokens"], pin["tiers"]) == ("a", 3, 48, ["l1"])
        assert (pin["ttl_s"], pin["pinned_bytes"]) == (600, {"l1": 3 * PAGE})
        assert pin["present_chunks"] == {"l1": 3}
        assert pin["expires_at"] == pytest.approx(pin["created_at"] + 600)
        listed = (await c.get("/pins", headers=AUTH)).json()["pins"]
        assert [p["id"] for p in listed] == [pin["id"]]
        assert (await c.get("/pins/b", headers=AUTH)).json() == {"pins": []}
        audit = (await c.get("/audit", headers=AUTH)).json()["records"][0]
        assert (audit["resource"], audit["target"], audit["before"]) == ("pins", "a", [])
        after = [{"id": pin["id"], "chunks": 3, "tiers": ["l1"], "expires_at": pin["expires_at"]}]
        assert audit["after"] == after
        assert (await c.delete("/pins/a", params={"id": pin["id"]}, headers=AUTH)).status_code == 204
        assert_error(await c.delete("/pins/a", params={"id": pin["id"]}, headers=AUTH), 404, "not_found")
        assert (await c.get("/pins", headers=AUTH)).json() == {"pins": []}


async def test_pins_that_cannot_be_honoured_are_409_with_the_reason(serve: ServeService) -> None:
    async with serve(SETTINGS) as running:
        c = running.client
        r = await c.put("/pins/a", json=body(1), headers=AUTH)
        assert_error(r, 409, "conflict", "no engine of model")
        register(running.service)
        r = await c.put("/quotas/a", json={"pinned_bytes": PAGE}, headers=AUTH)
        assert r.status_code == 200 and r.json()["quota"]["pinned_bytes"] == PAGE
        r = await c.put("/pins/a", json=body(2), headers=AUTH)
        assert_error(r, 409, "conflict", "pinned_bytes", "8192")
        assert (await c.put("/pins/a", json=body(1), headers=AUTH)).status_code == 200
        # L1 is 10 MiB: pins of all tenants together may take half of it.
        big = {"model": "m", "token_ids": [7] * (1400 * CHUNK)}
        assert_error(await c.put("/pins/b", json=big, headers=AUTH), 409, "conflict", "max_share")
        assert len((await c.get("/pins", headers=AUTH)).json()["pins"]) == 1


async def test_bad_bodies_are_4xx_and_the_service_is_intact(serve: ServeService) -> None:
    async with serve(SETTINGS | {"http.max_body_bytes": 1 << 20}) as running:
        c = running.client
        register(running.service)
        bad: list[dict[str, Any]] = [
            {},
            {"model": "m"},
            body(1, tiers=["nvme"]),
            body(1, tiers="l1"),
            body(1, tiers=[]),
            body(1, tiers=["l1"] * 17),
            body(1, ttl_s="10"),
            body(1, ttl_s=1.5),
            body(1, ttl_s=0),
            body(1, ttl_s=10**12),
            body(1, ttl_s=True),
            body(1, extra=1),
            {"model": 5, "token_ids": [1] * CHUNK},
            {"model": "m" * 300, "token_ids": [1] * CHUNK},
            {"model": "m", "token_ids": "abc"},
            {"model": "m", "token_ids": ["1"] * CHUNK},
            {"model": "m", "token_ids": [1.0] * CHUNK},
            {"model": "m", "token_ids": [-1] * CHUNK},
            {"model": "m", "token_ids": [1 << 40] * CHUNK},
            {"model": "m", "token_ids": [1] * (CHUNK - 1)},
            {"model": "m", "token_ids": [0] * (4097 * CHUNK)},
            {"model": "m", "token_ids": []},
        ]
        for b in bad:
            r = await c.put("/pins/a", json=b, headers=AUTH)
            assert r.status_code == 422, (b if len(json.dumps(b)) < 200 else list(b), r.text[:300])
            assert r.json()["error"]["code"] == "invalid_input"
        assert (await c.put("/pins/a", content=b"{not json", headers=AUTH)).status_code == 422
        assert (await c.put("/pins/" + "s" * 300, json=body(1), headers=AUTH)).status_code == 422
        huge = b'{"model": "m", "token_ids": [' + b"1," * (1 << 20) + b"1]}"
        assert_error(await c.put("/pins/a", content=huge, headers=AUTH), 413, "payload_too_large")
        assert (await c.delete("/pins/a", params={"id": "x" * 65}, headers=AUTH)).status_code == 422
        assert (await c.get("/pins", headers=AUTH)).json() == {"pins": []}
        assert (await c.get("/health")).text == "OK"
        assert (await c.put("/pins/a", json=body(1), headers=AUTH)).status_code == 200


async def test_pins_survive_a_restart(serve: ServeService, tmp_path: Path) -> None:
    data_dir = tmp_path / "kept"
    async with serve(SETTINGS | {"data_dir": data_dir}) as running:
        register(running.service)
        c = running.client
        forever = (await c.put("/pins/a", json=body(2), headers=AUTH)).json()
        assert (await c.put("/pins/b", json=body(1, ttl_s=3600), headers=AUTH)).status_code == 200
    saved = json.loads((data_dir / "pins.json").read_text())
    assert sorted(p["cache_salt"] for p in saved["pins"]) == ["a", "b"]
    async with serve(SETTINGS | {"data_dir": data_dir}) as again:
        listed = (await again.client.get("/pins", headers=AUTH)).json()["pins"]
        assert [(p["cache_salt"], p["ttl_s"]) for p in listed] == [("a", None), ("b", 3600)]
        assert listed[0]["id"] == forever["id"]
        pins = again.service.pins
        assert pins.table.holds("l1", "m", "a", bytes.fromhex(saved["pins"][0]["hashes"][0]))
