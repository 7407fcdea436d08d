"""Both clients against a scripted fake sidecar (a ZMQ ROUTER in a thread): the same operations
give the same messages and results over either transport, including the handshake, the
re-handshake after a sidecar restart, error replies and the copies of a store."""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from kvdepot_connector import protocol as p
from kvdepot_connector.aio import AsyncKVDepotClient
from kvdepot_connector.client import KVDepotClient
from kvdepot_connector.errors import ProtocolMismatch, SidecarError, SidecarUnavailable
from kvdepot_connector.handles import F_ADD_SEALS, SEALS
from kvdepot_connector.lifeline import HEADER, Hello, Welcome, decode_body, send_frame
from kvdepot_connector.outcomes import Posted

LAYOUT = p.Layout(dtype="float16", num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, kind="test",
                  chunk_size=4)  # fmt: skip
CHUNK_BYTES = LAYOUT.chunk_bytes  # 128
ARENA_BYTES = 4096


class FakeSidecar:
    """Answers every request with `answer(msg)`; registrations get engine ids 7, 8, ..."""

    def __init__(self, tmp: Path, answer: Callable[[Any], p.Reply | None], chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.url = f"ipc://{tmp}/fake.sock"
        self.answer = answer
        self.seen: list[Any] = []
        self.next_engine = 7
        self.arena_name = f"kvdepot-test-{uuid.uuid4().hex[:12]}"
        self.arena_fd = os.memfd_create(self.arena_name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.arena_fd, ARENA_BYTES)
        fcntl.fcntl(self.arena_fd, F_ADD_SEALS, SEALS)
        self.arena = mmap.mmap(self.arena_fd, ARENA_BYTES)
        self.old_arenas: list[tuple[int, mmap.mmap]] = []
        # The lifeline: every client connects one after HELLO; the arena's descriptor comes over it.
        self.lifeline_path = str(tmp / "lifeline.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.lifeline_path)
        self._listener.listen(16)
        self._listener.settimeout(0.02)
        self._lines: list[socket.socket] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.bind(self.url)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _accept_lifelines(self) -> None:
        while True:
            try:
                line, _ = self._listener.accept()
            except TimeoutError:
                return
            line.settimeout(5)
            header = line.recv(HEADER.size, socket.MSG_WAITALL)
            (n,) = HEADER.unpack(header)
            assert isinstance(decode_body(line.recv(n, socket.MSG_WAITALL)), Hello)
            send_frame(line, Welcome(names=["arena"]), [self.arena_fd])
            self._lines.append(line)

    def _serve(self) -> None:
        while not self._stop.is_set():
            self._accept_lifelines()
            if not self._sock.poll(20):
                continue
            ident, frame = self._sock.recv_multipart()
            msg = p.request_decoder.decode(frame)
            self.seen.append(msg)
            if isinstance(msg, p.Hello):
                reply: p.Reply | None = p.HelloReply(
                    id=msg.id, version=p.PROTOCOL_VERSION, server="fake", chunk_size=self.chunk_size,
                    arena_name=self.arena_name, arena_size=ARENA_BYTES, max_frame_bytes=1 << 20,
                    lifeline_path=self.lifeline_path, lifeline_token=b"t" * 32,
                )  # fmt: skip
            elif isinstance(msg, p.Register):
                reply = p.RegisterReply(id=msg.id, engine_id=self.next_engine, chunk_bytes=CHUNK_BYTES,
                                        layout_fingerprint=b"12345678")  # fmt: skip
                self.next_engine += 1
            else:
                reply = self.answer(msg)
            if reply is not None:
                self._sock.send_multipart([ident, p.encode(reply)])

    def ops(self) -> list[str]:
        return [type(m).__name__ for m in self.seen]

    def new_arena(self) -> None:
        """What a restarted sidecar has: a new arena, under the same name (a sidecar restarted
        in its container gets the same pid and data directory); later lifelines bring it."""
        fd = os.memfd_create(self.arena_name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, ARENA_BYTES)
        fcntl.fcntl(fd, F_ADD_SEALS, SEALS)
        self.old_arenas.append((self.arena_fd, self.arena))
        self.arena_fd, self.arena = fd, mmap.mmap(fd, ARENA_BYTES)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()
        for fd, arena in [*self.old_arenas, (self.arena_fd, self.arena)]:
            arena.close()
            os.close(fd)
        for line in self._lines:
            line.close()
        self._listener.close()


class Blocking:
    """The asyncio client's operations, each run to completion on one private event loop."""

    def __init__(self, client: AsyncKVDepotClient) -> None:
        self._client = client
        self._runner = asyncio.Runner()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)
        if not asyncio.iscoroutinefunction(method):
            return method
        return lambda *a, **kw: self._runner.run(method(*a, **kw))

    def pending(self) -> int:
        """Replies the asyncio client still has a future waiting for."""
        return len(self._client._pending)

    def close(self) -> None:
        self._runner.run(self._client.close())
        self._runner.close()


Connect = Callable[..., Any]


@pytest.fixture(params=["blocking", "asyncio"])
def connect(request: pytest.FixtureRequest) -> Iterator[Connect]:
    opened: list[Any] = []

    def make(url: str, **kw: Any) -> Any:
        kw.setdefault("timeout_s", 2.0)
        if request.param == "blocking":
            client: Any = KVDepotClient(url, model="m", layout=LAYOUT, **kw)
        else:
            client = Blocking(AsyncKVDepotClient(url, model="m", layout=LAYOUT, **kw))
        opened.append(client)
        return client

    yield make
    for client in opened:
        client.close()


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Callable[..., FakeSidecar]]:
    started: list[FakeSidecar] = []

    def start(answer: Callable[[Any], p.Reply | None], chunk_size: int = LAYOUT.chunk_size) -> FakeSidecar:
        started.append(FakeSidecar(tmp_path, answer, chunk_size))
        return started[-1]

    yield start
    for sc in started:
        sc.close()


