"""KV events decoded by vLLM's own msgspec classes (`vllm.distributed.kv_events.KVEventBatch`),
in a process of vLLM's venv: what the routers built on vLLM's format (llm-d, Dynamo) read."""

from __future__ import annotations

import struct
import time

import pytest

from api.kvevents.blocks import BlockNamer
from api.kvevents.config import KvEventsSettings
from api.kvevents.publisher import KvEventPublisher
from engine.events import L1_TIER, Event, EventBus, Kind
from engine.keys import KVLayout, Namespace, ObjectKey, TokenHasher
from tests.integration.kv_events_helpers import VLLM_PYTHON, consumer_result, start_consumer, stored

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM venv")

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
        endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", max_batch_events=2, salt="plain"
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
    assert {b["incarnation"] for b in batches} == {pub.incarnation}
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
