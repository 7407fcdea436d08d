"""The data-plane server's frame handling, driven in-process through `handle(frame)`."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Iterator
from typing import Any

import msgspec
import pytest
import structlog
from prometheus_client import CollectorRegistry

from api.dataplane.server import DataPlaneServer
from api.metrics import DataPlaneMetrics
from app.settings import AdapterConfig
from engine.facade import CacheEngine
from kvdepot_connector import protocol as p
from storage.base import L2Adapter
from storage.mock.adapter import MockAdapter
from storage.mock.config import MockAdapterConfig
from tests.factories import engine, l2_engine, tokens

CHUNK = 16
LAYOUT = p.Layout(dtype="float16", num_layers=2, num_kv_heads=1, head_dim=32, block_size=16, kind="test",
                  chunk_size=CHUNK)  # fmt: skip


INSTANCE = "a1" * 16


@pytest.fixture
def server() -> Iterator[DataPlaneServer]:
    with engine(64 * 4096, chunk_size=CHUNK) as (eng, _):
        server = DataPlaneServer(
            eng, url="ipc:///unused", max_frame_bytes=1 << 20, max_tokens=4096, lifeline_path="unused"
        )
        hello(server)
        yield server


def call(server: DataPlaneServer, msg: msgspec.Struct, peer: bytes = b"") -> p.Reply:
    return p.reply_decoder.decode(server.handle(p.encode(msg), peer))


def hello(server: DataPlaneServer, peer: bytes = b"", instance: str = INSTANCE) -> p.HelloReply:
    """HELLO on connection `peer`, and its lifeline held (as the lifeline server does when the
    client connects it with the reply's token)."""
    reply = call(server, p.Hello(id=1, version=p.PROTOCOL_VERSION, instance=instance), peer)
    assert isinstance(reply, p.HelloReply), reply
    assert server.sessions.hold(reply.lifeline_token) is not None
    return reply


def register(server: DataPlaneServer, peer: bytes = b"", instance: str = INSTANCE) -> int:
    hello(server, peer, instance)
    reply = call(server, p.Register(id=1, model="m", layout=LAYOUT), peer)
    assert isinstance(reply, p.RegisterReply)
    return reply.engine_id


def store_and_check(server: DataPlaneServer, eid: int, seed: int) -> None:
    eng: CacheEngine = server.engine
    toks = tokens(3 * CHUNK, start=seed * 1000)
    reply = call(server, p.Store(id=2, engine_id=eid, request_id=f"w{seed}", tokens=toks))
    assert isinstance(reply, p.StoreReply)
    oids = []
    for slot in reply.slots:
        if slot.status is p.SlotStatus.RESERVED:
            eng.arena.tensor(slot.offset, slot.size).fill_((seed + slot.chunk) % 251)
            oids.append(slot.oid)
    commit = call(server, p.Commit(id=3, engine_id=eid, oids=oids))
    assert isinstance(commit, p.CommitReply) and all(commit.ok)
    look = call(server, p.Lookup(id=4, engine_id=eid, request_id=f"r{seed}", tokens=toks))
    assert isinstance(look, p.LookupReply) and look.hit_chunks == 3
    got = call(server, p.Retrieve(id=5, engine_id=eid, request_id=f"r{seed}", num_chunks=3))
    assert isinstance(got, p.RetrieveReply)
    for i, ext in enumerate(got.extents):
        region = eng.arena.tensor(ext.offset, ext.size)
        assert bool((region == (seed + i) % 251).all())
    rel = call(server, p.Release(id=6, engine_id=eid, request_id=f"r{seed}"))
    assert isinstance(rel, p.ReleaseReply) and rel.valid


def errors_counted(registry: CollectorRegistry, op: str, code: str) -> float:
    return registry.get_sample_value("kvdepot_dataplane_errors_total", {"op": op, "code": code}) or 0.0


def test_hello_and_version_check(server: DataPlaneServer) -> None:
    registry = CollectorRegistry()
    server.metrics = DataPlaneMetrics(registry)
    hello = call(server, p.Hello(id=7, version=p.PROTOCOL_VERSION))
    assert isinstance(hello, p.HelloReply)
    assert (hello.id, hello.chunk_size, hello.arena_name) == (7, CHUNK, server.engine.arena.name)
    bad = call(server, p.Hello(id=8, version=99))
    assert isinstance(bad, p.ErrorReply)
    assert (bad.id, bad.code, bad.retryable) == (8, "unsupported_version", False)
    assert "protocol 99" in bad.message or "client 99" in bad.message
    assert errors_counted(registry, "hello", "unsupported_version") == 1


def test_full_round_trip(server: DataPlaneServer) -> None:
    store_and_check(server, register(server), seed=1)


@pytest.mark.parametrize(
    ("msg", "code"),
    [
        (p.Lookup(id=1, engine_id=424242, request_id="r", tokens=b""), "not_registered"),
        (p.Retrieve(id=1, engine_id=-1, request_id="r"), "malformed_frame"),  # engine_id bound
        (p.Register(id=1, model="m", layout=p.Layout("float16", 1, 1, 1, 16, "x", 32)), "invalid_input"),
        (p.Register(id=1, model="m", layout=p.Layout("complex128", 1, 1, 1, 16, "x", 16)), "invalid_input"),
        (p.Register(id=1, model="", layout=LAYOUT), "invalid_input"),
    ],
)
def test_invalid_requests_get_coded_errors(server: DataPlaneServer, msg: msgspec.Struct, code: str) -> None:
    reply = call(server, msg)
    assert isinstance(reply, p.ErrorReply), reply
    assert reply.code == code
    assert reply.id == 1


def test_token_bytes_are_validated(server: DataPlaneServer) -> None:
    eid = register(server)
    odd = call(server, p.Lookup(id=1, engine_id=eid, request_id="r", tokens=b"\x01\x02\x03"))
    assert isinstance(odd, p.ErrorReply) and odd.code == "invalid_input"
    huge = call(server, p.Lookup(id=1, engine_id=eid, request_id="r", tokens=bytes(4 * 5000)))
    assert isinstance(huge, p.ErrorReply) and "max_tokens" in huge.message


def test_a_block_list_past_its_bound_is_refused_before_any_work(server: DataPlaneServer) -> None:
    from kvdepot_connector.kv_sharing import MAX_BLOCK_IDS

    eid = register(server)
    frame = msgspec.msgpack.encode({
        "op": "load_blocks", "id": 7, "engine_id": eid, "request_id": "r", "first_chunk": 0,
        "num_chunks": 1, "block_ids": [1] * (MAX_BLOCK_IDS + 1),
    })  # fmt: skip
    reply = p.reply_decoder.decode(server.handle(frame))
    assert isinstance(reply, p.ErrorReply) and reply.code == "malformed_frame" and reply.id == 7
    assert MAX_BLOCK_IDS * 16 >= 2 * (1 << 20)  # a 2M-token request in blocks of 16 still fits


def test_undecodable_frames_get_malformed_frame_with_salvaged_id(server: DataPlaneServer) -> None:
    registry = CollectorRegistry()
    server.metrics = DataPlaneMetrics(registry)
    reply = p.reply_decoder.decode(server.handle(msgspec.msgpack.encode({"id": 42, "op": "nope"})))
    assert isinstance(reply, p.ErrorReply)
    assert (reply.id, reply.code) == (42, "malformed_frame")
    reply = p.reply_decoder.decode(server.handle(b"\xc1garbage"))
    assert isinstance(reply, p.ErrorReply) and reply.id == -1
    # Unknown fields are ignored (the version policy: newer peers add optional fields), never run.
    extra = msgspec.msgpack.encode({"op": "ping", "id": 1, "pickle": b"cos\nsystem\n"})
    reply = p.reply_decoder.decode(server.handle(extra))
    assert isinstance(reply, p.Pong)
    assert errors_counted(registry, "malformed", "malformed_frame") == 2


def _hostile_frames(rng: random.Random, valid: list[bytes]) -> Iterator[bytes]:
    values: list[object] = [
        -1, 0, 1, 2**31, 2**63 - 1, -(2**63), 1.5, float("nan"), "", "x" * 300, b"\x00" * 7, None, True,
        [], [1, 2, 3], {"a": 1}, [2**62] * 3, ["x"],
    ]  # fmt: skip
    fields = ["id", "op", "engine_id", "request_id", "tokens", "cache_salt", "first_chunk", "num_chunks",
              "oids", "model", "layout", "version", "kv_rank"]  # fmt: skip
    # CLEAR is left out: a frame that happens to be a valid CLEAR legitimately empties the cache.
    ops = [cls.__struct_config__.tag for cls in p.Request.__args__ if cls is not p.Clear]
    for _ in range(6000):
        kind = rng.randrange(4)
        if kind == 0:
            yield rng.randbytes(rng.randrange(0, 64))
        elif kind == 1:
            frame = bytearray(rng.choice(valid))
            for _ in range(rng.randrange(1, 4)):
                frame[rng.randrange(len(frame))] = rng.randrange(256)
            yield bytes(frame[: rng.randrange(1, len(frame) + 1)])
        else:
            doc: dict[str, object] = {"op": rng.choice(ops), "id": rng.randrange(100)}
            for name in rng.sample(fields, rng.randrange(1, 6)):
                doc[name] = rng.choice(values)
            yield msgspec.msgpack.encode(doc)


def test_fuzzed_frames_get_replies_and_change_nothing(server: DataPlaneServer) -> None:
    eid = register(server)
    store_and_check(server, eid, seed=1)
    valid = [
        p.encode(p.Lookup(id=9, engine_id=eid, request_id="f", tokens=tokens(2 * CHUNK))),
        p.encode(p.Store(id=9, engine_id=eid, request_id="f", tokens=tokens(CHUNK, start=77))),
        p.encode(p.Commit(id=9, engine_id=eid, oids=[1, 2, 3])),
        p.encode(p.Retrieve(id=9, engine_id=eid, request_id="f", first_chunk=0, num_chunks=2)),
    ]
    errors = 0
    for frame in _hostile_frames(random.Random(1234), valid):
        reply = p.reply_decoder.decode(server.handle(frame))  # always a decodable reply
        errors += isinstance(reply, p.ErrorReply)
    assert errors > 5000
    hello(server)  # a fuzzed HELLO may have replaced the connection's session
    eng = server.engine
    eng.cache.allocator.check()
    # The server still stores and retrieves correct bytes, for old and new data.
    store_and_check(server, eid, seed=2)
    look = call(
        server, p.Lookup(id=1, engine_id=eid, request_id="again", tokens=tokens(3 * CHUNK, start=1000))
    )
    assert isinstance(look, p.LookupReply) and look.hit_chunks == 3


# --- replies that wait ---------------------------------------------------------------------------


def build_mock(config: AdapterConfig) -> L2Adapter:
    assert isinstance(config, MockAdapterConfig)
    return MockAdapter(config)


def latency_sum(registry: CollectorRegistry, op: str) -> float:
    return registry.get_sample_value("kvdepot_dataplane_request_seconds_sum", {"op": op}) or 0.0


@pytest.mark.anyio
async def test_a_lookup_waiting_for_l2_is_timed_to_its_reply() -> None:
    latency_s = 0.2
    slow = [MockAdapterConfig(name="slow", latency_ms=latency_s * 1000)]
    async with l2_engine(64 * 4096, slow, build_mock, chunk_size=CHUNK) as (eng, _):
        registry = CollectorRegistry()
        server = DataPlaneServer(
            eng, url="ipc:///unused", max_frame_bytes=1 << 20, max_tokens=4096, lifeline_path="unused",
            metrics=DataPlaneMetrics(registry),
        )  # fmt: skip
        eid = register(server)
        toks = tokens(2 * CHUNK)
        stored = call(server, p.Store(id=2, engine_id=eid, request_id="w", tokens=toks))
        assert isinstance(stored, p.StoreReply)
        call(server, p.Commit(id=3, engine_id=eid, oids=[s.oid for s in stored.slots]))
        assert eng.l2 is not None and await eng.l2.store.wait_idle(10)
        eng.clear()  # L1 only: the chunks are now in L2 alone
        before = latency_sum(registry, "lookup")

        lookup = p.Lookup(id=4, engine_id=eid, request_id="r", tokens=toks, wait=True)
        pending = server.handle(p.encode(lookup))
        assert not isinstance(pending, bytes)  # the reply waits for the prefetch
        reply = p.reply_decoder.decode(await pending)

        assert isinstance(reply, p.LookupReply) and reply.hit_chunks == 2
        assert latency_sum(registry, "lookup") - before >= latency_s


class SlowTransfers:
    """Stands in for the sidecar's KV copies: each load takes `seconds` and notes the log context
    it ran under."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.contexts: list[dict[str, Any]] = []

    def drop(self, engine_id: int) -> None:
        return None

    async def load(self, engine_id: int, request_id: str, **_: Any) -> bool:
        await asyncio.sleep(self.seconds)  # the copy's duration, not a synchronisation
        self.contexts.append(structlog.contextvars.get_contextvars())
        return True


@pytest.mark.anyio
async def test_an_awaited_handler_runs_in_its_log_context_and_is_timed_whole() -> None:
    with engine(64 * 4096, chunk_size=CHUNK) as (eng, _):
        registry = CollectorRegistry()
        transfers = SlowTransfers(0.05)
        server = DataPlaneServer(
            eng, url="ipc:///unused", max_frame_bytes=1 << 20, max_tokens=4096, lifeline_path="unused",
            metrics=DataPlaneMetrics(registry), transfers=transfers,  # type: ignore[arg-type]
        )  # fmt: skip
        load = p.LoadBlocks(
            id=9, engine_id=register(server), request_id="r", first_chunk=0, num_chunks=1, block_ids=[0]
        )
        pending = server.handle(p.encode(load))
        assert isinstance(pending, Awaitable)
        assert structlog.contextvars.get_contextvars() == {}  # nothing leaks out of handle()
        reply = p.reply_decoder.decode(await pending)

        assert isinstance(reply, p.ReleaseReply) and reply.valid
        assert transfers.contexts == [{"op": "load_blocks", "rid": 9}]
        assert structlog.contextvars.get_contextvars() == {}
        assert latency_sum(registry, "load_blocks") >= transfers.seconds


class GatedTransfers:
    """A slow awaited handler: each load waits for `gate`, then runs `before_reply` (in the task
    that sends the deferred reply, right before it is sent)."""

    def __init__(self, before_reply: Any) -> None:
        self.started = asyncio.Event()
        self.gate = asyncio.Event()
        self.before_reply = before_reply

    def drop(self, engine_id: int) -> None:
        return None

    async def load(self, engine_id: int, request_id: str, **_: Any) -> bool:
        self.started.set()
        await self.gate.wait()
        self.before_reply()
        return True


@pytest.mark.anyio
async def test_a_ping_arriving_as_a_deferred_reply_is_sent_is_answered(tmp_path: Any) -> None:
    import select
    import time

    import zmq

    url = f"ipc://{tmp_path}/dp.sock"
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)

    def ask(sock: zmq.Socket[bytes], msg: msgspec.Struct) -> None:
        sock.send(p.encode(msg))

    async def answer(sock: zmq.Socket[bytes]) -> p.Reply:
        ready = await asyncio.to_thread(sock.poll, 10_000)
        assert ready, "no reply"
        return p.reply_decoder.decode(sock.recv())

    def ping_arrives() -> None:
        # B's PING reaches the sidecar's socket (its descriptor signals) just before the deferred
        # reply is sent on that socket: the send consumes the signal.
        assert server.transport.sock is not None
        ask(b, p.Ping(id=7))
        select.select([server.transport.sock.getsockopt(zmq.FD)], [], [], 10)
        # libzmq processes pending commands on send only if ~1 ms passed since it last did (its
        # command throttle): let that pass, as it does under any real copy. Not a synchronisation.
        time.sleep(0.005)

    with engine(64 * 4096, chunk_size=CHUNK) as (eng, _):
        transfers = GatedTransfers(ping_arrives)
        server = DataPlaneServer(
            eng, url=url, max_frame_bytes=1 << 20, max_tokens=4096, lifeline_path="unused",
            transfers=transfers,  # type: ignore[arg-type]
        )  # fmt: skip
        server.bind()
        serving = asyncio.get_running_loop().create_task(server.serve())
        try:
            for sock in (a, b):
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(url)
                ask(sock, p.Hello(id=1, version=p.PROTOCOL_VERSION, instance=INSTANCE))
                said = await answer(sock)
                assert isinstance(said, p.HelloReply) and server.sessions.hold(said.lifeline_token)
            ask(a, p.Register(id=2, model="m", layout=LAYOUT))
            reg = await answer(a)
            assert isinstance(reg, p.RegisterReply)
            load = p.LoadBlocks(id=3, engine_id=reg.engine_id, request_id="r", first_chunk=0, num_chunks=1,
                                block_ids=[0])  # fmt: skip
            ask(a, load)
            await transfers.started.wait()
            transfers.gate.set()
            assert isinstance(await answer(a), p.ReleaseReply)
            pong = await answer(b)  # nobody sends anything else meanwhile
            assert isinstance(pong, p.Pong) and pong.id == 7
        finally:
            server.stop()
            await serving
            a.close()
            b.close()
            server.close()
            ctx.term()


def test_a_clear_is_audited_with_the_tenants_bytes_and_a_refused_one_with_its_code() -> None:
    from api.audit import AuditLog

    audit = AuditLog()
    with engine(64 * 4096, chunk_size=CHUNK) as (eng, _):
        server = DataPlaneServer(
            eng, url="ipc:///unused", max_frame_bytes=1 << 20, max_tokens=4096, lifeline_path="unused",
            audit=audit,
        )
        eid = register(server)
        toks = tokens(2 * CHUNK)
        reply = call(server, p.Store(id=2, engine_id=eid, request_id="w", tokens=toks, cache_salt="t-a"))
        assert isinstance(reply, p.StoreReply)
        call(server, p.Commit(id=3, engine_id=eid, oids=[s.oid for s in reply.slots]))
        held = eng.tenants.held("t-a")
        assert held > 0
        assert isinstance(call(server, p.Clear(id=4, cache_salt="t-a")), p.CountReply)
        refused = call(server, p.Clear(id=5))
        assert isinstance(refused, p.ErrorReply) and refused.code == "unauthorized"
    no_salt, cleared = audit.recent(10)
    assert cleared["resource"] == "dataplane.clear" and cleared["target"] == "t-a"
    assert cleared["before"] == {"l1_bytes": held} and cleared["after"] == {"l1_bytes": 0}
    assert cleared["outcome"] == {"status": 200, "code": None}
    assert no_salt["target"] is None and no_salt["outcome"] == {"status": 401, "code": "unauthorized"}
    assert INSTANCE not in repr(audit.recent(10))  # the instance appears as a digest only
