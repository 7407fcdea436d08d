"""KV events decoded by vLLM's own msgspec classes (`vllm.distributed.kv_events.KVEventBatch`),
in a process of vLLM's venv: what the routers built on vLLM's format (llm-d, Dynamo) read."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import time
from typing import Any

import pytest

from api.kvevents.blocks import BlockNamer
from api.kvevents.config import KvEventsSettings
from api.kvevents.publisher import KvEventPublisher
from engine.events import L1_TIER, Event, EventBus, Kind
from engine.keys import KVLayout, Namespace, ObjectKey, TokenHasher
from tests.integration.conftest import StartSidecar
from tests.integration.kv_events_helpers import (
    consumer_cmd,
    consumer_env,
    consumer_result,
    need_vllm_python,
    start_consumer,
    stored,
)
from tests.integration.metrics_sidecar import metric
from tests.integration.test_kv_events_sidecar import client, data, env, prefix
from tests.integration.waiting import wait_for
from tests.ports import free_ports


@pytest.fixture(autouse=True)
def _vllm_venv() -> None:
    need_vllm_python()


LAYOUT = KVLayout(
    dtype="float16", num_layers=2, num_kv_heads=1, head_dim=32, block_size=4, kind="test", chunk_size=16
)  # fmt: skip


def prefix_events(tokens: list[int], salt: str) -> list[Event]:
    raw = struct.pack(f"<{len(tokens)}I", *tokens)
    hashes = TokenHasher(16).chunk_hashes(raw)
    ns = Namespace("m", LAYOUT.fingerprint)
    return [
        Event(
            Kind.STORED, time.time_ns(), tier=L1_TIER, key=ObjectKey(ns, salt, h),
            tokens=raw[i * 64 : (i + 1) * 64], parent=hashes[i - 1] if i else b"", lora_name="ad",
            extra=bytes(range(32)) if i == 1 else b"",
        )
        for i, h in enumerate(hashes)
    ]  # fmt: skip


@pytest.mark.anyio
async def test_vllm_decodes_every_batch_byte_for_byte_and_replays_ending_with_minus_one() -> None:
    config = KvEventsSettings(
        endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", max_batch_events=2, salt="plain",
        allow_plaintext_tcp=True,
    )  # fmt: skip
    namer = BlockNamer(salt_mode="plain", deployment_key=b"k", layout_of=lambda _fp: LAYOUT)
    pub = KvEventPublisher(config, namer)
    pub.bind()
    pub.start()
    try:
        bus = EventBus()
        bus.subscribe(pub.on_events)
        tokens = list(range(5000, 5064))
        events = prefix_events(tokens, "tenant")
        for ev in events:  # published before anyone subscribed: the consumer replays them
            bus.publish(ev)
        bus.flush()
        proc = await start_consumer(pub.endpoint, pub.replay_endpoint or "", 6, vllm=True)
        bus.publish(Event(Kind.REMOVED, time.time_ns(), tier=L1_TIER, key=events[3].key))
        bus.publish(Event(Kind.CLEARED, time.time_ns()))
        bus.flush()
        result = await consumer_result(proc)
    finally:
        pub.close()
    assert result["identical"] is True
    batches = result["batches"]
    assert {b["elements"] for b in batches} == {3}  # vLLM's batch exactly: Dynamo's decoder checks
    assert {b["topic"] for b in batches} == {f"kv@{pub.host}@m"}
    assert set(result["replayed"]) >= {0, 1}
    blocks = stored(batches)
    assert [t for e in blocks for t in e["token_ids"]] == tokens
    assert all(e["block_size"] == 4 and len(e["block_hashes"]) == 4 and e["medium"] == "CPU" for e in blocks)
    assert blocks[1]["extra_keys"] == [["ad", bytes(range(32)).hex(), "tenant"]] * 4
    assert blocks[0]["extra_keys"] == [["ad", "tenant"]] * 4 and blocks[0]["lora_name"] == "ad"
    assert [b["parent_block_hash"] for b in blocks[1:]] == [b["block_hashes"][-1] for b in blocks[:-1]]
    removed = [e for b in batches for e in b["events"] if e["type"] == "BlockRemoved"]
    assert removed == [{"type": "BlockRemoved", "block_hashes": blocks[3]["block_hashes"], "medium": "CPU"}]
    assert batches[3]["events"] == [{"type": "AllBlocksCleared"}]


def vllm_consumer(endpoint: str, replay: str, events: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        consumer_cmd(endpoint, replay, events, vllm=True), env=consumer_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    # Read the first line from the descriptor itself: a buffered readline may also take the result
    # line when it comes right after, and communicate() (which reads the descriptor) never sees it.
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(proc.stdout.fileno(), 1)
        assert byte, "the consumer exited before subscribing"
        line += byte
    assert line.strip() == b"subscribed"
    return proc


def vllm_result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, (out[-2000:], err[-4000:])
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def test_a_sidecar_s_events_decoded_by_vllm_live_and_by_replay(sidecar_factory: StartSidecar) -> None:
    pub, replay = free_ports(2)
    endpoint, replay_endpoint = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
    sc = sidecar_factory(
        "--kv-events-endpoint", endpoint,
        env=env(KVDEPOT_KV_EVENTS__REPLAY_ENDPOINT=replay_endpoint), l1_size_gb=0.02,
    )  # fmt: skip
    live = vllm_consumer(endpoint, replay_endpoint, 4)
    wait_for(lambda: metric(sc, "kvdepot_kv_events_subscribers") >= 1, what="the subscription")
    c = client(sc.url)
    toks = prefix(3, 4)
    assert c.store(toks, data(4), request_id="w").stored == 4
    c.close()
    seen = vllm_result(live)
    late = vllm_result(vllm_consumer(endpoint, replay_endpoint, 4))  # everything from the replay socket
    for result in (seen, late):
        assert result["identical"] is True  # vLLM's encoder gives back the bytes kvdepot sent
        blocks = stored(result["batches"])
        assert len(blocks) == 4 and [t for b in blocks for t in b["token_ids"]] == toks
        assert all(b["block_size"] == 4 and len(b["block_hashes"]) == 4 for b in blocks)
    assert seen["live"] and late["replayed"] and not late["live"]
    assert late["batches"] == seen["batches"]
