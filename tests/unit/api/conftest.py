"""Real, in-process services for the control-plane tests.

`serve({...})` builds a service from the settings and runs it (`Service.run()`: L2 adapters, purge
jobs, lifeline, background tasks) until the block ends. Its control plane is reached through
`httpx.ASGITransport`, with no socket: the app the service would hand uvicorn is called directly,
and a stand-in (`InProcessHttp`) takes uvicorn's place as the service's "http" component.
`serve({...}, tcp=True)` runs the real uvicorn on the service's own port instead, for the few tests
that need a socket (an answer that comes before the body it refuses was sent); the server's header
and body deadlines and its connection cap are tested on a real process
(tests/integration/test_http_budgets_process.py).

Helpers: store()/register() put chunks in a service's L1 through its engine; assert_error() checks
a JSON error answer.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import anyio
import httpx
import pytest
from fastapi import FastAPI

from app.main import Service
from app.settings_load import load_settings
from engine.results import SlotStatus
from tests.factories import small_layout, tokens

# A small, unpopulated arena and no L2: the control plane is what these tests look at.
SMALL = {"http.port": 0, "l1.size_gb": 0.01, "l1.populate": False, "l2.adapters": []}

BuildService = Callable[..., Service]
CHUNK = 16  # tokens; a chunk of small_layout() is 4 KiB
SMALL_CHUNKS = {"l1.chunk_size": CHUNK}  # the service's chunks as small as the engine's


@dataclass
class RunningService:
    service: Service
    task: asyncio.Task[int]
    client: httpx.AsyncClient  # the service's app, in-process (or over its real port: tcp=True)


class ServeService(Protocol):
    def __call__(
        self, overrides: Mapping[str, Any] | None = None, *, tcp: bool = False
    ) -> AbstractAsyncContextManager[RunningService]: ...


class InProcessHttp:
    """Takes uvicorn's place in `Service.run()`: "serves" until the service sets `should_exit`,
    listening on nothing (the tests call the app through httpx.ASGITransport)."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.started = False
        self._exit = asyncio.Event()

    @property
    def should_exit(self) -> bool:
        return self._exit.is_set()

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value:
            self._exit.set()

    async def serve(self, sockets: object = None) -> None:
        self.started = True
        await self._exit.wait()


def service_app(service: Service) -> FastAPI:
    """The control-plane app a built service serves."""
    assert service.http_server is not None, "build() first"
    app = service.http_server.config.app
    assert isinstance(app, FastAPI)
    return app


def asgi_client(app: FastAPI, *, raise_app_exceptions: bool = True) -> httpx.AsyncClient:
    """A client calling `app` in-process; the app sees it as the loopback peer 127.0.0.1:123."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
    return httpx.AsyncClient(transport=transport, base_url="http://kvdepot.test", timeout=5)


def register(service: Service) -> int:
    """A model-`m` engine (small_layout, CHUNK tokens a chunk) registered with the service."""
    eng = service.engine
    assert eng is not None
    return eng.register("m", small_layout(chunk_size=CHUNK)).engine_id


def store(service: Service, salt: str, chunks: int, start: int = 0) -> list[SlotStatus]:
    """Store `chunks` chunks for `salt` through the engine facade, committing what was reserved."""
    eng = service.engine
    assert eng is not None
    eid = register(service)
    slots = eng.store(eid, "w", tokens(chunks * CHUNK, start=start), salt)
    eng.commit(eid, [s.oid for s in slots if s.status is SlotStatus.RESERVED])
    return [s.status for s in slots]


def assert_error(r: httpx.Response, status: int, code: str, *words: str) -> None:
    """`r` is the JSON error `code` with `status`, its message naming each of `words`."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error["code"] == code
    for word in words:
        assert word in error["message"], error["message"]


def without_kvdepot_env(mp: pytest.MonkeyPatch) -> None:
    """Settings read KVDEPOT_* variables: the services are built from an environment without any."""
    for name in list(os.environ):
        if name.upper().startswith("KVDEPOT_"):
            mp.delenv(name)


class Services:
    """Real services built under `root` (a data dir each), closed together by `close()`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.built: list[Service] = []

    def build(self, overrides: Mapping[str, Any] | None = None) -> Service:
        data_dir = self.root / f"svc{len(self.built)}"
        service = Service(load_settings({"data_dir": data_dir, **SMALL, **(overrides or {})}))
        service.build()
        self.built.append(service)
        return service

    def close(self) -> None:
        for service in self.built:
            service.close()


@asynccontextmanager
async def started(service: Service, *, tcp: bool = False) -> AsyncIterator[RunningService]:
    """Run a built `service` (`Service.run()`) until the block ends, with a client of its app:
    in-process, or over its port (`tcp`)."""
    app = service_app(service)
    if not tcp:
        service.http_server = InProcessHttp(app)  # type: ignore[assignment]
    task = asyncio.get_running_loop().create_task(service.run())
    try:
        with anyio.fail_after(10):
            while service.not_ready():
                if task.done():
                    task.result()  # start-up failed: show why
                await anyio.sleep(0.01)
        if tcp:
            client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.http_port}", timeout=5)
        else:
            client = asgi_client(app)
        async with client:
            yield RunningService(service, task, client)
    finally:
        service.request_stop()
        with anyio.fail_after(10):
            assert await task == 0


@pytest.fixture
def build_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[BuildService]:
    """Build real services (data dir under tmp_path); every one is closed at teardown."""
    without_kvdepot_env(monkeypatch)
    services = Services(tmp_path)
    yield services.build
    services.close()


@pytest.fixture
def serve(build_service: BuildService) -> ServeService:
    """`async with serve({...}) as running:` runs a real service until the block ends."""

    def run(
        overrides: Mapping[str, Any] | None = None, *, tcp: bool = False
    ) -> AbstractAsyncContextManager[RunningService]:
        return started(build_service(overrides), tcp=tcp)

    return run


@pytest.fixture
async def running(serve: ServeService) -> AsyncIterator[RunningService]:
    """A service of its own, with the default settings, started for the test."""
    async with serve() as r:
        yield r


@pytest.fixture(scope="module")
async def shared(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningService]:
    """One started service (default settings) for the module's tests that leave it as they found
    it: answers that only read it, requests it refuses. A service of its own costs a test about
    0.3 s of CPU (FastAPI builds a new app's routes on its first request)."""
    with pytest.MonkeyPatch.context() as mp:
        without_kvdepot_env(mp)
        services = Services(tmp_path_factory.mktemp("shared"))
        try:
            async with started(services.build()) as r:
                yield r
        finally:
            services.close()
