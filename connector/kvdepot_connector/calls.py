"""One `Call` per data-plane operation: the request to send and how to read its reply. What both
clients (`client.KVDepotClient`, `aio.AsyncKVDepotClient`) send, with no I/O and no state here:
the session (`session.Session`) gives each message its id and engine id, and the client sends it.

State: none (a `Call` is immutable; its builder closes over the operation's arguments). Built and
read by one client, under its lock (blocking) or on its event loop (asyncio).

Primitives, in the order a client uses them:
  ping()                                        the sidecar's clock (no handshake needed)
  lookup(...), query_prefetch(...)              hits from the start, read-locked
  retrieve(...), release(...)                   the locked chunks' extents; whether the copies hold
  register_kv_cache(...), load_blocks(...),     the sidecar copies between the engine's shared KV
    save_blocks(...)                             blocks and L1 itself
  reserve(...), commit(...), abort(...)         a store's slots, then commit or give them back
  free_lookup_locks(...), end_request(...)      what a request still holds goes
  clear(...)                                    one tenant's chunks
  check_reply(reply, expected)                  the reply as `expected`, or the sidecar's error raised
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgspec

from kvdepot_connector import protocol as p
from kvdepot_connector.errors import SidecarError

R = TypeVar("R", bound=msgspec.Struct)
T = TypeVar("T")
Tokens = Sequence[int] | bytes


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One request: `build(id, engine_id)` makes its message, `read(reply)` checks the reply and
    turns it into the operation's result. `registered`: it needs the engine id (so a handshake
    first, and again when the sidecar no longer knows the id)."""

    build: Callable[[int, int], p.Request]
    read: Callable[[p.Reply], T]
    registered: bool = True


def check_reply(reply: p.Reply, expected: type[R]) -> R:
    if isinstance(reply, p.ErrorReply):
        raise SidecarError(reply.code, reply.message, reply.retryable)
    if not isinstance(reply, expected):
        raise SidecarError("internal", f"expected {expected.__name__}, got {type(reply).__name__}", False)
    return reply


def _call(build: Callable[[int, int], p.Request], expected: type[R], pick: Callable[[R], T]) -> Call[T]:
    return Call(build, lambda reply: pick(check_reply(reply, expected)))


def _same(reply: R) -> R:
    return reply


def _valid(reply: p.ReleaseReply) -> bool:
    return reply.valid


def _count(reply: p.CountReply) -> int:
    return reply.count


def ping() -> Call[float]:
    return Call(lambda i, _: p.Ping(id=i), lambda r: check_reply(r, p.Pong).server_time, registered=False)


def lookup(
    tokens: Tokens, request_id: str, cache_salt: str, wait: bool, *, extra_keys: Sequence[bytes] = (),
    uncacheable: p.Uncacheable | None = None, traceparent: str = "", extents: bool = False,
) -> Call[p.LookupReply]:  # fmt: skip
    data = p.encode_tokens(tokens)
    extras = list(extra_keys)
    return _call(
        lambda i, e: p.Lookup(
            id=i, engine_id=e, request_id=request_id, tokens=data, cache_salt=cache_salt, wait=wait,
            extra_keys=extras, uncacheable=uncacheable, traceparent=traceparent, extents=extents,
        ),
        p.LookupReply, _same,
    )  # fmt: skip


def query_prefetch(request_id: str, extents: bool = False) -> Call[p.LookupReply]:
    return _call(
        lambda i, e: p.QueryPrefetch(id=i, engine_id=e, request_id=request_id, extents=extents),
        p.LookupReply, _same,
    )  # fmt: skip


def retrieve(request_id: str, first_chunk: int, num_chunks: int) -> Call[p.RetrieveReply]:
    return _call(
        lambda i, e: p.Retrieve(
            id=i, engine_id=e, request_id=request_id, first_chunk=first_chunk, num_chunks=num_chunks
        ),
        p.RetrieveReply, _same,
    )  # fmt: skip


