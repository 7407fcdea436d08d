"""The KV-event publisher with a real EventBus and real ZMQ sockets on loopback (in-process)."""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import struct
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pydantic
import pytest
import zmq

from api.kvevents.blocks import BlockNamer
from api.kvevents.config import KvEventsSettings
from api.kvevents.guard import SubscriptionFilter
from api.kvevents.publisher import KvEventPublisher
from api.kvevents.wire import END_SEQ, BlockRemoved, BlockStored, decode_batch
from engine.events import L1_TIER, Event, EventBus, Kind
from engine.keys import KVLayout, Namespace, ObjectKey, TokenHasher

LAYOUT = KVLayout(
    dtype="float16", num_layers=2, num_kv_heads=1, head_dim=32, block_size=4, kind="test", chunk_size=16
)  # fmt: skip
NS = Namespace("m", LAYOUT.fingerprint)


def layout_of(fp: bytes) -> KVLayout | None:
    return LAYOUT if fp == LAYOUT.fingerprint else None


def namer(salt_mode: str = "hashed", key: bytes = b"k" * 32) -> BlockNamer:
    return BlockNamer(salt_mode=salt_mode, deployment_key=key, layout_of=layout_of)  # type: ignore[arg-type]


def chunk_events(tokens: list[int], salt: str = "", tier: str = L1_TIER) -> list[Event]:
    """STORED events for the full chunks of `tokens`, as the engine publishes them."""
    raw = struct.pack(f"<{len(tokens)}I", *tokens)
    hashes = TokenHasher(LAYOUT.chunk_size).chunk_hashes(raw)
    step = 4 * LAYOUT.chunk_size
    return [
        Event(
            Kind.STORED, time.time_ns(), tier=tier, key=ObjectKey(NS, salt, h),
            tokens=raw[i * step : (i + 1) * step], parent=hashes[i - 1] if i else b"",
        )
        for i, h in enumerate(hashes)
    ]  # fmt: skip


def test_a_chunk_is_announced_as_its_engine_blocks_linked_to_the_previous_chunk() -> None:
    n = namer()
    tokens = list(range(1000, 1064))  # 4 chunks of 16 tokens, 4 blocks of 4 each
    stored = [n.stored(ev) for ev in chunk_events(tokens)]
    assert all(isinstance(s, BlockStored) for s in stored)
    blocks = [s for s in stored if s is not None]
    assert [len(s.block_hashes) for s in blocks] == [4, 4, 4, 4]
    assert all(s.block_size == 4 and s.medium == "CPU" for s in blocks)
    assert [t for s in blocks for t in s.token_ids] == tokens
    assert blocks[0].parent_block_hash is None
    for prev, cur in itertools.pairwise(blocks):
        assert cur.parent_block_hash == prev.block_hashes[-1]
    every = [h for s in blocks for h in s.block_hashes]
    assert len(set(every)) == 16 and all(0 <= h < 1 << 64 for h in every)
    # removal names the same hashes from the key alone; another sidecar computes the same ones
    removed = namer().removed(chunk_events(tokens)[2].key, L1_TIER)  # type: ignore[arg-type]
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == blocks[2].block_hashes


def test_salt_modes_and_tiers() -> None:
    ev = chunk_events(list(range(16)), salt="tenant-a", tier="redis")[0]
    hashed, plain, omit = (namer(m).stored(ev) for m in ("hashed", "plain", "omit"))
    assert hashed is not None and plain is not None and omit is not None
    assert hashed.medium == "REDIS"
    assert plain.extra_keys == [("tenant-a",)] * 4
    assert omit.extra_keys is None
    assert hashed.extra_keys is not None
    tenant = hashed.extra_keys[0]
    assert tenant is not None and "tenant-a" not in tenant[0]
    # the hashed tenant depends on the deployment key, and tenants never share block hashes
    other_key = namer("hashed", key=b"x" * 32).stored(ev)
    assert other_key is not None and other_key.extra_keys != hashed.extra_keys
    assert len({tuple(s.block_hashes) for s in (hashed, plain, omit)}) == 3
    no_salt = chunk_events(list(range(16)), salt="")[0]
    assert namer("omit").stored(no_salt) == namer("omit").stored(no_salt)


