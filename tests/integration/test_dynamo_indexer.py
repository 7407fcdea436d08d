"""NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`, ai-dynamo-runtime 1.6.1, in
.venv-dynamo: tests/integration/setup_dynamo.sh) fed a real sidecar's KV events: it decodes every
batch (its decoder wants vLLM's three-element batch exactly) and answers `POST /query` with the
prefix the sidecar holds, as it does for vLLM's own engines. Dynamo hashes each block's token ids
itself, so this also checks that every BlockStored carries them, from L1 and from the disk tier.

Also: `kv_events.medium_names` puts L1 in the tier Dynamo's default router scores; batches lost on
the way (a forwarder drops them) are asked back from the sidecar's replay socket and repaired; a
restarted sidecar is relearnt by our directory and never trips Dynamo's decoder."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.sidecar import SidecarProcess, stop_process
from engine.keys import KVLayout
from storage.auth import BlobKeys, parse_secret
from tests.integration.conftest import StartSidecar
from tests.integration.directory_helpers import DirectoryProcess, DroppingForwarder, sent
from tests.integration.dp_client import CHUNK_TOKENS, LAYOUT, chunk_data, client, request_tokens
from tests.integration.metrics_sidecar import metric
from tests.integration.tools import DYNAMO_PYTHON, need_python
from tests.integration.waiting import wait_for
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "dynamo-test-token"
MODEL = "test-model"


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


class Indexer:
    """Dynamo's indexer process: its base URL and its log (colour codes stripped)."""

    def __init__(self, base: str, log: Path) -> None:
        self.base, self.log = base, log

    def text(self) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text())

    def replays_requested(self) -> list[int]:
        """The start sequence of every replay Dynamo asked the sidecar for."""
        return [int(s) for s in re.findall(r"Requesting replay from engine.*?start_seq=(\d+)", self.text())]


@pytest.fixture
def indexer(tmp_path: Path) -> Iterator[Indexer]:
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
        yield Indexer(base, tmp_path / "indexer.log")
    finally:
        stop_process(proc)
        log.close()
        text = Indexer(base, tmp_path / "indexer.log").text()
        assert "Failed to decode" not in text, text[-2000:]  # every batch we published was taken
        assert "Failed to decode replayed batch" not in text, text[-2000:]


def query(ix: Indexer, tokens: list[int]) -> dict[str, Any]:
    """Dynamo's `/query` answer for `tokens`."""
    status, answer = call(ix.base + "/query", "POST", {"token_ids": tokens, "model_name": MODEL})
    assert status == 200, answer
    return dict(answer)


def tiers(ix: Indexer, tokens: list[int]) -> dict[str, int]:
    """Instance 1's matched tokens per tier (`gpu` the device tier, `cpu`, `disk`; each counts the
    prefix matched down to that tier) and in all (`longest_matched`); {} when it names none."""
    got = query(ix, tokens)["instances"].get("1", {})
    return {k: int(v) for k, v in got.items() if k in ("longest_matched", "gpu", "cpu", "disk")}


def matched(ix: Indexer, tokens: list[int]) -> int:
    """Dynamo's `longest_matched` tokens of instance 1 for `tokens` (0: it names no instance)."""
    return tiers(ix, tokens).get("longest_matched", 0)


def wait_matched(ix: Indexer, tokens: list[int], want: int) -> None:
    deadline = time.monotonic() + 20
    while (got := matched(ix, tokens)) != want:
        assert time.monotonic() < deadline, f"Dynamo matched {got} tokens, not {want}"
        time.sleep(0.1)


def event_env(events: int, replay: int, **extra: str) -> dict[str, str]:
    """A sidecar publishing KV events on tcp `events` (replays on `replay`), L1 only."""
    return {
        "KVDEPOT_L1__CHUNK_SIZE": str(CHUNK_TOKENS), "KVDEPOT_L2__ADAPTERS": "[]",
        "KVDEPOT_HTTP__ADMIN_TOKEN": TOKEN, "KVDEPOT_EVENTS__LINGER_MS": "1",
        "KVDEPOT_KV_EVENTS__ENDPOINT": f"tcp://127.0.0.1:{events}",
        "KVDEPOT_KV_EVENTS__REPLAY_ENDPOINT": f"tcp://127.0.0.1:{replay}",
        "KVDEPOT_KV_EVENTS__ALLOW_PLAINTEXT_TCP": "true",
    } | extra  # fmt: skip


def register(ix: Indexer, endpoint: str, replay: int) -> None:
    """Registers instance 1 with Dynamo: its events from `endpoint`, replays from our socket."""
    spec = {
        "instance_id": 1, "endpoint": endpoint, "model_name": MODEL, "block_size": LAYOUT.block_size,
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
    }  # fmt: skip
    assert call(ix.base + "/register", "POST", spec) == (201, {"status": "ok"})


