"""The control plane as an attacker finds it: bodies capped before they are read (413), the token
checked before a mutation's body is read (401), tenant salts and per-tenant figures only for the
token's holder, Redis passwords on no surface, disk adapters only under the allowed roots."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.logs import configure_logging
from app.settings import LoggingSettings
from tests.unit.api.conftest import SMALL_CHUNKS, RunningService, ServeService, store

pytestmark = pytest.mark.anyio

TOKEN = "auth-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SALT = "tenant-secret-salt"
PASSWORD = "redis-pass-w0rd"


async def raw_request(port: int, head: str, body_parts: Sequence[bytes] = ()) -> tuple[int, dict[str, Any]]:
    """Send `head` (request line and headers) and `body_parts` as they are, then read the answer:
    its status and JSON body. The answer must come without the rest of any declared body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head.replace("\n", "\r\n").encode() + b"\r\n")
        for part in body_parts:
            writer.write(part)
        await writer.drain()
        async with asyncio.timeout(10):
            status_line = await reader.readline()
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers["content-length"]))
    finally:
        writer.close()
    return int(status_line.split()[1]), json.loads(body)


def head(method: str, path: str, *lines: str) -> str:
    return "\n".join([f"{method} {path} HTTP/1.1", "Host: kvdepot", *lines, ""])


def chunked(total: int, piece: int = 8192) -> list[bytes]:
    parts = [b"%x\r\n" % piece + b"x" * piece + b"\r\n" for _ in range(total // piece)]
    return [*parts, b"0\r\n\r\n"]


# --- bodies: the token first, then the size, both before reading ----------------------------------


async def test_a_mutation_without_the_token_is_refused_before_its_body_is_read(serve: ServeService) -> None:
    async with serve({"http.admin_token": TOKEN}, tcp=True) as running:  # the server, on its socket
        port = running.service.http_port
        big = head("POST", "/l2/adapters", "Content-Type: application/json", "Content-Length: 10000000")
        status, body = await raw_request(port, big)  # 10 MB declared, not a byte sent
        assert (status, body["error"]["code"]) == (401, "unauthorized")
        wrong = head("PUT", f"/quotas/{SALT}", "Authorization: Bearer nope", "Content-Length: 10000000")
        status, body = await raw_request(port, wrong)
        assert (status, body["error"]["code"]) == (401, "unauthorized")
        assert (await running.client.get("/quotas", headers=AUTH)).json()["tenants"] == []


@pytest.mark.parametrize("token", [None, TOKEN])
async def test_a_body_over_the_cap_is_refused_with_413_before_it_is_read(
    serve: ServeService, token: str | None
) -> None:
    auth = [f"Authorization: Bearer {token}"] if token else []
    settings = {"http.admin_token": token, "http.max_body_bytes": 4096}
    async with serve(settings, tcp=True) as running:  # the server, on its socket
        port = running.service.http_port
        declared = head(
            "PUT", "/quotas/a", *auth, "Content-Type: application/json", "Content-Length: 10000000"
        )
        status, body = await raw_request(port, declared)
        assert (status, body["error"]["code"]) == (413, "payload_too_large")
        assert "4096" in body["error"]["message"]
        # No Content-Length: a chunked body is counted as it comes and cut at the cap.
        streamed = head(
            "PUT", "/quotas/a", *auth, "Content-Type: application/json", "Transfer-Encoding: chunked"
        )
        status, body = await raw_request(port, streamed, chunked(64 * 1024))
        assert (status, body["error"]["code"]) == (413, "payload_too_large")
        # Bodies within the cap are served as before; nothing above changed anything.
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        c = running.client
        assert (await c.get("/quotas", headers=headers)).json()["tenants"] == []
        assert (await c.put("/quotas/a", json={"l1_bytes": 4096}, headers=headers)).status_code == 200


# --- tenants: salts and per-tenant figures need the token when one is set -------------------------


async def test_tenant_salts_and_figures_need_the_token(serve: ServeService) -> None:
    async with serve({"http.admin_token": TOKEN, **SMALL_CHUNKS}) as running:
        c = running.client
        assert (await c.put(f"/quotas/{SALT}", json={"l1_bytes": 1 << 20}, headers=AUTH)).status_code == 200
        store(running.service, SALT, 2)

        for path in ("/quotas", f"/quotas/{SALT}", "/quotas/_default"):
            r = await c.get(path)
            assert (r.status_code, r.json()["error"]["code"]) == (401, "unauthorized"), path
            assert SALT not in r.text
        status = await c.get("/status")
        assert status.status_code == 200 and SALT not in status.text
        assert status.json()["tenants"]["largest"] == []
        assert status.json()["tenant_details"] is False
        metrics = await c.get("/metrics")
        assert metrics.status_code == 200 and SALT not in metrics.text
        assert "kvdepot_tenant_" not in metrics.text and 'tenant="' not in metrics.text
        assert "kvdepot_l1_used_bytes" in metrics.text  # the rest of /metrics stays open

        assert SALT in [t["cache_salt"] for t in (await c.get("/quotas", headers=AUTH)).json()["tenants"]]
        assert (await c.get(f"/quotas/{SALT}", headers=AUTH)).json()["tiers"]["l1"]["objects"] == 2
        full = (await c.get("/status", headers=AUTH)).json()
        assert full["tenant_details"] is True
        assert SALT in [t["tenant"] for t in full["tenants"]["largest"]]
        scraped = (await c.get("/metrics", headers=AUTH)).text
        families = {f.name: f for f in text_string_to_metric_families(scraped)}
        assert {s.labels["tenant"] for s in families["kvdepot_tenant_bytes"].samples} >= {SALT}


async def test_without_a_token_on_loopback_tenant_figures_are_open(serve: ServeService) -> None:
    async with serve(SMALL_CHUNKS) as running:
        store(running.service, SALT, 1)
        c = running.client
        assert SALT in (await c.get("/quotas")).text
        assert (await c.get("/status")).json()["tenant_details"] is True
        assert f'tenant="{SALT}"' in (await c.get("/metrics")).text


async def test_request_logs_name_the_route_not_the_salt(serve: ServeService) -> None:
    stream = io.StringIO()  # the sidecar's own logging, as `kvdepot serve` configures it
    configure_logging(LoggingSettings(level="info", format="json"), stream=stream)
    try:
        async with serve({"http.admin_token": TOKEN}) as running:
            c = running.client
            assert (await c.put(f"/quotas/{SALT}", json={"l1_bytes": 1}, headers=AUTH)).status_code == 200
            assert (await c.delete(f"/quotas/{SALT}")).status_code == 401
            assert (await c.get(f"/quotas/{SALT}", headers=AUTH)).status_code == 200
    finally:
        configure_logging(LoggingSettings(level="info", format="json"))
    out = stream.getvalue()
    assert out.count("http_request") >= 3
    assert SALT not in out and TOKEN not in out


# --- secrets: a Redis URL password on no surface ---------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [f"redis://kv:{PASSWORD}@127.0.0.1:1/0", f"redis://:{PASSWORD}@127.0.0.1:1/0",
     f"redis://127.0.0.1:1/0?password={PASSWORD}"],
)  # fmt: skip
async def test_a_redis_password_appears_in_no_answer_and_no_log(
    serve: ServeService, capfd: pytest.CaptureFixture[str], url: str
) -> None:
    async with serve({"http.admin_token": TOKEN}) as running:
        c = running.client
        added = await c.post("/l2/adapters", json={"type": "redis", "name": "r", "url": url}, headers=AUTH)
        assert added.status_code == 201, added.text
        assert PASSWORD not in added.text
        listed = await c.get("/l2/adapters")
        assert [a["config"]["url"] for a in listed.json()["adapters"]] == [url.replace(PASSWORD, "***")]
        for path in ("/l2/adapters", "/status", "/metrics", "/openapi.json"):
            for headers in ({}, AUTH):
                r = await c.get(path, headers=headers)
                assert r.status_code == 200 and PASSWORD not in r.text, path
        duplicate = await c.post(
            "/l2/adapters", json={"type": "redis", "name": "r", "url": url}, headers=AUTH
        )
        assert duplicate.status_code == 409 and PASSWORD not in duplicate.text
    assert PASSWORD not in capfd.readouterr().out


