"""Sidecars that register themselves (`fleet.directory_url`) with a real directory, each with its own
credential (the directory sends it back for their inventory: no sidecar holds the admin token); a
credential or the admin token is required, bad bodies are 4xx and leave the directory serving, a
flood of registrations is 503; chunks one sidecar wrote to a shared Redis count for the other
sidecar attached to it; a tenant's chunks never count for another tenant's score or match; a
document is found at another offset (`/v1/match`) and its recomputation counted; a LoRA adapter is
scored by name; a sidecar killed leaves the scores after `instance_timeout_s`; a directory that is
down never affects the sidecar's data plane."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from fleet.credentials import instance_credential
from kvdepot_connector.client import KVDepotClient
from tests.integration.conftest import StartSidecar
from tests.integration.directory_helpers import DirectoryProcess, post
from tests.integration.redis_keys import REDIS_URL
from tests.integration.test_directory_converges import DEPLOYMENT, LAYOUT, TOKEN, data, prefix, store
from tests.integration.waiting import wait_for
from tests.ports import free_port

pytestmark = pytest.mark.slow

DIR_TOKEN = "directory-token"


def member_env(name: str, directory: str, prefix_key: str) -> dict[str, str]:
    redis = {"type": "redis", "url": REDIS_URL, "key_prefix": prefix_key, "ttl_s": 300}
    return {
        "KVDEPOT_L1__CHUNK_SIZE": "16", "KVDEPOT_HTTP__ADMIN_TOKEN": TOKEN,
        "KVDEPOT_L2__ADAPTERS": json.dumps([redis]), "KVDEPOT_EVENTS__LINGER_MS": "1",
        "KVDEPOT_L2__AUTH_KEYS": json.dumps([DEPLOYMENT]),
        "KVDEPOT_KV_EVENTS__ENDPOINT": f"tcp://127.0.0.1:{free_port()}",
        "KVDEPOT_KV_EVENTS__ALLOW_PLAINTEXT_TCP": "true",  # the directory connects over tcp
        "KVDEPOT_KV_EVENTS__REPLAY_ENDPOINT": f"tcp://127.0.0.1:{free_port()}",
        "KVDEPOT_FLEET__DIRECTORY_URL": directory,
        # its own credential, never the directory's admin token: it registers this id only, and the
        # directory sends it back for GET /inventory
        "KVDEPOT_FLEET__DIRECTORY_TOKEN": instance_credential(DIR_TOKEN, name),
        "KVDEPOT_FLEET__DIRECTORY_HEARTBEAT_S": "0.3", "KVDEPOT_FLEET__INSTANCE_ID": name,
    }  # fmt: skip


def test_registered_sidecars_shared_redis_tenants_and_timeouts(
    tmp_path: Path, sidecar_factory: StartSidecar, redis_prefix: str
) -> None:
    port = free_port()
    config = tmp_path / "directory.toml"
    config.write_text(
        f'[http]\nadmin_token = "{DIR_TOKEN}"\n[directory]\n'
        f'deployment_keys = ["{DEPLOYMENT}"]\ninstance_timeout_s = 2.0\nmatch = true\n'
        "max_instances = 4\n"
    )
    # the directory is not there yet: the sidecars start and serve all the same, then register
    url = f"http://127.0.0.1:{port}"
    a = sidecar_factory(data_dir=tmp_path / "a", env=member_env("a", url, redis_prefix), l1_size_gb=0.02)
    b = sidecar_factory(data_dir=tmp_path / "b", env=member_env("b", url, redis_prefix), l1_size_gb=0.02)
    victim = prefix(21, 4)
    store(a, victim, salt="victim")  # the data plane works with the directory down
    store(b, prefix(22, 1), salt="other")  # b's engine registers its namespace too
    d = DirectoryProcess(config, port)
    try:
        wait_for(lambda: set(d.instances()) == {"a", "b"}, 20, "both registered")
        wait_for(lambda: all(i["synced"] for i in d.instances().values()), 20, "both synced")
        # a sidecar's inventory opens to its own credential (what the directory sent), not b's
        own, other = instance_credential(DIR_TOKEN, "a"), instance_credential(DIR_TOKEN, "b")
        for token, expected in ((own, 200), (other, 401), (TOKEN, 200), (None, 401)):
            assert inventory_status(a.http, token) == expected, token
        # a wrote the chunks to L1 and to the shared Redis; b, attached to the same Redis, serves
        # them from there
        wait_for(lambda: d.prefixes(victim, "victim") == {"a": 64, "b": 64}, 20, "the shared tier")
        tiers = {i["id"]: i["tiers"] for i in d.score(victim, "victim")["instances"]}
        assert tiers["a"]["l1"] == 64 and tiers["b"] == {"l1": 0, "local_l2": 0, "shared_l2": 64}
        assert d.score(victim, "victim")["instances"][0]["id"] == "a"  # L1 beats the shared tier

        # an attacker who knows the victim's tokens, with any other salt or none, sees nothing
        for salt in ("attacker", None, "VICTIM", "victim "):
            assert d.prefixes(victim, salt) == {"a": 0, "b": 0}, salt

        # a document a stores after its prompt (live: the matcher learns from stores' token ids),
        # found after another prompt at an unaligned offset
        doc = prefix(40, 3)
        store(a, prefix(41, 1) + doc, salt="victim")
        wait_for(lambda: d.prefixes(prefix(41, 1) + doc, "victim") == {"a": 64, "b": 64}, 20, "doc")
        request = prefix(30, 1)[:5] + doc + prefix(31, 1)
        status, found = post(url + "/v1/match", {"model": "test-model", "token_ids": request,
                                                   "cache_salt": "victim"})  # fmt: skip
        assert status == 200
        rows = {r["id"]: r for r in found["instances"]}
        assert [m["offset"] for m in rows["a"]["matches"]] == [5, 21, 37]
        assert rows["a"]["matched_tokens"] == 48 and rows["a"]["matches"][0]["tier"] == "l1"
        assert [m["tier"] for m in rows["b"]["matches"]] == ["shared_l2"] * 3  # b reaches a's Redis
        status, other = post(url + "/v1/match", {"model": "test-model", "token_ids": request,
                                                  "cache_salt": "attacker"})  # fmt: skip
        assert status == 200 and all(r["matches"] == [] for r in other["instances"])
        # the same document stored after another prompt: content computed again, counted
        store(b, prefix(32, 1) + doc, salt="victim")
        wait_for(lambda: d.metric("kvdepot_directory_repeated_chunks_total") >= 3, 20, "repeated content")

        # a LoRA adapter's chunks, scored by the adapter's name (its extra key learnt from events)
        adapter_key = bytes(range(32))
        lora_prompt = prefix(50, 2)
        c = KVDepotClient(a.url, model="test-model", layout=LAYOUT, timeout_s=10).connect()
        try:
            stored = c.store(lora_prompt, data(2), request_id="l", cache_salt="victim",
                             extra_keys=[adapter_key] * 2, lora_name="sql-adapter")  # fmt: skip
            assert stored.stored == 2
        finally:
            c.close()
        wait_for(lambda: lora_score(d, lora_prompt, "sql-adapter")["a"] == 32, 20, "the adapter's chunks")
        assert d.prefixes(lora_prompt, "victim")["a"] == 0  # the base model holds none of them
        assert lora_score(d, lora_prompt, "other-adapter")["a"] == 0

        # registration needs the token; bad bodies are 4xx and the directory keeps serving
        spec = {"id": "x", "url": "http://127.0.0.1:1", "events_endpoint": "tcp://127.0.0.1:1"}
        assert post(url + "/v1/instances", spec)[0] == 401
        assert post(url + "/v1/instances", spec, token="wrong")[0] == 401
        for bad in (
            {**spec, "events_endpoint": "http://nope"}, {**spec, "id": ""}, {**spec, "url": "ftp://x"},
            {**spec, "salt_mode": "whatever"}, {**spec, "l1_usage": 7}, {**spec, "surprise": 1}, [1, 2],
        ):  # fmt: skip
            status, body = post(url + "/v1/instances", bad, token=DIR_TOKEN)
            assert status == 422 and body["error"]["code"] == "invalid_input", (bad, body)
        assert post(url + "/v1/instances", b"{not json", token=DIR_TOKEN)[0] == 422
        # a flood of registrations: the directory is full (503, retry later), not broken
        for i in range(2):
            assert post(url + "/v1/instances", {**spec, "id": f"x{i}"}, token=DIR_TOKEN)[0] == 200
        status, body = post(url + "/v1/instances", {**spec, "id": "x2"}, token=DIR_TOKEN)
        assert status == 503 and body["error"]["code"] == "overloaded"
        for i in range(2):
            assert post(url + f"/v1/instances/x{i}", b"", token=DIR_TOKEN, method="DELETE")[0] == 204
        assert post(url + "/v1/instances/x0", b"", token=DIR_TOKEN, method="DELETE")[0] == 404
        assert post(url + "/v1/instances/a", b"", method="DELETE")[0] == 401
        for bad_score in (
            {"model": "test-model", "token_ids": [-1]}, {"model": "test-model", "token_ids": [1 << 32]},
            {"model": "test-model", "token_ids": "abc"}, {"token_ids": [1]}, {"model": "", "token_ids": []},
        ):  # fmt: skip
            status, body = post(url + "/v1/score", bad_score)
            assert status == 422 and body["error"]["code"] == "invalid_input", (bad_score, body)
        assert declared_too_large(port, 9 << 20).startswith(b"HTTP/1.1 413")
        assert d.prefixes(victim, "victim") == {"a": 64, "b": 64}  # still serving, unchanged

        # b killed: it leaves the scores once silent for instance_timeout_s
        b.proc.send_signal(signal.SIGKILL)
        b.proc.wait(10)
        wait_for(lambda: set(d.prefixes(victim, "victim")) == {"a"}, 10, "b timed out")
        assert d.instances()["b"]["live"] is False
        assert 'kvdepot_directory_instances{state="stale"} 1.0' in metrics_text(d)
    finally:
        d.stop()


def inventory_status(sidecar: str, token: str | None) -> int:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(sidecar + "/inventory")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)


def metrics_text(d: DirectoryProcess) -> str:
    return d.get("/metrics").decode()


def declared_too_large(port: int, length: int) -> bytes:
    """A score request declaring a body past http.max_body_bytes: answered before it is sent."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            f"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n".encode()
        )
        return sock.recv(4096)


def lora_score(d: DirectoryProcess, tokens: list[int], adapter: str) -> dict[str, int]:
    return {i["id"]: i["prefix_tokens"] for i in d.score(tokens, "victim", lora=adapter)["instances"]}
