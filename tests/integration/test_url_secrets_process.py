"""Credentials written into a URL setting never leave a real sidecar: not in its unauthenticated
`GET /status`, not in any log line (the directory it cannot reach logs its URL), whichever URL holds
them (the OTLP endpoint, the engine's URL, the directory's URL, a Redis adapter) and whether they
sit in the user part or in a token-like query parameter."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.integration.conftest import StartSidecar
from tests.integration.waiting import wait_for

pytestmark = pytest.mark.slow

SECRETS = ("otel-pass-1c9e", "otel-query-token-5a2b", "engine-user-token-77d0", "engine-key-3f41",
           "dir-pass-0b6d", "redis-pass-9e2c")  # fmt: skip


def test_no_credential_in_a_url_is_shown_by_status_or_logged(
    sidecar_factory: StartSidecar, tmp_path: Path
) -> None:
    otel, otel_q, eng_user, eng_key, dir_pass, redis_pass = SECRETS
    env = {
        "KVDEPOT_HTTP__ADMIN_TOKEN": "status-test-token",
        "KVDEPOT_TRACING__OTLP_ENDPOINT": f"http://otel:{otel}@127.0.0.1:1/v1/traces?api_key={otel_q}",
        "KVDEPOT_FLEET__ENGINE_URL": f"http://{eng_user}@127.0.0.1:9/?Token={eng_key}",
        "KVDEPOT_FLEET__DIRECTORY_URL": f"http://fleet:{dir_pass}@127.0.0.1:1",
        "KVDEPOT_FLEET__DIRECTORY_HEARTBEAT_S": "0.2",
        "KVDEPOT_KV_EVENTS__ENDPOINT": f"ipc://{tmp_path / 'events.sock'}",
        "KVDEPOT_L2__ADAPTERS": json.dumps([
            {"type": "redis", "name": "r", "url": f"redis://kv:{redis_pass}@127.0.0.1:1/0"}
        ]),
        "KVDEPOT_LOGGING__FORMAT": "json",
    }  # fmt: skip
    sc = sidecar_factory(env=env, l1_size_gb=0.01)
    with urllib.request.urlopen(sc.http + "/status", timeout=10) as resp:  # no token
        shown = resp.read().decode()
    settings = json.loads(shown)["settings"]
    assert settings["fleet"]["directory_url"] == "http://fleet:***@127.0.0.1:1"
    assert settings["fleet"]["engine_url"] == "http://***@127.0.0.1:9/?Token=***"
    assert settings["tracing"]["otlp_endpoint"] == "http://otel:***@127.0.0.1:1/v1/traces?api_key=***"
    wait_for(lambda: any("directory_unreachable" in line for line in sc.lines), what="the failure logged")
    logged = "\n".join(sc.lines)
    for secret in SECRETS:
        assert secret not in shown, secret
        assert secret not in logged, secret
    assert "fleet:***@127.0.0.1:1" in logged
