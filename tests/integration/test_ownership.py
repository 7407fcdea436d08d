"""Ownership on the data plane, with a real sidecar process, real client processes and a second,
malicious client: nobody acts on another engine instance's ids, a late reader is never told that
changed bytes are valid, one request cannot take all of L1, and every connection says HELLO."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
import torch
import zmq

from kvdepot_connector import protocol as p
from kvdepot_connector.client import KVDepotClient
from kvdepot_connector.errors import SidecarError
from kvdepot_connector.lifeline import LifelineClient
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import LAYOUT, chunk_data, client, request_tokens
from tests.integration.waiting import wait_for

CHUNK_ENV = {"KVDEPOT_L1__CHUNK_SIZE": "16", "KVDEPOT_L2__ADAPTERS": "[]"}  # L1 alone: no write-behind pins
CHUNK_BYTES = LAYOUT.chunk_bytes  # 64 KiB
SMALL_L1 = 1 / 1024  # 1 MiB: 16 chunks


def victim(url: str, chunks: int, seed: int) -> tuple[subprocess.Popen[str], list[int]]:
    """A client process with a half-written store in flight: its reservations' oids."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.dp_client", "reserve-then-commit", url, f"{chunks}",
         f"{seed}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    words = proc.stdout.readline().split()
    assert words[0] == "reserved" and len(words) == chunks + 1, words
    return proc, [int(w) for w in words[1:]]