def store(sc: SidecarProcess, seed: int, chunks: int, salt: str = "t") -> list[int]:
    c = client(sc.url)
    try:
        toks = request_tokens(seed, chunks)
        data = [chunk_data(seed, i) for i in range(chunks)]
        assert c.store(toks, data, request_id=f"w{seed}", cache_salt=salt).stored == chunks
        return list(toks)
    finally:
        c.close()


def test_dynamos_indexer_matches_the_prefixes_a_sidecar_holds(
    sidecar_factory: StartSidecar, tmp_path: Path, indexer: Indexer
) -> None:
    events, replay = free_port(), free_port()
    env = event_env(events, replay, KVDEPOT_L2__ADAPTERS=json.dumps([{"type": "disk", "name": "disk"}]))
    sc = sidecar_factory(env=env, l1_size_gb=0.05)
    register(indexer, f"tcp://127.0.0.1:{events}", replay)
    c = client(sc.url)
    try:
        toks = request_tokens(5, 4)  # 4 chunks of 16 tokens, blocks of 16
        # Stored before the indexer's subscription may be up: what it missed it asks the replay for.
        assert c.store(toks, [chunk_data(5, i) for i in range(4)], request_id="w", cache_salt="t").stored == 4
        ids = list(toks)
        wait_matched(indexer, ids, 4 * CHUNK_TOKENS)
        # L1 is CPU and the disk tier DISK by default: Dynamo keeps both as tiers of their own,
        # and its default scores count neither (they count the device tier alone)
        wait_for(lambda: tiers(indexer, ids) == {"longest_matched": 64, "gpu": 0, "cpu": 64, "disk": 64},
                 what="L1 in Dynamo's cpu tier, the disk tier in its disk tier")  # fmt: skip
        assert query(indexer, ids)["scores"] == {}
        diverging = ids[: 2 * CHUNK_TOKENS] + [7] * (2 * CHUNK_TOKENS)
        assert matched(indexer, diverging) == 2 * CHUNK_TOKENS
        # A quota below what the tenant holds evicts its least recent chunks at once, in L1 and on
        # disk: Dynamo hears of each BlockRemoved and matches less.
        quota = {"l1_bytes": 2 * LAYOUT.chunk_bytes, "l2_bytes": 2 * LAYOUT.chunk_bytes, "pinned_bytes": None}
        assert call(sc.http + "/quotas/t", "PUT", quota, token=TOKEN)[0] == 200
        deadline = time.monotonic() + 20
        while matched(indexer, ids) >= 4 * CHUNK_TOKENS:
            assert time.monotonic() < deadline, "the eviction did not reach Dynamo"
            time.sleep(0.1)
        assert call(sc.http + "/quotas/t", "DELETE", token=TOKEN)[0] == 204
        more = request_tokens(6, 3)
        assert c.store(more, [chunk_data(6, i) for i in range(3)], request_id="m", cache_salt="t").stored == 3
        wait_matched(indexer, list(more), 3 * CHUNK_TOKENS)
        wait_for(lambda: tiers(indexer, list(more))["disk"] == 48, what="the second prefix on disk")
        # The engine's CLEAR empties the tenant's L1: Dynamo still finds it on disk, below the CPU tier
        assert c.clear("t") > 0
        on_disk = {"longest_matched": 48, "gpu": 0, "cpu": 0, "disk": 48}
        wait_for(lambda: tiers(indexer, list(more)) == on_disk, what="the second prefix on disk only")
        # The tenant purged from every tier: nothing of it is matched any more.
        assert call(sc.http + "/tenants/t/cache", "DELETE", token=TOKEN)[0] == 202
        wait_matched(indexer, list(more), 0)
        wait_matched(indexer, ids, 0)
    finally:
        c.close()


def test_l1_named_gpu_counts_in_the_tier_dynamos_router_scores(
    sidecar_factory: StartSidecar, indexer: Indexer
) -> None:
    events, replay = free_port(), free_port()
    env = event_env(events, replay, KVDEPOT_KV_EVENTS__MEDIUM_NAMES=json.dumps({"l1": "GPU"}))
    sc = sidecar_factory(env=env, l1_size_gb=0.05)
    register(indexer, f"tcp://127.0.0.1:{events}", replay)
    ids = store(sc, 5, 4)
    wait_for(lambda: tiers(indexer, ids).get("gpu") == 64, what="L1 in Dynamo's device tier")
    assert query(indexer, ids)["scores"] == {"1": {"0": 64}}  # what Dynamo's default router weighs


