"""The data-plane wire protocol, defined once: message types, error codes, version.

Transport: ZMQ, the sidecar binds a ROUTER, clients connect DEALERs. One frame per message,
encoded with msgpack (msgspec). Every request carries `id`, a client-chosen integer echoed in the
reply, so a client may keep several requests in flight. Requests and replies are tagged unions:
the map's `op` field names the type. No pickle, ever.

Tokens travel as bytes: unsigned 32-bit little-endian integers (`TOKEN_BYTES`, `encode_tokens`).

Versions. `PROTOCOL_VERSION` is the major version; HELLO carries it and the sidecar refuses any
other (error `unsupported_version`, naming both versions). Within one major version the protocol
only grows: new fields are optional (they have a default, and a peer that omits them keeps the
old meaning), new messages are new tags, and unknown fields are ignored by both sides, so an
older peer of the same major version keeps working. Anything else (a field removed, retyped or
given a new meaning, a default changed) bumps the major version.
  1: the first protocol.
  2: HELLO first on every connection, with the engine instance nonce; ids owned by the instance
     (`not_owner`); RETRIEVE returns each extent's object id and RELEASE carries them back (the
     generation check); data-plane CLEAR needs a cache_salt.

Sessions and ownership. Every connection says HELLO first; other messages before it are refused
(`hello_required`, also after the sidecar restarted: say HELLO again and register again). HELLO
names the engine `instance`: a random hex nonce shared by an engine's processes (its scheduler and
its workers, on different connections); empty means a private instance of that connection alone.
Engine ids (REGISTER), requests, read locks and reservations belong to the instance that made
them; a message naming another instance's engine id or reservation is refused with `not_owner`
and changes nothing. Ids are unguessable (random). The instance is never part of a cache key:
two instances of one model register different engine ids and share the cached chunks.

Requests, in the order a client uses them:

  Hello(version, instance)               -> HelloReply: chunk size, arena name and size, session,
                                            its lifeline path and token
  Register(model, layout, kv_rank, group)-> RegisterReply: engine_id (per instance), chunk_bytes
  Lookup(engine_id, request_id, tokens, cache_salt)
                                         -> LookupReply: hit_tokens from the start; hits read-locked
  Retrieve(engine_id, request_id, first_chunk, num_chunks)
                                         -> RetrieveReply: (offset, size, oid) per locked chunk
  Release(engine_id, request_id, oids)   -> ReleaseReply: valid=True only when every object the
                                            client copied from (`oids`, from RETRIEVE) is still the
                                            same live object (its bytes unchanged); without oids,
                                            only when the request still held its locks
  Store(engine_id, request_id, tokens, cache_salt, first_chunk)
                                         -> StoreReply: per chunk reserved(oid, offset)/exists/
                                            no_space/quota
  Commit(engine_id, oids)                -> CommitReply: per oid True, False = lease expired
  Abort(engine_id, oids), FreeLookupLocks, EndRequest -> CountReply
  Clear(cache_salt)                      -> CountReply: one tenant only (all tenants: HTTP)
  QueryPrefetch(engine_id, request_id)   -> LookupReply (after a Lookup that said pending_chunks > 0)
  Ping                                   -> Pong

Where the engine's KV cache can be shared with the sidecar (CUDA IPC; a shared-memory region on
CPU), the sidecar copies itself instead of the client:

  RegisterKVCache(engine_id, layers)     -> CountReply
  LoadBlocks(engine_id, request_id, chunks, block_ids)   -> ReleaseReply (valid = blocks filled)
  SaveBlocks(engine_id, request_id, tokens, salt, first_chunk, block_ids) -> SaveReply

Any request may instead get an ErrorReply(code, message, retryable). A frame that cannot be
decoded gets ErrorReply(code="malformed_frame") with id -1 when no id could be read.
"""

from __future__ import annotations

import array
import enum
import sys
from collections.abc import Sequence
from typing import Annotated

import msgspec

from kvdepot_connector import layout

PROTOCOL_VERSION = 2
TOKEN_BYTES = 4
MAX_ID_LEN = 256
MAX_LIST = 1 << 16

#: an engine instance nonce: lowercase hex (empty: a private instance of the connection)
INSTANCE_PATTERN = "^([0-9a-f]{16,128})?$"

Id = Annotated[int, msgspec.Meta(ge=-1, lt=1 << 62)]
EngineId = Annotated[int, msgspec.Meta(ge=1, lt=1 << 31)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_ID_LEN)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Oid = Annotated[int, msgspec.Meta(ge=1, lt=1 << 62)]
Dim = Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]


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


class _Msg(msgspec.Struct, tag_field="op"):
    """Unknown fields are ignored (the version policy above); unknown tags are refused."""

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


# --- requests ---------------------------------------------------------------------------------


class Hello(_Msg, tag="hello"):
    """`instance`: the engine instance nonce its processes share (INSTANCE_PATTERN); empty: a
    private instance for this connection alone."""

    version: Count
    client: Name = ""
    instance: Annotated[str, msgspec.Meta(pattern=INSTANCE_PATTERN)] = ""


class Register(_Msg, tag="register"):
    model: Name
    layout: Layout
    kv_rank: Count = 0
    group: Count = 0


class Lookup(_Msg, tag="lookup"):
    """`wait`: reply only once chunks missing in L1 were loaded from L2 (or the prefetch deadline
    passed); without it the reply is immediate and `pending_chunks` says what is still coming."""

    engine_id: EngineId
    request_id: Name
    tokens: bytes
    cache_salt: Name = ""
    wait: bool = False


class QueryPrefetch(_Msg, tag="query_prefetch"):
    engine_id: EngineId
    request_id: Name


