"""Clients of the kvdepot data plane: `KVDepotClient` (blocking, here) and `AsyncKVDepotClient`
(asyncio, in `aio`, importable from here too).

Both connect a ZMQ DEALER to the sidecar, say HELLO (protocol version, chunk size, arena name),
connect the lifeline the reply names (the arena's sealed memfd comes over it) and map the arena
from that descriptor, REGISTER the engine's identity, and then offer:

  lookup(tokens, request_id, cache_salt)      -> LookupReply (hits read-locked for request_id)
  retrieve(request_id, outs, first_chunk)     -> True when `outs` hold the cached bytes
  store(tokens, chunks, request_id, ...)      -> StoreOutcome (reserve, copy, commit)
  free_lookup_locks / end_request / clear / ping

KV bytes never travel through the socket: the client copies between its tensors and the arena
itself, at the offsets the sidecar hands out. A sidecar that does not answer within `timeout_s`
raises `SidecarUnavailable`; a sidecar that restarted (its engine ids are random per process, so
an old id is unknown to it) is re-handshaken transparently on the next call.

Every client acts for an engine instance (`instance`, a hex nonce): the sidecar lets only clients
of the same instance touch the requests and reservations it made. The processes of one engine
give the same nonce; a client given none has a random one of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import zmq

from kvdepot_connector import calls
from kvdepot_connector import protocol as p
from kvdepot_connector.aio import AsyncKVDepotClient
from kvdepot_connector.base import ClientBase
from kvdepot_connector.calls import Call, T, Tokens
from kvdepot_connector.errors import SidecarUnavailable
from kvdepot_connector.outcomes import Locked, Posted, StoreOutcome
from kvdepot_connector.protocol import encode_tokens

__all__ = ["AsyncKVDepotClient", "KVDepotClient", "Locked", "StoreOutcome", "encode_tokens"]

#: a first RegisterKVCache waits for the sidecar to set up its copy engine
REGISTER_KV_CACHE_TIMEOUT_S = 30.0


class KVDepotClient(ClientBase):
    """Blocking client. Thread-safe: one request at a time per client."""

    def _open_transport(self) -> None:
        self.timeout_ms = int(self.timeout_s * 1000)
        self._ctx = zmq.Context()
        self._sock: zmq.Socket[bytes] | None = None
        self._lock = threading.RLock()
        #: requests sent without waiting for their reply (a RELEASE whose fences held, a COMMIT)
        self.posted = Posted()

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
            self._session.engine_id = 0  # a new connection says HELLO (and registers) first

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
            # A reply to a request sent without waiting, or a late one to a request that timed out.
            self._late(reply)

    def _late(self, reply: p.Reply) -> None:
        """A reply nobody waits for: an error answering a request sent without waiting is counted
        and logged (its locks expire with their lease), anything else is skipped."""
        op = self.posted.pop(reply.id)
        if op is not None:
            self._posted_reply(op, reply)

    def _post(self, call: Call[Any], op: str) -> None:
        """Send `call` without waiting for its reply (read, and skipped, by a later call); the
        handshake first where the call needs the engine id, as `_call` does."""
        if call.registered and self._session.engine_id == 0:
            self._handshake()
        msg = self._session.message(call)
        self._socket().send(p.encode(msg), copy=False)
        self.posted.add(msg.id, op)

    def _handshake(self) -> None:
        for step in self._session.handshake():
            self._call(step)

    def _call(self, call: Call[T]) -> T:
        """Send `call`'s message and read the reply; handshake first where the call needs the
        engine id, and once more (or register again) if the sidecar no longer knows it."""
        s = self._session
        with self._lock:
            if call.registered and s.engine_id == 0:
                self._handshake()
            reply = self._raw_call(s.message(call))
            recovery = s.recovery(call, reply)
            if recovery:
                for step in recovery:
                    self._call(step)
                reply = self._raw_call(s.message(call))
            return call.read(reply)

    def join_instance(self, instance: str) -> None:
        """Act for engine instance `instance` from the next call on (a vLLM worker joining its
        scheduler's nonce, which reaches it in the step metadata): the connection says HELLO again
        with it, connects a new lifeline and registers; the arena stays mapped. What this client
        held under its former instance goes with that instance (share regions after joining)."""
        with self._lock:
            if instance == self.instance:
                return
            self.instance = self._session.instance = instance
            self._session.engine_id = 0  # the next call that needs the engine id says HELLO first

    def close(self) -> None:
        with self._lock:
            self._drop_socket()
            self._session.close()
            self._ctx.term()

    def __enter__(self) -> KVDepotClient:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- operations ----------------------------------------------------------------------------

    def ping(self) -> float:
        return self._call(calls.ping())

    def lookup(
        self, tokens: Tokens, *, request_id: str, cache_salt: str = "", wait: bool = False,
        extra_keys: Sequence[bytes] = (), uncacheable: p.Uncacheable | None = None, traceparent: str = "",
        extents: bool = False,
    ) -> p.LookupReply:  # fmt: skip
        """Hit length from the start of `tokens`; the hits are read-locked for `request_id`.

        Chunks missing in L1 are fetched from L2 meanwhile: with `wait` the reply comes once they
        are in (or the sidecar's prefetch deadline passed); without it `pending_chunks` says how
        many are still coming and `query_prefetch` polls. `extra_keys`: per chunk (protocol); with
        `uncacheable` the sidecar counts the reason and answers a miss; `traceparent`: the engine
        request's W3C trace context (the sidecar's spans of the request join its trace); with
        `extents` the reply also names the hits as a RETRIEVE would, when none is still pending
        (`locked_from` makes them views, with no round trip; this client or another of the same
        engine instance, e.g. the scheduler's lookup for a worker's copy).
        """
        return self._call(calls.lookup(
            tokens, request_id, cache_salt, wait, extra_keys=extra_keys, uncacheable=uncacheable,
            traceparent=traceparent, extents=extents,
        ))

    def query_prefetch(self, request_id: str, *, extents: bool = False) -> p.LookupReply:
        """Where the request's lookup stands (chunks locked, chunks still coming from L2); with
        `extents`, once none is still coming, the locked chunks named as `lookup` names them."""
        return self._call(calls.query_prefetch(request_id, extents))

    def retrieve(self, request_id: str, outs: Sequence[torch.Tensor], *, first_chunk: int = 0) -> bool:
        """Copy the request's locked chunks `first_chunk..` into `outs`, then release the locks.

        False when the bytes may have changed under the copy (a lease expired, the objects were
        reclaimed): discard `outs`.
        """
        with self._lock:
            reply = self._call(calls.retrieve(request_id, first_chunk, len(outs)))
            oids = self._session.oids(reply)
            try:
                self._session.copy_out(reply, outs)
            except BaseException:
                self.release(request_id, oids, epoch=reply.epoch)
                raise
            return self.release(request_id, oids, fences=reply.fences, epoch=reply.epoch)

    def release(
        self, request_id: str, oids: Sequence[int] = (), *, fences: Sequence[p.Fence] = (), epoch: int = 0
    ) -> bool:
        """Drop the request's locks. True only when copies from the objects `oids` (or, without
        oids, from the request's locks) are valid. With the `fences` their RETRIEVE named, called
        after the copies: when no fence moved, True without waiting for the sidecar's answer. With
        the RETRIEVE's `epoch`, only the locks of that LOOKUP go (not a newer one's)."""
        with self._lock:
            if fences and self._session.unmoved(fences):
                self._post(calls.release(request_id, oids, epoch), "RELEASE")
                self.released_unasked += 1
                return True
            return self._call(calls.release(request_id, oids, epoch))

    def locked(self, request_id: str, *, first_chunk: int, num_chunks: int) -> Locked:
        """Arena views (uint8) of the request's locked chunks `first_chunk..` and their object
        ids, for callers that copy themselves (e.g. scattering into paged KV blocks). Call
        `release(request_id, locked.oids)` afterwards: its answer says whether the copies are valid."""
        reply = self._call(calls.retrieve(request_id, first_chunk, num_chunks))
        return self._session.locked(reply)

    def locked_from(self, reply: p.LookupReply, *, first_chunk: int, num_chunks: int) -> Locked:
        """As `locked`, from a LOOKUP's reply that named its extents (`lookup(..., extents=True)`):
        no round trip. ValueError when the reply names no such chunks or another arena than this
        client maps (the sidecar restarted since): `locked` then asks instead."""
        return self._session.locked(reply, first_chunk, num_chunks)

    def register_kv_cache(
        self, layers: Sequence[p.TensorHandle], *, timeout_s: float = REGISTER_KV_CACHE_TIMEOUT_S
    ) -> int:
        """Share the engine's KV planes with the sidecar (it then copies itself). Once per engine
        (and sidecar) start, so it may take longer than other calls: a sidecar that has not copied
        for an engine before sets its copy engine up first (torch, CUDA streams: seconds)."""
        with self._lock:
            usual = self.timeout_ms
            self.timeout_ms = max(usual, int(timeout_s * 1000))
            try:
                return self._call(calls.register_kv_cache(layers))
            finally:
                self.timeout_ms = usual

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
        return self._call(calls.load_blocks(request_id, first_chunk, num_chunks, block_ids, skip_blocks))

    def save_blocks(
        self,
        tokens: Tokens,
        *,
        request_id: str,
        block_ids: Sequence[int],
        cache_salt: str = "",
        first_chunk: int = 0,
        extra_keys: Sequence[bytes] = (),
        prompt_tokens: int = 0,
        lora_name: str = "",
    ) -> p.SaveReply:
        """The sidecar stores the full chunks `first_chunk..` of `tokens` from `block_ids`.
        `prompt_tokens`: the prompt's length (chunks past it hold generated tokens; 0: all prompt);
        `lora_name`: the LoRA adapter the KV was computed with (for the sidecar's events)."""
        return self._call(
            calls.save_blocks(
                tokens, request_id, block_ids, cache_salt, first_chunk, extra_keys=extra_keys,
                prompt_tokens=prompt_tokens, lora_name=lora_name,
            )
        )

    def slot_view(self, slot: p.Slot) -> torch.Tensor:
        """The arena view (uint8) of a reserved slot, for callers that fill it themselves (its
        segment is mapped writable first: the grant the sidecar sent is read)."""
        return self._session.writable_region(slot.offset, slot.size)

    def reserve(
        self, tokens: Tokens, *, request_id: str, cache_salt: str = "", first_chunk: int = 0,
        extra_keys: Sequence[bytes] = (),
        prompt_tokens: int = 0, lora_name: str = "",
    ) -> p.StoreReply:  # fmt: skip
        """Phase one of a store: slots for the full chunks `first_chunk..` of `tokens`.
        `prompt_tokens`: the prompt's length (chunks past it hold generated tokens; 0: all prompt);
        `lora_name`: the LoRA adapter the KV was computed with (for the sidecar's events)."""
        return self._call(
            calls.reserve(
                tokens, request_id, cache_salt, first_chunk, extra_keys=extra_keys,
                prompt_tokens=prompt_tokens, lora_name=lora_name,
            )
        )

    def commit(self, oids: Sequence[int], *, wait: bool = True) -> list[bool]:
        """Phase two: make the filled slots visible. Per oid: False = its lease expired, not stored.
        `wait=False`: sent without waiting for the answer (all True is returned); chunks the sidecar
        refused are counted in `commits_refused` when the reply is read, at the latest by this
        client's next call, before that call returns. Until the sidecar has handled it, a LOOKUP
        from another connection may miss those chunks (a miss, never wrong bytes: the sidecar checks
        the commit as it would have)."""
        if not oids:
            return []
        with self._lock:
            if wait:
                committed = self._call(calls.commit(oids))
            else:
                self._post(calls.commit(oids), "COMMIT")
                self.commits_posted += len(oids)
                committed = [True] * len(oids)
            self._session.map_ahead()
        return committed

    def abort(self, oids: Sequence[int]) -> int:
        """Give reserved slots back unfilled."""
        return self._call(calls.abort(oids))

    def store(
        self,
        tokens: Tokens,
        chunks: Sequence[torch.Tensor],
        *,
        request_id: str,
        cache_salt: str = "",
        first_chunk: int = 0,
        extra_keys: Sequence[bytes] = (),
        lora_name: str = "",
        wait: bool = True,
    ) -> StoreOutcome:
        """Store `chunks` as the full chunks `first_chunk..` of `tokens`: reserve, copy, commit
        (`wait=False`: the commit is sent without waiting, as `commit` says; the outcome then
        counts every reserved chunk as stored)."""
        s = self._session
        with self._lock:
            reply = self.reserve(
                tokens, request_id=request_id, cache_salt=cache_salt, first_chunk=first_chunk,
                extra_keys=extra_keys, lora_name=lora_name,
            )  # fmt: skip
            try:
                oids = s.copy_in(reply, chunks, first_chunk)
            except BaseException:
                self.abort(s.reserved(reply))
                raise
            return s.outcome(reply, self.commit(oids, wait=wait))

    def free_lookup_locks(self, request_id: str) -> int:
        return self._call(calls.free_lookup_locks(request_id))

    def end_request(self, request_id: str) -> int:
        return self._call(calls.end_request(request_id))

    def clear(self, cache_salt: str | None = None) -> int:
        return self._call(calls.clear(cache_salt))