def test_medium_names_rename_a_tier_s_events_and_refuse_ambiguity() -> None:
    config = KvEventsSettings(medium_names={"l1": "GPU", "redis": "SHARED"})
    assert [config.medium(t) for t in (L1_TIER, "l1", "redis", "disk")] == ["GPU", "GPU", "SHARED", "DISK"]
    assert KvEventsSettings().medium(L1_TIER) == "CPU"  # vLLM's convention unless told
    n = BlockNamer(salt_mode="plain", deployment_key=b"", layout_of=lambda _fp: LAYOUT, medium=config.medium)
    ev = chunk_events(list(range(16)))[0]
    stored = n.stored(ev)
    assert stored is not None and stored.medium == "GPU"
    removed = n.removed(ev.key, "redis")  # type: ignore[arg-type]
    assert removed is not None and removed.medium == "SHARED"
    for bad in ({"l1": "DISK", "disk": "DISK"}, {"l1": "gpu"}, {"L1": "GPU"}, {"l1": ""}, {"a b": "X"}):
        with pytest.raises(ValueError, match="medium_names"):
            KvEventsSettings(medium_names=bad)


def test_unknown_layout_is_counted_not_guessed() -> None:
    n = BlockNamer(salt_mode="plain", deployment_key=b"", layout_of=lambda _fp: None)
    assert n.stored(chunk_events(list(range(16)))[0]) is None
    assert n.unknown_layout == 1


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://[::]:5557"])
def test_binding_every_address_is_refused_unless_allowed(endpoint: str) -> None:
    with pytest.raises(pydantic.ValidationError, match="allow_any_address"):
        KvEventsSettings(endpoint=endpoint)
    allowed = KvEventsSettings(endpoint=endpoint, allow_any_address=True, allow_plaintext_tcp=True)
    assert allowed.endpoint == endpoint
    with pytest.raises(pydantic.ValidationError, match="allow_any_address"):
        KvEventsSettings(endpoint="tcp://127.0.0.1:1", replay_endpoint=endpoint, allow_plaintext_tcp=True)


def test_plain_tcp_needs_curve_or_an_explicit_opt_in() -> None:
    for endpoints in (
        {"endpoint": "tcp://127.0.0.1:5557"},
        {"endpoint": "ipc:///tmp/e", "replay_endpoint": "tcp://127.0.0.1:1"},
    ):
        with pytest.raises(pydantic.ValidationError, match="allow_plaintext_tcp"):
            KvEventsSettings(**endpoints)  # type: ignore[arg-type]
    assert (
        KvEventsSettings(endpoint="ipc:///tmp/e", replay_endpoint="ipc:///tmp/r").endpoint == "ipc:///tmp/e"
    )
    assert KvEventsSettings(endpoint="tcp://127.0.0.1:5557", allow_plaintext_tcp=True).endpoint
    public, secret = zmq.curve_keypair()
    curve = {"curve_secret_key": secret.decode(), "curve_public_key": public.decode()}
    assert KvEventsSettings(endpoint="tcp://127.0.0.1:5557", **curve).endpoint  # type: ignore[arg-type]


def test_subscriptions_apply_only_this_sidecar_s_topics_up_to_a_cap() -> None:
    f = SubscriptionFilter("kv@{host}@{model}", "h", cap=2)
    assert all(f.subscribe(t) for t in (b"", b"kv", b"kv@h@", b"kv@h@", b"kv@h@m1", b"kv@h@m2", b"kv@h@m1"))
    assert not f.subscribe(b"kv@h@m3")  # a third distinct model filter: past the cap
    assert not f.subscribe(b"kv@other@m")  # another host's topics: never published here
    assert not f.subscribe(b"kv@h@" + b"x" * 4096)
    assert f.refused == 3 and f.subscribers == 7
    assert f.unsubscribe(b"kv@h@m2") and f.subscribe(b"kv@h@m3")  # room again
    assert not f.unsubscribe(b"kv@other@m")  # never applied: nothing to withdraw
    assert f.subscribers == 7


