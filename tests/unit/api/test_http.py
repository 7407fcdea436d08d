"""The HTTP control plane of a real, in-process service: endpoints, readiness, errors, admin token."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from fastapi import APIRouter, FastAPI
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from pydantic import TypeAdapter

from api.http.answers import Readiness, ServiceStatus
from api.http.app import create_app
from api.http.deps import Admin
from app import __version__
from app import errors as e
from app.main import Service
from engine.admin import adapter
from engine.answers import AdapterList, QuotaList, TenantQuota
from engine.l2.tiers import Tier
from httpkit.errors import http_status
from storage.redis.config import RedisAdapterConfig
from storage.registry import build_adapter
from tests.unit.api.conftest import (
    BuildService,
    RunningService,
    ServeService,
    Services,
    asgi_client,
    service_app,
    without_kvdepot_env,
)

pytestmark = pytest.mark.anyio

TOKEN = "s3cret-admin-token"


def app_with_test_routes(service: Service) -> FastAPI:
    """The real app factory, plus test-only routes: a mutating one behind the admin token, and
    routes that raise, to see how errors reach the client."""
    assert service.control is not None
    app = create_app(dataclasses.replace(service.control, registry=CollectorRegistry()))
    router = APIRouter(prefix="/test")

    @router.post("/mutate")
    async def mutate(_: Admin) -> dict[str, bool]:
        return {"mutated": True}

    @router.get("/raise/{name}")
    async def raise_error(name: str) -> None:
        raise getattr(e, name)(f"{name} was raised")

    @router.get("/crash")
    async def crash() -> None:
        raise RuntimeError("internal detail that must not leak")

    @router.get("/count")
    async def count(n: int) -> dict[str, int]:
        return {"n": n}

    app.include_router(router)
    return app


@pytest.fixture(scope="module")
def routes_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastAPI]:
    """app_with_test_routes of one built service (default settings), for the tests that only call
    its routes (a new app builds its routes again on its first request)."""
    with pytest.MonkeyPatch.context() as mp:
        without_kvdepot_env(mp)
        services = Services(tmp_path_factory.mktemp("routes"))
        try:
            yield app_with_test_routes(services.build())
        finally:
            services.close()


# --- endpoints of a running service ------------------------------------------------------------


async def test_health_is_plain_ok(shared: RunningService) -> None:
    r = await shared.client.get("/health")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    assert r.text == "OK"


async def test_the_service_answers_on_its_own_port(serve: ServeService) -> None:
    """uvicorn on the port the service bound serves the same app the in-process tests call."""
    async with serve(tcp=True) as running:
        assert running.service.http_port > 0
        r = await running.client.get("/ready")
        assert (r.status_code, r.json()) == (200, {"ready": True})
        status = (await running.client.get("/status")).json()
        assert status["components"]["http"] == "running"


async def test_ready_when_running(shared: RunningService) -> None:
    r = await shared.client.get("/ready")
    assert r.status_code == 200
    assert r.json() == {"ready": True}


async def test_status_reports_version_uptime_components_settings_and_l1(shared: RunningService) -> None:
    service = shared.service
    assert service.engine is not None and service.arena is not None
    r = await shared.client.get("/status")
    assert r.status_code == 200
    body = r.json()
    assert body["version"] == __version__
    assert 0 <= body["uptime_s"] < 60
    assert body["ready"] is True
    for component in ("l1", "dataplane", "http"):
        assert body["components"][component] == "running"
    settings = body["settings"]
    assert settings["l1"]["size_gb"] == 0.01
    assert settings["http"]["admin_token"] is None
    assert settings["data_plane"]["url"] == service.settings.data_plane_url
    assert settings["data_dir"] == str(service.settings.data_dir)
    l1 = body["l1"]
    assert l1["arena"] == f"memfd:{service.arena.name} {service.arena.size}"
    assert not (Path("/dev/shm") / service.arena.name).exists()  # a memfd: nothing by name
    assert 0 < l1["capacity_bytes"] <= int(0.01 * (1 << 30))
    assert l1["capacity_bytes"] == service.engine.cache.allocator.capacity
    assert l1["used_bytes"] == 0
    later = (await shared.client.get("/status")).json()
    assert later["uptime_s"] >= body["uptime_s"]


async def test_status_masks_the_admin_token(serve: ServeService) -> None:
    async with serve({"http.admin_token": TOKEN}) as running:
        r = await running.client.get("/status")  # reading needs no token
        assert r.status_code == 200
        assert r.json()["settings"]["http"]["admin_token"] == "***"
        assert TOKEN not in r.text


async def test_metrics_are_prometheus_text_with_l1_and_process_figures(shared: RunningService) -> None:
    assert shared.service.engine is not None
    r = await shared.client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    capacity = families["kvdepot_l1_capacity_bytes"]
    assert capacity.type == "gauge"
    assert [s.value for s in capacity.samples] == [shared.service.engine.cache.allocator.capacity]
    assert families["kvdepot_l1_used_bytes"].samples[0].value == 0
    assert families["process_resident_memory_bytes"].samples[0].value > 0
    assert families["process_cpu_seconds"].type == "counter"
    assert "python_info" in families


async def test_ready_turns_503_naming_a_component_whose_task_died(running: RunningService) -> None:
    service = running.service
    assert service.dataplane is not None and service.dataplane.transport.sock is not None
    service.dataplane.transport.sock.close()  # the data plane's serve loop ends under it
    with anyio.fail_after(5):
        await service.supervisor.crashed.wait()
    r = await running.client.get("/ready")
    assert r.status_code == 503
    body = r.json()
    assert body["ready"] is False
    assert list(body["reasons"]) == ["dataplane"]  # only the dead component, nothing else
    assert body["reasons"]["dataplane"] not in ("stopped", "starting")  # why it died
    status = (await running.client.get("/status")).json()
    assert status["ready"] is False
    assert status["components"]["dataplane"] == "failed"
    assert status["components"]["http"] == "running"
    assert (await running.client.get("/health")).status_code == 200  # alive, but not ready


async def test_unknown_path_is_a_json_404(shared: RunningService) -> None:
    r = await shared.client.get("/no/such/thing")
    assert r.status_code == 404
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"error": {"code": "not_found", "message": "Not Found"}}


async def test_wrong_method_is_a_json_405(shared: RunningService) -> None:
    r = await shared.client.post("/health")
    assert r.status_code == 405
    assert r.json()["error"]["code"] == "method_not_allowed"


async def test_docs_and_openapi_list_the_endpoints(shared: RunningService) -> None:
    docs = await shared.client.get("/docs")
    assert docs.status_code == 200
    assert docs.headers["content-type"].startswith("text/html")
    spec = (await shared.client.get("/openapi.json")).json()
    assert spec["info"]["version"] == __version__
    assert {"/health", "/ready", "/status", "/metrics"} <= set(spec["paths"])
    assert not any(path.startswith(("/docs", "/redoc")) for path in spec["paths"])


async def test_docs_pages_load_their_assets_from_the_sidecar(shared: RunningService) -> None:
    for page in ("/docs", "/redoc"):
        html = (await shared.client.get(page)).text
        urls = re.findall(r'(?:src|href)="([^"]+)"', html)
        assert urls and all(url.startswith("/docs-assets/") for url in urls), (page, urls)
        assert "https://" not in html and "fonts.googleapis" not in html
        for url in urls:
            asset = await shared.client.get(url)
            assert asset.status_code == 200 and len(asset.content) > 1000, url
    js = await shared.client.get("/docs-assets/swagger-ui-bundle.js")
    assert "javascript" in js.headers["content-type"] and b"SwaggerUIBundle" in js.content
    redoc = await shared.client.get("/docs-assets/redoc.standalone.js")
    assert "javascript" in redoc.headers["content-type"] and b"Redoc" in redoc.content
    assert b"cdn.redoc.ly" not in redoc.content and b"redocly logo" in redoc.content
    assert (await shared.client.get("/docs-assets/../pyproject.toml")).status_code == 404
    assert (await shared.client.get("/docs/oauth2-redirect")).status_code == 200


async def test_request_id_is_echoed_or_made_up(shared: RunningService) -> None:
    r = await shared.client.get("/status", headers={"x-request-id": "req-42"})
    assert r.headers["x-request-id"] == "req-42"
    a = (await shared.client.get("/status")).headers["x-request-id"]
    b = (await shared.client.get("/status")).headers["x-request-id"]
    assert a and b and a != b


# --- readiness before serving ------------------------------------------------------------------


async def test_not_ready_before_the_service_runs(build_service: BuildService) -> None:
    service = build_service()
    async with asgi_client(service_app(service)) as client:
        r = await client.get("/ready")
        assert r.status_code == 503
        reasons = r.json()["reasons"]
        assert {"dataplane", "http"} <= set(reasons)
        assert "l1" not in reasons  # the arena exists from build() on
        assert (await client.get("/health")).text == "OK"


# --- error mapping -----------------------------------------------------------------------------


class ChunkNotFound(e.NotFound):
    """A subclass maps like its base."""


@pytest.mark.parametrize(
    ("cls", "status"),
    [
        (e.NotFound, 404),
        (ChunkNotFound, 404),
        (e.Conflict, 409),
        (e.InvalidInput, 422),
        (e.ConfigError, 422),
        (e.ProtocolError, 400),
        (e.Unauthorized, 401),
        (e.BackendError, 502),
        (e.TransferError, 503),
        (e.NotRegistered, 404),
        (e.LeaseExpired, 410),
        (e.KVDepotError, 500),
    ],
)
def test_http_status_of_each_error_class(cls: type[e.KVDepotError], status: int) -> None:
    assert http_status(cls("x")) == status


@pytest.mark.parametrize(
    ("name", "status"),
    [
        ("NotFound", 404),
        ("Conflict", 409),
        ("InvalidInput", 422),
        ("TransferError", 503),
        ("BackendError", 502),
        ("KVDepotError", 500),
    ],
)
async def test_errors_reach_the_client_as_json(routes_app: FastAPI, name: str, status: int) -> None:
    async with asgi_client(routes_app) as client:
        r = await client.get(f"/test/raise/{name}")
    assert r.status_code == status
    assert r.json() == {"error": {"code": getattr(e, name).code, "message": f"{name} was raised"}}


async def test_unexpected_exception_is_a_json_500_without_details(routes_app: FastAPI) -> None:
    async with asgi_client(routes_app, raise_app_exceptions=False) as client:
        r = await client.get("/test/crash")
    assert r.status_code == 500
    assert r.json() == {"error": {"code": "internal", "message": "RuntimeError"}}
    assert "must not leak" not in r.text


async def test_request_validation_error_names_the_parameter(routes_app: FastAPI) -> None:
    async with asgi_client(routes_app) as client:
        r = await client.get("/test/count", params={"n": "many"})
        assert r.status_code == 422
        error = r.json()["error"]
        assert error["code"] == "invalid_input"
        assert "query.n" in error["message"]
        assert (await client.get("/test/count", params={"n": "3"})).json() == {"n": 3}


# --- the admin token ---------------------------------------------------------------------------


async def test_mutating_route_needs_the_admin_token(build_service: BuildService) -> None:
    app = app_with_test_routes(build_service({"http.admin_token": TOKEN}))
    async with asgi_client(app) as client:
        missing = await client.post("/test/mutate")
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "unauthorized"
        assert missing.headers["www-authenticate"] == "Bearer"

        wrong = await client.post("/test/mutate", headers={"Authorization": "Bearer not-the-token"})
        assert wrong.status_code == 401
        assert TOKEN not in wrong.text

        prefix = await client.post("/test/mutate", headers={"Authorization": f"Bearer {TOKEN[:-1]}"})
        assert prefix.status_code == 401

        basic = await client.post("/test/mutate", headers={"Authorization": f"Basic {TOKEN}"})
        assert basic.status_code == 401

        right = await client.post("/test/mutate", headers={"Authorization": f"Bearer {TOKEN}"})
        assert right.status_code == 200
        assert right.json() == {"mutated": True}


async def test_without_a_configured_token_mutating_routes_are_open(routes_app: FastAPI) -> None:
    async with asgi_client(routes_app) as client:
        r = await client.post("/test/mutate")
    assert r.status_code == 200
    assert r.json() == {"mutated": True}


# --- OpenAPI: every answer has a schema, and the answers match it ------------------------------

TEXT_ROUTES = {"/health", "/metrics"}
MOCK_L2 = {"l2.adapters": [{"type": "mock", "name": "m1", "capacity_gb": 0.01}]}


def json_schema(response: dict[str, Any]) -> dict[str, Any]:
    return dict(response.get("content", {}).get("application/json", {}).get("schema", {}))


async def test_openapi_declares_a_schema_for_every_answer_and_error(shared: RunningService) -> None:
    spec = (await shared.client.get("/openapi.json")).json()
    schemas = spec["components"]["schemas"]
    assert schemas["ErrorBody"]["properties"]["error"]
    operations = [(path, method, op) for path, ops in spec["paths"].items() for method, op in ops.items()]
    assert len(operations) >= 13
    for path, method, op in operations:
        where = f"{method.upper()} {path}"
        answers = {code: r for code, r in op["responses"].items() if code.startswith("2")}
        assert answers, f"{where}: no 2xx answer declared"
        for code, answer in answers.items():
            if path in TEXT_ROUTES:
                assert set(answer["content"]) == {"text/plain"}, where
            elif code != "204":
                assert json_schema(answer), f"{where}: {code} has no JSON schema"
        errors = {code: r for code, r in op["responses"].items() if not code.startswith("2")}
        if path not in TEXT_ROUTES:
            assert errors, f"{where}: no error answer declared"
        for code, error in errors.items():
            ref = json_schema(error).get("$ref", "")
            if path == "/ready" and code == "503":
                assert ref.endswith("/Readiness"), where
            else:
                assert ref == "#/components/schemas/ErrorBody", f"{where}: {code} is not an ErrorBody"


async def test_json_answers_validate_against_their_declared_models(serve: ServeService) -> None:
    async with serve(MOCK_L2) as running:
        c = running.client
        assert (await c.put("/quotas/a", json={"l1_bytes": 4096})).status_code == 200
        spec = (await c.get("/openapi.json")).json()
        answers: dict[str, type[Any]] = {
            "/ready": Readiness,
            "/status": ServiceStatus,
            "/quotas": QuotaList,
            "/quotas/{cache_salt}": TenantQuota,
            "/l2/adapters": AdapterList,
        }
        for path, model in answers.items():
            declared = json_schema(spec["paths"][path]["get"]["responses"]["200"])
            assert declared == {"$ref": f"#/components/schemas/{model.__name__}"}, path
            body = (await c.get(path.replace("{cache_salt}", "a"))).json()
            adapter = TypeAdapter(model)
            # Round trip: every field is declared (nothing extra), every value has its declared type.
            again = adapter.dump_python(
                adapter.validate_python(body), mode="json", exclude_none=path == "/ready"
            )
            assert again == body, path
        adapters = (await c.get("/l2/adapters")).json()["adapters"]
        assert [a["name"] for a in adapters] == ["m1"]


async def test_redis_url_passwords_are_masked_in_status(build_service: BuildService) -> None:
    service = build_service(
        {"l2.adapters": [{"type": "redis", "name": "r", "url": "redis://user:hunter2@127.0.0.1:6379/0"}]}
    )
    async with asgi_client(service_app(service)) as client:
        r = await client.get("/status")
    assert r.status_code == 200
    assert "hunter2" not in r.text
    assert r.json()["settings"]["l2"]["adapters"][0]["url"] == "redis://user:***@127.0.0.1:6379/0"


def test_an_adapters_redis_url_password_is_masked(tmp_path: Path) -> None:
    config = RedisAdapterConfig(name="r", url="redis://:hunter2@127.0.0.1:6379/0")
    shown = adapter(Tier(build_adapter(config, tmp_path), config))
    assert isinstance(shown.config, RedisAdapterConfig)
    assert shown.config.url == "redis://:***@127.0.0.1:6379/0"
    assert "hunter2" not in repr(shown)
    assert config.url.endswith("hunter2@127.0.0.1:6379/0")  # the adapter itself keeps it
