"""`AsyncKVDepotClient`: the asyncio data-plane client, many requests in flight on one socket,
matched by id; copies between tensors and the arena run in a thread. Same operations as
`client.KVDepotClient`."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch
import zmq
import zmq.asyncio

from kvdepot_connector import calls
from kvdepot_connector import protocol as p
from kvdepot_connector.base import ClientBase
from kvdepot_connector.calls import Call, T, Tokens
from kvdepot_connector.errors import SidecarUnavailable
from kvdepot_connector.outcomes import Locked, Posted, StoreOutcome


class AsyncKVDepotClient(ClientBase):
    """asyncio client: many requests in flight on one socket, matched by id; copies in a thread."""

    def _open_transport(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._pending: dict[int, asyncio.Future[p.Reply]] = {}
        #: requests sent without waiting for their reply (a RELEASE whose fences held, a COMMIT)
        self.posted = Posted()
        self._reader: asyncio.Task[None] | None = None
        self._handshake_lock = asyncio.Lock()

    async def connect(self) -> AsyncKVDepotClient:
        await self._handshake()
        return self

    def _socket(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.url)
            self._sock = sock
            self._reader = asyncio.get_running_loop().create_task(self._read(sock))
        return self._sock

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frame = await sock.recv()
            reply = p.reply_decoder.decode(frame)
            op = self.posted.pop(reply.id)
            if op is not None:
                self._posted_reply(op, reply)
                continue
            fut = self._pending.pop(reply.id, None)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    async def _raw_call(self, msg: p.Request) -> p.Reply:
        sock = self._socket()
        fut: asyncio.Future[p.Reply] = asyncio.get_running_loop().create_future()
        self._pending[msg.id] = fut
        try:
            await sock.send(p.encode(msg))
            return await asyncio.wait_for(fut, self.timeout_s)
        except TimeoutError:
            raise SidecarUnavailable(f"no reply from {self.url} within {self.timeout_s} s") from None
        finally:
            self._pending.pop(msg.id, None)

    async def _handshake(self, steps: list[Call[None]] | None = None) -> None:
        async with self._handshake_lock:
            for step in self._session.handshake() if steps is None else steps:
                await self._call(step)

    async def _call(self, call: Call[T]) -> T:
        """As `KVDepotClient._call`, without blocking the loop."""
        s = self._session
        if call.registered and s.engine_id == 0:
            await self._handshake()
        reply = await self._raw_call(s.message(call))
        recovery = s.recovery(call, reply)
        if recovery:
            await self._handshake(recovery)
            reply = await self._raw_call(s.message(call))
        return call.read(reply)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._sock is not None:
            self._sock.close(linger=0)
        self._session.close()
        self._ctx.term()

    async def ping(self) -> float:
        return await self._call(calls.ping())

    async def lookup(
        self, tokens: Tokens, *, request_id: str, cache_salt: str = "", wait: bool = False,
        extra_keys: Sequence[bytes] = (), uncacheable: p.Uncacheable | None = None, traceparent: str = "",
        extents: bool = False,
    ) -> p.LookupReply:  # fmt: skip
        """As `KVDepotClient.lookup`."""
        return await self._call(calls.lookup(
            tokens, request_id, cache_salt, wait, extra_keys=extra_keys, uncacheable=uncacheable,
            traceparent=traceparent, extents=extents,
        ))

    def locked_from(self, reply: p.LookupReply, *, first_chunk: int, num_chunks: int) -> Locked:
        """As `KVDepotClient.locked_from` (no round trip)."""
        return self._session.locked(reply, first_chunk, num_chunks)

    async def query_prefetch(self, request_id: str, *, extents: bool = False) -> p.LookupReply:
        """As `KVDepotClient.query_prefetch`."""
        return await self._call(calls.query_prefetch(request_id, extents))

    async def retrieve(self, request_id: str, outs: Sequence[torch.Tensor], *, first_chunk: int = 0) -> bool:
        """As `KVDepotClient.retrieve`; the copies run in a thread."""
        reply = await self._call(calls.retrieve(request_id, first_chunk, len(outs)))
        oids = self._session.oids(reply)
        try:
            await asyncio.to_thread(self._session.copy_out, reply, outs)
        except BaseException:
            await self.release(request_id, oids, epoch=reply.epoch)
            raise
        return await self.release(request_id, oids, fences=reply.fences, epoch=reply.epoch)

    async def release(
        self, request_id: str, oids: Sequence[int] = (), *, fences: Sequence[p.Fence] = (), epoch: int = 0
    ) -> bool:
        """As `KVDepotClient.release`."""
        if fences and self._session.unmoved(fences):
            await self._post(calls.release(request_id, oids, epoch), "RELEASE")
            self.released_unasked += 1
            return True
        return await self._call(calls.release(request_id, oids, epoch))

    async def _post(self, call: Call[Any], op: str) -> None:
        """Send `call` without waiting for its reply (the handshake first where the call needs the
        engine id); an error reply is counted and logged."""
        if call.registered and self._session.engine_id == 0:
            await self._handshake()
        sock = self._socket()
        msg = self._session.message(call)
        self.posted.add(msg.id, op)
        await sock.send(p.encode(msg))

    async def store(
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
        """As `KVDepotClient.store`; the copies run in a thread."""
        s = self._session
        reply = await self._call(
            calls.reserve(
                tokens, request_id, cache_salt, first_chunk, extra_keys=extra_keys, lora_name=lora_name
            )
        )
        try:
            oids = await asyncio.to_thread(s.copy_in, reply, chunks, first_chunk)
        except BaseException:
            await self._call(calls.abort(s.reserved(reply)))
            raise
        committed: list[bool] = []
        if oids and wait:
            committed = await self._call(calls.commit(oids))
        elif oids:
            await self._post(calls.commit(oids), "COMMIT")
            self.commits_posted += len(oids)
            committed = [True] * len(oids)
        if oids:
            s.map_ahead()  # a non-blocking read of the lifeline; the mapping runs in its thread
        return s.outcome(reply, committed)

    async def free_lookup_locks(self, request_id: str) -> int:
        return await self._call(calls.free_lookup_locks(request_id))

    async def end_request(self, request_id: str) -> int:
        return await self._call(calls.end_request(request_id))

    async def clear(self, cache_salt: str | None = None) -> int:
        return await self._call(calls.clear(cache_salt))