@asynccontextmanager
async def running(**settings: object) -> AsyncIterator[tuple[KvEventPublisher, EventBus]]:
    settings.setdefault("allow_plaintext_tcp", True)
    settings.setdefault("endpoint", "tcp://127.0.0.1:0")
    settings.setdefault("replay_endpoint", "tcp://127.0.0.1:0")
    config = KvEventsSettings(**settings)  # type: ignore[arg-type]
    pub = KvEventPublisher(config, namer())
    pub.bind()
    pub.start()
    bus = EventBus(capacity=1 << 20)
    bus.subscribe(pub.on_events)
    try:
        yield pub, bus
    finally:
        pub.close()


async def until(predicate: object, what: str) -> None:
    deadline = time.monotonic() + 10
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached")
        await asyncio.sleep(0.01)


async def recv(sock: zmq.Socket[bytes]) -> list[bytes]:
    deadline = time.monotonic() + 10
    while True:
        try:
            return sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            if time.monotonic() > deadline:
                raise AssertionError("nothing received") from None
            await asyncio.sleep(0.005)


@pytest.mark.anyio
async def test_live_batches_then_replay_from_zero_ends_with_minus_one() -> None:
    async with running(max_batch_events=3) as (pub, bus):
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(pub.endpoint)
        await until(lambda: pub.subscribers == 1, "subscription")
        for ev in chunk_events(list(range(64))):  # 4 chunks -> batches of 3 + 1
            bus.publish(ev)
        bus.emit(Kind.CLEARED, tier="")
        bus.flush()
        live = [await recv(sub) for _ in range(3)]
        assert [int.from_bytes(f[1], "big") for f in live] == [0, 1, 2]
        assert live[0][0] == f"kv@{pub.host}@m".encode()
        batches = [decode_batch(f[2]) for f in live]
        assert [len(b.events) for b in batches] == [3, 1, 1]
        # vLLM's three elements exactly (length-checking decoders, Dynamo's, take nothing more)
        assert all(len(msgspec.msgpack.decode(f[2])) == 3 for f in live)
        assert type(batches[2].events[0]).__name__ == "AllBlocksCleared"
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint or "")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = [await recv(dealer) for _ in range(4)]
        assert [r[1:] for r in replayed[:3]] == live
        assert replayed[3] == [b"", b"", END_SEQ, b""]
        dealer.send_multipart([b"garbage"])  # malformed requests are ignored, counted
        dealer.send_multipart([b"", b"\x00" * 3])
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        assert (await recv(dealer))[1:] == live[2]
        assert pub.bad_requests.count == 2
        assert (await recv(dealer))[2] == END_SEQ
        sub.close(0)
        dealer.close(0)
        ctx.term()


N_EVENTS = 20_000  # a batch each


@pytest.mark.anyio
async def test_a_subscriber_that_never_reads_costs_drops_not_a_stall(tmp_path: Path) -> None:
    # Over a unix socket: the kernel buffers a few hundred KiB of it (loopback TCP grows its
    # buffers to megabytes, which took 10^5 batches to fill).
    short = Path(tempfile.mkdtemp(prefix="kvev-"))  # a socket path within 107 bytes
    endpoints = {"endpoint": f"ipc://{short}/pub", "replay_endpoint": f"ipc://{short}/replay"}
    async with running(sndhwm=16, buffer=1000, max_batch_events=1, **endpoints) as (pub, bus):
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 16)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        await until(lambda: pub.subscribers == 1, "subscription")
        events = chunk_events(list(range(16 * 100)))
        task = asyncio.create_task(bus.run())
        for i in range(N_EVENTS):
            bus.publish(events[i % 100])
        # the loop keeps turning while the bus drains into a subscriber that reads nothing
        ticks = 0
        while bus.pending():
            await asyncio.sleep(0)
            ticks += 1
        bus.stop()
        await task
        assert ticks > 10
        assert pub.sent + pub.dropped == pub.next_seq == N_EVENTS
        assert pub.dropped > 0 and pub.sent > 0, (pub.dropped, pub.sent)
        assert pub.buffered == 1000 and pub.events_sent["BlockStored"] == N_EVENTS
        sub.close(0)
        ctx.term()
    shutil.rmtree(short)