def release(request_id: str, oids: Sequence[int] = (), epoch: int = 0) -> Call[bool]:
    ids = list(oids)
    return _call(
        lambda i, e: p.Release(id=i, engine_id=e, request_id=request_id, oids=ids, epoch=epoch),
        p.ReleaseReply, _valid,
    )  # fmt: skip


def register_kv_cache(layers: Sequence[p.TensorHandle]) -> Call[int]:
    handles = list(layers)
    return _call(lambda i, e: p.RegisterKVCache(id=i, engine_id=e, layers=handles), p.CountReply, _count)


def load_blocks(
    request_id: str, first_chunk: int, num_chunks: int, block_ids: Sequence[int], skip_blocks: int
) -> Call[bool]:
    ids = list(block_ids)
    return _call(
        lambda i, e: p.LoadBlocks(
            id=i, engine_id=e, request_id=request_id, first_chunk=first_chunk, num_chunks=num_chunks,
            block_ids=ids, skip_blocks=skip_blocks,
        ),
        p.ReleaseReply, _valid,
    )  # fmt: skip


def _lora(lora_name: str) -> str:
    if len(lora_name) > p.MAX_LORA_NAME_LEN:
        raise ValueError(f"lora_name has {len(lora_name)} characters, at most {p.MAX_LORA_NAME_LEN} allowed")
    return lora_name


def save_blocks(
    tokens: Tokens, request_id: str, block_ids: Sequence[int], cache_salt: str, first_chunk: int, *,
    extra_keys: Sequence[bytes] = (), prompt_tokens: int = 0, lora_name: str = "",
) -> Call[p.SaveReply]:  # fmt: skip
    lora = _lora(lora_name)
    data = p.encode_tokens(tokens)
    ids = list(block_ids)
    extras = list(extra_keys)
    return _call(
        lambda i, e: p.SaveBlocks(
            id=i, engine_id=e, request_id=request_id, tokens=data, cache_salt=cache_salt,
            first_chunk=first_chunk, block_ids=ids, extra_keys=extras, prompt_tokens=prompt_tokens,
            lora_name=lora,
        ),
        p.SaveReply, _same,
    )  # fmt: skip


def reserve(
    tokens: Tokens, request_id: str, cache_salt: str, first_chunk: int, *, extra_keys: Sequence[bytes] = (),
    prompt_tokens: int = 0, lora_name: str = "",
) -> Call[p.StoreReply]:
    lora = _lora(lora_name)
    data = p.encode_tokens(tokens)
    extras = list(extra_keys)
    return _call(
        lambda i, e: p.Store(id=i, engine_id=e, request_id=request_id, tokens=data,
                             cache_salt=cache_salt, first_chunk=first_chunk, extra_keys=extras,
                             prompt_tokens=prompt_tokens, lora_name=lora),
        p.StoreReply, _same,
    )  # fmt: skip


def commit(oids: Sequence[int]) -> Call[list[bool]]:
    ids = list(oids)
    return _call(lambda i, e: p.Commit(id=i, engine_id=e, oids=ids), p.CommitReply, lambda r: r.ok)


def abort(oids: Sequence[int]) -> Call[int]:
    ids = list(oids)
    return _call(lambda i, e: p.Abort(id=i, engine_id=e, oids=ids), p.CountReply, _count)


def free_lookup_locks(request_id: str) -> Call[int]:
    return _call(
        lambda i, e: p.FreeLookupLocks(id=i, engine_id=e, request_id=request_id), p.CountReply, _count
    )


def end_request(request_id: str) -> Call[int]:
    return _call(lambda i, e: p.EndRequest(id=i, engine_id=e, request_id=request_id), p.CountReply, _count)


def clear(cache_salt: str | None) -> Call[int]:
    return _call(lambda i, _: p.Clear(id=i, cache_salt=cache_salt), p.CountReply, _count)
