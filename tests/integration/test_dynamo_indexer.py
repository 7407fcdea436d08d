"""NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`, ai-dynamo-runtime 1.6.1, in
.venv-dynamo: tests/integration/setup_dynamo.sh) fed a real sidecar's KV events: it decodes every
batch (its decoder wants vLLM's three-element batch exactly) and answers `POST /query` with the
prefix the sidecar holds, as it does for vLLM's own engines. Dynamo hashes each block's token ids
itself, so this also checks that every BlockStored carries them."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.bench.sidecar import stop_process
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import CHUNK_TOKENS, LAYOUT, chunk_data, client, request_tokens
from tests.integration.tools import need_python

ROOT = Path(__file__).resolve().parents[2]
DYNAMO_PYTHON = ROOT / ".venv-dynamo" / "bin" / "python"
TOKEN = "dynamo-test-token"
MODEL = "test-model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def call(url: str, method: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode(errors="replace")


@pytest.fixture
def indexer(tmp_path: Path) -> Iterator[str]:
    python = need_python(DYNAMO_PYTHON, "tests/integration/setup_dynamo.sh")
    port = free_port()
    log = (tmp_path / "indexer.log").open("w")
    proc = subprocess.Popen(
        [str(python), "-m", "dynamo.indexer", "--port", str(port), "--threads", "1"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "indexer.log").read_text()
            try:
                if call(base + "/health", "GET")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the indexer did not answer /health"
            time.sleep(0.1)
        yield base
    finally:
        stop_process(proc)
        log.close()
        text = (tmp_path / "indexer.log").read_text()
        assert "Failed to decode" not in text, text[-2000:]  # every batch we published was taken


def matched(base: str, tokens: list[int]) -> int:
    """Dynamo's `longest_matched` tokens of instance 1 for `tokens` (0: it names no instance)."""
    status, answer = call(base + "/query", "POST", {"token_ids": tokens, "model_name": MODEL})
    assert status == 200, answer
    return int(answer["instances"].get("1", {}).get("longest_matched", 0))


def wait_matched(base: str, tokens: list[int], want: int) -> None:
    deadline = time.monotonic() + 20
    while (got := matched(base, tokens)) != want:
        assert time.monotonic() < deadline, f"Dynamo matched {got} tokens, not {want}"
        time.sleep(0.1)


def test_dynamos_indexer_matches_the_prefixes_a_sidecar_holds(
    sidecar_factory: StartSidecar, indexer: str
) -> None:
    events, replay = free_port(), free_port()
    sc = sidecar_factory(
        env={
            "KVDEPOT_L1__CHUNK_SIZE": str(CHUNK_TOKENS), "KVDEPOT_L2__ADAPTERS": "[]",
            "KVDEPOT_HTTP__ADMIN_TOKEN": TOKEN,
            "KVDEPOT_KV_EVENTS__ENDPOINT": f"tcp://127.0.0.1:{events}",
            "KVDEPOT_KV_EVENTS__REPLAY_ENDPOINT": f"tcp://127.0.0.1:{replay}",
            "KVDEPOT_KV_EVENTS__ALLOW_PLAINTEXT_TCP": "true",
        },
        l1_size_gb=0.05,
    )  # fmt: skip
    spec = {
        "instance_id": 1, "endpoint": f"tcp://127.0.0.1:{events}", "model_name": MODEL,
        "block_size": LAYOUT.block_size, "replay_endpoint": f"tcp://127.0.0.1:{replay}",
    }  # fmt: skip
    assert call(indexer + "/register", "POST", spec) == (201, {"status": "ok"})
    c = client(sc.url)
    try:
        toks = request_tokens(5, 4)  # 4 chunks of 16 tokens, blocks of 16
        # Stored before the indexer's subscription may be up: what it missed it asks the replay for.
        assert c.store(toks, [chunk_data(5, i) for i in range(4)], request_id="w", cache_salt="t").stored == 4
        ids = list(toks)
        wait_matched(indexer, ids, 4 * CHUNK_TOKENS)
        diverging = ids[: 2 * CHUNK_TOKENS] + [7] * (2 * CHUNK_TOKENS)
        assert matched(indexer, diverging) == 2 * CHUNK_TOKENS
        # A quota below what the tenant holds evicts its least recent chunks at once: Dynamo hears
        # of each BlockRemoved and matches less.
        quota = {"l1_bytes": 2 * LAYOUT.chunk_bytes, "l2_bytes": None, "pinned_bytes": None}
        assert call(sc.http + "/quotas/t", "PUT", quota, token=TOKEN)[0] == 200
        deadline = time.monotonic() + 20
        while matched(indexer, ids) >= 4 * CHUNK_TOKENS:
            assert time.monotonic() < deadline, "the eviction did not reach Dynamo"
            time.sleep(0.1)
        # The tenant cleared: nothing of it is matched any more.
        assert call(sc.http + "/quotas/t", "DELETE", token=TOKEN)[0] == 204
        more = request_tokens(6, 3)
        assert c.store(more, [chunk_data(6, i) for i in range(3)], request_id="m", cache_salt="t").stored == 3
        wait_matched(indexer, list(more), 3 * CHUNK_TOKENS)
        assert c.clear("t") > 0
        wait_matched(indexer, list(more), 0)
        wait_matched(indexer, ids, 0)
    finally:
        c.close()
