"""KV events from a real `kvdepot serve` process: chunks stored over the data plane are announced
as engine blocks on the PUB socket, clears and evictions follow, replay repeats the stream, the
inventory lists the same blocks; bad endpoints are refused; a subscriber that never reads costs
drops, never a stalled data plane."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq

from bench.sidecar import SidecarProcess
from kvdepot_connector.client import KVDepotClient
from kvdepot_connector.protocol import Layout
from tests.integration.conftest import StartSidecar
from tests.integration.metrics_sidecar import metric
from tests.integration.waiting import wait_for
from tests.ports import free_ports

TOKEN = "kv-events-test-token"
LAYOUT = Layout(
    dtype="float16", num_layers=2, num_kv_heads=2, head_dim=64, block_size=4, kind="test", chunk_size=16
)  # fmt: skip  (8 KiB per chunk, 4 engine blocks of 4 tokens)
END = -1


def env(**extra: str) -> dict[str, str]:
    out = {
        "KVDEPOT_L1__CHUNK_SIZE": "16", "KVDEPOT_L2__ADAPTERS": "[]",
        "KVDEPOT_HTTP__ADMIN_TOKEN": TOKEN, "KVDEPOT_EVENTS__LINGER_MS": "1",
        "KVDEPOT_KV_EVENTS__ALLOW_PLAINTEXT_TCP": "true",  # these tests read the events over loopback tcp
    }  # fmt: skip
    out.update(extra)
    return out


class Events:
    """A subscriber and a replay client of one sidecar, reading from this (test) process."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.connect(replay)
        self.batches: list[tuple[bytes, int, list[Any], Any]] = []

    def close(self) -> None:
        self.sub.close(0)
        self.dealer.close(0)
        self.ctx.term()

    def read(self, until: Any, timeout: float = 20) -> list[dict[str, Any]]:
        """Read live batches until `until(events so far)`; answer every event read."""
        deadline = time.monotonic() + timeout
        events: list[dict[str, Any]] = []
        while not until(events):
            assert time.monotonic() < deadline, f"events not seen; got {events}"
            if not self.sub.poll(100):
                continue
            topic, seq, payload = self.sub.recv_multipart()
            raw = msgspec.msgpack.decode(payload)
            self.batches.append((topic, int.from_bytes(seq, "big"), raw[1], len(raw)))
            events.extend(raw[1])
        return events

    def replay(self, start: int) -> list[tuple[bytes, int, list[Any], Any]]:
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert self.dealer.poll(10_000), "replay did not end"
            _, topic, seq_b, payload = self.dealer.recv_multipart()
            seq = int.from_bytes(seq_b, "big", signed=True)
            if seq == END:
                assert topic == b"" and payload == b""
                return out
            raw = msgspec.msgpack.decode(payload)
            out.append((topic, seq, raw[1], len(raw)))


def of_type(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]


def inventory(sc: SidecarProcess, token: str | None = TOKEN) -> list[dict[str, Any]]:
    req = urllib.request.Request(sc.http + "/inventory")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in resp.read().decode().splitlines()]


def client(url: str) -> KVDepotClient:
    return KVDepotClient(url, model="test-model", layout=LAYOUT, timeout_s=10).connect()


def prefix(seed: int, chunks: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 60_000, (chunks * 16,), generator=g).tolist()


