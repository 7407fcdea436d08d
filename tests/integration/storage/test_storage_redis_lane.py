"""The Redis adapter's bulk lane (blocking sockets in its executor) and load_into, against real
Redis: the shared one at 127.0.0.1:6379 (unique key prefixes, deleted afterwards) and private
redis-server processes that the tests start with a password, freeze (SIGSTOP) and restart."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable

import anyio
import pytest
import torch
from redis.asyncio import Redis

from app.errors import IntegrityError
from storage import codec
from storage.base import Status
from storage.codec import CodecOptions, EncodedBlob, blob_header
from storage.redis.adapter import RedisAdapter
from storage.redis.lane import PIECE_BYTES
from tests.integration.storage.redis_servers import MakeRedis, RedisServer

pytestmark = pytest.mark.anyio

FP = b"layoutfp"
KiB = 1 << 10
MiB = 1 << 20


def payload_for(key: str, size: int) -> bytes:
    return random.Random(key).randbytes(size)


def blob(key: str, size: int) -> EncodedBlob:
    return codec.encode(key, FP, payload_for(key, size), CodecOptions())


def outs_for(*sizes: int) -> list[bytearray]:
    return [bytearray(size) for size in sizes]


def views(outs: list[bytearray]) -> list[memoryview]:
    return [memoryview(out) for out in outs]


READ_MODES = ["get", "window"]


def read_mode(adapter: RedisAdapter, mode: str) -> RedisAdapter:
    """Make the lane read every value with one GET, or always in a window of GETRANGE pieces."""
    assert adapter.lane is not None
    adapter.lane.whole_get_max = 1 << 40 if mode == "get" else 0
    return adapter


def fp16_kv(pairs: int, run_elems: int) -> bytes:
    gen = torch.Generator().manual_seed(pairs)
    return bytes(torch.randn(pairs, 2, run_elems, generator=gen).to(torch.float16).view(torch.uint8).numpy())


def fp8(key: str, raw: bytes, run_elems: int) -> EncodedBlob:
    return codec.encode(key, FP, raw, CodecOptions(fp8_values=True, dtype="float16", run_elems=run_elems))


def expected_decode(stored: EncodedBlob, size: int) -> bytearray:
    out = bytearray(size)
    codec.decode_into(stored.to_bytes(), stored.key, FP, out)
    return out


# --- the lane against the shared Redis ------------------------------------------------------------


@pytest.mark.parametrize("mode", READ_MODES)
@pytest.mark.parametrize(
    "size",
    [256 * KiB, PIECE_BYTES, PIECE_BYTES + 1, 3 * PIECE_BYTES - 7, 32 * MiB],
    ids=["threshold", "one-piece", "piece+1", "three-pieces", "32MiB"],
)
async def test_large_raw_blobs_round_trip_in_place(
    make_redis: MakeRedis, raw_redis: Redis, size: int, mode: str
) -> None:
    adapter = read_mode(make_redis(), mode)
    stored = blob("big", size)
    assert (await adapter.store([("big", stored)]))[0].ok
    assert await raw_redis.get(adapter.redis_key("big")) == stored.to_bytes()
    out = bytearray(size)
    (result,) = await adapter.load_into(["big"], [memoryview(out)])
    assert result.ok
    assert result.in_place
    assert result.data == stored.header
    assert out == stored.payload
    codec.verify_in_place(result.data, "big", FP, out)
    assert adapter.lane is not None
    assert adapter.lane.connections >= 1  # the lane carried it
    assert adapter.stats.load_bytes == stored.nbytes
    assert adapter.usage().bytes_used == stored.nbytes
    assert adapter.health().state == "ok"


async def test_one_batch_mixes_the_lane_and_the_pipeline(make_redis: MakeRedis) -> None:
    adapter = make_redis()
    sizes = {"s0": 1000, "b0": MiB, "s1": 2000, "b1": 2 * MiB + 3}
    stored = {key: blob(key, size) for key, size in sizes.items()}
    results = await adapter.store(list(stored.items()))
    assert [r.status for r in results] == [Status.OK] * 4
    outs = outs_for(*sizes.values(), 5 * MiB)
    loaded = await adapter.load_into([*sizes, "missing"], views(outs))
    assert [r.status for r in loaded] == [Status.OK] * 4 + [Status.MISS]
    assert [r.in_place for r in loaded] == [False, True, False, True, False]
    for (key, size), result, out in zip(sizes.items(), loaded, outs, strict=False):
        assert result.data is not None
        if result.in_place:
            codec.verify_in_place(result.data, key, FP, out)
        else:
            codec.decode_into(result.data, key, FP, out)
        assert out == payload_for(key, size)
    assert adapter.usage().objects == 4


@pytest.mark.parametrize("mode", READ_MODES)
async def test_blobs_that_are_not_raw_come_back_whole(make_redis: MakeRedis, mode: str) -> None:
    adapter = read_mode(make_redis(), mode)
    zeros = bytes(4 * MiB)
    kv4 = fp16_kv(64 * 1024, 4)
    cases = {
        "lz4": (codec.encode("lz4", FP, zeros, CodecOptions(lz4=True)), len(zeros)),  # far shorter
        "fp8-same": (fp8("fp8-same", kv4, 4), len(kv4)),  # exactly as long as the raw blob
    }
    assert cases["fp8-same"][0].nbytes == blob_header.header_size("fp8-same") + len(kv4)
    assert all(r.ok for r in await adapter.store([(key, b) for key, (b, _) in cases.items()]))
    outs = outs_for(*(size for _, size in cases.values()))
    results = await adapter.load_into(list(cases), views(outs))
    for (key, (stored, size)), result, out in zip(cases.items(), results, outs, strict=True):
        assert result.ok, key
        assert not result.in_place, key
        assert result.data == stored.to_bytes(), key
        assert result.data is not None
        codec.decode_into(result.data, key, FP, out)
        assert out == expected_decode(stored, size), key


@pytest.mark.parametrize("mode", READ_MODES)
async def test_corrupted_or_truncated_values_never_pass_the_checks(
    make_redis: MakeRedis, raw_redis: Redis, mode: str
) -> None:
    adapter = read_mode(make_redis(), mode)
    size = 2 * MiB
    keys = ["payload", "header", "short", "long"]
    await adapter.store([(key, blob(key, size)) for key in keys])
    flip_at = {"payload": blob_header.header_size("payload") + MiB + 5, "header": 30}
    for key, at in flip_at.items():
        value = bytearray(await raw_redis.get(adapter.redis_key(key)))
        value[at] ^= 0x10
        await raw_redis.setrange(adapter.redis_key(key), at, bytes(value[at : at + 1]))
    await raw_redis.set(adapter.redis_key("short"), blob("short", size).to_bytes()[:-100])
    await raw_redis.append(adapter.redis_key("long"), b"trailing")
    outs = outs_for(size, size, size, size)
    results = await adapter.load_into(keys, views(outs))
    assert [r.ok for r in results] == [True, True, True, False]
    assert results[0].in_place  # caught by the payload checksum over the L1 region
    # longer than any blob of a 2 MiB chunk: refused unread and counted, never deleted (a shared
    # tier keeps what it cannot use: a fleet-mate may write blobs of another size or key list)
    assert results[3].status is Status.MISS
    assert adapter.stats.integrity_failures == 1
    assert await raw_redis.exists(adapter.redis_key("long")) == 1
    for key, result, out in zip(keys[:3], results[:3], outs[:3], strict=True):
        assert result.data is not None
        check = codec.verify_in_place if result.in_place else codec.decode_into
        with pytest.raises(IntegrityError):
            check(result.data, key, FP, out)


@pytest.mark.parametrize("mode", READ_MODES)
async def test_missing_keys_are_misses_and_forgotten(
    make_redis: MakeRedis, raw_redis: Redis, mode: str
) -> None:
    adapter = read_mode(make_redis(), mode)
    await adapter.store([("k", blob("k", MiB))])
    await raw_redis.unlink(adapter.redis_key("k"))
    (result,) = await adapter.load_into(["k"], [memoryview(bytearray(MiB))])
    assert result.status is Status.MISS
    assert adapter.usage().objects == 0
    assert adapter.stats.misses == 1


async def test_lane_writes_expire_with_the_ttl(make_redis: MakeRedis, raw_redis: Redis) -> None:
    adapter = make_redis(ttl_s=100)
    await adapter.store([("k", blob("k", MiB))])
    assert 0 < await raw_redis.ttl(adapter.redis_key("k")) <= 100


async def test_without_a_lane_everything_goes_through_redis_py(make_redis: MakeRedis) -> None:
    adapter = make_redis(bulk_min_kib=None)
    assert adapter.lane is None
    stored = blob("k", 3 * MiB)
    assert (await adapter.store([("k", stored)]))[0].ok
    out = bytearray(3 * MiB)
    (result,) = await adapter.load_into(["k"], [memoryview(out)])
    assert (result.ok, result.in_place, result.data) == (True, False, stored.to_bytes())


# --- private servers: credentials, freezing, restarts -------------------------------------------


async def test_auth_and_select_come_from_the_url(
    redis_server: Callable[..., RedisServer], make_redis: MakeRedis
) -> None:
    server = redis_server("--requirepass", "s3cret")
    for url in (
        f"redis://:s3cret@127.0.0.1:{server.port}/3",
        f"redis://default:s3cret@127.0.0.1:{server.port}/3",
    ):
        adapter = make_redis(url=url)
        stored = blob("k", MiB)
        assert (await adapter.store([("k", stored)]))[0].ok
        out = bytearray(MiB)
        (result,) = await adapter.load_into(["k"], [memoryview(out)])
        assert (result.ok, result.in_place) == (True, True)
        assert out == stored.payload
    db3 = Redis(port=server.port, password="s3cret", db=3)
    db0 = Redis(port=server.port, password="s3cret", db=0)
    try:
        assert await db3.exists(adapter.redis_key("k")) == 1
        assert await db0.exists(adapter.redis_key("k")) == 0
    finally:
        await db3.aclose()
        await db0.aclose()
    wrong = make_redis(url=f"redis://:wrong@127.0.0.1:{server.port}/0")
    assert (await wrong.store([("k", blob("k", MiB))]))[0].status is Status.ERROR
    # Refused at the first command (redis-py's INFO cluster probe, or the lane's AUTH).
    last_error = wrong.health().last_error or ""
    assert "WRONGPASS" in last_error or "invalid username-password pair" in last_error
    assert wrong.health().state == "down"


@pytest.mark.parametrize("mode", READ_MODES)
async def test_a_frozen_redis_is_errors_within_the_timeout_then_works_again(
    redis_server: Callable[..., RedisServer], make_redis: MakeRedis, mode: str
) -> None:
    server = redis_server()
    adapter = read_mode(make_redis(url=server.url, timeout_s=1.0), mode)
    await adapter.store([("a", blob("a", 4 * MiB)), ("b", blob("b", 4 * MiB))])
    server.freeze()
    started = time.perf_counter()
    results = await adapter.store([("c", blob("c", 4 * MiB)), ("d", blob("d", 4 * MiB))])
    assert time.perf_counter() - started < 1.0 + 0.5
    assert [r.status for r in results] == [Status.ERROR, Status.ERROR]
    assert adapter.health().state == "down"
    outs = outs_for(4 * MiB, 4 * MiB)
    started = time.perf_counter()
    results = await adapter.load_into(["a", "b"], views(outs))
    assert time.perf_counter() - started < 1.0 + 0.5
    assert [r.status for r in results] == [Status.ERROR, Status.ERROR]
    server.thaw()
    results = await adapter.load_into(["a", "b"], views(outs))
    assert [(r.ok, r.in_place) for r in results] == [(True, True)] * 2
    assert outs == [payload_for("a", 4 * MiB), payload_for("b", 4 * MiB)]
    assert adapter.health().state == "degraded"  # recent errors, but working

    server.stop()  # and a restart: a fresh, empty server on the same port
    server.start()
    results = await adapter.load_into(["a", "b"], views(outs))
    assert [r.status for r in results] == [Status.MISS, Status.MISS]
    assert (await adapter.store([("a", blob("a", 4 * MiB))]))[0].ok
    assert (await adapter.load_into(["a"], views(outs[:1])))[0].in_place


async def test_a_pooled_connection_to_a_restarted_server_is_retried_unseen(
    redis_server: Callable[..., RedisServer], make_redis: MakeRedis
) -> None:
    server = redis_server()
    adapter = make_redis(url=server.url)
    assert (await adapter.store([("k", blob("k", MiB))]))[0].ok  # leaves a pooled connection
    server.stop()
    server.start()
    assert (await adapter.store([("k", blob("k", MiB))]))[0].ok
    assert adapter.health().state == "ok"


# --- peers that misbehave -----------------------------------------------------------------------


class ScriptedPeer:
    """A TCP peer speaking for Redis from a script: for each reply in turn it reads commands until
    it has seen `count` more `word`s (commands), then sends the reply. After the last one it hangs
    up (`hang_up`) or waits until the client does and says so."""

    def __init__(self, replies: list[bytes], word: bytes, count: int, *, hang_up: bool = False) -> None:
        self.replies = replies
        self.word = word
        self.count = count
        self.hang_up = hang_up
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.request_seen = threading.Event()
        self.client_gone = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            received = b""
            for turn in range(max(1, len(self.replies))):
                while received.count(self.word) < self.count * (turn + 1):
                    chunk = conn.recv(65536)
                    if not chunk:
                        self.client_gone.set()
                        return
                    received += chunk
                self.request_seen.set()
                if turn < len(self.replies):
                    conn.sendall(self.replies[turn])
            if self.hang_up:
                return
            while conn.recv(65536):  # until the client shuts its side down
                pass
            self.client_gone.set()

    def close(self) -> None:
        self.listener.close()
        self.thread.join(5)


def scripted_value(stored: EncodedBlob, pieces: list[bytes], last_header: bytes | None = None) -> bytes:
    """The replies to [STRLEN, header, pieces..., header] for a stored blob."""
    head = stored.header
    out = [b":%d\r\n" % stored.nbytes, b"$%d\r\n%s\r\n" % (len(head), head)]
    out += [b"$%d\r\n%s\r\n" % (len(p), p) for p in pieces]
    last = head if last_header is None else last_header
    out.append(b"$%d\r\n%s\r\n" % (len(last), last))
    return b"".join(out)


async def test_a_reply_cut_short_is_an_error_not_a_hit(make_redis: MakeRedis) -> None:
    size = PIECE_BYTES + 4096
    stored = blob("k", size)
    head_len = len(stored.header)
    reply = (  # STRLEN, the header, then the first piece cut short
        b":%d\r\n" % (head_len + size)
        + b"$%d\r\n%s\r\n" % (head_len, stored.header)
        + b"$%d\r\n" % PIECE_BYTES + bytes(stored.payload[:5000])
    )  # fmt: skip
    peer = ScriptedPeer([reply], b"GETRANGE", 4, hang_up=True)  # header, two pieces, header again
    try:
        adapter = read_mode(make_redis(url=peer.url, timeout_s=5, cluster=False), "window")
        out = bytearray(size)
        with anyio.fail_after(5):
            (result,) = await adapter.load_into(["k"], [memoryview(out)])
        assert result.status is Status.ERROR
        assert "closed" in result.message
        assert out[:5000] == stored.payload[:5000]  # garbage to the caller, never committed
        assert adapter.health().state == "down"
    finally:
        peer.close()


async def test_a_get_reply_cut_short_is_an_error_not_a_hit(make_redis: MakeRedis) -> None:
    size = 2 * MiB
    stored = blob("k", size)
    reply = b"$%d\r\n%s" % (stored.nbytes, stored.header) + bytes(stored.payload[:5000])
    peer = ScriptedPeer([reply], b"GET", 1, hang_up=True)
    try:
        adapter = read_mode(make_redis(url=peer.url, timeout_s=5, cluster=False), "get")
        with anyio.fail_after(5):
            (result,) = await adapter.load_into(["k"], [memoryview(bytearray(size))])
        assert result.status is Status.ERROR
        assert adapter.health().state == "down"
    finally:
        peer.close()


async def test_a_value_replaced_during_the_read_is_an_error_not_a_hit(make_redis: MakeRedis) -> None:
    size = PIECE_BYTES + 4096
    before, after = blob("k", size), codec.encode("k", FP, bytes(size), CodecOptions())
    payload = bytes(before.payload)
    replies = [
        # the pieces are the old blob's, the header read last is the new one's
        scripted_value(before, [payload[:PIECE_BYTES], payload[PIECE_BYTES:]], after.header),
        # a piece longer than asked: the value grew meanwhile
        scripted_value(before, [payload[:PIECE_BYTES], payload[PIECE_BYTES:] + b"more"]),
        # and the same connection, every reply consumed, still reads a good value
        scripted_value(before, [payload[:PIECE_BYTES], payload[PIECE_BYTES:]]),
    ]
    peer = ScriptedPeer(replies, b"GETRANGE", 4)
    try:
        adapter = read_mode(make_redis(url=peer.url, timeout_s=5, cluster=False), "window")
        out = bytearray(size)
        with anyio.fail_after(5):
            for _ in range(2):
                (result,) = await adapter.load_into(["k"], [memoryview(out)])
                assert result.status is Status.ERROR
                assert "changed" in result.message
            (result,) = await adapter.load_into(["k"], [memoryview(out)])
        assert (result.ok, result.in_place) == (True, True)
        assert out == payload
        assert adapter.lane is not None
        assert adapter.lane.connections == 1
        assert adapter.health().state == "degraded"  # errors for one key; the server is fine
    finally:
        peer.close()


async def test_a_cancelled_load_into_stops_its_socket_io(make_redis: MakeRedis) -> None:
    peer = ScriptedPeer([], b"GETRANGE", 4)
    try:
        adapter = read_mode(make_redis(url=peer.url, timeout_s=60, cluster=False), "window")
        out = bytearray(2 * MiB)
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(adapter.load_into, ["k"], [memoryview(out)])
                assert await anyio.to_thread.run_sync(peer.request_seen.wait, 5)
                tg.cancel_scope.cancel()
            assert await anyio.to_thread.run_sync(peer.client_gone.wait, 5)  # the lane hung up at once
        assert adapter.lane is not None
        assert adapter.lane.connections == 0
    finally:
        peer.close()


async def test_close_ends_lane_commands_in_flight(make_redis: MakeRedis) -> None:
    peer = ScriptedPeer([], b"GETRANGE", 4)
    try:
        adapter = read_mode(make_redis(url=peer.url, timeout_s=60, cluster=False), "window")
        answers: list[Status] = []

        async def load() -> None:
            (result,) = await adapter.load_into(["k"], [memoryview(bytearray(2 * MiB))])
            answers.append(result.status)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(load)
                assert await anyio.to_thread.run_sync(peer.request_seen.wait, 5)
                await adapter.close()
        assert answers == [Status.ERROR]
        assert await anyio.to_thread.run_sync(peer.client_gone.wait, 5)  # the lane hung up
    finally:
        peer.close()