def test_first_call_handshakes_then_sends_with_the_engine_id(sidecar: Any, connect: Connect) -> None:
    sc = sidecar(lambda m: p.LookupReply(id=m.id, hit_tokens=8, hit_chunks=2, total_chunks=3))
    client = connect(sc.url, map_arena=False)
    reply = client.lookup([1, 2, 3, 4, 5], request_id="r", cache_salt="t")
    assert (reply.hit_tokens, reply.hit_chunks) == (8, 2)
    assert sc.ops() == ["Hello", "Register", "Lookup"]
    lookup = sc.seen[2]
    assert (lookup.engine_id, lookup.request_id, lookup.cache_salt) == (7, "r", "t")
    assert lookup.tokens == p.encode_tokens([1, 2, 3, 4, 5])
    assert client.engine_id == 7 and client.chunk_bytes == CHUNK_BYTES


@pytest.mark.parametrize(
    ("code", "again"),
    [(p.ErrorCode.HELLO_REQUIRED, ["Hello", "Register"]), (p.ErrorCode.NOT_REGISTERED, ["Register"])],
    ids=["sidecar-restarted", "registration-dropped"],
)
def test_a_restarted_sidecar_is_handshaken_again_and_the_call_resent(
    sidecar: Any, connect: Connect, code: p.ErrorCode, again: list[str]
) -> None:
    """A sidecar that no longer knows the connection (it restarted) gets the whole handshake; one
    that no longer knows the engine id (an idle registration dropped) a register only: the
    session, its lifeline and its reservations stay."""

    def answer(m: Any) -> p.Reply:
        if m.engine_id == 7 and isinstance(m, p.EndRequest):  # engine 7 is gone
            return p.ErrorReply(id=m.id, code=code, message="who?")
        return p.CountReply(id=m.id, count=m.engine_id)

    sc = sidecar(answer)
    client = connect(sc.url, map_arena=False)
    assert client.free_lookup_locks("r") == 7
    assert client.end_request("r") == 8
    assert sc.ops() == ["Hello", "Register", "FreeLookupLocks", "EndRequest", *again, "EndRequest"]
    assert client.engine_id == 8


