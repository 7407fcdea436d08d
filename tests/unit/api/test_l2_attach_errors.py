"""`POST /l2/adapters` with an adapter that cannot start: a 4xx with a stable code, never a 500, and
nothing half attached (the adapter list is what it was, the name is free for a later attach)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.api.conftest import RunningService

pytestmark = pytest.mark.anyio


async def adapters(running: RunningService) -> list[dict[str, Any]]:
    reply = await running.client.get("/l2/adapters")
    assert reply.status_code == 200
    listed: list[dict[str, Any]] = reply.json()["adapters"]
    return listed


async def attach(running: RunningService, config: dict[str, Any]) -> tuple[int, dict[str, str]]:
    reply = await running.client.post("/l2/adapters", json=config)
    body: dict[str, Any] = reply.json()
    return reply.status_code, body.get("error", {})


async def test_a_disk_adapter_under_a_regular_file_is_refused_and_not_attached(
    running: RunningService,
) -> None:
    data_dir = running.service.settings.data_dir  # disk adapters live under it (l2.allowed_roots)
    not_a_dir = data_dir / "plain-file"
    not_a_dir.write_text("not a directory")
    before = await adapters(running)

    status, error = await attach(running, {"type": "disk", "name": "d2", "paths": [str(not_a_dir / "l2")]})

    assert status == 422
    assert error["code"] == "config"
    assert "d2" in error["message"] and "cannot start" in error["message"]
    assert await adapters(running) == before
    # The name was not left reserved: a disk adapter that can start takes it.
    status, _ = await attach(running, {"type": "disk", "name": "d2", "paths": [str(data_dir / "ok")]})
    assert status == 201
    assert [a["name"] for a in await adapters(running)] == [*(a["name"] for a in before), "d2"]


async def test_an_adapter_whose_config_cannot_be_used_is_refused_and_not_attached(
    running: RunningService,
) -> None:
    before = await adapters(running)

    status, error = await attach(running, {"type": "redis", "name": "r2", "url": "redis://127.0.0.1:port/0"})

    assert status == 422
    assert error["code"] == "config"
    assert "r2" in error["message"]
    assert await adapters(running) == before
