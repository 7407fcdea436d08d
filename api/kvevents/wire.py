"""vLLM's KV-event wire format, as msgspec Structs that encode byte for byte like
`vllm.distributed.kv_events` (KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared).

A published message is three frames: the topic (UTF-8), the sequence number (8 bytes, big-endian,
from 0 at each start) and a msgpack `KVEventBatch`. vLLM's structs: the batch is array-like
(`[ts, events, data_parallel_rank]`), each event a map tagged `"type": "<class name>"`, defaults
omitted. Field names and their order here are vLLM's, so the bytes match.

The batch is exactly vLLM's three elements: decoders that check the array's length (NVIDIA
Dynamo's indexer) take it as they take vLLM's. The sidecar's incarnation id (random, new at each
start) is not in the stream: it is in the inventory's header and in the sidecar's heartbeats to a
directory, and the sequence starting over at 0 tells any consumer of a restart. (Sidecars before
this appended the incarnation as a fourth element; msgspec decoders ignore it.) Block hashes
are unsigned 64-bit integers, as vLLM publishes them by default
(`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`).

Stateless; any thread.
"""

from __future__ import annotations

from typing import Any

import msgspec

#: the end-of-replay marker, as vLLM's publisher sends it (sequence -1, empty topic and payload)
END_SEQ = (-1).to_bytes(8, "big", signed=True)

MEDIUM_CPU = "CPU"


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events (tagged with their class name, like vLLM's)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)