def test_batches_lost_on_the_way_are_repaired_from_the_replay_socket(
    sidecar_factory: StartSidecar, indexer: Indexer
) -> None:
    events, replay = free_port(), free_port()
    sc = sidecar_factory(env=event_env(events, replay), l1_size_gb=0.05)
    fwd = DroppingForwarder(f"tcp://127.0.0.1:{events}")  # Dynamo hears the sidecar through it
    try:
        wait_for(lambda: metric(sc, "kvdepot_kv_events_subscribers") >= 1, what="the forwarder subscribed")
        register(indexer, fwd.endpoint, replay)
        first = store(sc, 1, 2)
        wait_matched(indexer, first, 32)
        asked = len(indexer.replays_requested())
        lag = sent(sc) - fwd.forwarded  # batches published before the forwarder subscribed
        fwd.dropping.set()
        lost = store(sc, 2, 3)
        gone_too = store(sc, 3, 1)
        wait_for(lambda: sent(sc) == fwd.forwarded + fwd.dropped + lag, what="the batches dropped")
        assert fwd.dropped >= 1 and matched(indexer, lost) == 0
        fwd.dropping.clear()
        last = store(sc, 4, 1)  # the next live batch shows Dynamo the gap
        wait_matched(indexer, last, 16)
        wait_matched(indexer, lost, 48)  # asked back from our replay socket
        assert matched(indexer, gone_too) == 16
        assert matched(indexer, first) == 32
        starts = indexer.replays_requested()[asked:]
        assert starts and starts[0] >= 1, indexer.text()[-3000:]  # a gap mid-stream, not the start
        assert "Replay incomplete" not in indexer.text()
        assert "No replay endpoint" not in indexer.text()
    finally:
        fwd.close()


def test_a_restarted_sidecar_is_relearnt_by_our_directory_and_never_trips_dynamo(
    sidecar_factory: StartSidecar, tmp_path: Path, indexer: Indexer
) -> None:
    http, events, replay = free_port(), free_port(), free_port()
    secret = "ab" * 32

    def start() -> SidecarProcess:
        env = event_env(events, replay, KVDEPOT_L2__AUTH_KEYS=json.dumps([secret]))
        return sidecar_factory("--http-port", str(http), data_dir=tmp_path / "sc", env=env, l1_size_gb=0.05)

    sc = start()
    fp = KVLayout(LAYOUT.dtype, LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.block_size,
                  LAYOUT.kind, LAYOUT.chunk_size).fingerprint.hex()  # fmt: skip
    key_id = BlobKeys([parse_secret(secret)]).signer.key_id.hex()
    config = tmp_path / "directory.toml"
    config.write_text(
        f'[directory]\nsidecar_token = "{TOKEN}"\ndeployment_keys = ["{secret}"]\nprobe_s = 1.0\n'
        f'[[directory.static_instances]]\nid = "s"\nurl = "{sc.http}"\n'
        f'events_endpoint = "tcp://127.0.0.1:{events}"\nreplay_endpoint = "tcp://127.0.0.1:{replay}"\n'
        f'salt_key_id = "{key_id}"\n[[directory.static_instances.namespaces]]\nmodel = "{MODEL}"\n'
        f'layout_fp = "{fp}"\nblock_size = {LAYOUT.block_size}\nchunk_size = {LAYOUT.chunk_size}\n'
    )
    d = DirectoryProcess(config)
    try:
        register(indexer, f"tcp://127.0.0.1:{events}", replay)
        old = store(sc, 1, 4)
        wait_matched(indexer, old, 64)
        wait_for(lambda: d.prefixes(old, "t") == {"s": 64}, what="the old prefix in our directory")
        incarnation = d.instances()["s"]["incarnation"]

        sc.stop()
        sc = start()  # same ports, same data dir; L1 empty, a new incarnation, sequence back at 0
        new = store(sc, 2, 3)
        # our directory: the new incarnation's holdings, nothing of the old one's
        wait_for(lambda: d.prefixes(new, "t") == {"s": 48}, 30, "the new prefix in our directory")
        wait_for(lambda: d.prefixes(old, "t") == {"s": 0}, 30, "the old prefix gone from our directory")
        assert d.instances()["s"]["incarnation"] != incarnation
        # Dynamo decoded every batch of the new incarnation (the fixture checks its log); a stream
        # back at sequence 0 is stale to it until the instance is registered again, as for a
        # restarted vLLM: re-registered, it learns the new holdings
        assert call(indexer.base + "/unregister", "POST", {"instance_id": 1, "model_name": MODEL})[0] == 200
        register(indexer, f"tcp://127.0.0.1:{events}", replay)
        newer = store(sc, 3, 2)
        wait_matched(indexer, newer, 32)
        wait_matched(indexer, new, 48)  # published before it registered again: from the replay
        assert matched(indexer, old) == 0
    finally:
        d.stop()
