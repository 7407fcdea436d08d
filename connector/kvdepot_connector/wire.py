"""The wire's base vocabulary, shared by every message of `kvdepot_connector.protocol` (which
re-exports all of it: import it from there): the version and limits, the bounded field types,
error codes and slot statuses, the tagged message base `Msg` and the engine's `Layout`; and the
encoding: a message's bytes (`encode`), tokens' bytes (`encode_tokens`) and the id of a frame
that did not decode (`salvage_id`).

State: none (constants and immutable types). Pure: the stdlib and msgspec only, so the sidecar
may use it; any thread or loop.

Primitives: `Msg` (base of every request and reply: its `id`, the `op` tag), `Layout.chunk_bytes`,
`encode(msg)`, `encode_tokens(tokens)`, `salvage_id(frame)`.
"""

from __future__ import annotations

import array
import enum
import sys
from collections.abc import Sequence
from typing import Annotated

import msgspec

from kvdepot_connector import layout

PROTOCOL_VERSION = 3
TOKEN_BYTES = 4
MAX_ID_LEN = 256
MAX_LIST = 1 << 16

#: an engine instance nonce: lowercase hex (empty: a private instance of the connection)
INSTANCE_PATTERN = "^([0-9a-f]{16,128})?$"

Id = Annotated[int, msgspec.Meta(ge=-1, lt=1 << 62)]
EngineId = Annotated[int, msgspec.Meta(ge=1, lt=1 << 31)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_ID_LEN)]
MAX_LORA_NAME_LEN = 256
LoraName = Annotated[str, msgspec.Meta(max_length=MAX_LORA_NAME_LEN)]
"""The LoRA adapter a stored chunk's KV was computed with (optional: "" = none or not said)."""
Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Oid = Annotated[int, msgspec.Meta(ge=1, lt=1 << 62)]
Dim = Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]

#: bytes of one chunk's extra key: a digest of what changes the chunk's KV besides its tokens
EXTRA_KEY_BYTES = 32
#: per chunk (index = chunk number): empty, or an EXTRA_KEY_BYTES digest
ExtraKey = Annotated[bytes, msgspec.Meta(max_length=EXTRA_KEY_BYTES)]
ExtraKeys = Annotated[list[ExtraKey], msgspec.Meta(max_length=MAX_LIST)]


class Uncacheable(enum.StrEnum):
    """Why a client will neither load nor store a request (a miss, counted by the sidecar)."""

    LORA_UNFINGERPRINTED = "lora_unfingerprinted"  # an adapter whose weights cannot be fingerprinted
    MM_UNIDENTIFIED = "mm_unidentified"  # a multimodal item without an identifier or position
    EMBEDS_UNHASHABLE = "embeds_unhashable"  # prompt embeddings the client cannot hash
    UNSUPPORTED_INPUT = "unsupported_input"  # any other input the client cannot key


class ErrorCode(enum.StrEnum):
    MALFORMED_FRAME = "malformed_frame"
    UNSUPPORTED_VERSION = "unsupported_version"
    INVALID_INPUT = "invalid_input"
    NOT_REGISTERED = "not_registered"
    NOT_FOUND = "not_found"
    LEASE_EXPIRED = "lease_expired"
    NO_SPACE = "no_space"
    QUOTA_EXCEEDED = "quota_exceeded"
    OVERLOADED = "overloaded"
    SHUTTING_DOWN = "shutting_down"
    HELLO_REQUIRED = "hello_required"
    NOT_OWNER = "not_owner"
    UNAUTHORIZED = "unauthorized"
    INTERNAL = "internal"


class SlotStatus(enum.StrEnum):
    RESERVED = "reserved"
    EXISTS = "exists"
    NO_SPACE = "no_space"
    QUOTA = "quota"


class Msg(msgspec.Struct, tag_field="op"):
    """Unknown fields are ignored (the version policy: `protocol`); unknown tags are refused."""

    id: Id


class Layout(msgspec.Struct, frozen=True):
    """One engine rank's KV layout. `kind` names the memory arrangement of a chunk's bytes."""

    dtype: Annotated[str, msgspec.Meta(max_length=32)]
    num_layers: Dim
    num_kv_heads: Dim
    head_dim: Dim
    block_size: Dim
    kind: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    chunk_size: Dim

    @property
    def chunk_bytes(self) -> int:
        return layout.chunk_bytes(
            self.dtype, num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, chunk_size=self.chunk_size,
        )  # fmt: skip


class _IdOnly(msgspec.Struct):
    id: int = -1


_encoder = msgspec.msgpack.Encoder()
_id_decoder = msgspec.msgpack.Decoder(_IdOnly)


def encode_tokens(tokens: Sequence[int] | bytes) -> bytes:
    """Tokens as the wire carries them (and the sidecar hashes them): uint32 little-endian."""
    if isinstance(tokens, bytes):
        return tokens
    if isinstance(tokens, list):  # `fromlist` converts a list in about 60% of the constructor's time
        arr = array.array("I")
        arr.fromlist(tokens)
    else:
        arr = array.array("I", tokens)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def salvage_id(frame: bytes) -> int:
    """The `id` of a frame that failed to decode, or -1."""
    try:
        value = _id_decoder.decode(frame).id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return -1
    return value if isinstance(value, int) and -1 <= value < 1 << 62 else -1
