"""Sessions and their lifelines, with a real sidecar process and malicious raw ZMQ clients: a
connection whose lifeline is not held registers, stores, commits and copies nothing, and sessions
that never open one go after the lifeline handshake timeout instead of locking engines out."""

from __future__ import annotations

import os
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvdepot_connector import protocol as p
from kvdepot_connector.client import KVDepotClient
from kvdepot_connector.errors import SidecarError, SidecarUnavailable
from kvdepot_connector.lifeline import LifelineClient
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import LAYOUT, chunk_data, client, request_tokens
from tests.integration.waiting import wait_for

CHUNK_ENV = {"KVDEPOT_L1__CHUNK_SIZE": "16", "KVDEPOT_L2__ADAPTERS": "[]"}


class Raw:
    """A DEALER speaking the protocol by hand: it says HELLO and never opens its lifeline unless told."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], url: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(url)
        self.ids = 0

    def ask(self, msg: msgspec.Struct) -> p.Reply:
        self.sock.send(p.encode(msg))
        assert self.sock.poll(10_000), f"no reply to {msg}"
        return p.reply_decoder.decode(self.sock.recv())

    def hello(self, instance: str) -> p.HelloReply:
        reply = self.ask(p.Hello(id=1, version=p.PROTOCOL_VERSION, instance=instance))
        assert isinstance(reply, p.HelloReply), reply
        return reply


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def code(reply: p.Reply) -> str:
    return reply.code if isinstance(reply, p.ErrorReply) else type(reply).__struct_config__.tag


def test_a_connection_without_its_lifeline_cannot_store_commit_or_save(
    sidecar_factory: StartSidecar, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    sc = sidecar_factory(env=CHUNK_ENV, l1_size_gb=0.02)
    nonce = os.urandom(16).hex()
    # The attacker's instance has one honest, held connection (it registered an engine id) and a
    # second one that said HELLO with the same nonce and never opened its lifeline.
    held = Raw(ctx, sc.url)
    reply = held.hello(nonce)
    line = LifelineClient(reply.lifeline_path, reply.lifeline_token)
    registered = held.ask(p.Register(id=2, model="test-model", layout=LAYOUT))
    assert isinstance(registered, p.RegisterReply), registered
    eid = registered.engine_id
    unheld = Raw(ctx, sc.url)
    unheld.hello(nonce)
    victim = client(sc.url)
    toks = request_tokens(7, 4)
    try:
        store = unheld.ask(p.Store(id=3, engine_id=eid, request_id="evil", tokens=p.encode_tokens(toks),
                                   cache_salt="victim"))  # fmt: skip
        oids = [s.oid for s in store.slots] if isinstance(store, p.StoreReply) else [1, 2, 3, 4]
        commit = unheld.ask(p.Commit(id=4, engine_id=eid, oids=oids))
        save = unheld.ask(p.SaveBlocks(id=5, engine_id=eid, request_id="evil2", tokens=p.encode_tokens(toks),
                                       cache_salt="victim", block_ids=[0, 1, 2, 3]))  # fmt: skip
        again = unheld.ask(p.Register(id=6, model="other-model", layout=LAYOUT))
        # Nothing the unheld connection did is visible: the victim's prompt is a miss, as it should be.
        assert victim.lookup(toks, request_id="r", cache_salt="victim").hit_chunks == 0
        assert [code(store), code(commit), code(save), code(again)] == [p.ErrorCode.UNAUTHORIZED] * 4
        assert "lifeline" in store.message if isinstance(store, p.ErrorReply) else False
        # The held connection of the same instance stores as before.
        ok = held.ask(p.Store(id=7, engine_id=eid, request_id="w", tokens=p.encode_tokens(toks)))
        assert isinstance(ok, p.StoreReply) and len(ok.slots) == 4
        # And a real engine's client (it opens its lifeline right after HELLO) stores and reads back.
        stored = victim.store(toks, [chunk_data(7, i) for i in range(4)], request_id="v", cache_salt="victim")
        assert stored.stored == 4
        assert victim.lookup(toks, request_id="r2", cache_salt="victim").hit_chunks == 4
    finally:
        victim.close()
        line.close()
        held.sock.close(linger=0)
        unheld.sock.close(linger=0)


def test_hellos_without_lifelines_expire_and_do_not_lock_engines_out(
    sidecar_factory: StartSidecar, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    env = CHUNK_ENV | {
        "KVDEPOT_DATA_PLANE__MAX_SESSIONS": "32",
        "KVDEPOT_DATA_PLANE__MAX_REGISTRATIONS": "16",
    }
    sc = sidecar_factory(env=env, l1_size_gb=0.02)
    attackers = [Raw(ctx, sc.url) for _ in range(32)]
    registers = []
    for i, raw in enumerate(attackers):  # every session slot taken; registrations tried too
        raw.hello(os.urandom(16).hex())
        asked = [raw.ask(p.Register(id=2 + k, model=f"m{i}-{k}", layout=LAYOUT)) for k in range(2)]
        registers += [code(reply) for reply in asked]
    for raw in attackers:
        raw.sock.close(linger=0)  # gone, as far as the attacker is concerned: ZMQ tells nobody
    engine = KVDepotClient(sc.url, model="test-model", layout=LAYOUT, timeout_s=10)

    def connects() -> bool:
        try:
            engine.connect()
        except (SidecarError, SidecarUnavailable):
            return False
        return True

    try:
        # The unheld sessions go after the lifeline handshake timeout (5 s), not session_idle_s (600).
        wait_for(connects, timeout=60, what="a real engine connects")
        assert set(registers) == {p.ErrorCode.UNAUTHORIZED}  # and none registered meanwhile
        toks = request_tokens(3, 2)
        assert engine.store(toks, [chunk_data(3, i) for i in range(2)], request_id="w").stored == 2
        assert engine.lookup(toks, request_id="r").hit_chunks == 2
        status = sc.get_json("/status")
        assert len(status["l1"]["engines"]) == 1
    finally:
        engine.close()
