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

from kvdepot_connector import protocol as p
from kvdepot_connector.errors import SidecarUnavailable
from kvdepot_connector.protocol import encode_tokens
from kvdepot_connector.session import ClientBase, R, StoreOutcome
from kvdepot_connector.session import check_reply as _check


class AsyncKVDepotClient(ClientBase):
    """asyncio client: many requests in flight on one socket, matched by id; copies in a thread."""

    def _open_transport(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._pending: dict[int, asyncio.Future[p.Reply]] = {}
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

    async def _handshake(self) -> None:
        async with self._handshake_lock:
            s = self._session
            hello = _check(
                await self._raw_call(self._hello()),
                p.HelloReply,
            )
            s.accept_hello(hello, self._map_arena)
            reg = _check(await self._raw_call(s.register_msg(next(self._ids))), p.RegisterReply)
            s.engine_id = reg.engine_id
            s.chunk_bytes = reg.chunk_bytes

    async def _call(self, build: Any, expected: type[R]) -> R:
        if self._session.engine_id == 0:
            await self._handshake()
        reply = await self._raw_call(build(next(self._ids), self._session.engine_id))
        if isinstance(reply, p.ErrorReply) and reply.code == p.ErrorCode.NOT_REGISTERED:
            await self._handshake()
            reply = await self._raw_call(build(next(self._ids), self._session.engine_id))
        return _check(reply, expected)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._session.arena is not None:
            self._session.arena.close()
            self._session.arena = None
        self._ctx.term()

    async def ping(self) -> float:
        return _check(await self._raw_call(p.Ping(id=next(self._ids))), p.Pong).server_time

    async def lookup(
        self, tokens: Sequence[int] | bytes, *, request_id: str, cache_salt: str = "", wait: bool = False
    ) -> p.LookupReply:
        """Hit length from the start of `tokens`; the hits are read-locked for `request_id`.

        Chunks missing in L1 are fetched from L2 meanwhile: with `wait` the reply comes once they
        are in (or the sidecar's prefetch deadline passed); without it `pending_chunks` says how
        many are still coming and `query_prefetch` polls.
        """
        data = encode_tokens(tokens)
        return await self._call(
            lambda i, e: p.Lookup(
                id=i, engine_id=e, request_id=request_id, tokens=data, cache_salt=cache_salt, wait=wait
            ),
            p.LookupReply,
        )

    async def query_prefetch(self, request_id: str) -> p.LookupReply:
        return await self._call(
            lambda i, e: p.QueryPrefetch(id=i, engine_id=e, request_id=request_id), p.LookupReply
        )

    async def retrieve(self, request_id: str, outs: Sequence[torch.Tensor], *, first_chunk: int = 0) -> bool:
        reply = await self._call(
            lambda i, e: p.Retrieve(
                id=i, engine_id=e, request_id=request_id, first_chunk=first_chunk, num_chunks=len(outs)
            ),
            p.RetrieveReply,
        )
        try:
            await asyncio.to_thread(self._session.copy_out, reply, outs)
        finally:
            valid = await self.release(request_id)
        return valid

    async def release(self, request_id: str) -> bool:
        reply = await self._call(
            lambda i, e: p.Release(id=i, engine_id=e, request_id=request_id), p.ReleaseReply
        )
        return reply.valid

    async def store(
        self,
        tokens: Sequence[int] | bytes,
        chunks: Sequence[torch.Tensor],
        *,
        request_id: str,
        cache_salt: str = "",
        first_chunk: int = 0,
    ) -> StoreOutcome:
        data = encode_tokens(tokens)
        reply = await self._call(
            lambda i, e: p.Store(
                id=i,
                engine_id=e,
                request_id=request_id,
                tokens=data,
                cache_salt=cache_salt,
                first_chunk=first_chunk,
            ),
            p.StoreReply,
        )
        try:
            oids = await asyncio.to_thread(self._session.copy_in, reply, chunks, first_chunk)
        except BaseException:
            reserved = [s.oid for s in reply.slots if s.status is p.SlotStatus.RESERVED]
            await self._call(lambda i, e: p.Abort(id=i, engine_id=e, oids=reserved), p.CountReply)
            raise
        committed: list[bool] = []
        if oids:
            committed = (
                await self._call(lambda i, e: p.Commit(id=i, engine_id=e, oids=oids), p.CommitReply)
            ).ok
        return self._session.outcome(reply, committed)

    async def free_lookup_locks(self, request_id: str) -> int:
        reply = await self._call(
            lambda i, e: p.FreeLookupLocks(id=i, engine_id=e, request_id=request_id), p.CountReply
        )
        return reply.count

    async def end_request(self, request_id: str) -> int:
        reply = await self._call(
            lambda i, e: p.EndRequest(id=i, engine_id=e, request_id=request_id), p.CountReply
        )
        return reply.count

    async def clear(self, cache_salt: str | None = None) -> int:
        return (await self._call(lambda i, e: p.Clear(id=i, cache_salt=cache_salt), p.CountReply)).count
