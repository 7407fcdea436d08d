"""The data-plane wire protocol, defined once: message types, error codes, version. Every name of
the wire is imported from here; two pure modules hold parts of it, re-exported here: `wire` (the
version and limits, field types, error codes, slot statuses, the message base, `Layout`) and
`kv_sharing` (the messages by which the sidecar copies the engine's shared KV blocks itself).
This module: the requests and replies, their unions, the codecs and the token encoding.

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
  3: chunk keys cover what changes KV besides the tokens: LOOKUP, STORE and SAVE_BLOCKS carry
     `extra_keys` (per chunk, a digest of the LoRA adapter, the multimodal items and the prompt
     embeddings it depends on), and LOOKUP may say `uncacheable` (a miss the sidecar counts). A v2
     client never sent them, so its keys would alias an adapter's KV with the base model's: v2 is
     refused, not served.

Extra keys. `extra_keys[i]` is chunk i's extra key: empty (the chunk's KV depends on its tokens
alone) or EXTRA_KEY_BYTES bytes; entries past the list's end are empty. The sidecar chains it into
the chunk's hash (`engine.keys`), so a chunk's key also covers every earlier chunk's extra key. The
digests are the client's: the sidecar never interprets them, it only keeps keys that differ apart.

Sessions and ownership. Every connection says HELLO first; other messages before it are refused
(`hello_required`, also after the sidecar restarted: say HELLO again and register again). HELLO
names the engine `instance`: a random hex nonce shared by an engine's processes (its scheduler and
its workers, on different connections); empty means a private instance of that connection alone.
Engine ids (REGISTER), requests, read locks and reservations belong to the instance that made
them; a message naming another instance's engine id or reservation is refused with `not_owner`
and changes nothing. Ids are unguessable (random). The instance is never part of a cache key:
two instances of one model register different engine ids and share the cached chunks. The HELLO
reply names a lifeline (a unix socket, `kvdepot_connector.lifeline`) and a token for it: until the
client has connected it, its session may not REGISTER, STORE, COMMIT, REGISTER_KV_CACHE,
LOAD_BLOCKS or SAVE_BLOCKS (`unauthorized`), and a session whose lifeline is not connected within
the sidecar's handshake timeout (seconds) is closed (`hello_required` next). The client library
connects it right after HELLO.

Workers and heartbeats (optional fields, protocol 3). HELLO may say the process's `role`
(scheduler or worker) and `rank`; the sidecar lists it under its instance (GET /workers). A reply
with `heartbeat_s` > 0 asks the client to send a lifeline heartbeat that often, from a thread of
its own; a client silent for the sidecar's `fleet.worker_timeout_s` after heartbeating is suspect:
its read locks are dropped (its late RELEASE reports invalid) and its reservations quarantined
until its lifeline closes; a heartbeat makes it alive again. A client that never heartbeats (an
older one) is never suspected, and an older sidecar sends no `heartbeat_s`, so none is sent.

Tracing (an optional field, protocol 3). LOOKUP may carry the engine request's W3C `traceparent`;
a sidecar that exports traces makes its spans of the request children of it. An older sidecar
ignores the field; an older client never sends it.

Requests, in the order a client uses them:

  Hello(version, instance, role, rank)   -> HelloReply: chunk size, arena name and size, session,
                                            its lifeline path and token, the heartbeat interval
  Register(model, layout, kv_rank, group)-> RegisterReply: engine_id (per instance), chunk_bytes
  Lookup(engine_id, request_id, tokens, cache_salt, extra_keys, uncacheable, traceparent)
                                         -> LookupReply: hit_tokens from the start; hits read-locked
  Retrieve(engine_id, request_id, first_chunk, num_chunks)
                                         -> RetrieveReply: (offset, size, oid) per locked chunk
  Release(engine_id, request_id, oids)   -> ReleaseReply: valid=True only when every object the
                                            client copied from (`oids`, from RETRIEVE) is still the
                                            same live object (its bytes unchanged); without oids,
                                            only when the request still held its locks
  Store(engine_id, request_id, tokens, cache_salt, first_chunk, extra_keys, prompt_tokens[, lora_name])
                                         -> StoreReply: per chunk reserved(oid, offset)/exists/
                                            no_space/quota
  Commit(engine_id, oids)                -> CommitReply: per oid True, False = lease expired
  Abort(engine_id, oids), FreeLookupLocks, EndRequest -> CountReply
  Clear(cache_salt)                      -> CountReply: one tenant only (all tenants: HTTP)
  QueryPrefetch(engine_id, request_id)   -> LookupReply (after a Lookup that said pending_chunks > 0)
  Ping                                   -> Pong

Where the engine's KV cache can be shared with the sidecar (CUDA IPC; a shared-memory region on
CPU), the sidecar copies itself instead of the client (the messages: `kv_sharing`):

  RegisterKVCache(engine_id, layers)     -> CountReply
  LoadBlocks(engine_id, request_id, chunks, block_ids)   -> ReleaseReply (valid = blocks filled)
  SaveBlocks(engine_id, request_id, tokens, salt, first_chunk, block_ids, extra_keys, prompt_tokens
             [, lora_name])
                                         -> SaveReply

Any request may instead get an ErrorReply(code, message, retryable). A frame that cannot be
decoded gets ErrorReply(code="malformed_frame") with id -1 when no id could be read.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from kvdepot_connector.kv_sharing import (
    BlockIds,
    LoadBlocks,
    RegisterKVCache,
    SaveBlocks,
    SaveReply,
    TensorHandle,
)
from kvdepot_connector.wire import (
    EXTRA_KEY_BYTES,
    INSTANCE_PATTERN,
    MAX_ID_LEN,
    MAX_LIST,
    MAX_LORA_NAME_LEN,
    PROTOCOL_VERSION,
    TOKEN_BYTES,
    Count,
    Dim,
    EngineId,
    ErrorCode,
    ExtraKey,
    ExtraKeys,
    Id,
    Layout,
    LoraName,
    Msg,
    Name,
    Oid,
    SlotStatus,
    Uncacheable,
    encode,
    encode_tokens,
    salvage_id,
)

# the whole wire, including what kv_sharing and wire define: import it from here
__all__ = [
    "EXTRA_KEY_BYTES", "INSTANCE_PATTERN", "MAX_ID_LEN", "MAX_LIST", "MAX_LORA_NAME_LEN", "PROTOCOL_VERSION",
    "TOKEN_BYTES",
    "Abort", "BlockIds", "Clear", "Commit", "CommitReply", "Count", "CountReply", "Dim", "EndRequest",
    "EngineId", "ErrorCode", "ErrorReply", "Extent", "ExtraKey", "ExtraKeys", "FreeLookupLocks", "Hello",
    "HelloReply", "Id", "Layout", "LoadBlocks", "Lookup", "LookupReply", "LoraName", "Name", "Oid", "Ping",
    "Pong",
    "QueryPrefetch", "Register", "RegisterKVCache", "RegisterReply", "Release", "ReleaseReply", "Reply",
    "Request", "Retrieve", "RetrieveReply", "Role", "SaveBlocks", "SaveReply", "Slot", "SlotStatus", "Store",
    "StoreReply", "TensorHandle", "Uncacheable", "encode", "encode_tokens", "reply_decoder",
    "request_decoder", "salvage_id"
]  # fmt: skip


# --- requests ---------------------------------------------------------------------------------

#: what a client process is to its engine (HELLO): a scheduler, a worker, or unsaid
Role = Literal["", "scheduler", "worker"]


class Hello(Msg, tag="hello"):
    """`instance`: the engine instance nonce its processes share (INSTANCE_PATTERN); empty: a
    private instance for this connection alone."""

    version: Count
    client: Name = ""
    instance: Annotated[str, msgspec.Meta(pattern=INSTANCE_PATTERN)] = ""
    #: what the process is to its engine (the worker registry shows it; optional, new in 1.x)
    role: Role = ""
    rank: Annotated[int, msgspec.Meta(ge=0, lt=1 << 20)] | None = None


class Register(Msg, tag="register"):
    model: Name
    layout: Layout
    kv_rank: Count = 0
    group: Count = 0


#: "00-<32 hex trace id>-<16 hex parent span id>-<2 hex flags>", or "" (none)
TRACEPARENT_PATTERN = "^(00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2})?$"
Traceparent = Annotated[str, msgspec.Meta(pattern=TRACEPARENT_PATTERN, max_length=55)]


class Lookup(Msg, tag="lookup"):
    """`wait`: reply only once chunks missing in L1 were loaded from L2 (or the prefetch deadline
    passed); without it the reply is immediate and `pending_chunks` says what is still coming."""

    engine_id: EngineId
    request_id: Name
    tokens: bytes
    cache_salt: Name = ""
    wait: bool = False
    extra_keys: ExtraKeys = msgspec.field(default_factory=list)
    #: set: the client will neither load nor store this request; the sidecar counts the reason
    #: and answers a miss without locking anything
    uncacheable: Uncacheable | None = None
    #: the engine request's W3C trace context (`traceparent` header value, version 00), when the
    #: engine traces it: the sidecar's spans of the request join that trace
    traceparent: Traceparent = ""
    #: set: when every chunk found is in L1 by the time of the reply (none still coming from L2),
    #: the reply also names them as a RETRIEVE of them all would (extents, fence words, epoch):
    #: a reader copies without a RETRIEVE, then RELEASEs as after one
    extents: bool = False


class QueryPrefetch(Msg, tag="query_prefetch"):
    engine_id: EngineId
    request_id: Name
    #: as `Lookup.extents`: once nothing is still coming, the reply names the locked chunks
    extents: bool = False


class Retrieve(Msg, tag="retrieve"):
    engine_id: EngineId
    request_id: Name
    first_chunk: Count = 0
    num_chunks: Count = 0


class Release(Msg, tag="release"):
    """`oids`: the objects the client copied from (RETRIEVE's extents); see the module docstring."""

    engine_id: EngineId
    request_id: Name
    oids: Annotated[list[Oid], msgspec.Meta(max_length=MAX_LIST)] = msgspec.field(default_factory=list)
    #: the `epoch` of the RETRIEVE reply copied from: the locks of a newer LOOKUP of the request
    #: (a RELEASE that arrives after it, from another connection) are not this RELEASE's to drop
    epoch: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0


class Store(Msg, tag="store"):
    """`prompt_tokens`: the request's prompt length; chunks that end after it contain generated
    tokens (counted apart by the sidecar); 0 means all prompt. `lora_name` (optional, bounded):
    the LoRA adapter the KV was computed with, announced in the sidecar's STORED events (it keys
    nothing: the extra keys do)."""

    engine_id: EngineId
    request_id: Name
    tokens: bytes
    cache_salt: Name = ""
    first_chunk: Count = 0
    extra_keys: ExtraKeys = msgspec.field(default_factory=list)
    prompt_tokens: Count = 0
    lora_name: LoraName = ""


class Commit(Msg, tag="commit"):
    engine_id: EngineId
    oids: Annotated[list[Oid], msgspec.Meta(max_length=MAX_LIST)]


class Abort(Msg, tag="abort"):
    engine_id: EngineId
    oids: Annotated[list[Oid], msgspec.Meta(max_length=MAX_LIST)]


class FreeLookupLocks(Msg, tag="free_lookup_locks"):
    engine_id: EngineId
    request_id: Name


class EndRequest(Msg, tag="end_request"):
    engine_id: EngineId
    request_id: Name


class Ping(Msg, tag="ping"):
    pass


class Clear(Msg, tag="clear"):
    cache_salt: Name | None = None


Request = (
    Hello | Register | Lookup | QueryPrefetch | Retrieve | Release | Store | Commit | Abort
    | FreeLookupLocks | EndRequest | Ping | Clear | RegisterKVCache | LoadBlocks | SaveBlocks
)  # fmt: skip


# --- replies ----------------------------------------------------------------------------------


class HelloReply(Msg, tag="hello_reply"):
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
    #: heartbeat over the lifeline this often (0: the sidecar wants none; an older one)
    heartbeat_s: float = 0.0


class RegisterReply(Msg, tag="register_reply"):
    engine_id: int
    chunk_bytes: int
    layout_fingerprint: bytes


class LookupReply(Msg, tag="lookup_reply"):
    hit_tokens: int
    hit_chunks: int
    total_chunks: int
    pending_chunks: int = 0
    #: asked for (`Lookup.extents`) and nothing pending: the locked chunks from chunk 0, their
    #: fence words and lock epoch, as in a RetrieveReply; empty otherwise (RETRIEVE them)
    extents: list[Extent] = msgspec.field(default_factory=list)
    fences: list[Fence] = msgspec.field(default_factory=list)
    epoch: int = 0
    #: the name of the arena the extents are in (a reader mapping another one must RETRIEVE)
    arena: str = ""


class Slot(msgspec.Struct, array_like=True, frozen=True):
    chunk: int
    status: SlotStatus
    oid: int = 0
    offset: int = 0
    size: int = 0


class StoreReply(Msg, tag="store_reply"):
    slots: list[Slot]


class CommitReply(Msg, tag="commit_reply"):
    ok: list[bool]


class Extent(msgspec.Struct, array_like=True, frozen=True):
    offset: int
    size: int
    oid: int = 0


class Fence(msgspec.Struct, array_like=True, frozen=True):
    """An arena segment's release-fence word as the RETRIEVE found it (kvdepot_connector.fences)."""

    segment: int
    word: int


class RetrieveReply(Msg, tag="retrieve_reply"):
    extents: list[Extent]
    #: the fence words of the segments the extents span; empty: the RELEASE's answer decides
    fences: list[Fence] = msgspec.field(default_factory=list)
    #: which LOOKUP of the request holds these locks (name it in the RELEASE); 0: unknown
    epoch: int = 0


class ReleaseReply(Msg, tag="release_reply"):
    valid: bool


class CountReply(Msg, tag="count_reply"):
    count: int


class Pong(Msg, tag="pong"):
    server_time: float


class ErrorReply(Msg, tag="error"):
    code: str
    message: str
    retryable: bool = False


Reply = (
    HelloReply | RegisterReply | LookupReply | StoreReply | CommitReply | RetrieveReply | ReleaseReply
    | CountReply | SaveReply | Pong | ErrorReply
)  # fmt: skip


request_decoder: msgspec.msgpack.Decoder[Request] = msgspec.msgpack.Decoder(Request)
reply_decoder: msgspec.msgpack.Decoder[Reply] = msgspec.msgpack.Decoder(Reply)
