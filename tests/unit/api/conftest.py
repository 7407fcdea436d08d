from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from app.main import Service
from app.settings_load import load_settings

# A small, unpopulated arena and no L2: the control plane is what these tests look at.
SMALL = {"http.port": 0, "l1.size_gb": 0.01, "l1.populate": False, "l2.adapters": []}

BuildService = Callable[..., Service]


@dataclass
class RunningService:
    service: Service
    task: asyncio.Task[int]
    client: httpx.AsyncClient  # talks HTTP to the service's real port


ServeService = Callable[..., AbstractAsyncContextManager[RunningService]]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def build_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[BuildService]:
    """Build real services (data dir under tmp_path); every one is closed at teardown."""
    for name in list(os.environ):
        if name.upper().startswith("KVDEPOT_"):
            monkeypatch.delenv(name)
    built: list[Service] = []

    def build(overrides: Mapping[str, Any] | None = None) -> Service:
        settings = load_settings({"data_dir": tmp_path / f"svc{len(built)}", **SMALL, **(overrides or {})})
        service = Service(settings)
        service.build()
        built.append(service)
        return service

    yield build
    for service in built:
        service.close()


@pytest.fixture
def serve(build_service: BuildService) -> ServeService:
    """`async with serve({...}) as running:` runs a real service until the block ends."""

    @asynccontextmanager
    async def run(overrides: Mapping[str, Any] | None = None) -> AsyncIterator[RunningService]:
        service = build_service(overrides)
        task = asyncio.get_running_loop().create_task(service.run())
        try:
            with anyio.fail_after(10):
                while service.not_ready():
                    if task.done():
                        task.result()  # start-up failed: show why
                    await anyio.sleep(0.01)
            base_url = f"http://127.0.0.1:{service.http_port}"
            async with httpx.AsyncClient(base_url=base_url, timeout=5) as client:
                yield RunningService(service, task, client)
        finally:
            service.request_stop()
            with anyio.fail_after(10):
                assert await task == 0

    return run


@pytest.fixture
async def running(serve: ServeService) -> AsyncIterator[RunningService]:
    async with serve() as r:
        yield r
