"""The sidecar's own KV copies made when the first engine shares its KV cache (`make_transfers`):
once for all concurrent REGISTER_KV_CACHE calls, never for calls that come before any, again after
a failure."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import pytest

from api.dataplane.server import DataPlaneServer
from kvdepot_connector import protocol as p
from tests.factories import engine
from tests.unit.api.test_dataplane import CHUNK, INSTANCE, call, register

HANDLE = p.TensorHandle(kind="cpu-memfd", shape=[4, 64], stride=[64, 1], dtype="uint8", name="r")


class Transfers:
    """Stands in for engine/transfers.py: counts registrations, loads succeed."""

    def __init__(self) -> None:
        self.registered: list[int] = []
        self.dropped: list[int] = []

    def register(self, engine_id: int, handles: list[dict[str, Any]]) -> int:
        self.registered.append(engine_id)
        return len(handles)

    def drop(self, engine_id: int) -> None:
        self.dropped.append(engine_id)

    async def load(self, engine_id: int, request_id: str, **_: Any) -> bool:
        return True


class Maker:
    """The factory: waits for `gate`, fails while `failures` is positive, counts its calls."""

    def __init__(self, failures: int = 0) -> None:
        self.gate = asyncio.Event()
        self.calls = 0
        self.failures = failures
        self.made = Transfers()

    async def __call__(self) -> Any:
        self.calls += 1
        await self.gate.wait()
        if self.failures:
            self.failures -= 1
            raise ImportError("no module named 'torch'")
        return self.made


async def answer(pending: bytes | Awaitable[bytes]) -> p.Reply:
    assert isinstance(pending, Awaitable), "expected a deferred reply"
    return p.reply_decoder.decode(await pending)


def kv_register(server: DataPlaneServer, eid: int, peer: bytes) -> bytes | Awaitable[bytes]:
    return server.handle(p.encode(p.RegisterKVCache(id=5, engine_id=eid, layers=[HANDLE, HANDLE])), peer)


@pytest.mark.anyio
async def test_concurrent_registrations_make_the_copies_once() -> None:
    maker = Maker()
    with engine(64 * 4096, chunk_size=CHUNK) as (eng, _):
        server = DataPlaneServer(eng, url="ipc:///unused", max_frame_bytes=1 << 20, max_tokens=4096,
                                 lifeline_path="unused",
                                 make_transfers=maker)  # fmt: skip
        a, b = register(server, b"a"), register(server, b"b", instance="b2" * 16)
        first, second = kv_register(server, a, b"a"), kv_register(server, b, b"b")
        await asyncio.sleep(0)  # both waiting on the same making
        maker.gate.set()
        assert [await answer(first), await answer(second)] == [p.CountReply(id=5, count=2)] * 2
        assert maker.calls == 1
        assert maker.made.registered == [a, b]
        # Made: the next registration is answered at once, and a dropped engine reaches the copies.
        assert call(server, p.RegisterKVCache(id=6, engine_id=a, layers=[HANDLE]), b"a") == p.CountReply(
            id=6, count=1
        )
        eng.engines.drop_instance(INSTANCE)
        assert maker.made.dropped == [a]


@pytest.mark.anyio
async def test_block_copies_before_any_registration_are_not_found_and_make_nothing() -> None:
    maker = Maker()
    with engine(64 * 4096, chunk_size=CHUNK) as (eng, _):
        server = DataPlaneServer(eng, url="ipc:///unused", max_frame_bytes=1 << 20, max_tokens=4096,
                                 lifeline_path="unused",
                                 make_transfers=maker)  # fmt: skip
        eid = register(server)
        load = p.LoadBlocks(id=7, engine_id=eid, request_id="r", first_chunk=0, num_chunks=1, block_ids=[0])
        reply = await answer(server.handle(p.encode(load)))
        assert isinstance(reply, p.ErrorReply) and reply.code == "not_found"
        assert maker.calls == 0


@pytest.mark.anyio
async def test_a_failed_making_is_answered_retryable_and_the_next_registration_tries_again() -> None:
    maker = Maker(failures=1)
    maker.gate.set()
    with engine(64 * 4096, chunk_size=CHUNK) as (eng, _):
        server = DataPlaneServer(eng, url="ipc:///unused", max_frame_bytes=1 << 20, max_tokens=4096,
                                 lifeline_path="unused",
                                 make_transfers=maker)  # fmt: skip
        eid = register(server)
        failed = await answer(kv_register(server, eid, b""))
        assert isinstance(failed, p.ErrorReply)
        assert (failed.code, failed.retryable) == ("internal", True)  # a TransferError
        assert "torch" in failed.message
        assert await answer(kv_register(server, eid, b"")) == p.CountReply(id=5, count=2)
        assert maker.calls == 2


@pytest.mark.anyio
async def test_prepared_copies_are_made_before_the_registration_comes() -> None:
    maker = Maker()
    with engine(64 * 4096, chunk_size=CHUNK) as (eng, _):
        server = DataPlaneServer(eng, url="ipc:///unused", max_frame_bytes=1 << 20, max_tokens=4096,
                                 lifeline_path="unused",
                                 make_transfers=maker)  # fmt: skip
        eid = register(server)
        server.prepare_transfers()
        server.prepare_transfers()  # being made: nothing more
        maker.gate.set()
        making = server.copies._making
        assert making is not None
        await making  # its own callback (attaching the copies) runs before this await returns
        assert server.transfers is maker.made
        assert maker.calls == 1
        reply = call(server, p.RegisterKVCache(id=6, engine_id=eid, layers=[HANDLE]))
        assert reply == p.CountReply(id=6, count=1)  # answered at once
        server.prepare_transfers()  # made: nothing more
        assert maker.calls == 1