def data(chunks: int) -> list[torch.Tensor]:
    return [torch.full((LAYOUT.chunk_bytes // 2,), float(i), dtype=torch.float16) for i in range(chunks)]


@pytest.fixture
def running(sidecar_factory: StartSidecar) -> Iterator[tuple[SidecarProcess, Events]]:
    """A sidecar with the disk tier, its KV events on loopback, and a live subscriber."""
    pub, replay = free_ports(2)
    sc = sidecar_factory(
        "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
        env=env(
            KVDEPOT_KV_EVENTS__REPLAY_ENDPOINT=f"tcp://127.0.0.1:{replay}",
            KVDEPOT_L2__ADAPTERS='[{"type": "disk"}]',
        ),
        l1_size_gb=0.02,
    )  # fmt: skip
    events = Events(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    wait_for(lambda: metric(sc, "kvdepot_kv_events_subscribers") >= 1, what="the subscription")
    yield sc, events
    events.close()


def delete(sc: SidecarProcess, path: str) -> int:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    req = urllib.request.Request(sc.http + path, method="DELETE", headers=auth)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return int(resp.status)


def test_a_stored_prefix_is_announced_block_by_block_then_removed_cleared_and_replayed(
    running: tuple[SidecarProcess, Events],
) -> None:
    sc, ev = running
    c = client(sc.url)
    toks = prefix(1, 4)
    assert c.store(toks, data(4), request_id="w", cache_salt="t", lora_name="adapter-1").stored == 4
    seen = ev.read(lambda e: len(of_type(e, "BlockStored")) >= 8)  # in L1, then written behind to disk
    cpu = [s for s in of_type(seen, "BlockStored") if s["medium"] == "CPU"]
    disk = [s for s in of_type(seen, "BlockStored") if s["medium"] == "DISK"]
    assert len(cpu) == 4 and len(disk) == 4
    assert [t for s in cpu for t in s["token_ids"]] == toks  # the token ids rebuild the prefix
    assert all(s["block_size"] == 4 and len(s["block_hashes"]) == 4 for s in cpu)
    assert all(s["lora_name"] == "adapter-1" for s in cpu)
    assert cpu[0]["parent_block_hash"] is None
    assert [s["parent_block_hash"] for s in cpu[1:]] == [s["block_hashes"][-1] for s in cpu[:-1]]
    hashes = {h for s in cpu for h in s["block_hashes"]}
    assert len(hashes) == 16 and {h for s in disk for h in s["block_hashes"]} == hashes
    # the write-behind announces what the commit did: a consumer hashing tokens itself (NVIDIA
    # Dynamo's indexer) rebuilds the same chain from either tier
    for field in ("block_hashes", "token_ids", "parent_block_hash", "lora_name", "extra_keys"):
        assert [s.get(field) for s in disk] == [s.get(field) for s in cpu], field
    topic = ev.batches[0][0]
    assert topic.decode().startswith("kv@") and topic.decode().endswith("@test-model")
    assert {b[3] for b in ev.batches} == {3}  # [ts, events, data_parallel_rank]: vLLM's exactly

    # the inventory: admin token only, the same blocks per tier, the header names sequence and incarnation
    with pytest.raises(urllib.error.HTTPError) as refused:
        inventory(sc, token=None)
    assert refused.value.code == 401
    refused.value.close()
    with pytest.raises(urllib.error.HTTPError) as wrong:
        inventory(sc, token="wrong")
    assert wrong.value.code == 401
    wrong.value.close()
    lines = inventory(sc)
    header, chunks, end = lines[0], lines[1:-1], lines[-1]
    assert header["kind"] == "header" and len(header["incarnation"]) == 16  # the stream carries none
    assert header["seq"] == ev.batches[-1][1]
    for medium in ("CPU", "DISK"):
        assert {h for line in chunks if line["medium"] == medium for h in line["block_hashes"]} == hashes
    assert end == {"kind": "end", "chunks": 8, "unknown_layout": 0}

    assert c.clear("t") == 4  # the tenant's chunks leave L1: their blocks are removed
    removed = of_type(ev.read(lambda e: len(of_type(e, "BlockRemoved")) >= 4), "BlockRemoved")
    assert {h for r in removed if r["medium"] == "CPU" for h in r["block_hashes"]} == hashes

    # a lookup loads them back from disk: announced in L1 again, tokens and parents from the lookup
    assert c.lookup(toks, request_id="r", cache_salt="t", wait=True).hit_tokens == 64
    assert c.release("r")
    loaded = of_type(ev.read(lambda e: len(of_type(e, "BlockStored")) >= 4), "BlockStored")
    assert len(loaded) == 4 and all(s["medium"] == "CPU" for s in loaded)
    for field in ("block_hashes", "token_ids", "parent_block_hash"):
        assert [s.get(field) for s in loaded] == [s.get(field) for s in cpu], field
    c.close()
    assert delete(sc, "/l2/adapters/disk") == 204  # a tier cleared: consumers drop what they knew
    assert of_type(ev.read(lambda e: bool(of_type(e, "AllBlocksCleared"))), "AllBlocksCleared")

    replayed = ev.replay(0)
    assert replayed == ev.batches  # the same batches, in order, from sequence 0
    assert [b[1] for b in replayed] == list(range(len(replayed)))
    assert {b[3] for b in replayed} == {3}
    assert ev.replay(replayed[-1][1]) == replayed[-1:]
    assert inventory(sc)[1:] == [{"kind": "end", "chunks": 0, "unknown_layout": 0}]


def test_eviction_announces_the_removed_blocks(sidecar_factory: StartSidecar) -> None:
    pub, replay = free_ports(2)
    sc = sidecar_factory(
        env=env(
            KVDEPOT_KV_EVENTS__ENDPOINT=f"tcp://127.0.0.1:{pub}",
            KVDEPOT_KV_EVENTS__REPLAY_ENDPOINT=f"tcp://127.0.0.1:{replay}",
        ),
        l1_size_gb=256 / (1 << 20),  # 256 KiB: 32 chunks of 8 KiB
    )  # fmt: skip
    ev = Events(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    try:
        c = client(sc.url)
        for seed in range(1, 7):  # 6 x 8 chunks: the oldest are evicted
            c.store(prefix(seed, 8), data(8), request_id=f"w{seed}")
        c.close()
        # everything since sequence 0, by replay (the subscription may have come late), until the
        # events account for what the inventory lists: the stores' events are published from the
        # loop's event drain, after their replies, so the first BlockRemoved may come before the rest
        deadline = time.monotonic() + 20
        while True:
            batches = ev.replay(0)
            events = [e for b in batches for e in b[2]]
            removed = of_type(events, "BlockRemoved")
            stored = {h for e in of_type(events, "BlockStored") for h in e["block_hashes"]}
            gone = [h for e in removed for h in e["block_hashes"]]
            listed = {h for line in inventory(sc)[1:-1] for h in line["block_hashes"]}
            if (removed and listed == stored - set(gone)) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert gone and set(gone) <= stored and all(e["medium"] == "CPU" for e in removed)
        assert listed == stored - set(gone)  # what the inventory lists is what the events leave
    finally:
        ev.close()


def run_serve(tmp: Path, endpoint: str, *extra: str) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVDEPOT_")}
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", "--http-port", "0", "--data-dir", str(tmp),
         "--l1-size-gb", "0.01", "--kv-events-endpoint", endpoint, *extra],
        capture_output=True, text=True, env=e, timeout=60, cwd=tmp, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5557", "tcp://*:5557"])
def test_binding_every_address_is_refused(tmp_path: Path, endpoint: str) -> None:
    result = run_serve(tmp_path, endpoint)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1 and "kv_events" in result.stderr
    assert "allow_any_address" in result.stderr and "Traceback" not in result.stderr


def test_plain_tcp_is_refused_without_curve_or_the_explicit_setting(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    result = run_serve(tmp_path, f"tcp://127.0.0.1:{port}")
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1 and "allow_plaintext_tcp" in result.stderr
    assert "ipc://" in result.stderr and "Traceback" not in result.stderr


def salted_hashes(sidecar_factory: StartSidecar, mode: str, key: str) -> tuple[list[int], list[Any]]:
    pub, replay = free_ports(2)
    sc = sidecar_factory(
        env=env(
            KVDEPOT_KV_EVENTS__ENDPOINT=f"tcp://127.0.0.1:{pub}",
            KVDEPOT_KV_EVENTS__REPLAY_ENDPOINT=f"tcp://127.0.0.1:{replay}",
            KVDEPOT_KV_EVENTS__SALT=mode, KVDEPOT_L2__AUTH_KEYS=json.dumps([key]),
        ),
        l1_size_gb=0.02,
    )  # fmt: skip
    ev = Events(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    try:
        c = client(sc.url)
        assert c.store(prefix(9, 1), data(1), request_id="w", cache_salt="tenant-x").stored == 1
        c.close()
        deadline = time.monotonic() + 20
        while not (batches := ev.replay(0)):
            assert time.monotonic() < deadline, "\n".join(sc.lines[-20:])
            time.sleep(0.05)
        (stored,) = of_type([e for b in batches for e in b[2]], "BlockStored")
        return stored["block_hashes"], stored.get("extra_keys")
    finally:
        ev.close()
        sc.stop()


def test_salt_modes(sidecar_factory: StartSidecar) -> None:
    key_a, key_b = "aa" * 32, "bb" * 32
    hashed_a1, extra_a1 = salted_hashes(sidecar_factory, "hashed", key_a)
    hashed_a2, extra_a2 = salted_hashes(sidecar_factory, "hashed", key_a)
    hashed_b, extra_b = salted_hashes(sidecar_factory, "hashed", key_b)
    plain, extra_plain = salted_hashes(sidecar_factory, "plain", key_a)
    omit, extra_omit = salted_hashes(sidecar_factory, "omit", key_a)
    # two sidecars of one deployment name a tenant's blocks alike, without showing the salt
    assert hashed_a1 == hashed_a2 and extra_a1 == extra_a2
    assert "tenant-x" not in json.dumps(extra_a1)
    assert hashed_b != hashed_a1 and extra_b != extra_a1
    assert extra_plain == [["tenant-x"]] * 4
    assert extra_omit is None
    assert len({tuple(h) for h in (hashed_a1, plain, omit)}) == 3


def test_a_flood_with_a_subscriber_that_never_reads_costs_drops_not_the_data_plane(
    sidecar_factory: StartSidecar,
) -> None:
    pub, replay = free_ports(2)
    sc = sidecar_factory(
        env=env(
            KVDEPOT_KV_EVENTS__ENDPOINT=f"tcp://127.0.0.1:{pub}",
            KVDEPOT_KV_EVENTS__REPLAY_ENDPOINT=f"tcp://127.0.0.1:{replay}",
            KVDEPOT_KV_EVENTS__SNDHWM="8", KVDEPOT_KV_EVENTS__MAX_BATCH_EVENTS="4",
        ),
        l1_size_gb=16 / 1024,  # 1024 chunks: every chunk stored is evicted later (STORED + REMOVED)
    )  # fmt: skip
    ctx = zmq.Context()
    stuck = ctx.socket(zmq.SUB)  # subscribes, then never reads a byte
    stuck.setsockopt(zmq.RCVHWM, 8)
    stuck.setsockopt(zmq.RCVBUF, 4096)
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    stuck.connect(f"tcp://127.0.0.1:{pub}")
    try:
        wait_for(lambda: metric(sc, "kvdepot_kv_events_subscribers") >= 1, what="the subscription")
        c = client(sc.url)
        chunks = 250
        for seed in range(200):  # 50,000 chunks: 100,000 KV events
            toks = prefix(1000 + seed, chunks)
            assert c.store(toks, data(chunks), request_id=f"w{seed}").stored == chunks
            assert c.lookup(toks, request_id=f"r{seed}").hit_chunks == chunks  # answered, and right
            c.end_request(f"r{seed}")
        outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(chunks)]
        assert c.lookup(toks, request_id="last").hit_chunks == chunks
        assert c.retrieve("last", outs) and all(
            torch.equal(o, d) for o, d in zip(outs, data(chunks), strict=True)
        )
        c.close()

        def published() -> float:
            kinds = ("BlockStored", "BlockRemoved")
            return sum(metric(sc, f'kvdepot_kv_events_events_total{{type="{k}"}}') for k in kinds)

        wait_for(lambda: published() + metric(sc, "kvdepot_events_dropped_total") >= 99_000, what="the flood")
        assert metric(sc, "kvdepot_kv_events_dropped_total") > 0  # counted, and the stores went on
        assert metric(sc, "kvdepot_kv_events_sent_total") > 0
    finally:
        stuck.close(0)
        ctx.term()