class Retrieve(_Msg, tag="retrieve"):
    engine_id: EngineId
    request_id: Name
    first_chunk: Count = 0
    num_chunks: Count = 0


class Release(_Msg, tag="release"):
    """`oids`: the objects the client copied from (RETRIEVE's extents); see the module docstring."""

    engine_id: EngineId
    request_id: Name
    oids: Annotated[list[Oid], msgspec.Meta(max_length=MAX_LIST)] = msgspec.field(default_factory=list)


class Store(_Msg, tag="store"):
    engine_id: EngineId
    request_id: Name
    tokens: bytes
    cache_salt: Name = ""
    first_chunk: Count = 0


class Commit(_Msg, tag="commit"):
    engine_id: EngineId
    oids: Annotated[list[Oid], msgspec.Meta(max_length=MAX_LIST)]


class Abort(_Msg, tag="abort"):
    engine_id: EngineId
    oids: Annotated[list[Oid], msgspec.Meta(max_length=MAX_LIST)]


class FreeLookupLocks(_Msg, tag="free_lookup_locks"):
    engine_id: EngineId
    request_id: Name


class EndRequest(_Msg, tag="end_request"):
    engine_id: EngineId
    request_id: Name


class Ping(_Msg, tag="ping"):
    pass


class Clear(_Msg, tag="clear"):
    cache_salt: Name | None = None


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


BlockIds = Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]], msgspec.Meta(max_length=1 << 20)]


class RegisterKVCache(_Msg, tag="register_kv_cache"):
    """The engine's paged KV cache, one handle per layer (per K/V plane where they are separate),
    each indexed by block on its first dimension. Then LOAD_BLOCKS / SAVE_BLOCKS have the sidecar
    copy between these blocks and L1 on its own (CUDA streams, or the CPU stub)."""

    engine_id: EngineId
    layers: Annotated[list[TensorHandle], msgspec.Meta(min_length=1, max_length=4096)]


class LoadBlocks(_Msg, tag="load_blocks"):
    """Copy the request's read-locked chunks into `block_ids` (block j holds the request's tokens
    [j*block_size, (j+1)*block_size)), skipping blocks before `skip_blocks`; then release."""

    engine_id: EngineId
    request_id: Name
    first_chunk: Count
    num_chunks: Count
    block_ids: BlockIds
    skip_blocks: Count = 0


class SaveBlocks(_Msg, tag="save_blocks"):
    """Store the full chunks `first_chunk..` of `tokens` from `block_ids` (the blocks of those
    chunks, in order): reserve, copy, commit, in one operation."""

    engine_id: EngineId
    request_id: Name
    tokens: bytes
    cache_salt: Name = ""
    first_chunk: Count = 0
    block_ids: BlockIds = msgspec.field(default_factory=list)


Request = (
    Hello | Register | Lookup | QueryPrefetch | Retrieve | Release | Store | Commit | Abort
    | FreeLookupLocks | EndRequest | Ping | Clear | RegisterKVCache | LoadBlocks | SaveBlocks
)  # fmt: skip


# --- replies ----------------------------------------------------------------------------------


class HelloReply(_Msg, tag="hello_reply"):
    version: int
    server: str
    chunk_size: int
    arena_name: str
    arena_size: int
    max_frame_bytes: int
    session: int = 0
    #: the unix socket every client process connects its lifeline to, with this session's token
    #: (empty: the sidecar offers no lifeline)
    lifeline_path: str = ""
    lifeline_token: bytes = b""


class RegisterReply(_Msg, tag="register_reply"):
    engine_id: int
    chunk_bytes: int
    layout_fingerprint: bytes


class LookupReply(_Msg, tag="lookup_reply"):
    hit_tokens: int
    hit_chunks: int
    total_chunks: int
    pending_chunks: int = 0


class Slot(msgspec.Struct, array_like=True, frozen=True):
    chunk: int
    status: SlotStatus
    oid: int = 0
    offset: int = 0
    size: int = 0


class StoreReply(_Msg, tag="store_reply"):
    slots: list[Slot]


class CommitReply(_Msg, tag="commit_reply"):
    ok: list[bool]


class Extent(msgspec.Struct, array_like=True, frozen=True):
    offset: int
    size: int
    oid: int = 0


class RetrieveReply(_Msg, tag="retrieve_reply"):
    extents: list[Extent]


class ReleaseReply(_Msg, tag="release_reply"):
    valid: bool


class CountReply(_Msg, tag="count_reply"):
    count: int


class SaveReply(_Msg, tag="save_reply"):
    stored: int
    existing: int
    refused: int


class Pong(_Msg, tag="pong"):
    server_time: float


class ErrorReply(_Msg, tag="error"):
    code: str
    message: str
    retryable: bool = False


Reply = (
    HelloReply | RegisterReply | LookupReply | StoreReply | CommitReply | RetrieveReply | ReleaseReply
    | CountReply | SaveReply | Pong | ErrorReply
)  # fmt: skip


class _IdOnly(msgspec.Struct):
    id: int = -1


_encoder = msgspec.msgpack.Encoder()
request_decoder: msgspec.msgpack.Decoder[Request] = msgspec.msgpack.Decoder(Request)
reply_decoder: msgspec.msgpack.Decoder[Reply] = msgspec.msgpack.Decoder(Reply)
_id_decoder = msgspec.msgpack.Decoder(_IdOnly)


def encode_tokens(tokens: Sequence[int] | bytes) -> bytes:
    """Tokens as the wire carries them (and the sidecar hashes them): uint32 little-endian."""
    if isinstance(tokens, bytes):
        return tokens
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