def test_error_replies_raise_with_their_code(sidecar: Any, connect: Connect) -> None:
    sc = sidecar(lambda m: p.ErrorReply(id=m.id, code=p.ErrorCode.NOT_FOUND, message="no such thing"))
    client = connect(sc.url, map_arena=False)
    with pytest.raises(SidecarError) as info:
        client.release("r")
    assert info.value.code == p.ErrorCode.NOT_FOUND and not info.value.retryable


def test_no_reply_is_unavailable(sidecar: Any, connect: Connect) -> None:
    sc = sidecar(lambda m: None)
    client = connect(sc.url, map_arena=False, timeout_s=0.2)
    with pytest.raises(SidecarUnavailable):
        client.clear()
    assert sc.ops() == ["Hello", "Register", "Clear"]


def test_a_sidecar_with_another_chunk_size_is_refused(sidecar: Any, connect: Connect) -> None:
    sc = sidecar(lambda m: p.Pong(id=m.id, server_time=1.0), chunk_size=2 * LAYOUT.chunk_size)
    client = connect(sc.url, map_arena=False)
    assert client.ping() == 1.0  # ping needs no handshake
    with pytest.raises(ProtocolMismatch, match="chunk size"):
        client.query_prefetch("r")
    assert sc.ops() == ["Ping", "Hello"]