# --- disk adapters: only under the allowed roots ---------------------------------------------------


async def attach_disk(running: RunningService, name: str, path: Path) -> tuple[int, dict[str, Any]]:
    config = {"type": "disk", "name": name, "paths": [str(path)]}
    r = await running.client.post("/l2/adapters", json=config, headers=AUTH)
    return r.status_code, r.json()


async def test_a_disk_adapter_outside_the_data_dir_is_refused(serve: ServeService, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    async with serve({"http.admin_token": TOKEN}) as running:
        data_dir = running.service.settings.data_dir
        (data_dir / "link").symlink_to(outside, target_is_directory=True)
        for i, path in enumerate(
            [outside, data_dir / "link" / "l2", data_dir / "x" / ".." / ".." / "elsewhere"]
        ):
            status, body = await attach_disk(running, f"d{i}", path)
            assert (status, body["error"]["code"]) == (422, "config"), path
            assert "l2.allowed_roots" in body["error"]["message"]
        assert not outside.exists()  # nothing was created there
        status, _ = await attach_disk(running, "inside", data_dir / "disks" / "a")
        assert status == 201
        names = [a["name"] for a in (await running.client.get("/l2/adapters")).json()["adapters"]]
        assert names == ["inside"]


async def test_configured_roots_replace_the_data_dir(serve: ServeService, tmp_path: Path) -> None:
    disks = tmp_path / "disks"
    async with serve({"l2.allowed_roots": [str(disks)]}) as running:
        status, _ = await attach_disk(running, "ok", disks / "one")
        assert status == 201
        status, body = await attach_disk(running, "no", running.service.settings.data_dir / "l2")
        assert (status, body["error"]["code"]) == (422, "config")
