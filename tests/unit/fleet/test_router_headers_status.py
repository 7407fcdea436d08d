"""The router's relay passes end-to-end headers only (RFC 9110 §7.6.1), and its /status answers
only the token's holder, or loopback clients when no token is set."""

from __future__ import annotations

import httpx
import pytest

from app.supervisor import Supervisor
from fleet.http.proxy import end_to_end
from fleet.http.router_app import create_router_app
from fleet.router_config import RouterSettings


def test_hop_by_hop_and_connection_named_headers_are_dropped() -> None:
    headers = [
        ("Connection", "keep-alive, X-A"), ("connection", "x-b"), ("X-A", "1"), ("X-B", "2"),
        ("Keep-Alive", "timeout=5"), ("TE", "trailers"), ("Proxy-Connection", "x"), ("X-C", "3"),
    ]  # fmt: skip
    assert end_to_end(headers) == {"x-c": "3"}


async def status(token: str | None, client: tuple[str, int], authorization: str | None = None) -> int:
    settings = RouterSettings.model_validate(
        {"engines": [{"url": "http://u:engine-pw@127.0.0.1:9"}], "admin_token": token}
    )
    app = create_router_app(settings, Supervisor())
    headers = {} if authorization is None else {"Authorization": authorization}
    transport = httpx.ASGITransport(app=app, client=client)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
        resp = await c.get("/status", headers=headers)
    assert "engine-pw" not in resp.text
    return resp.status_code


@pytest.mark.anyio
async def test_status_needs_the_token_or_a_loopback_client() -> None:
    assert await status(None, ("127.0.0.1", 5000)) == 200
    assert await status(None, ("10.1.2.3", 5000)) == 401
    assert await status("tok", ("127.0.0.1", 5000)) == 401
    assert await status("tok", ("10.1.2.3", 5000), "Bearer tok") == 200
    assert await status("tok", ("10.1.2.3", 5000), "Bearer other") == 401
