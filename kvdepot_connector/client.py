"""Clients of the kvdepot data plane: `KVDepotClient` (blocking, here) and `AsyncKVDepotClient`
(asyncio, in `aio`, importable from here too).

Both connect a ZMQ DEALER to the sidecar, say HELLO (protocol version, chunk size, arena name),
map the shared-memory arena, REGISTER the engine's identity, and then offer:

  lookup(tokens, request_id, cache_salt)      -> LookupReply (hits read-locked for request_id)
  retrieve(request_id, outs, first_chunk)     -> True when `outs` hold the cached bytes
  store(tokens, chunks, request_id, ...)      -> StoreOutcome (reserve, copy, commit)
  free_lookup_locks / end_request / clear / ping

KV bytes never travel through the socket: the client copies between its tensors and the arena
itself, at the offsets the sidecar hands out. A sidecar that does not answer within `timeout_s`
raises `SidecarUnavailable`; a sidecar that restarted (its engine ids are random per process, so
an old id is unknown to it) is re-handshaken transparently on the next call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import zmq

from kvdepot_connector import protocol as p
from kvdepot_connector.aio import AsyncKVDepotClient
from kvdepot_connector.errors import SidecarUnavailable
from kvdepot_connector.protocol import encode_tokens
from kvdepot_connector.session import ClientBase, R, StoreOutcome
from kvdepot_connector.session import check_reply as _check

__all__ = ["AsyncKVDepotClient", "KVDepotClient", "StoreOutcome", "encode_tokens"]


class KVDepotClient(ClientBase):
    """Blocking client. Thread-safe: one request at a time per client."""

    def _open_transport(self) -> None:
        self.timeout_ms = int(self.timeout_s * 1000)
        self._ctx = zmq.Context()
        self._sock: zmq.Socket[bytes] | None = None
        self._lock = threading.RLock()

    # --- connection ----------------------------------------------------------------------------

    def connect(self) -> KVDepotClient:
        with self._lock:
            self._handshake()
        return self

    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.url)
            self._sock = sock
        return self._sock

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _raw_call(self, msg: p.Request) -> p.Reply:
        sock = self._socket()
        sock.send(p.encode(msg), copy=False)
        deadline = time.monotonic() + self.timeout_ms / 1000
        while True:
            remaining = int((deadline - time.monotonic()) * 1000)
            if remaining <= 0 or not sock.poll(remaining, zmq.POLLIN):
                # Replies to this request may still arrive: a fresh socket never sees them.
                self._drop_socket()
                raise SidecarUnavailable(f"no reply from {self.url} within {self.timeout_ms} ms")
            reply = p.reply_decoder.decode(sock.recv())
            if reply.id == msg.id:
                return reply
            # A late reply to an earlier request that timed out: skip it.

    def _handshake(self) -> None:
        s = self._session
        hello = _check(
            self._raw_call(self._hello()),
            p.HelloReply,
        )
        s.accept_hello(hello, self._map_arena)
        reg = _check(self._raw_call(s.register_msg(next(self._ids))), p.RegisterReply)
        s.engine_id = reg.engine_id
        s.chunk_bytes = reg.chunk_bytes

    def _call(self, build: Any, expected: type[R]) -> R:
        """Send `build(id, engine_id)`; re-handshake once if the sidecar no longer knows us."""
        with self._lock:
            if self._session.engine_id == 0:
                self._handshake()
            reply = self._raw_call(build(next(self._ids), self._session.engine_id))
            if isinstance(reply, p.ErrorReply) and reply.code == p.ErrorCode.NOT_REGISTERED:
                self._handshake()
                reply = self._raw_call(build(next(self._ids), self._session.engine_id))
            return _check(reply, expected)

    def close(self) -> None:
        with self._lock:
            self._drop_socket()
            if self._session.arena is not None:
                self._session.arena.close()
                self._session.arena = None
            self._ctx.term()

    def __enter__(self) -> KVDepotClient:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- operations ----------------------------------------------------------------------------

    def ping(self) -> float:
        with self._lock:
            return _check(self._raw_call(p.Ping(id=next(self._ids))), p.Pong).server_time

    def lookup(
        self, tokens: Sequence[int] | bytes, *, request_id: str, cache_salt: str = "", wait: bool = False
    ) -> p.LookupReply:
        """Hit length from the start of `tokens`; the hits are read-locked for `request_id`.

        Chunks missing in L1 are fetched from L2 meanwhile: with `wait` the reply comes once they
        are in (or the sidecar's prefetch deadline passed); without it `pending_chunks` says how
        many are still coming and `query_prefetch` polls.
        """
        data = encode_tokens(tokens)
        return self._call(
            lambda i, e: p.Lookup(
                id=i, engine_id=e, request_id=request_id, tokens=data, cache_salt=cache_salt, wait=wait
            ),
            p.LookupReply,
        )

    def query_prefetch(self, request_id: str) -> p.LookupReply:
        return self._call(
            lambda i, e: p.QueryPrefetch(id=i, engine_id=e, request_id=request_id), p.LookupReply
        )

    def retrieve(self, request_id: str, outs: Sequence[torch.Tensor], *, first_chunk: int = 0) -> bool:
        """Copy the request's locked chunks `first_chunk..` into `outs`, then release the locks.

        False when the locks' lease expired (the bytes may have been overwritten): discard `outs`.
        """
        with self._lock:
            reply = self._call(
                lambda i, e: p.Retrieve(
                    id=i, engine_id=e, request_id=request_id, first_chunk=first_chunk, num_chunks=len(outs)
                ),
                p.RetrieveReply,
            )
            try:
                self._session.copy_out(reply, outs)
            finally:
                valid = self.release(request_id)
            return valid

    def release(self, request_id: str) -> bool:
        return self._call(
            lambda i, e: p.Release(id=i, engine_id=e, request_id=request_id), p.ReleaseReply
        ).valid

    def locked_views(self, request_id: str, *, first_chunk: int, num_chunks: int) -> list[torch.Tensor]:
        """Arena views (uint8) of the request's locked chunks `first_chunk..`, for callers that copy
        themselves (e.g. scattering into paged KV blocks). Call `release` afterwards: its answer
        says whether the copies are valid."""
        reply = self._call(
            lambda i, e: p.Retrieve(
                id=i, engine_id=e, request_id=request_id, first_chunk=first_chunk, num_chunks=num_chunks
            ),
            p.RetrieveReply,
        )
        return [self._session.region(ext.offset, ext.size) for ext in reply.extents]

    def register_kv_cache(self, layers: Sequence[p.TensorHandle]) -> int:
        """Share the engine's KV planes with the sidecar (it then copies itself)."""
        handles = list(layers)
        return self._call(
            lambda i, e: p.RegisterKVCache(id=i, engine_id=e, layers=handles), p.CountReply
        ).count

    def load_blocks(
        self,
        request_id: str,
        *,
        first_chunk: int,
        num_chunks: int,
        block_ids: Sequence[int],
        skip_blocks: int = 0,
    ) -> bool:
        """The sidecar copies the request's locked chunks into `block_ids` and releases the locks.
        True when the blocks hold the cached bytes."""
        ids = list(block_ids)
        return self._call(
            lambda i, e: p.LoadBlocks(
                id=i, engine_id=e, request_id=request_id, first_chunk=first_chunk, num_chunks=num_chunks,
                block_ids=ids, skip_blocks=skip_blocks,
            ),
            p.ReleaseReply,
        ).valid  # fmt: skip

    def save_blocks(
        self,
        tokens: Sequence[int] | bytes,
        *,
        request_id: str,
        block_ids: Sequence[int],
        cache_salt: str = "",
        first_chunk: int = 0,
    ) -> p.SaveReply:
        """The sidecar stores the full chunks `first_chunk..` of `tokens` from `block_ids`."""
        data = encode_tokens(tokens)
        ids = list(block_ids)
        return self._call(
            lambda i, e: p.SaveBlocks(
                id=i, engine_id=e, request_id=request_id, tokens=data, cache_salt=cache_salt,
                first_chunk=first_chunk, block_ids=ids,
            ),
            p.SaveReply,
        )  # fmt: skip

    def slot_view(self, slot: p.Slot) -> torch.Tensor:
        """The arena view (uint8) of a reserved slot, for callers that fill it themselves."""
        return self._session.region(slot.offset, slot.size)

    def reserve(
        self, tokens: Sequence[int] | bytes, *, request_id: str, cache_salt: str = "", first_chunk: int = 0
    ) -> p.StoreReply:
        """Phase one of a store: slots for the full chunks `first_chunk..` of `tokens`."""
        data = encode_tokens(tokens)
        return self._call(
            lambda i, e: p.Store(id=i, engine_id=e, request_id=request_id, tokens=data,
                                 cache_salt=cache_salt, first_chunk=first_chunk),
            p.StoreReply,
        )  # fmt: skip

    def commit(self, oids: Sequence[int]) -> list[bool]:
        """Phase two: make the filled slots visible. Per oid: False = its lease expired, not stored."""
        if not oids:
            return []
        return self._call(lambda i, e: p.Commit(id=i, engine_id=e, oids=list(oids)), p.CommitReply).ok

    def abort(self, oids: Sequence[int]) -> int:
        """Give reserved slots back unfilled."""
        return self._call(lambda i, e: p.Abort(id=i, engine_id=e, oids=list(oids)), p.CountReply).count

    def store(
        self,
        tokens: Sequence[int] | bytes,
        chunks: Sequence[torch.Tensor],
        *,
        request_id: str,
        cache_salt: str = "",
        first_chunk: int = 0,
    ) -> StoreOutcome:
        """Store `chunks` as the full chunks `first_chunk..` of `tokens`: reserve, copy, commit."""
        with self._lock:
            reply = self.reserve(
                tokens, request_id=request_id, cache_salt=cache_salt, first_chunk=first_chunk
            )
            try:
                oids = self._session.copy_in(reply, chunks, first_chunk)
            except BaseException:
                self.abort([s.oid for s in reply.slots if s.status is p.SlotStatus.RESERVED])
                raise
            return self._session.outcome(reply, self.commit(oids))

    def free_lookup_locks(self, request_id: str) -> int:
        return self._call(
            lambda i, e: p.FreeLookupLocks(id=i, engine_id=e, request_id=request_id), p.CountReply
        ).count

    def end_request(self, request_id: str) -> int:
        return self._call(
            lambda i, e: p.EndRequest(id=i, engine_id=e, request_id=request_id), p.CountReply
        ).count

    def clear(self, cache_salt: str | None = None) -> int:
        return self._call(lambda i, e: p.Clear(id=i, cache_salt=cache_salt), p.CountReply).count