def finish(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """Let the victim fill and commit its slots; its commit answer and its own read-back."""
    out, _ = proc.communicate("go\n", timeout=60)
    lines = out.strip().splitlines()
    return lines[-2], lines[-1]


def read(c: KVDepotClient, seed: int, chunks: int, rid: str, salt: str = "") -> list[torch.Tensor]:
    hit = c.lookup(request_tokens(seed, chunks), request_id=rid, cache_salt=salt).hit_chunks
    outs = [torch.empty(CHUNK_BYTES // 2, dtype=torch.float16) for _ in range(hit)]
    if hit:
        assert c.retrieve(rid, outs)
    return outs


def test_another_instance_cannot_commit_a_half_written_reservation(sidecar_factory: StartSidecar) -> None:
    sc = sidecar_factory(env=CHUNK_ENV, l1_size_gb=0.02)
    proc, oids = victim(sc.url, 4, seed=5)
    attacker = client(sc.url)
    try:
        with pytest.raises(SidecarError) as refused:
            attacker.commit(oids)  # the victim's ids, leaked: still not the attacker's to commit
        assert refused.value.code == p.ErrorCode.NOT_OWNER
        assert attacker.lookup(request_tokens(5, 4), request_id="peek").hit_chunks == 0
        with pytest.raises(SidecarError) as refused:
            attacker.abort(oids)
        assert refused.value.code == p.ErrorCode.NOT_OWNER
        assert finish(proc) == ("committed 1 1 1 1", "identical 4")
    finally:
        proc.kill()
        attacker.close()


def test_guessed_ids_in_one_frame_commit_and_abort_nothing(sidecar_factory: StartSidecar) -> None:
    sc = sidecar_factory(env=CHUNK_ENV, l1_size_gb=0.02)
    proc, _ = victim(sc.url, 4, seed=6)
    attacker = client(sc.url)
    try:
        guesses = list(range(1, 1 << 16))
        assert attacker.abort(guesses) == 0
        assert not any(attacker.commit(guesses))
        assert finish(proc) == ("committed 1 1 1 1", "identical 4")
        assert sc.get_json("/status")["l1"]["allocator_ok"]
    finally:
        proc.kill()
        attacker.close()


def test_two_engines_of_one_model_get_their_own_engine_ids_and_share_chunks(
    sidecar_factory: StartSidecar,
) -> None:
    sc = sidecar_factory(env=CHUNK_ENV, l1_size_gb=0.02)
    a, b = client(sc.url), client(sc.url)
    try:
        assert a.engine_id != b.engine_id  # their own requests, locks and KV planes
        toks = request_tokens(8, 4)
        assert a.store(toks, [chunk_data(8, i) for i in range(4)], request_id="w").stored == 4
        outs = read(b, 8, 4, "r")  # the same cache keys: B hits what A stored
        assert len(outs) == 4 and all(torch.equal(o, chunk_data(8, i)) for i, o in enumerate(outs))
        with pytest.raises(SidecarError):  # and B's request ids are not A's
            a.locked("r", first_chunk=0, num_chunks=1)
    finally:
        a.close()
        b.close()


def reuse_memory(c: KVDepotClient, salt: str) -> None:
    """Clear the tenant (its objects are freed) and store other bytes, in the freed extents."""
    c.clear(cache_salt=salt)
    toks = request_tokens(77, 4)
    c.store(toks, [chunk_data(77, i) for i in range(4)], request_id="other", cache_salt=salt)


def test_end_request_under_a_copying_reader_then_reuse_is_reported_invalid(
    sidecar_factory: StartSidecar,
) -> None:
    # One client stands for the scheduler (lookup, end_request) and the worker (copies) of one engine.
    sc = sidecar_factory(env=CHUNK_ENV, l1_size_gb=SMALL_L1)
    c = client(sc.url)
    try:
        toks = request_tokens(3, 4)
        assert c.store(toks, [chunk_data(3, i) for i in range(4)], request_id="w", cache_salt="t").stored == 4
        assert c.lookup(toks, request_id="r", cache_salt="t").hit_chunks == 4
        c.locked("r", first_chunk=0, num_chunks=4)  # the worker copies from these
        assert c.end_request("r") == 4  # the scheduler is done with it; the worker still copies
        reuse_memory(c, "t")
        assert c.release("r") is False
        # Unchanged objects stay valid even after END_REQUEST: the check is on the objects.
        toks = request_tokens(78, 4)
        assert (
            c.store(toks, [chunk_data(78, i) for i in range(4)], request_id="w", cache_salt="u").stored == 4
        )
        assert c.lookup(toks, request_id="r2", cache_salt="u").hit_chunks == 4
        locked = c.locked("r2", first_chunk=0, num_chunks=4)
        assert c.end_request("r2") == 4
        assert c.release("r2", locked.oids) is True
        reuse_memory(c, "u")
        assert c.release("r2", locked.oids) is False
    finally:
        c.close()


def test_a_reader_is_told_invalid_after_more_expiries_than_any_record_keeps(
    sidecar_factory: StartSidecar,
) -> None:
    env = CHUNK_ENV | {"KVDEPOT_L1__READ_LEASE_S": "1.0", "KVDEPOT_L1__REAP_INTERVAL_S": "0.1"}
    sc = sidecar_factory(env=env, l1_size_gb=SMALL_L1)
    c = client(sc.url)
    try:
        toks = request_tokens(4, 2)
        assert c.store(toks, [chunk_data(4, i) for i in range(2)], request_id="w", cache_salt="t").stored == 2
        assert c.lookup(toks, request_id="victim", cache_salt="t").hit_chunks == 2
        locked = c.locked("victim", first_chunk=0, num_chunks=2)
        for i in range(5000):  # more expired requests than the old bounded record kept (4096)
            c.lookup(toks, request_id=f"filler{i}", cache_salt="t")
        wait_for(lambda: sc.get_json("/status")["l1"]["counters"]["expired_locks"] >= 5001, timeout=60)
        reuse_memory(c, "t")
        assert c.release("victim") is False
        assert c.release("victim", locked.oids) is False
    finally:
        c.close()


def test_every_connection_says_hello_first_and_versions_are_checked(sidecar_factory: StartSidecar) -> None:
    sc = sidecar_factory(env=CHUNK_ENV, l1_size_gb=0.02)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sc.url)

    def ask(msg: msgspec.Struct) -> p.Reply:
        sock.send(p.encode(msg))
        assert sock.poll(10_000)
        return p.reply_decoder.decode(sock.recv())

    try:
        early = ask(p.Ping(id=1))
        assert isinstance(early, p.ErrorReply) and early.code == p.ErrorCode.HELLO_REQUIRED
        old = ask(p.Hello(id=2, version=1))
        assert isinstance(old, p.ErrorReply) and old.code == p.ErrorCode.UNSUPPORTED_VERSION
        assert f"sidecar speaks {p.PROTOCOL_VERSION}" in old.message and "client 1" in old.message
        assert isinstance(ask(p.Ping(id=3)), p.ErrorReply)  # a refused HELLO opens no session
        # A v2 client would send keys without extra keys (an adapter's chunks as the base model's):
        # refused with both versions named, never served.
        v2 = ask(p.Hello(id=6, version=2))
        assert isinstance(v2, p.ErrorReply) and v2.code == p.ErrorCode.UNSUPPORTED_VERSION
        assert "client 2" in v2.message and p.PROTOCOL_VERSION == 3
        assert isinstance(ask(p.Hello(id=4, version=p.PROTOCOL_VERSION)), p.HelloReply)
        assert isinstance(ask(p.Ping(id=5)), p.Pong)
    finally:
        sock.close()
        ctx.term()


def test_sessions_are_bounded(sidecar_factory: StartSidecar) -> None:
    sc = sidecar_factory(env=CHUNK_ENV | {"KVDEPOT_DATA_PLANE__MAX_SESSIONS": "2"}, l1_size_gb=0.02)
    first, second = client(sc.url), client(sc.url)
    third = KVDepotClient(sc.url, model="test-model", layout=LAYOUT, timeout_s=10)
    try:
        with pytest.raises(SidecarError) as refused:
            third.connect()
        assert refused.value.code == p.ErrorCode.OVERLOADED
        assert first.ping() > 0 and second.ping() > 0
    finally:
        third.close()
        first.close()
        second.close()


def test_one_store_cannot_take_the_whole_arena(sidecar_factory: StartSidecar) -> None:
    sc = sidecar_factory(env=CHUNK_ENV, l1_size_gb=SMALL_L1)
    tenant, attacker = client(sc.url), client(sc.url)
    try:
        toks = request_tokens(1, 6)
        stored = tenant.store(toks, [chunk_data(1, i) for i in range(6)], request_id="w", cache_salt="v")
        assert stored.stored == 6
        big = request_tokens(2, 40)
        greedy = attacker.store(big, [chunk_data(2, i) for i in range(40)], request_id="all", cache_salt="a")
        assert greedy.stored <= 8 and greedy.no_space == 40 - greedy.stored  # l1.max_request_share 0.5
        outs = read(tenant, 1, 6, "r", salt="v")
        assert len(outs) == 6 and all(torch.equal(o, chunk_data(1, i)) for i, o in enumerate(outs))
    finally:
        tenant.close()
        attacker.close()


def test_registrations_are_bounded_per_instance(sidecar_factory: StartSidecar) -> None:
    sc = sidecar_factory(env=CHUNK_ENV, l1_size_gb=0.02)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sc.url)
    try:
        sock.send(p.encode(p.Hello(id=0, version=p.PROTOCOL_VERSION, instance="ab" * 16)))
        assert sock.poll(10_000)
        said = p.reply_decoder.decode(sock.recv())
        assert isinstance(said, p.HelloReply)
        line = LifelineClient(said.lifeline_path, said.lifeline_token)  # REGISTER needs it held
        codes = []
        for i in range(200):
            sock.send(p.encode(p.Register(id=i + 1, model=f"model-{i}", layout=LAYOUT)))
            assert sock.poll(10_000)
            reply = p.reply_decoder.decode(sock.recv())
            codes.append(reply.code if isinstance(reply, p.ErrorReply) else "ok")
        assert (
            codes == ["ok"] * 64 + [p.ErrorCode.OVERLOADED] * 136
        )  # data_plane.max_registrations_per_instance
        assert len(sc.get_json("/status")["l1"]["engines"]) == 64
        line.close()
    finally:
        sock.close()
        ctx.term()


def test_clearing_every_tenant_is_refused_on_the_data_plane(sidecar_factory: StartSidecar) -> None:
    sc = sidecar_factory(env=CHUNK_ENV, l1_size_gb=0.02)
    c, attacker = client(sc.url), client(sc.url)
    try:
        toks = request_tokens(9, 2)
        assert c.store(toks, [chunk_data(9, i) for i in range(2)], request_id="w", cache_salt="t").stored == 2
        with pytest.raises(SidecarError) as refused:
            attacker.clear()
        assert refused.value.code == p.ErrorCode.UNAUTHORIZED and "cache_salt" in refused.value.message
        assert c.lookup(toks, request_id="r", cache_salt="t").hit_chunks == 2
        assert c.end_request("r") == 2
        assert c.clear(cache_salt="t") == 2  # one tenant, by its salt
    finally:
        c.close()
        attacker.close()