@pytest.mark.anyio
async def test_curve_with_an_allowed_client_key() -> None:
    server_pub, server_sec = zmq.curve_keypair()
    client_pub, client_sec = zmq.curve_keypair()
    other_pub, other_sec = zmq.curve_keypair()
    async with running(
        curve_secret_key=server_sec.decode(), curve_public_key=server_pub.decode(),
        curve_allowed_clients=[client_pub.decode()],
    ) as (pub, bus):  # fmt: skip
        ctx = zmq.Context()
        socks = []
        for public, secret in ((client_pub, client_sec), (other_pub, other_sec)):
            sub = ctx.socket(zmq.SUB)
            sub.curve_serverkey, sub.curve_publickey, sub.curve_secretkey = server_pub, public, secret
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(pub.endpoint)
            socks.append(sub)
        plain = ctx.socket(zmq.SUB)
        plain.setsockopt(zmq.SUBSCRIBE, b"")
        plain.connect(pub.endpoint)
        await until(lambda: pub.subscribers == 1, "the allowed subscription")
        for ev in chunk_events(list(range(16))):
            bus.publish(ev)
        bus.flush()
        frames = await recv(socks[0])
        assert len(decode_batch(frames[2]).events) == 1
        await until(lambda: pub._zap is not None and pub._zap.refused >= 1, "a refusal")
        for refused in (socks[1], plain):
            with pytest.raises(zmq.Again):
                refused.recv_multipart(zmq.NOBLOCK)
        assert pub.subscribers == 1
        for s in (*socks, plain):
            s.close(0)
        ctx.term()


def test_wire_matches_vllm_field_order() -> None:
    ev = namer("plain").stored(chunk_events(list(range(16)), salt="t")[0])
    assert ev is not None
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(ev))
    assert list(raw) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys",
    ]  # fmt: skip


def test_kv_events_need_the_bus_and_hide_the_curve_secret() -> None:
    from app.settings import Settings

    with pytest.raises(pydantic.ValidationError, match=r"events\.enabled"):
        Settings(kv_events={"endpoint": "ipc:///tmp/x"}, events={"enabled": False})  # type: ignore[arg-type]
    public, secret = zmq.curve_keypair()
    s = Settings(
        kv_events={
            "endpoint": "ipc:///tmp/x",
            "curve_secret_key": secret.decode(),
            "curve_public_key": public.decode(),
        }
    )  # type: ignore[arg-type]
    assert secret.decode() not in json.dumps(s.summary())
    with pytest.raises(pydantic.ValidationError, match="go together"):
        KvEventsSettings(endpoint="ipc:///tmp/x", curve_secret_key=secret.decode())  # type: ignore[arg-type]
    with pytest.raises(pydantic.ValidationError, match="needs endpoint"):
        KvEventsSettings(replay_endpoint="ipc:///tmp/r")


@pytest.mark.anyio
async def test_a_port_in_use_is_a_config_error_naming_the_setting() -> None:
    from app.errors import ConfigError

    async with running() as (pub, _bus):
        taken = pub.endpoint
        other = KvEventPublisher(KvEventsSettings(endpoint=taken, allow_plaintext_tcp=True), namer())
        with pytest.raises(ConfigError, match=r"kv_events\.endpoint"):
            other.bind()