def test_store_copies_into_the_reserved_slots_and_commits(sidecar: Any, connect: Connect) -> None:
    def answer(m: Any) -> p.Reply:
        if isinstance(m, p.Store):
            return p.StoreReply(id=m.id, slots=[
                p.Slot(chunk=0, status=p.SlotStatus.EXISTS),
                p.Slot(chunk=1, status=p.SlotStatus.RESERVED, oid=11, offset=256, size=CHUNK_BYTES),
                p.Slot(chunk=2, status=p.SlotStatus.NO_SPACE),
            ])  # fmt: skip
        if isinstance(m, p.Commit):
            return p.CommitReply(id=m.id, ok=[True] * len(m.oids))
        return p.CountReply(id=m.id, count=len(m.oids))

    sc = sidecar(answer)
    client = connect(sc.url)
    chunks = [torch.full((CHUNK_BYTES // 2,), float(i), dtype=torch.float16) for i in range(3)]
    out = client.store(list(range(12)), chunks, request_id="w")
    assert (out.stored, out.existing, out.no_space, out.complete) == (1, 1, 1, False)
    assert sc.arena[256 : 256 + CHUNK_BYTES] == chunks[1].view(torch.uint8).numpy().tobytes()
    assert sc.ops()[-2:] == ["Store", "Commit"] and sc.seen[-1].oids == [11]
    # A chunk of the wrong size: nothing is committed, the reservation is given back.
    with pytest.raises(ValueError, match="bytes"):
        client.store(list(range(12)), [chunks[0], chunks[1][:4], chunks[2]], request_id="w")
    assert sc.ops()[-2:] == ["Store", "Abort"] and sc.seen[-1].oids == [11]


def test_a_commit_sent_without_waiting_is_accounted_by_the_next_call(sidecar: Any, connect: Connect) -> None:
    def answer(m: Any) -> p.Reply:
        if isinstance(m, p.Store):
            return p.StoreReply(id=m.id, slots=[
                p.Slot(chunk=0, status=p.SlotStatus.RESERVED, oid=11, offset=0, size=CHUNK_BYTES),
                p.Slot(chunk=1, status=p.SlotStatus.RESERVED, oid=12, offset=CHUNK_BYTES, size=CHUNK_BYTES),
            ])  # fmt: skip
        if isinstance(m, p.Commit):  # the second chunk's lease ran out
            return p.CommitReply(id=m.id, ok=[oid != 12 for oid in m.oids])
        return p.Pong(id=m.id, server_time=1.0)

    sc = sidecar(answer)
    client = connect(sc.url)
    chunks = [torch.full((CHUNK_BYTES // 2,), float(i), dtype=torch.float16) for i in range(2)]
    out = client.store(list(range(8)), chunks, request_id="w", wait=False)
    assert out.stored == 2 and client.commits_posted == 2  # sent, not yet answered
    client.ping()  # reads the COMMIT's answer before its own
    assert sc.ops()[-3:] == ["Store", "Commit", "Ping"]
    assert (client.commits_refused, client.posted_errors) == (1, 0)


def test_requests_sent_without_waiting_are_remembered_up_to_a_bound(
    sidecar: Any, connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sidecar that never answers the COMMITs sent without waiting (it restarted, the replies
    were lost): the client remembers the newest `Posted.limit` of them, not all of them forever."""

    def answer(m: Any) -> p.Reply | None:
        if isinstance(m, p.Store):
            return p.StoreReply(id=m.id, slots=[
                p.Slot(chunk=0, status=p.SlotStatus.RESERVED, oid=11, offset=0, size=CHUNK_BYTES),
            ])  # fmt: skip
        if isinstance(m, p.Commit):
            return None
        return p.Pong(id=m.id, server_time=1.0)

    monkeypatch.setattr(Posted, "limit", 8)
    sc = sidecar(answer)
    client = connect(sc.url)
    chunk = torch.zeros(CHUNK_BYTES // 2, dtype=torch.float16)
    for _ in range(12):
        assert client.store(list(range(4)), [chunk], request_id="w", wait=False).stored == 1
    client.ping()  # answered after every COMMIT before it has reached the sidecar
    assert sc.ops().count("Commit") == 12 and client.commits_posted == 12
    assert (len(client.posted), client.posted.forgotten) == (8, 4)
    if isinstance(client, Blocking):  # nothing else holds on to them: no future is left waiting
        assert client.pending() == 0


def test_a_sidecar_restarted_with_an_arena_of_the_same_name_is_read_from_its_new_arena(
    sidecar: Any, connect: Connect
) -> None:
    """The client maps the arena the new lifeline brings, not the one it had because the name is
    the same: copies out of the old one would be another sidecar's bytes at the new one's offsets."""
    restarted = threading.Event()

    def answer(m: Any) -> p.Reply:
        if isinstance(m, p.Retrieve):
            if restarted.is_set():  # it knows the connection no more: the client says HELLO again
                restarted.clear()
                return p.ErrorReply(id=m.id, code=p.ErrorCode.HELLO_REQUIRED, message="who?")
            return p.RetrieveReply(id=m.id, extents=[p.Extent(offset=512, size=CHUNK_BYTES, oid=21)])
        return p.ReleaseReply(id=m.id, valid=True)

    sc = sidecar(answer)
    sc.arena[512 : 512 + CHUNK_BYTES] = b"\xaa" * CHUNK_BYTES
    client = connect(sc.url)
    out = torch.zeros(CHUNK_BYTES, dtype=torch.uint8)
    assert client.retrieve("r", [out]) is True and out.tolist() == [0xAA] * CHUNK_BYTES
    sc.new_arena()
    sc.arena[512 : 512 + CHUNK_BYTES] = b"\xbb" * CHUNK_BYTES
    restarted.set()
    assert client.retrieve("r", [out]) is True
    assert sc.ops().count("Hello") == 2
    assert out.tolist() == [0xBB] * CHUNK_BYTES


def test_a_lookups_extents_are_copied_from_with_no_round_trip(sidecar: Any, connect: Connect) -> None:
    def answer(m: Any) -> p.Reply:
        if isinstance(m, p.Lookup):
            assert m.extents
            return p.LookupReply(id=m.id, hit_tokens=8, hit_chunks=2, total_chunks=2, extents=[
                p.Extent(offset=256, size=CHUNK_BYTES, oid=31), p.Extent(offset=0, size=CHUNK_BYTES, oid=32),
            ], epoch=3, arena=sc.arena_name)  # fmt: skip
        return p.ReleaseReply(id=m.id, valid=True)

    sc = sidecar(answer)
    sc.arena[0:CHUNK_BYTES] = b"\x11" * CHUNK_BYTES
    sc.arena[256 : 256 + CHUNK_BYTES] = b"\x22" * CHUNK_BYTES
    client = connect(sc.url)
    reply = client.lookup(list(range(8)), request_id="r", extents=True)
    seen = len(sc.seen)
    locked = client.locked_from(reply, first_chunk=1, num_chunks=1)
    assert bytes(locked.views[0].numpy()) == b"\x11" * CHUNK_BYTES and locked.oids == [32]
    assert (locked.epoch, len(sc.seen)) == (3, seen)  # nothing asked
    for first, count in ((1, 2), (-1, 1), (2, 1)):
        with pytest.raises(ValueError, match="no such extents"):
            client.locked_from(reply, first_chunk=first, num_chunks=count)
    beyond = p.LookupReply(id=0, hit_tokens=4, hit_chunks=1, total_chunks=1, arena=sc.arena_name,
                           extents=[p.Extent(offset=ARENA_BYTES - 64, size=CHUNK_BYTES, oid=33)])  # fmt: skip
    with pytest.raises(ValueError, match="outside the arena"):  # a view past the mapping: never made
        client.locked_from(beyond, first_chunk=0, num_chunks=1)
    reply.arena = "kvdepot-another"  # a sidecar that restarted since this client mapped its arena
    with pytest.raises(ValueError, match="no such extents"):
        client.locked_from(reply, first_chunk=0, num_chunks=1)


def test_a_slot_beyond_the_arena_is_refused_and_given_back(sidecar: Any, connect: Connect) -> None:
    """The client copies with memmove: a slot the arena does not hold must never be written."""

    def answer(m: Any) -> p.Reply:
        if isinstance(m, p.Store):
            return p.StoreReply(id=m.id, slots=[
                p.Slot(chunk=0, status=p.SlotStatus.RESERVED, oid=5, offset=0, size=CHUNK_BYTES),
                p.Slot(chunk=1, status=p.SlotStatus.RESERVED, oid=6, offset=ARENA_BYTES - 64,
                       size=CHUNK_BYTES),
            ])  # fmt: skip
        return p.CountReply(id=m.id, count=len(m.oids))

    sc = sidecar(answer)
    client = connect(sc.url)
    chunks = [torch.full((CHUNK_BYTES // 2,), 3.0, dtype=torch.float16) for _ in range(2)]
    with pytest.raises(ValueError, match="outside the arena"):
        client.store(list(range(8)), chunks, request_id="w")
    assert sc.ops()[-2:] == ["Store", "Abort"] and sc.seen[-1].oids == [5, 6]
    assert sc.arena[ARENA_BYTES - 64 :] == bytes(64)


def test_retrieve_copies_the_locked_chunks_out_then_releases_them(sidecar: Any, connect: Connect) -> None:
    def answer(m: Any) -> p.Reply:
        if isinstance(m, p.Retrieve):
            return p.RetrieveReply(id=m.id, extents=[
                p.Extent(offset=1024, size=CHUNK_BYTES, oid=21),
                p.Extent(offset=512, size=CHUNK_BYTES, oid=22),
            ])  # fmt: skip
        if isinstance(m, p.Release):
            return p.ReleaseReply(id=m.id, valid=True)
        raise AssertionError(m)

    sc = sidecar(answer)
    sc.arena[512 : 512 + CHUNK_BYTES] = bytes(range(CHUNK_BYTES))
    sc.arena[1024 : 1024 + CHUNK_BYTES] = bytes(range(CHUNK_BYTES, 0, -1))
    client = connect(sc.url)
    outs = [torch.zeros(CHUNK_BYTES // 4, dtype=torch.float32) for _ in range(2)]
    assert client.retrieve("r", outs) is True
    assert outs[0].view(torch.uint8).numpy().tobytes() == sc.arena[1024 : 1024 + CHUNK_BYTES]
    assert outs[1].view(torch.uint8).numpy().tobytes() == sc.arena[512 : 512 + CHUNK_BYTES]
    assert sc.ops()[-2:] == ["Retrieve", "Release"] and sc.seen[-1].oids == [21, 22]
    # An output of the wrong size raises; the locks still go.
    with pytest.raises(ValueError, match="bytes"):
        client.retrieve("r", [outs[0], outs[1][:4]])
    assert sc.ops()[-1] == "Release"
