"""The router against a real `kvdepot directory` fed by real sidecars (registered with
`fleet.directory_url`, publishing KV events), the engines being fake OpenAI servers: the directory's
answers, the sidecar ids in the router's config and the engines' tokenization fit together.
Chunks are written into the sidecars by the engine-side client, as an engine's connector does.

Skipped where the directory (`fleet.directory`) is absent."""

from __future__ import annotations

import json
import random
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from bench.sidecar import SidecarProcess
from kvdepot_connector.client import KVDepotClient
from kvdepot_connector.protocol import Layout
from tests.integration.conftest import StartSidecar
from tests.integration.route_fakes import fake_tokens
from tests.integration.route_helpers import Proc, fake_engine, metric, router
from tests.integration.waiting import wait_for
from tests.ports import free_port

pytestmark = pytest.mark.slow

CHUNK = 16
DEPLOYMENT = secrets.token_hex(32)
LAYOUT = Layout(
    dtype="float16", num_layers=2, num_kv_heads=2, head_dim=64, block_size=4, kind="test", chunk_size=CHUNK
)  # fmt: skip


def sidecar_env(name: str, directory: str) -> dict[str, str]:
    return {
        "KVDEPOT_L1__CHUNK_SIZE": str(CHUNK), "KVDEPOT_L2__ADAPTERS": "[]", "KVDEPOT_EVENTS__LINGER_MS": "1",
        "KVDEPOT_L2__AUTH_KEYS": json.dumps([DEPLOYMENT]),
        "KVDEPOT_KV_EVENTS__ENDPOINT": f"tcp://127.0.0.1:{free_port()}",
        "KVDEPOT_KV_EVENTS__ALLOW_PLAINTEXT_TCP": "true",  # the directory connects over tcp
        "KVDEPOT_KV_EVENTS__REPLAY_ENDPOINT": f"tcp://127.0.0.1:{free_port()}",
        "KVDEPOT_FLEET__DIRECTORY_URL": directory, "KVDEPOT_FLEET__DIRECTORY_HEARTBEAT_S": "0.3",
        "KVDEPOT_FLEET__INSTANCE_ID": name,
    }  # fmt: skip


def store(sc: SidecarProcess, tokens: list[int], salt: str) -> None:
    """What an engine's connector does after computing `tokens` (model `base`)."""
    chunks = [torch.full((LAYOUT.chunk_bytes // 2,), float(i), dtype=torch.float16)
              for i in range(len(tokens) // CHUNK)]  # fmt: skip
    c = KVDepotClient(sc.url, model="base", layout=LAYOUT, timeout_s=10).connect()
    try:
        assert c.store(tokens, chunks, request_id="w", cache_salt=salt).stored == len(chunks)
    finally:
        c.close()


@pytest.fixture
def fleet(tmp_path: Path, sidecar_factory: StartSidecar) -> Iterator[dict[str, Any]]:
    config = tmp_path / "directory.toml"
    config.write_text(f'[directory]\ndeployment_keys = ["{DEPLOYMENT}"]\n')
    port = free_port()
    procs: list[Proc] = []
    try:
        directory = Proc(["-m", "app.cli", "directory", "--config", str(config), "--http-port", str(port)],
                         port, "/health")  # fmt: skip
        procs.append(directory)
        sidecars = {
            name: sidecar_factory(data_dir=tmp_path / name, env=sidecar_env(name, directory.url),
                                  l1_size_gb=0.02)
            for name in ("sc-a", "sc-b")
        }  # fmt: skip
        engines = {"sc-a": fake_engine("A"), "sc-b": fake_engine("B")}
        procs += engines.values()
        toml = f'directory_url = "{directory.url}"\ndirectory_timeout_ms = 1000\n' + "".join(
            f'[[engines]]\nurl = "{e.url}"\nsidecar_id = "{name}"\n' for name, e in engines.items()
        )
        route = router(tmp_path, toml)
        procs.append(route)
        yield {"directory": directory, "sidecars": sidecars, "engines": engines, "router": route}
    finally:
        for p in reversed(procs):
            p.stop()


def ask(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "base", "max_tokens": 2, **body}, timeout=30)


def scored(directory: Proc, tokens: list[int], salt: str) -> dict[str, int]:
    body = {"model": "base", "token_ids": tokens, "cache_salt": salt, "lora_name": None}
    answer = httpx.post(directory.url + "/v1/score", json=body, timeout=10).json()
    return {i["id"]: i["prefix_tokens"] for i in answer["instances"]}


def test_routes_where_the_real_directory_sees_the_prefix(fleet: dict[str, Any]) -> None:
    directory, route = fleet["directory"], fleet["router"].url
    engines, sidecars = fleet["engines"], fleet["sidecars"]
    rng = random.Random(7)
    ids = [rng.randint(100, 30_000) for _ in range(4 * CHUNK)]
    text = "x" * (3 * CHUNK - 1)  # the fake engine's tokens: BOS + 47 characters = 3 chunks
    store(sidecars["sc-b"], ids, salt="t")
    store(sidecars["sc-a"], fake_tokens({"prompt": text}), salt="t")
    wait_for(lambda: scored(directory, ids, "t").get("sc-b") == 4 * CHUNK, 30, "ids indexed on sc-b")
    wait_for(lambda: scored(directory, fake_tokens({"prompt": text}), "t").get("sc-a") == 3 * CHUNK, 30,
             "text indexed on sc-a")  # fmt: skip

    for _ in range(2):  # token ids: sc-b's engine; a text prompt, tokenized by an engine: sc-a's
        resp = ask(route, {"prompt": [*ids, 5, 6], "cache_salt": "t"})
        assert resp.json()["engine"] == "B" and resp.headers["x-kvdepot-route"] == "prefix"
        resp = ask(route, {"prompt": text + " and more", "cache_salt": "t"})
        assert resp.json()["engine"] == "A" and resp.headers["x-kvdepot-route"] == "prefix"
    # another tenant, or none: nobody holds its prefix
    for salt in ("other", None):
        resp = ask(route, {"prompt": ids, "cache_salt": salt})
        assert resp.status_code == 200 and resp.headers["x-kvdepot-route"] == "no_prefix"
    text_ = httpx.get(route + "/metrics").text
    assert sum(metric(text_, "kvdepot_route_routed_total", engine=e.url) for e in engines.values()) == 4
    assert metric(text_, "kvdepot_route_fallback_total", reason="no_prefix") == 2
