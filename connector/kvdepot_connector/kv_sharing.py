"""The KV-sharing messages: where the engine's KV cache can be shared with the sidecar (CUDA
IPC; a shared-memory region on CPU), the sidecar copies between its blocks and L1 itself instead
of the client. Part of the wire protocol (`kvdepot_connector.protocol` re-exports them and puts
them in its `Request` / `Reply` unions: import them from there).

State: none (immutable message types). Pure: the stdlib and msgspec only; any thread or loop.

Messages, in the order a client uses them:
  TensorHandle                          one shared tensor (CUDA IPC fields, or a region and offset)
  RegisterKVCache(engine_id, layers)    -> CountReply
  LoadBlocks(engine_id, request_id, chunks, block_ids)   -> ReleaseReply (valid = blocks filled)
  SaveBlocks(engine_id, request_id, tokens, salt, first_chunk, block_ids, prompt_tokens) -> SaveReply
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvdepot_connector.wire import Count, Dim, EngineId, ExtraKeys, LoraName, Msg, Name


class TensorHandle(msgspec.Struct, frozen=True):
    """A tensor of the engine's shared with the sidecar, so the sidecar copies it itself.

    kind "cuda-ipc": torch's CUDA IPC fields (storage._share_cuda_); kind "cpu-shm": a tensor
    inside the named POSIX shared-memory region `name`. `offset` is in elements.
    """

    kind: Annotated[str, msgspec.Meta(max_length=16)]
    dtype: Annotated[str, msgspec.Meta(max_length=32)]
    shape: Annotated[list[Dim], msgspec.Meta(min_length=1, max_length=8)]
    stride: Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 48)]], msgspec.Meta(max_length=8)]
    offset: Annotated[int, msgspec.Meta(ge=0, lt=1 << 48)] = 0
    name: Name = ""
    device: Count = 0
    ipc_handle: Annotated[bytes, msgspec.Meta(max_length=256)] = b""
    storage_bytes: Annotated[int, msgspec.Meta(ge=0, lt=1 << 48)] = 0
    storage_offset_bytes: Annotated[int, msgspec.Meta(ge=0, lt=1 << 48)] = 0
    ref_counter_handle: Annotated[bytes, msgspec.Meta(max_length=256)] = b""
    ref_counter_offset: Annotated[int, msgspec.Meta(ge=0, lt=1 << 48)] = 0
    event_handle: Annotated[bytes, msgspec.Meta(max_length=256)] = b""
    event_sync_required: bool = False


#: block ids in one LOAD_BLOCKS / SAVE_BLOCKS: 2M tokens in blocks of 16 (decoding the most costs
#: the sidecar's loop ~5 ms; 1 << 20 of them cost ~45 ms, a stall any client could repeat)
MAX_BLOCK_IDS = 1 << 17
BlockIds = Annotated[
    list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]], msgspec.Meta(max_length=MAX_BLOCK_IDS)
]


class RegisterKVCache(Msg, tag="register_kv_cache"):
    """The engine's paged KV cache, one handle per layer (per K/V plane where they are separate),
    each indexed by block on its first dimension. Then LOAD_BLOCKS / SAVE_BLOCKS have the sidecar
    copy between these blocks and L1 on its own (CUDA streams, or the CPU stub)."""

    engine_id: EngineId
    layers: Annotated[list[TensorHandle], msgspec.Meta(min_length=1, max_length=4096)]


class LoadBlocks(Msg, tag="load_blocks"):
    """Copy the request's read-locked chunks into `block_ids` (block j holds the request's tokens
    [j*block_size, (j+1)*block_size)), skipping blocks before `skip_blocks`; then release."""

    engine_id: EngineId
    request_id: Name
    first_chunk: Count
    num_chunks: Count
    block_ids: BlockIds
    skip_blocks: Count = 0


class SaveBlocks(Msg, tag="save_blocks"):
    """Store the full chunks `first_chunk..` of `tokens` from `block_ids` (the blocks of those
    chunks, in order): reserve, copy, commit, in one operation. `prompt_tokens`: as in STORE."""

    engine_id: EngineId
    request_id: Name
    tokens: bytes
    cache_salt: Name = ""
    first_chunk: Count = 0
    block_ids: BlockIds = msgspec.field(default_factory=list)
    extra_keys: ExtraKeys = msgspec.field(default_factory=list)  # as in protocol.Store
    prompt_tokens: Count = 0
    lora_name: LoraName = ""  # as in protocol.Store


class SaveReply(Msg, tag="save_reply"):
    stored: int
    existing: int
    refused: int
